"""Merge shard stores into one store in which every input ID resolves.

* Per-record columns and the pooled vectors (``mean``, and ``bos`` when stored) are copied (small: N rows), so pooled reads from
  the merged store need nothing else. A column some shards lack (added to the format after
  they were written) is filled with its default for their rows.
* ``per_residue/layer_{k}`` becomes an HDF5 *virtual dataset* over the shard stores'
  per-residue datasets, by path relative to the merged file: no per-residue data is copied,
  the shard stores must stay next to the merged file (move the results directory as a whole),
  and checksums are still verified when reading (filters apply at the source).
* With the shard manifest, ``duplicate`` rows become ``aliases/id`` -> ``aliases/of`` and
  ``skipped:<reason>`` rows are recorded in ``skipped/id``, ``skipped/reason``
  (:mod:`embedpipe.store.aliases`).

The header and the final ``complete`` are the writer's (:mod:`embedpipe.store.writer`).
See ``docs/store-format.md`` ("Merged stores"). Ctrl-C and SIGTERM are held back to the points
between files and blocks (:mod:`embedpipe.core.interrupts`): raised inside h5py, they ended
the command with ``SystemError`` and exit 1.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from embedpipe.core.atomic import check_output_path
from embedpipe.core.errors import StoreError
from embedpipe.core.idtext import bad_id_message
from embedpipe.core.interrupts import checkpoint, deferred
from embedpipe.core.output_guard import STORE, writing_outputs
from embedpipe.core.units import human_bytes
from embedpipe.store.aliases import PairSpool, Stores, plan_manifest
from embedpipe.store.attr_digests import ATTR_DIGESTS, check_attrs
from embedpipe.store.checks import check_layout, check_offsets, check_steps
from embedpipe.store.columns import COLUMNS, STR, Column, create_column, required_columns
from embedpipe.store.create import (
    create_array_dataset,
    create_fixed_string_dataset,
    create_per_residue_group,
    create_pooled_group,
)
from embedpipe.store.digests import COVERED_SINCE, HEX, digest_parts
from embedpipe.store.digests import ROW_DIGEST as ROW_DIGEST_NAME
from embedpipe.store.encoding import check_encodings
from embedpipe.store.format import (
    ALIASES,
    SKIPPED,
    STORE_UUID_ATTR,
    VIRTUAL,
    check_format,
    decode_strings,
    encode_strings,
    is_complete,
    open_h5,
    poolings_of,
    read_blocks,
    read_root_attrs,
    stored_layers,
    string_dtype,
    tag,
)
from embedpipe.store.h5write import atomic_h5
from embedpipe.store.idsort import STORED, IndexWriter, entries, index_sort, sorted_index
from embedpipe.store.merged_provenance import MUST_AGREE, check_agreement, common_provenance
from embedpipe.store.record_digest import describe, store_mismatches
from embedpipe.store.reuse_index import reused_totals
from embedpipe.store.sequences import SequenceSink, iter_sequence_blocks
from embedpipe.store.sources import pinned_by, source_identity
from embedpipe.store.writer import WRITE_OPTIONS, mark_complete, write_header

__all__ = ["MergeSummary", "merge_stores", "MUST_AGREE"]

#: the writer's options with a chunk cache of 8 MiB per dataset: merge writes each dataset in
#: order (two 4 MiB chunks suffice), and fills ~10 per-record datasets at once; the writer's
#: 32 MiB each grew to ~320 MiB of cached chunks at 10M records (docs/benchmarks.md)
MERGE_WRITE_OPTIONS = {**WRITE_OPTIONS, "rdcc_nbytes": 8 << 20}



@dataclass
class MergeSummary:
    out: Path
    stores: int
    records: int
    per_residue_rows: int
    aliases: int = 0
    skipped: int = 0
    skipped_by_reason: dict[str, int] = field(default_factory=dict)
    varying_attrs: list[str] = field(default_factory=list)
    file_size: int = 0

    def render(self) -> str:
        lines = [
            f"merged {self.stores} store(s) -> {self.out}: {self.records} records"
            + (f", {self.per_residue_rows} per-residue rows (virtual, read from the shard stores)"
               if self.per_residue_rows else ""),
        ]
        if self.aliases or self.skipped:
            reasons = ", ".join(f"{k} {v}" for k, v in sorted(self.skipped_by_reason.items()))
            lines.append(
                f"  aliases {self.aliases} (duplicate sequences); skipped {self.skipped}"
                + (f" ({reasons})" if reasons else "")
            )
        if self.varying_attrs:
            lines.append(f"  differs between shards (kept per shard in shard_provenance): {', '.join(self.varying_attrs)}")
        lines.append(f"  file size {human_bytes(self.file_size)}; keep the shard stores next to it")
        return "\n".join(lines)


@dataclass
class _Shard:
    path: Path
    rel: str
    attrs: dict[str, Any]
    layers: list[int]
    dim: int
    per_residue: bool
    count: int  # records
    rows: int  # per-residue rows
    widths: dict[str, int]  # item size of each column the shard has
    identity: dict[str, Any]  # what merged_sources records about this file
    version: int  # its format_version


def _open_shard(f: h5py.File, path: Path) -> int:
    """The shard's format version, once it is known to be a complete, unmerged store."""
    version = check_format(f, path)
    check_encodings(f, path)
    if not is_complete(f):
        raise StoreError(f"{path}: incomplete store; cannot merge it")
    if "merged_from" in f.attrs:
        raise StoreError(f"{path}: is itself a merged store; merge the shard stores instead")
    return version


def _read_shard(path: Path, out_dir: Path) -> _Shard:
    with open_h5(path) as f:
        version = _open_shard(f, path)
        check_layout(f, path, list(COLUMNS))  # shapes, offsets' ends, index (embedpipe.store.checks)
        try:
            attrs = read_root_attrs(f)
            layers = stored_layers(f)
            ds = f[f"mean/layer_{layers[-1]}"]
            dim = int(ds.shape[1])
            attrs.setdefault("dim", dim)
            attrs.setdefault("storage_dtype", str(ds.dtype))
            attrs["layers"] = layers
            per_residue = "per_residue" in f
            attrs["per_residue"] = per_residue
            attrs["pooling"] = poolings_of(f)  # a store older than the attribute holds mean only
            ids = decode_strings(f["ids"][:], f"{path}: dataset ids")  # one store's IDs, checked, not kept
            offsets = _shard_offsets(f, path) if per_residue else None
            # item size of each fixed-width column (0: the ragged sequence column of format 2)
            widths = {name: getattr(f[name], "dtype", np.dtype("u1")).itemsize * isinstance(f[name], h5py.Dataset)
                      for name in COLUMNS if name in f}
            missing = [c.name for c in required_columns(version) if c.name not in f]
        except (KeyError, OSError, IndexError) as exc:
            raise StoreError(f"{path}: cannot read store: {exc}") from None
        if missing:
            raise StoreError(f"{path}: missing dataset(s) {', '.join(missing)}")
        if (bad := bad_id_message(ids, "record id")) is not None:
            raise StoreError(f"{path}: dataset ids: {bad}")
        attrs.pop(ATTR_DIGESTS, None)
        if version >= COVERED_SINCE:  # read through the digests (docs/store-format.md, "Row digests")
            _check_digests(f, path, len(ids), ids, attrs)
    rel = os.path.relpath(path.resolve(), out_dir.resolve())
    uuid = attrs.get(STORE_UUID_ATTR)
    return _Shard(
        path=path, rel=rel, attrs=attrs, layers=layers, dim=dim, per_residue=per_residue, count=len(ids),
        rows=int(offsets[-1]) if offsets is not None else 0, widths=widths,
        identity=source_identity(path, rel, str(uuid) if uuid else None), version=version,
    )


def _check_digests(f: h5py.File, path: Path, n: int, ids: list[str], attrs: dict[str, Any]) -> None:
    """A format-3 shard's root attributes and every record's ID, sequence and columns are the
    bytes written (its vectors are checked by validate and by readers as they read them)."""
    check_attrs(f, path, "refusing to merge it")
    if ROW_DIGEST_NAME not in f:
        raise StoreError(f"{path}: dataset {ROW_DIGEST_NAME} is missing; a store of format {COVERED_SINCE} has one: "
                         f"refusing to merge it; run embedpipe validate {path}")
    parts = digest_parts(attrs["pooling"], attrs["layers"], bool(attrs["per_residue"]))
    if (problem := describe(*store_mismatches(f, n, parts, ids.__getitem__, path))) is not None:
        raise StoreError(f"{path}: {problem}: refusing to merge it; run embedpipe validate {path}")


def _shard_offsets(f: h5py.File, path: Path) -> np.ndarray:
    """A shard's per_residue/offsets, checked in full (merge reads them all anyway)."""
    name = "per_residue/offsets"
    off = f[name][:]
    total = int(f[f"per_residue/layer_{stored_layers(f)[-1]}"].shape[0])
    off = check_offsets(off, 0, total, path, name)
    if "embedded_length" in f:
        check_steps(off, 0, f["embedded_length"][:], path, name, "embedded_length")
    return off


def _check_paths(stores: Sequence[Path], out: Path, manifest: Path | None) -> list[Path]:
    if not stores:
        hint = f" (see {manifest}: every record may have been skipped or invalid)" if manifest else ""
        raise StoreError(f"no shard stores to merge: nothing was embedded{hint}")
    check_output_path(out)
    paths = [Path(p) for p in stores]
    resolved = [p.resolve() for p in paths]
    dup = [p for p, c in Counter(resolved).items() if c > 1]
    if dup:
        raise StoreError(f"{dup[0]}: given twice")
    if out.resolve() in resolved:
        raise StoreError(f"{out}: the output would overwrite one of the input stores")
    return paths


def _starts(counts: Sequence[int]) -> np.ndarray:
    """[0, c0, c0+c1, ...]: where each shard's rows start in the merged store, then the total."""
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)


@dataclass
class _Merge:
    """What the merged store is made of."""

    shards: list[_Shard]
    manifest: Path | None
    aliases: int = 0
    skipped: int = 0
    skipped_by_reason: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        first = self.shards[0]
        self.layers, self.dim, self.per_residue = first.layers, first.dim, first.per_residue
        self.pooling = first.attrs["pooling"]
        self.storage = np.dtype(first.attrs["storage_dtype"])
        self.record_rows = _starts([s.count for s in self.shards])
        self.residue_rows = _starts([s.rows for s in self.shards])
        self.n = int(self.record_rows[-1])
        self.common, self.varying, self.config_varying = common_provenance([s.attrs for s in self.shards])
        # format 3 over format-3 shards; over older ones format 2, whose row_digest it copies
        self.version = min(COVERED_SINCE, *(max(2, s.version) for s in self.shards))

    def header(self) -> dict[str, Any]:
        """Root attributes: those all shards share, the layout, and where each row came from."""
        return {
            **self.common,
            "layers": np.array(self.layers, dtype=np.int64),
            "dim": self.dim,
            "storage_dtype": str(self.storage),
            "per_residue": self.per_residue,
            "pooling": self.pooling,
            "merged_from": [s.rel for s in self.shards],
            "merged_rows": self.record_rows,
            # pins each source: a rewritten shard no longer matches (docs/store-format.md)
            "merged_sources": [s.identity for s in self.shards],
            "shard_provenance": [{"path": s.rel, **s.attrs} for s in self.shards],
            "varying_attrs": self.varying,
            "config_varying": self.config_varying,
            "alias_count": self.aliases,
            "skipped_count": self.skipped,
            **reused_totals([s.attrs for s in self.shards]),  # embed --reuse: summed (docs/store-format.md)
        }

    def write(self, f: h5py.File, work: Path) -> None:
        self.write_ids(f, work)  # first: a duplicate ID or a manifest problem stops the merge early
        write_header(f, self.header(), self.version)
        self.write_records(f)
        for pooling in self.pooling:
            g = create_pooled_group(f, pooling)
            for k in self.layers:
                dst = create_array_dataset(g, f"layer_{k}", shape=(self.n, self.dim), dtype=self.storage)
                for shard, start in zip(self.shards, self.record_rows[:-1]):
                    with h5py.File(shard.path, "r") as src:
                        _copy_rows(src, shard.path, f"{pooling}/layer_{k}", dst, int(start), self.storage,
                                   check_finite=True)
                dst.flush()
        if self.per_residue:
            self.write_per_residue(f)
        mark_complete(f)

    def write_records(self, f: h5py.File) -> None:
        """Per-record columns, the sequences and the per-residue offsets in one pass over the
        shard stores, each opened once for all of them, each copied in blocks: memory
        independent of N (no whole column, no whole offsets array)."""
        columns = [c for c in COLUMNS.values() if c.name != "sequence" and any(c.name in s.widths for s in self.shards)]
        dsts = {c.name: self.create_column(f, c) for c in columns}
        sequences = SequenceSink(f, self.n)
        offsets = create_per_residue_group(f, self.n + 1)["offsets"] if self.per_residue else None
        if offsets is not None:
            offsets[0:1] = 0
        for shard, start, base in zip(self.shards, self.record_rows[:-1], self.residue_rows[:-1]):
            start = int(start)
            with h5py.File(shard.path, "r") as g:
                for column in columns:
                    dst, cast = dsts[column.name]
                    if column.name == ROW_DIGEST_NAME and shard.version > self.version:
                        # format 2 over older shards: a format-3 shard's digests without their record part
                        digests = np.array([d[:-HEX] for d in g[column.name][:].tolist()], dtype=cast)
                        dst[start : start + shard.count] = digests
                    elif column.name in shard.widths:
                        _copy_rows(g, shard.path, column.name, dst, start, cast, check_finite=False)
                    elif shard.count:
                        values = column.buffer(shard.count)
                        dst[start : start + shard.count] = encode_strings(values) if column.dtype == STR else values
                for _, block in iter_sequence_blocks(g, shard.path):
                    sequences.append(block)
                if offsets is not None:  # one store's offsets at a time (checked when read)
                    offsets[start + 1 : start + 1 + shard.count] = _shard_offsets(g, shard.path)[1:] + base
        for dst, _ in dsts.values():
            dst.flush()  # a full disk surfaces here, not when ``dst`` is garbage collected
        sequences.close()
        if offsets is not None:
            offsets.flush()

    def create_column(self, f: h5py.File, column: Column) -> tuple[h5py.Dataset, Any]:
        """The merged column and the type its rows are cast to (strings: the widest shard's
        width, or the default's for shards that lack the column)."""
        if column.dtype != STR:
            return create_column(f, column, self.n), np.dtype(column.dtype)
        lacking = any(column.name not in s.widths for s in self.shards)
        default_width = len(str(column.default).encode("utf-8")) if lacking else 1
        width = max([default_width] + [s.widths[column.name] for s in self.shards if column.name in s.widths])
        return create_column(f, column, self.n, width=width), string_dtype(width)

    def write_per_residue(self, f: h5py.File) -> None:
        """``layer_{k}`` virtual over the shards' rows (the offsets: :meth:`write_records`)."""
        pr = f["per_residue"]
        total = int(self.residue_rows[-1])
        for k in self.layers:
            name = f"layer_{k}"
            if total == 0:
                create_array_dataset(pr, name, shape=(0, self.dim), dtype=self.storage)
                continue
            layout = h5py.VirtualLayout(shape=(total, self.dim), dtype=self.storage)
            for shard, base in zip(self.shards, self.residue_rows[:-1]):
                checkpoint()
                if shard.rows:
                    layout[int(base) : int(base) + shard.rows] = h5py.VirtualSource(
                        shard.rel, f"per_residue/{name}", shape=(shard.rows, self.dim), dtype=self.storage
                    )
            # a missing source reads as NaN (not zeros), which validate and readers catch
            tag(pr.create_virtual_dataset(name, layout, fillvalue=np.nan), VIRTUAL)

    def write_ids(self, f: h5py.File, work: Path) -> None:
        """``id_index/`` and, with the manifest, ``aliases/`` and ``skipped/``, by external sorts
        (embedpipe.store.idsort, embedpipe.store.aliases): memory independent of N."""
        stores = Stores(self.shards)

        def refuse(kind: str, message: str, line: int) -> None:
            where = f"manifest {self.manifest} line {line}: " if line >= 0 and self.manifest else ""
            raise StoreError(where + message)

        with index_sort(work) as index, tempfile.TemporaryFile(dir=work) as a_fh, \
                tempfile.TemporaryFile(dir=work) as s_fh:
            aliases, skipped = PairSpool(a_fh), PairSpool(s_fh)
            if self.manifest is not None:
                plan_manifest(self.manifest, stores, index, skipped, work)
            for lo, ids, _ in stores.blocks(digests=False):
                checkpoint()
                index.add(entries(ids, STORED, lo + np.arange(len(ids))))
            writer = None
            for keys, rows, kept in sorted_index(index, stores.name, refuse):
                checkpoint()
                if writer is None:
                    writer = IndexWriter(f, index.key_width())
                writer.add(keys, rows)
                for alias, of in zip(kept["key"].tolist(), kept["other"].tolist()):
                    aliases.add(alias, of)
            (writer or IndexWriter(f, 1)).close()
            self.aliases, self.skipped = aliases.count, skipped.count
            if self.manifest is not None:
                self.skipped_by_reason = _write_pairs(f, "skipped", SKIPPED, "reason", skipped)
                _write_pairs(f, "aliases", ALIASES, "of", aliases)


def _write_pairs(f: h5py.File, group: str, encoding: str, second: str, spool: PairSpool) -> dict[str, int]:
    """``{group}/id`` and ``{group}/{second}`` from the spool, in blocks; counts of the second values."""
    g = f.create_group(group)
    tag(g, encoding)
    first = create_fixed_string_dataset(g, "id", spool.count, spool.widths[0])
    other = create_fixed_string_dataset(g, second, spool.count, spool.widths[1])
    counts: Counter[str] = Counter()
    pairs = spool.pairs()
    for lo in range(0, spool.count, 1 << 16):
        block = list(islice(pairs, 1 << 16))
        first[lo : lo + len(block)] = np.array([a for a, _ in block], dtype=first.dtype)
        other[lo : lo + len(block)] = np.array([b for _, b in block], dtype=other.dtype)
        counts.update(b.decode("utf-8") for _, b in block)
    first.flush()
    other.flush()
    return dict(counts)


def stores_from(listing: Path) -> list[Path]:
    """``merge --stores-from FILE``: one store path per line (blank lines ignored; a relative
    path is taken from the current directory, as on the command line). A list in a file is
    not bounded by the kernel's ARG_MAX, which 16,000 store paths in argv exceed."""
    try:
        text = Path(listing).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise StoreError(f"{listing}: cannot read the list of stores ({getattr(exc, 'strerror', None) or exc})") from None
    return [Path(line) for line in text.split("\n") if line.strip()]


def merge_stores(stores: Sequence[Path], *, out: Path, manifest: Path | None = None) -> MergeSummary:
    """Merge shard stores into ``out`` (atomic). See the module docstring."""
    with deferred():  # a signal is raised at the next checkpoint, not inside h5py
        return _merge_stores(stores, Path(out), manifest)


def _merge_stores(stores: Sequence[Path], out: Path, manifest: Path | None) -> MergeSummary:
    paths = _check_paths(stores, out, manifest)
    out_dir = out.parent if str(out.parent) else Path(".")
    with writing_outputs("merge", [("--out", out, STORE)], [*paths, *([Path(manifest)] if manifest else [])],
                         pinned=pinned_by(paths)):
        shards = [_read_shard(p, out_dir) for p in paths]
        check_agreement([(s.path, s.attrs) for s in shards])
        merge = _Merge(shards, Path(manifest) if manifest is not None else None)
        with atomic_h5(out) as target, target.create(**MERGE_WRITE_OPTIONS) as f:
            merge.write(f, out_dir)
            checkpoint()  # before the rename: an interrupted merge leaves no output
    return MergeSummary(
        out=out,
        stores=len(shards), records=merge.n,
        per_residue_rows=int(merge.residue_rows[-1]) if merge.per_residue else 0,
        aliases=merge.aliases, skipped=merge.skipped,
        skipped_by_reason=merge.skipped_by_reason,
        varying_attrs=merge.varying,
        file_size=out.stat().st_size,
    )


def _copy_rows(g: h5py.File, src_path: Path, name: str, dst: h5py.Dataset, start: int, cast: Any, *,
               check_finite: bool) -> None:
    """Dataset ``name`` of the open shard store ``g`` into ``dst`` from row ``start``, in blocks."""
    for sl, block in read_blocks(g[name], name, src_path):
        if check_finite and not np.isfinite(block).all():
            raise StoreError(f"{src_path}: dataset {name} holds non-finite values; run embedpipe validate")
        with contextlib.suppress(AttributeError):
            block = block.astype(cast, copy=False)
        dst[start + sl.start : start + sl.stop] = block
