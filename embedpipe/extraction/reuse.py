"""``embed --reuse``: copy the records an earlier store already holds instead of computing them.

A record whose ``sha256(sequence)`` is in a reuse store embedded with the same identity (the
resume identity, :func:`embedpipe.extraction.identity.embed_identity`) is copied: its stored vectors
(bit-identical: the stored values are written back in the same storage dtype) and every
per-record column, with ``reused_from`` set to the source's ``store_uuid``. Lookups go
through the source's reuse index (:mod:`embedpipe.store.reuse_index`), so a job reads only
what its own records need. The identity is checked before the model is loaded
(:func:`embedpipe.extraction.job.predict_run`): a job whose records are all reused loads no model.
docs/cluster.md, "Release to release"; docs/store-format.md, ``reused_from``.
"""

from __future__ import annotations

import contextlib
import json
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from embedpipe.core.atomic import owned_work_dir
from embedpipe.core.errors import EmbedpipeError
from embedpipe.core.progress import say
from embedpipe.extraction.identity import describe_difference
from embedpipe.store import EmbeddedRecord
from embedpipe.store.columns import COLUMNS
from embedpipe.store.format import RESERVED_ATTRS, read_root_attrs
from embedpipe.store.reader import Store
from embedpipe.store.reuse_checks import open_indexed_store
from embedpipe.store.reuse_index import ReuseIndex, build_index, is_index, sequence_digests
from embedpipe.store.row_checks import RowChecks

#: root attributes of a source that describe that file or its run, not how the numbers were made:
#: not carried into an all-reused store (which gets its own; ``precision_requested`` and
#: ``precision_reason`` are this run's request, set by it when it asked for auto)
_NOT_CARRIED = frozenset({"precision_requested", "precision_reason",
    "created_utc", "finished_utc", "input", "input_sha256", "embed_identity", "fallback_count", "fallback_reasons",
    "padding_efficiency", "reused_count", "reused_sources", "merged_from", "merged_rows", "shard_provenance",
    "varying_attrs", "config_varying", "alias_count", "skipped_count", "merged_sources",
    "storage_dtype", "layers", "dim", "per_residue", "pooling"}) | RESERVED_ATTRS


def _plain(value: Any) -> Any:
    """A table value (numpy scalar or str) as a plain Python value."""
    return value.item() if isinstance(value, np.generic) else value


@dataclass
class Source:
    """One reuse store: its index (fence in memory) and, once a row is copied, the store."""

    path: Path
    index: ReuseIndex
    uuid: str
    identity: str
    num_layers: int | None
    width: int | None = None  # the model's width (the store's ``dim``): int8-mixed's weight range is measured for it
    _store: Store | None = None
    _checks: RowChecks | None = None  # the rows verified so far (embedpipe.store.row_checks)

    @property
    def store(self) -> Store:
        """The store, once it is shown to be the one its index was built from (its own uuid,
        model and identity: embedpipe.store.reuse_checks)."""
        if self._store is None:
            self._store = open_indexed_store(self.path, self.index.path, self.index.attrs)
        return self._store

    def verify(self, rows: Sequence[int]) -> None:
        """Refuse, before any is copied, rows that fail validate's checks (embedpipe.store.row_checks)."""
        if rows:
            if self._checks is None:
                self._checks = RowChecks(self.store, self.index.path)
            self._checks.check(rows)

    def check(self, identity: str, ignore: Sequence[str] = ()) -> None:
        """One line naming, in user words, the first field of the identity this store differs
        in (``ignore``: fields left out, embedpipe.extraction.identity.ignored)."""
        why = describe_difference(self.identity, identity, ignore)
        if why is not None:
            raise EmbedpipeError(f"--reuse {self.path}: {why}; "
                                 "only a store embedded with the same model and options can be reused")

    def check_model(self, sha256: str) -> None:
        """The model first: another model makes every other difference moot."""
        theirs = str(self.index.attrs.get("model_sha256", ""))
        if theirs != sha256:
            raise EmbedpipeError(f"--reuse {self.path}: embedded with model_sha256 {theirs!r}, this run {sha256!r}; "
                                 "only a store embedded with the same model and options can be reused")

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
        self.index.close()


def _open_source(path: Path, work: Path, quiet: bool) -> Source:
    """A reuse store, given as the store (indexed now, into ``work``) or as its index."""
    path = Path(path)
    if not path.exists():
        raise EmbedpipeError(f"--reuse {path}: no such file")
    if not is_index(path):
        index_path = work / f"{len(list(work.iterdir()))}.reuse.h5"
        n = build_index(path, index_path, work=work)
        say(f"--reuse {path}: indexed {n} sequences (at scale, build the index once: embedpipe reuse-index)",
            quiet=quiet)
        path = index_path
    index = ReuseIndex(path)
    store = Path(str(index.attrs["store_path"]))
    identity = str(index.attrs.get("embed_identity", ""))
    if not identity:
        index.close()
        raise EmbedpipeError(f"--reuse {store}: the store records no embed_identity (its shards were embedded "
                             "with different options, or by an older embedpipe); reuse its shard stores")
    layers, width = index.attrs.get("model_num_layers"), index.attrs.get("dim")
    return Source(store, index, index.store_uuid, identity, int(layers) if layers is not None else None,
                  int(width) if width is not None else None)


class Reuse:
    """The reuse stores of one embed job, in the order given (the first that holds a sequence wins)."""

    def __init__(self, paths: Sequence[Path], quiet: bool = True) -> None:
        self._work = contextlib.ExitStack()
        work = self._work.enter_context(owned_work_dir(".embedpipe-reuse-"))  # a killed job's: swept
        self.sources: list[Source] = []
        self.copied_fallbacks = 0  # copies that carry an fp32 fallback
        try:
            for path in paths:
                self.sources.append(_open_source(Path(path), work, quiet))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for source in self.sources:
            source.close()
        self._work.close()

    def __enter__(self) -> Reuse:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def check(self, identity: str, ignore: Sequence[str] = ()) -> None:
        for source in self.sources:
            source.check(identity, ignore)

    def find(self, records: Sequence[tuple[str, str]]) -> dict[int, tuple[int, int]]:
        """Record index -> (source number, row) for each record a source holds."""
        digests = sequence_digests(s for _, s in records)
        found: dict[int, tuple[int, int]] = {}
        left = np.arange(len(records))
        for number, source in enumerate(self.sources):
            rows = source.index.lookup(digests[left])
            hit = rows >= 0
            found |= {int(i): (number, int(r)) for i, r in zip(left[hit], rows[hit])}
            source.verify(rows[hit].tolist())
            left = left[~hit]
        return found

    def embedded_rows(self, found: dict[int, tuple[int, int]]) -> dict[int, int]:
        """Record index -> the per-residue rows its copy holds (the source's ``embedded_length``)."""
        return {i: int(self.sources[s].store.records(rows=slice(r, r + 1))["embedded_length"][0])
                for i, (s, r) in found.items()}

    def copies(self, records: Sequence[tuple[str, str]],
               found: dict[int, tuple[int, int]]) -> Iterator[tuple[int, EmbeddedRecord]]:
        """Each found record as read from its source, in the sources' row order (chunk reuse)."""
        for index, (number, row) in sorted(found.items(), key=lambda item: item[1]):
            record = self._copy(records[index], self.sources[number], row)
            self.copied_fallbacks += bool(record.fallback_reason)
            yield index, record

    def _copy(self, record: tuple[str, str], source: Source, row: int) -> EmbeddedRecord:
        st = source.store
        table = st.records(sequence=True, rows=slice(row, row + 1))
        if table["sequence"][0] != record[1]:
            raise EmbedpipeError(f"--reuse {source.path}: row {row} does not hold the sequence of {record[0]!r} "
                                 f"(a stale reuse index {source.index.path}); build the index again")
        fields = {c.attr or c.name: _plain(table[c.name][0]) for c in COLUMNS.values()
                  if not c.announced and c.name in table}
        fields["reused_from"] = source.uuid
        pooled = {p: {k: st.mean_rows(slice(row, row + 1), k, pooling=p)[0] for k in st.layers} for p in st.pooling}
        residues = ({k: st.per_residue_rows(slice(row, row + 1), k)[0] for k in st.layers}
                    if st.has_per_residue else None)
        return EmbeddedRecord(id=record[0], sequence=record[1], mean=pooled["mean"], bos=pooled.get("bos"),
                              per_residue=residues, **fields)

    def provenance(self, found: dict[int, tuple[int, int]], fasta: Path) -> dict[str, Any]:
        """Root attributes of a store whose records are all copies: the first source's, less
        what describes that file (:data:`_NOT_CARRIED`), ``config`` naming this input."""
        number = min(s for s, _ in found.values())
        with h5py.File(self.sources[number].path, "r") as f:
            attrs = read_root_attrs(f)
        out = {k: v for k, v in attrs.items() if k not in _NOT_CARRIED}
        if isinstance(out.get("config"), dict):
            out["config"] = json.dumps(out["config"] | {"input": str(fasta)}, sort_keys=True)
        return out

    def counts(self, found: dict[int, tuple[int, int]]) -> dict[str, Any]:
        """``reused_count`` and ``reused_sources`` (uuid, path, records) for the store's root."""
        per = Counter(s for s, _ in found.values())
        sources = [{"store_uuid": self.sources[s].uuid, "path": str(self.sources[s].path), "records": n}
                   for s, n in sorted(per.items())]
        return {"reused_count": len(found), "reused_sources": json.dumps(sources)}
