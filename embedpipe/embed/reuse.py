"""``embed --reuse``: copy the records an earlier store already holds instead of computing them.

A record whose ``sha256(sequence)`` is in a reuse store embedded with the same identity (the
resume identity, :func:`embedpipe.embed.identity.embed_identity`) is copied: its stored vectors
(bit-identical: the stored values are written back in the same storage dtype) and every
per-record column, with ``reused_from`` set to the source's ``store_uuid``. Lookups go
through the source's reuse index (:mod:`embedpipe.store.reuse_index`), so a job reads only
what its own records need. The identity is checked before the model is loaded
(:func:`predicted_computed_as`): a job whose records are all reused loads no model.
docs/cluster.md, "Release to release"; docs/store-format.md, ``reused_from``.
"""

from __future__ import annotations

import contextlib
import json
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch

from embedpipe.core.atomic import owned_work_dir
from embedpipe.core.errors import EmbedpipeError
from embedpipe.core.options import EmbedOptions
from embedpipe.core.progress import say
from embedpipe.embed.identity import describe_difference, embed_identity, first_difference
from embedpipe.model import registry
from embedpipe.model.layers import resolve_layers
from embedpipe.runtime import attention as attention_choice
from embedpipe.runtime.precision import dtype_name, get_policy
from embedpipe.store import EmbeddedRecord
from embedpipe.store.columns import COLUMNS
from embedpipe.store.format import RESERVED_ATTRS, read_root_attrs
from embedpipe.store.reader import Store
from embedpipe.store.reuse_checks import open_indexed_store
from embedpipe.store.reuse_index import ReuseIndex, build_index, is_index, sequence_digests
from embedpipe.store.row_checks import RowChecks

#: root attributes of a source that describe that file or its run, not how the numbers were made:
#: not carried into an all-reused store (which gets its own)
_NOT_CARRIED = frozenset({
    "created_utc", "finished_utc", "input", "input_sha256", "embed_identity", "fallback_count", "fallback_reasons",
    "padding_efficiency", "reused_count", "reused_sources", "merged_from", "merged_rows", "shard_provenance",
    "varying_attrs", "config_varying", "alias_count", "skipped_count", "merged_sources",
    "storage_dtype", "layers", "dim", "per_residue", "pooling"}) | RESERVED_ATTRS


def predicted_computed_as(options: EmbedOptions, device: torch.device, packs: bool) -> dict[str, str]:
    """``Embedder.computed_as`` without a model: the same decisions (embedpipe.runtime.attention)."""
    policy = get_policy(options.precision)
    layout = attention_choice.batch_layout(options, policy, device) if packs else "padded"
    return {"device_type": device.type, "batch_layout": layout,
            "attention_inputs": dtype_name(attention_choice.qkv_dtype(options, policy, device))}


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

    def check(self, identity: str) -> None:
        """One line naming, in user words, the first field of the identity this store differs in."""
        why = describe_difference(self.identity, identity)
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
    layers = index.attrs.get("model_num_layers")
    return Source(store, index, index.store_uuid, identity, int(layers) if layers is not None else None)


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

    def check(self, identity: str) -> None:
        for source in self.sources:
            source.check(identity)

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


@dataclass
class Work:
    """One store's records split: copies (index -> source, row) and the indices to compute."""

    records: Sequence[tuple[str, str]]
    found: dict[int, tuple[int, int]]
    todo: list[int]
    reuse: Reuse | None

    @property
    def computing(self) -> list[tuple[str, str]]:
        return [self.records[i] for i in self.todo]

    def residue_rows(self, plan_rows: Sequence[int] | None) -> list[int]:
        """Per-residue rows of every record: the copies' from their sources, the plan's for the rest."""
        rows = [0] * len(self.records)
        for j, i in enumerate(self.todo):
            rows[i] = int(plan_rows[j])  # type: ignore[index]
        if self.found:
            for i, n in self.reuse.embedded_rows(self.found).items():  # type: ignore[union-attr]
                rows[i] = n
        return rows

    def copies(self) -> Iterator[tuple[int, EmbeddedRecord]]:
        return self.reuse.copies(self.records, self.found) if self.found else iter(())  # type: ignore[union-attr]

    def counts(self) -> dict[str, Any]:
        return self.reuse.counts(self.found) if self.reuse is not None else {}

    def fallbacks(self) -> int:
        """Copies that carry an fp32 fallback (counted in the store's ``fallback_count``)."""
        return self.reuse.copied_fallbacks if self.reuse is not None else 0


class Job:
    """What one embed job embeds with: the reuse stores, and the model, loaded only when a
    record must be computed (``load`` returns the job's embedder and its identity)."""

    def __init__(self, reuse: Reuse | None, load: Callable[[], tuple[Any, str]], predicted: str | None,
                 options: EmbedOptions) -> None:
        self.reuse = reuse
        self.options = options
        self._load = load
        self._embedder: Any = None
        #: the identity of every store the job writes: predicted without the model when reuse allows
        self.identity = predicted

    def split(self, records: Sequence[tuple[str, str]]) -> Work:
        found = self.reuse.find(records) if self.reuse is not None else {}
        return Work(records, found, [i for i in range(len(records)) if i not in found], self.reuse)

    def embedder(self) -> Any:
        """The job's embedder, the model loaded on first use; its identity checked against the
        reuse stores and the one predicted before loading."""
        if self._embedder is None:
            self._embedder, identity = self._load()
            if self.reuse is not None:
                self.reuse.check(identity)
            if self.identity is not None and self.identity != identity:
                key = (first_difference(self.identity, identity) or ("?",))[0]
                raise EmbedpipeError(f"--reuse: the loaded model resolves {key} differently than predicted "
                                     "from its files; run without --reuse")
            self.identity = identity
        return self._embedder

    def layout(self) -> tuple[list[int], int, list[str]]:
        """(layers, dim, pooling) of the stores: the embedder's, or the first source's without a model."""
        if self._embedder is not None:
            return self._embedder.layers, self._embedder.loaded.embed_dim, self._embedder.pooling
        st = self.reuse.sources[0].store  # type: ignore[union-attr]
        return st.layers, st.dim, st.pooling


def predict_identity(reuse: Reuse | None, model: str, options: EmbedOptions) -> str | None:
    """The job's identity without loading the model (checked against every reuse store), or
    None when it cannot be known so (no reuse store, a family without ``file_identity``)."""
    if reuse is None or not reuse.sources or reuse.sources[0].num_layers is None:
        return None
    facts = registry.model_identity(model)
    if facts is None:
        return None
    from embedpipe.core.devices import resolve_device

    computed_as = predicted_computed_as(options, resolve_device(options.device), facts.packs)
    for source in reuse.sources:
        source.check_model(facts.sha256)
    identity = embed_identity(options, facts, computed_as, resolve_layers(options.layers, reuse.sources[0].num_layers))
    reuse.check(identity)
    return identity
