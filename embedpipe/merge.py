"""Merge shard stores into one store in which every input ID resolves.

* Per-record datasets and the mean vectors are copied (small: N rows), so pooled reads
  from the merged store need nothing else.
* ``per_residue/layer_{k}`` becomes an HDF5 *virtual dataset* over the shard stores'
  per-residue datasets, by path relative to the merged file: no per-residue data is copied,
  the shard stores must stay next to the merged file (move the results directory as a whole),
  and checksums are still verified when reading (filters apply at the source).
* With the shard manifest, ``duplicate`` rows become ``aliases/id`` -> ``aliases/of`` and
  ``skipped:<reason>`` rows are recorded in ``skipped/id``, ``skipped/reason``.

See ``docs/store-format.md`` ("Merged stores").
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from embedpipe.atomic import check_output_path
from embedpipe.errors import StoreError
from embedpipe.h5write import atomic_h5
from embedpipe.integrity import MERGED_SOURCES_ATTR, STORE_UUID_ATTR, new_store_uuid, source_identity
from embedpipe.manifest import iter_manifest
from embedpipe.store import (
    FORMAT,
    FORMAT_VERSION,
    LIBVER,
    PER_RECORD,
    RESERVED_ATTRS,
    _WRITE_CACHE_BYTES,
    _WRITE_CACHE_SLOTS,
    _human_bytes,
    _tag,
    check_format,
    create_array_dataset,
    create_fixed_string_dataset,
    create_string_dataset,
    decode_strings,
    is_complete,
    iter_row_blocks,
    open_h5,
    read_root_attrs,
    stored_layers,
    string_dtype,
    utc_now,
    write_root_attrs,
)

#: shard attributes that must be identical for stores to be merged
MUST_AGREE = ("model_sha256", "precision_policy", "layers", "storage_dtype", "dim", "per_residue")
#: attributes describing one file, never carried over as merged provenance
_PER_FILE = {"created_utc", "complete", "merged_from", "merged_rows", "shard_provenance", "varying_attrs",
             "config_varying", "alias_count", "skipped_count", MERGED_SOURCES_ATTR} | set(RESERVED_ATTRS)


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
        lines.append(f"  file size {_human_bytes(self.file_size)}; keep the shard stores next to it")
        return "\n".join(lines)


@dataclass
class _Shard:
    path: Path
    rel: str
    attrs: dict[str, Any]
    layers: list[int]
    dim: int
    per_residue: bool
    ids: list[str]
    rows: int  # per-residue rows
    offsets: np.ndarray | None
    widths: dict[str, int]
    dtypes: dict[str, np.dtype]
    identity: dict[str, Any]  # what merged_sources records about this file


def _read_shard(path: Path, out_dir: Path) -> _Shard:
    with open_h5(path) as f:
        check_format(f, path)
        if not is_complete(f):
            raise StoreError(f"{path}: incomplete store; cannot merge it")
        if "merged_from" in f.attrs:
            raise StoreError(f"{path}: is itself a merged store; merge the shard stores instead")
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
            ids = decode_strings(f["ids"][:])
            offsets = f["per_residue/offsets"][:].astype(np.int64) if per_residue else None
            widths = {name: f[name].dtype.itemsize for name, kind in PER_RECORD.items() if kind == "str"}
            dtypes = {name: f[name].dtype for name, kind in PER_RECORD.items() if kind != "str"}
            missing = [name for name in PER_RECORD if name not in f]
        except (KeyError, OSError, IndexError) as exc:
            raise StoreError(f"{path}: cannot read store: {exc}") from None
        if missing:
            raise StoreError(f"{path}: missing dataset(s) {', '.join(missing)}")
    rel = os.path.relpath(path.resolve(), out_dir.resolve())
    uuid = attrs.get(STORE_UUID_ATTR)
    return _Shard(
        path=path, rel=rel, attrs=attrs, layers=layers, dim=dim, per_residue=per_residue, ids=ids,
        rows=int(offsets[-1]) if offsets is not None else 0, offsets=offsets, widths=widths, dtypes=dtypes,
        identity=source_identity(path, rel, str(uuid) if uuid else None),
    )


def _check_agreement(shards: Sequence[_Shard]) -> None:
    first = shards[0]
    for shard in shards[1:]:
        for key in MUST_AGREE:
            a, b = first.attrs.get(key), shard.attrs.get(key)
            if a != b:
                raise StoreError(
                    f"{shard.path}: {key} is {b!r} but {first.path} has {a!r}; "
                    f"stores to merge must agree on {', '.join(MUST_AGREE)}"
                )


def _common_provenance(shards: Sequence[_Shard]) -> tuple[dict[str, Any], list[str], list[str]]:
    """Attributes equal in every shard; names that differ; config keys that differ."""
    keys = sorted({k for s in shards for k in s.attrs} - _PER_FILE)
    common: dict[str, Any] = {}
    varying: list[str] = []
    config_varying: list[str] = []
    for key in keys:
        values = [s.attrs.get(key) for s in shards]
        if key == "config" and all(isinstance(v, dict) for v in values):
            ckeys = sorted({ck for v in values for ck in v})
            merged_config = {}
            for ck in ckeys:
                cv = [v.get(ck) for v in values]
                if all(json.dumps(x, sort_keys=True, default=str) == json.dumps(cv[0], sort_keys=True, default=str) for x in cv):
                    merged_config[ck] = cv[0]
                else:
                    config_varying.append(ck)
            common["config"] = merged_config
        elif all(v == values[0] for v in values):
            common[key] = values[0]
        else:
            varying.append(key)
    return common, varying, config_varying


def _index_ids(shards: Sequence[_Shard]) -> dict[str, int]:
    """Row of every stored ID in the merged store; an ID held by two stores is refused."""
    index: dict[str, int] = {}
    row = 0
    for shard in shards:
        for rid in shard.ids:
            if rid in index:
                raise StoreError(f"duplicate id {rid!r} in {_store_of(shards, index[rid]).path} and {shard.path}")
            index[rid] = row
            row += 1
    return index


def _store_of(shards: Sequence[_Shard], row: int) -> _Shard:
    for shard in shards:
        if row < len(shard.ids):
            return shard
        row -= len(shard.ids)
    raise IndexError(row)  # pragma: no cover - rows come from _index_ids


def _sequence_digests(shards: Sequence[_Shard]) -> bytearray:
    """sha256 of every stored sequence, 32 bytes per row in merged order.

    The digest ``shard`` writes as ``sequence_sha256`` (of the normalised ASCII sequence), so
    a manifest row can be checked against the record it names. Read block by block.
    """
    digests = bytearray()
    sha256 = hashlib.sha256
    for shard in shards:
        with h5py.File(shard.path, "r") as f:
            ds = f["sequence"]
            for sl in iter_row_blocks(ds):
                try:
                    block = ds[sl]
                except OSError as exc:
                    raise StoreError(
                        f"{shard.path}: dataset sequence rows {sl.start}:{sl.stop}: checksum mismatch or read error ({exc})"
                    ) from None
                for seq in block.tolist():
                    digests += sha256(seq if isinstance(seq, bytes) else str(seq).encode("utf-8")).digest()
    return digests


class _ManifestCheck:
    """Checks manifest rows against the stores: every ``ok`` row names a stored record whose
    sequence has the row's ``sequence_sha256``, and so does every ``duplicate`` row's target
    (a stale manifest would otherwise alias IDs to other sequences)."""

    def __init__(self, manifest: Path, shards: Sequence[_Shard], index: dict[str, int]) -> None:
        self.manifest, self.shards, self.index = manifest, shards, index
        self.digests = _sequence_digests(shards)
        self._by_digest: dict[bytes, str] | None = None

    def where(self, line: int) -> str:
        return f"manifest {self.manifest} line {line}"

    def stored_sha(self, rid: str) -> str:
        row = self.index[rid]
        return self.digests[32 * row : 32 * row + 32].hex()

    def check_sha(self, line: int, row: dict[str, str], target: str) -> None:
        """The row's sequence_sha256 must be that of ``target``'s stored sequence."""
        claimed, stored = row.get("sequence_sha256", "").strip().lower(), self.stored_sha(target)
        if claimed == stored:
            return
        what = f"id {row['id']!r}" if row["id"] == target else f"duplicate {row['id']!r} of {target!r}"
        raise StoreError(
            f"{self.where(line)}: {what} has sequence_sha256 {claimed[:16] or '(empty)'}... but the sequence "
            f"of {target!r} in {_store_of(self.shards, self.index[target]).path} has {stored[:16]}...; "
            "is this manifest from another shard run (stale)?"
        )

    def by_content(self, sha: str) -> str | None:
        """The stored ID whose sequence has digest ``sha`` (duplicate rows without duplicate_of)."""
        if self._by_digest is None:
            ids = [rid for shard in self.shards for rid in shard.ids]
            self._by_digest = {}
            for row in range(len(ids) - 1, -1, -1):  # the first record wins
                self._by_digest[bytes(self.digests[32 * row : 32 * row + 32])] = ids[row]
        try:
            return self._by_digest.get(bytes.fromhex(sha))
        except ValueError:
            return None


def _check_ok_rows(check: _ManifestCheck) -> None:
    """Pass 1 over the manifest: every ``ok`` row is stored with its sequence; every stored ID is ``ok``."""
    seen = bytearray(len(check.index))
    for line, row in iter_manifest(check.manifest):
        if row.get("status") != "ok":
            continue
        rid = row["id"]
        if rid not in check.index:
            raise StoreError(
                f"{check.where(line)}: id {rid!r} (status ok, shard {row.get('shard')!r}) "
                "is not in any of the stores being merged"
            )
        check.check_sha(line, row, rid)
        seen[check.index[rid]] = 1
    missing = seen.find(0)
    if missing >= 0:
        shard = _store_of(check.shards, missing)
        rid = next(r for r, k in check.index.items() if k == missing)
        raise StoreError(
            f"manifest {check.manifest}: store {shard.path} holds id {rid!r}, which the manifest "
            f"does not list as ok ({seen.count(0)} such id(s)); wrong manifest for these stores?"
        )


def _plan_manifest(manifest: Path, shards: Sequence[_Shard], index: dict[str, int]) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(aliases [(id, of)], skipped [(id, reason)]) from the manifest, checked against the stores.

    Streams the manifest twice (``ok`` rows first), holding no per-row objects.
    """
    check = _ManifestCheck(manifest, shards, index)
    _check_ok_rows(check)
    aliases: list[tuple[str, str]] = []
    alias_seen: dict[str, str] = {}
    skipped: list[tuple[str, str]] = []
    for line, row in iter_manifest(manifest):
        status, rid = row.get("status") or "", row["id"]
        if status == "ok":
            continue
        if status == "duplicate":
            of = _duplicate_target(check, line, row)
            if of is None:
                continue
            if rid in alias_seen:
                if alias_seen[rid] != of:
                    raise StoreError(f"{check.where(line)}: id {rid!r} is a duplicate of both {alias_seen[rid]!r} and {of!r}")
                continue
            alias_seen[rid] = of
            aliases.append((rid, of))
        elif status.startswith("skipped"):
            reason = status.split(":", 1)[1] if ":" in status else ""
            skipped.append((rid, reason or "unspecified"))
        else:
            raise StoreError(f"{check.where(line)}: unknown status {status!r} for id {rid!r}")
    return aliases, skipped


def _duplicate_target(check: _ManifestCheck, line: int, row: dict[str, str]) -> str | None:
    """The stored ID a ``duplicate`` row aliases (``None``: it is that stored record itself)."""
    rid = row["id"]
    # the kept record: the manifest's duplicate_of column where present, else by content
    of = row.get("duplicate_of") or None
    if of not in check.index:
        of = check.by_content(row.get("sequence_sha256", "").strip().lower())
    if of is None:
        raise StoreError(
            f"{check.where(line)}: duplicate {rid!r} has no ok record with sequence_sha256 "
            f"{row.get('sequence_sha256')} (shard {row.get('shard')!r})"
        )
    check.check_sha(line, row, of)
    if rid == of:
        return None  # the same ID and sequence seen twice: already resolves
    if rid in check.index:
        raise StoreError(f"{check.where(line)}: id {rid!r} is both a stored record and a duplicate of {of!r}")
    return of


def merge_stores(stores: Sequence[Path], *, out: Path, manifest: Path | None = None) -> MergeSummary:
    """Merge shard stores into ``out`` (atomic). See the module docstring."""
    if not stores:
        hint = f" (see {manifest}: every record may have been skipped or invalid)" if manifest else ""
        raise StoreError(f"no shard stores to merge: nothing was embedded{hint}")
    out = Path(out)
    check_output_path(out)
    out_dir = out.parent if str(out.parent) else Path(".")
    paths = [Path(p) for p in stores]
    resolved = [p.resolve() for p in paths]
    dup = [p for p, c in Counter(resolved).items() if c > 1]
    if dup:
        raise StoreError(f"{dup[0]}: given twice")
    if out.resolve() in resolved:
        raise StoreError(f"{out}: the output would overwrite one of the input stores")

    shards = [_read_shard(p, out_dir) for p in paths]
    _check_agreement(shards)

    index = _index_ids(shards)

    aliases: list[tuple[str, str]] = []
    skipped: list[tuple[str, str]] = []
    if manifest is not None:
        aliases, skipped = _plan_manifest(Path(manifest), shards, index)

    first = shards[0]
    layers, dim = first.layers, first.dim
    storage = np.dtype(first.attrs["storage_dtype"])
    per_residue = first.per_residue
    n = sum(len(s.ids) for s in shards)
    record_rows = np.concatenate([[0], np.cumsum([len(s.ids) for s in shards])]).astype(np.int64)
    residue_rows = np.concatenate([[0], np.cumsum([s.rows for s in shards])]).astype(np.int64)
    common, varying, config_varying = _common_provenance(shards)

    with atomic_h5(out) as target:
        with target.create(libver=LIBVER, rdcc_nbytes=_WRITE_CACHE_BYTES, rdcc_w0=1.0, rdcc_nslots=_WRITE_CACHE_SLOTS) as f:
            _tag(f, FORMAT)
            f.attrs["format"] = FORMAT
            f.attrs["format_version"] = np.int64(FORMAT_VERSION)
            f.attrs[STORE_UUID_ATTR] = new_store_uuid()
            root = dict(common)
            root.update(
                created_utc=utc_now(),
                layers=np.array(layers, dtype=np.int64),
                dim=dim,
                storage_dtype=str(storage),
                per_residue=per_residue,
                merged_from=[s.rel for s in shards],
                merged_rows=record_rows,
                # pins each source: a rewritten shard no longer matches (docs/store-format.md)
                merged_sources=[s.identity for s in shards],
                shard_provenance=[{"path": s.rel, **s.attrs} for s in shards],
                varying_attrs=varying,
                config_varying=config_varying,
                alias_count=len(aliases),
                skipped_count=len(skipped),
            )
            write_root_attrs(f, root)

            # per-record datasets: copied block by block (checksums verified on read)
            for name, kind in PER_RECORD.items():
                if kind == "str":
                    width = max(s.widths[name] for s in shards)
                    dst = create_fixed_string_dataset(f, name, n, width)
                    cast = string_dtype(width)
                else:
                    dtype = np.result_type(*[s.dtypes[name] for s in shards])
                    dst = create_array_dataset(f, name, shape=(n,), dtype=dtype, compress=True,
                                               rows=min(max(n, 1), 131_072))
                    cast = dtype
                for shard, start in zip(shards, record_rows[:-1]):
                    _copy_rows(shard.path, name, dst, int(start), cast, check_finite=False)
                dst.flush()  # a full disk surfaces here, not when ``dst`` is garbage collected

            g = f.create_group("mean")
            _tag(g, "pooled-layers", pooling="mean")
            for k in layers:
                dst = create_array_dataset(g, f"layer_{k}", shape=(n, dim), dtype=storage)
                for shard, start in zip(shards, record_rows[:-1]):
                    _copy_rows(shard.path, f"mean/layer_{k}", dst, int(start), storage, check_finite=True)
                dst.flush()

            if per_residue:
                pr = f.create_group("per_residue")
                _tag(pr, "ragged-layers")
                offsets = np.concatenate(
                    [[0]] + [s.offsets[1:] + base for s, base in zip(shards, residue_rows[:-1])]  # type: ignore[index]
                ).astype(np.int64)
                ds = create_array_dataset(pr, "offsets", shape=(n + 1,), dtype=np.int64, data=offsets,
                                          rows=min(n + 1, 131_072), compress=True)
                ds.attrs["encoding-type"] = "offsets"
                total = int(residue_rows[-1])
                for k in layers:
                    name = f"layer_{k}"
                    if total == 0:
                        create_array_dataset(pr, name, shape=(0, dim), dtype=storage)
                        continue
                    layout = h5py.VirtualLayout(shape=(total, dim), dtype=storage)
                    for shard, base in zip(shards, residue_rows[:-1]):
                        if shard.rows:
                            layout[int(base) : int(base) + shard.rows] = h5py.VirtualSource(
                                shard.rel, f"per_residue/{name}", shape=(shard.rows, dim), dtype=storage
                            )
                    # a missing source reads as NaN (not zeros), which validate and readers catch
                    vds = pr.create_virtual_dataset(name, layout, fillvalue=np.nan)
                    _tag(vds, "virtual-array")

            if manifest is not None:
                ga = f.create_group("aliases")
                _tag(ga, "aliases")
                create_string_dataset(ga, "id", [a for a, _ in aliases])
                create_string_dataset(ga, "of", [b for _, b in aliases])
                gs = f.create_group("skipped")
                _tag(gs, "skipped")
                create_string_dataset(gs, "id", [a for a, _ in skipped])
                create_string_dataset(gs, "reason", [b for _, b in skipped])

            f.flush()
            f.attrs["complete"] = np.bool_(True)  # last
    return MergeSummary(
        out=out,
        stores=len(shards),
        records=n,
        per_residue_rows=int(residue_rows[-1]) if per_residue else 0,
        aliases=len(aliases),
        skipped=len(skipped),
        skipped_by_reason=dict(Counter(r for _, r in skipped)),
        varying_attrs=varying,
        file_size=out.stat().st_size,
    )


def _copy_rows(src_path: Path, name: str, dst: h5py.Dataset, start: int, cast: Any, *, check_finite: bool) -> None:
    with h5py.File(src_path, "r") as g:
        src = g[name]
        for sl in iter_row_blocks(src):
            try:
                block = src[sl]
            except OSError as exc:
                raise StoreError(
                    f"{src_path}: dataset {name} rows {sl.start}:{sl.stop}: checksum mismatch or read error ({exc})"
                ) from None
            if check_finite and not np.isfinite(block).all():
                raise StoreError(f"{src_path}: dataset {name} holds non-finite values; run embedpipe validate")
            with contextlib.suppress(AttributeError):
                block = block.astype(cast, copy=False)
            dst[start + sl.start : start + sl.stop] = block


__all__ = ["MergeSummary", "merge_stores", "MUST_AGREE"]
