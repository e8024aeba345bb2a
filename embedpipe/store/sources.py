"""How a merged store pins its sources: which files it was made from, and whether they are
still those files.

A checksum proves that a chunk holds the bytes that were written, not that the bytes of
two files belong to the same run. A merged store copies the pooled vectors but reads
per-residue rows from its shard stores, so rewriting a shard after merging would silently
mix two runs. Every store therefore carries a random ``store_uuid`` written at creation, and
a merged store records each source's identity (``merged_sources``); the checks here are the
one implementation that ``embedpipe validate``, ``open_store`` and ``crosscheck`` share.
See docs/store-format.md ("Merged stores", "How a merged store pins its sources").
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from embedpipe.core.checksums import file_sha256
from embedpipe.core.errors import EmbedpipeError, StoreError
from embedpipe.store.attrjson import load_json_attr
from embedpipe.store.format import STORE_UUID_ATTR, attr_to_python, check_format, is_complete, read_strings
from embedpipe.store.residues import is_resource_error, open_error

#: root attribute of merged stores: JSON list of {path, store_uuid, size[, sha256]}
MERGED_SOURCES_ATTR = "merged_sources"


def resolve_source(store_dir: Path, file_name: str) -> Path:
    """A merged store's source path (relative to the merged file's directory) on this machine."""
    p = Path(file_name)
    return p if p.is_absolute() else store_dir / p


def source_identity(path: Path, rel: str, store_uuid: str | None) -> dict[str, Any]:
    """What a merge records about one source store. Stores from before ``store_uuid`` existed
    are identified by their sha256, computed now (one extra read of the file)."""
    entry: dict[str, Any] = {"path": rel, "store_uuid": store_uuid, "size": int(path.stat().st_size)}
    if store_uuid is None:
        try:
            entry["sha256"] = file_sha256(path)
        except OSError as exc:
            raise StoreError(f"{path}: cannot read store to compute its sha256: {exc.strerror or exc}") from None
    return entry


class _PermissionDenied(Exception):
    """A source this process may not read: not a changed source (no "re-run merge")."""


def permission_denied(src: Path, rel: str) -> str:
    """The line for a source that cannot be read for lack of permission."""
    return (f"source store {rel} ({src}): permission denied: this user may not read it "
            "(check the file's and its directories' permissions)")


@dataclass(frozen=True)
class SourceProblem:
    """One source of a merged store that is missing or no longer the file that was merged;
    ``missing``: it cannot be used at all (absent, or this user may not read it)."""

    rel: str
    message: str
    missing: bool


def recorded_sources(f: h5py.File) -> dict[str, dict[str, Any]]:
    """``merged_sources`` by path; empty for shard stores and for stores merged before it existed."""
    raw = attr_to_python(f.attrs.get(MERGED_SOURCES_ATTR))
    if raw is None:
        return {}
    try:
        entries = load_json_attr(raw, MERGED_SOURCES_ATTR, f.filename)  # bounded (a crafted nesting)
        return {str(e["path"]): dict(e) for e in entries}
    except (ValueError, TypeError, KeyError):
        raise StoreError(f"root attribute {MERGED_SOURCES_ATTR} is not a JSON list of sources") from None


def _identity_change(src: Path, entry: dict[str, Any], *, full: bool) -> str | None:
    """Why ``src`` is not the file recorded in ``entry`` (None when it still is)."""
    want_uuid = entry.get("store_uuid")
    try:
        with h5py.File(src, "r") as g:
            have_uuid = attr_to_python(g.attrs.get(STORE_UUID_ATTR))
    except PermissionError:
        raise _PermissionDenied() from None
    except OSError as exc:
        if is_resource_error(exc):
            raise open_error(src, src.name, exc) from None  # a resource limit, not a changed source
        return f"is unreadable ({str(exc).splitlines()[0] if str(exc) else exc})"
    if have_uuid != want_uuid:
        return (f"was rewritten after the merge (store_uuid {have_uuid or 'none'}, "
                f"merged {want_uuid or 'none'})")
    size = src.stat().st_size
    if size != entry.get("size"):
        return f"changed after the merge (size {size} bytes, merged {entry.get('size')})"
    if full and want_uuid is None and entry.get("sha256"):
        try:
            digest = file_sha256(src)
        except OSError as exc:
            return f"is unreadable ({exc.strerror or exc})"
        if digest != entry["sha256"]:
            return f"changed after the merge (sha256 {digest[:16]}..., merged {str(entry['sha256'])[:16]}...)"
    return None


def source_problems(f: h5py.File, store_path: Path, *, full: bool) -> list[SourceProblem]:
    """Sources of the merged store ``f`` that are missing or were rewritten since the merge.

    ``full`` also re-hashes legacy sources (recorded by sha256, no ``store_uuid``); without it
    they are compared by size and by still having no ``store_uuid`` (cheap: no data read).
    """
    store_dir = Path(store_path).resolve().parent
    recorded = recorded_sources(f)
    names = [attr_to_python(v) or "" for v in np.atleast_1d(f.attrs.get("merged_from", []))]
    listed = set(names)
    names += [rel for rel in recorded if rel not in listed]
    out: list[SourceProblem] = []
    for rel in names:
        src = resolve_source(store_dir, rel)
        try:
            if not src.exists():
                out.append(SourceProblem(rel, f"source store {rel} is missing (looked for {src}); "
                                              "merged stores read per-residue data from their shard stores", True))
                continue
            why = _identity_change(src, recorded[rel], full=full) if rel in recorded else None
        except (PermissionError, _PermissionDenied):
            out.append(SourceProblem(rel, permission_denied(src, rel), True))  # unusable, as if missing
            continue
        if why:
            out.append(SourceProblem(rel, f"source store {rel} {why}: the merged store would mix runs; "
                                          "re-run embedpipe merge", False))
    return out


def require_sources(f: h5py.File, store_path: Path) -> None:
    """Raise StoreError (one line, naming the shard) unless every source is present and unchanged."""
    problems = source_problems(f, store_path, full=False)
    if problems:
        raise StoreError(f"{store_path}: {problems[0].message}")


def require_sources_present(f: h5py.File, store_path: Path) -> None:
    """``open_store``: every source exists, may be read and has the size it had when merged,
    by ``stat`` alone (no source is opened: ~10 s at 16,000 sources). A source whose size
    changed is opened to say why. Its ``store_uuid`` is checked when it is first read
    (:class:`embedpipe.store.residues.ShardRows`)."""
    store_dir = str(Path(store_path).resolve().parent)
    recorded = recorded_sources(f)
    names = [v or "" for v in attr_to_python(np.atleast_1d(f.attrs.get("merged_from", [])))]
    listed = set(names)  # once: a set built per source was O(K^2), 16 s at 16,000 sources
    for rel in names + [rel for rel in recorded if rel not in listed]:
        src = os.path.join(store_dir, rel)  # resolve_source, without a Path per source (0.2 s at 16,000)
        try:
            size = os.stat(src).st_size
        except FileNotFoundError:
            size = None
        except PermissionError:
            raise StoreError(f"{store_path}: {permission_denied(Path(src), rel)}") from None
        if size is None:
            raise StoreError(f"{store_path}: source store {rel} is missing (looked for {Path(src)}); "
                             "merged stores read per-residue data from their shard stores")
        if not os.access(src, os.R_OK):
            raise StoreError(f"{store_path}: {permission_denied(Path(src), rel)}")
        if rel in recorded and size != recorded[rel].get("size"):
            why = _identity_change(Path(src), recorded[rel], full=False)
            raise StoreError(f"{store_path}: source store {rel} {why or 'changed after the merge'}: the merged "
                             "store would mix runs; re-run embedpipe merge")


# ---------------------------------------------------------------------------------------------
# embedpipe validate: every source, in full


def virtual_sources(f: h5py.File) -> dict[str, set[str]]:
    """Source file -> dataset names that the virtual datasets of ``f`` read from."""
    sources: dict[str, set[str]] = {}

    def visit(name: str, obj: Any) -> None:
        if isinstance(obj, h5py.Dataset) and obj.is_virtual:
            for vmap in obj.virtual_sources():
                if vmap.file_name != ".":
                    sources.setdefault(vmap.file_name, set()).add(vmap.dset_name)

    f.visititems(visit)
    return sources


def _check_source(f: h5py.File, g: h5py.File, rel: str, datasets: set[str], rows: tuple[int, int] | None,
                  ids: Sequence[str] | None, problems: list[str]) -> bool:
    """One present source: complete, has the datasets read through it, same ids and offsets."""
    if not is_complete(g):
        problems.append(f"source store {rel} is incomplete")
        return False
    ok = True
    for dname in sorted(datasets):
        if dname not in g:
            problems.append(f"source store {rel} lacks dataset {dname}")
            ok = False
        elif not g[dname].fletcher32:
            problems.append(f"source store {rel} dataset {dname} has no fletcher32 checksum")
    if ids is not None and rows is not None:
        lo, hi = rows
        if read_strings(g["ids"]) != ids[lo:hi]:
            problems.append(f"source store {rel} holds different records than when merged (ids differ)")
            return False
        if "per_residue/offsets" in f and "per_residue/offsets" in g:
            merged_off = f["per_residue/offsets"][lo : hi + 1]
            if not np.array_equal(merged_off - merged_off[0], g["per_residue/offsets"][:]):
                problems.append(f"source store {rel} per-residue offsets differ from the merged store's")
                return False
    return ok


def _open_and_check_source(f: h5py.File, src: Path, rel: str, datasets: set[str], rows: tuple[int, int] | None,
                           ids: Sequence[str] | None, problems: list[str]) -> bool:
    try:
        with h5py.File(src, "r") as g:
            check_format(g, src)
            return _check_source(f, g, rel, datasets, rows, ids, problems)
    except StoreError as exc:
        problems.append(f"source store {rel}: {exc}")
    except PermissionError:
        problems.append(permission_denied(src, rel))
    except OSError as exc:
        problems.append(str(open_error(src, rel, exc)) if is_resource_error(exc)
                        else f"source store {rel} is unreadable: {exc}")
    except KeyError as exc:
        problems.append(f"source store {rel} is unreadable: {exc}")
    return False


def validate_sources(f: h5py.File, path: Path, ids: Sequence[str] | None, problems: list[str]) -> bool:
    """Merged stores: every source exists, is the very file that was merged (store_uuid, size,
    sha256 for legacy sources), is complete and matches. Returns False when a source is missing
    or unusable (reads through the virtual datasets would be meaningless)."""
    store_dir = path.resolve().parent
    sources = virtual_sources(f)
    merged_from = [str(p) for p in (attr_to_python(f.attrs.get("merged_from")) or [])]
    merged_rows = [int(v) for v in (attr_to_python(f.attrs.get("merged_rows")) or [])]
    rows_known = len(merged_rows) == len(merged_from) + 1
    listed = set(merged_from)
    merged_from += [name for name in sources if name not in listed]
    ok = True
    missing: set[str] = set()
    try:
        for problem in source_problems(f, path, full=True):
            problems.append(problem.message)
            if problem.missing:
                missing.add(problem.rel)
                ok = False
    except StoreError as exc:
        problems.append(str(exc))
    for i, rel in enumerate(merged_from):
        src = resolve_source(store_dir, rel)
        if rel in missing or not os.path.exists(src):
            ok = False
            continue
        rows = (merged_rows[i], merged_rows[i + 1]) if rows_known and i + 1 < len(merged_rows) else None
        ok = _open_and_check_source(f, src, rel, sources.get(rel, set()), rows, ids, problems) and ok
    return ok


#: first bytes of an HDF5 file whose superblock is at offset 0 (every store embedpipe writes)
_HDF5_MAGIC = b"\x89HDF\r\n\x1a\n"


def pinned_sources(store: Path) -> list[Path]:
    """The source stores a merged store reads through (``merged_from``/``merged_sources``);
    empty for anything that is not a readable merged store (a FASTA, a shard store)."""
    try:
        with open(store, "rb") as fh:
            if fh.read(len(_HDF5_MAGIC)) != _HDF5_MAGIC:
                return []
        with h5py.File(store, "r") as f:
            names = [str(attr_to_python(v) or "") for v in (attr_to_python(f.attrs.get("merged_from")) or [])]
            names += [rel for rel in recorded_sources(f) if rel not in names]
    except (OSError, ValueError, TypeError, EmbedpipeError):
        return []  # the reader says what is wrong with the store itself
    base = Path(store).resolve().parent
    return [resolve_source(base, rel) for rel in names if rel]


def pinned_by(stores: Iterable[Path]) -> dict[Path, list[Path]]:
    """``{store: the sources it pins}`` for the stores a command reads, for
    :func:`embedpipe.core.output_guard.guard_outputs` (no output may replace one of them)."""
    return {Path(store): pinned_sources(Path(store)) for store in stores}
