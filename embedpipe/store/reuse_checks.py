"""Checks before ``embed --reuse`` trusts a reuse index, and that the index belongs to its store.

A reuse index is an input like any other: a crafted or mis-edited one (rows out of range,
``block`` 0, missing or retyped datasets, an identity that is not JSON, a fence declaring
2^36 entries) gave tracebacks or a 2 TiB allocation, and one whose identity attributes were
edited made a job copy another model's vectors. So every field is checked against the real
datasets before use (:func:`index_problem`, a few attribute and shape reads at open; each
block as it is read, :func:`check_block`), and the store the index names must carry the very
identity the index records (:func:`index_mismatch`). Every failure is one StoreError line
naming the index file and the field. docs/store-format.md, "Reuse index".
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from embedpipe.core.errors import StoreError
from embedpipe.store.checks import size_problems
from embedpipe.store.format import STORE_UUID_ATTR, attr_to_python, read_root_attrs

#: the largest ``block`` a reader accepts: one block read is at most 2.5 MiB (keys and rows)
MAX_BLOCK = 1 << 16
#: the largest chunk of an index dataset (the writer's: ``block`` entries, 32 KiB)
MAX_CHUNK_BYTES = 4 << 20
#: root attributes that must be text when present (``store_path`` must be present)
_TEXT_ATTRS = ("store_path", STORE_UUID_ATTR, "embed_identity", "model_sha256", "model_num_layers")
#: the index's copies of its store's root attributes, compared with the store's own (uuid first)
BELONGS_ATTRS = (STORE_UUID_ATTR, "model_sha256", "model_num_layers", "embed_identity")
_KEY = np.dtype("S32")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _attr_problem(f: h5py.File) -> str | None:
    """``block`` and ``entries`` integers, the text attributes text, the identity a JSON object."""
    block = attr_to_python(f.attrs.get("block"))
    if not _is_int(block) or not 1 <= block <= MAX_BLOCK:
        return f"attribute block is {block!r}, not an integer in 1..{MAX_BLOCK}"
    entries = attr_to_python(f.attrs.get("entries"))
    if not _is_int(entries) or entries < 0:
        return f"attribute entries is {entries!r}, not a non-negative integer"
    for name in _TEXT_ATTRS:
        if name in f.attrs and not isinstance(attr_to_python(f.attrs[name]), str):
            return f"attribute {name} is {_short(attr_to_python(f.attrs[name]))}, not text"
    store = attr_to_python(f.attrs.get("store_path", ""))
    if "store_path" not in f.attrs:
        return "attribute store_path is missing"
    if not store or "\0" in store:
        return f"attribute store_path is {_short(store)}, not a file name"
    identity = attr_to_python(f.attrs.get("embed_identity", ""))
    if identity:
        try:
            parsed = json.loads(identity)
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):
            return f"attribute embed_identity is {_short(identity)}, not a JSON object"
    layers = attr_to_python(f.attrs.get("model_num_layers", "1"))
    if not (0 < len(layers) <= 6 and layers.isascii() and layers.isdigit() and int(layers) > 0):
        return f"attribute model_num_layers is {_short(layers)}, not a positive integer"
    return None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _dataset_problem(f: h5py.File, name: str, kind: str) -> str | None:
    """``name`` is a 1-D dataset of 32-byte keys (``kind`` "key") or integers ("int")."""
    ds = f.get(name)
    if not isinstance(ds, h5py.Dataset):
        return f"dataset {name} is missing" if ds is None else f"{name} is not a dataset"
    ok = ds.dtype == _KEY if kind == "key" else (ds.dtype.kind in "iu" and ds.dtype.itemsize <= 8)
    if ds.ndim != 1 or not ok:
        want = "32-byte keys (S32)" if kind == "key" else "integers"
        return f"dataset {name} has shape {ds.shape} and dtype {ds.dtype}, expected 1-D {want}"
    return None


def index_problem(f: h5py.File, path: Path) -> str | None:
    """The first problem of an opened index's attributes and datasets, or None. Reads
    attributes and shapes only: nothing proportional to what the file declares."""
    problem = _attr_problem(f)
    for name, kind in (("keys", "key"), ("rows", "int"), ("fence", "key")):
        problem = problem or _dataset_problem(f, name, kind)
    if problem:
        return problem
    file_size = Path(path).stat().st_size
    sizes = size_problems(f, file_size)
    if sizes:
        return sizes[0].message
    for name in ("keys", "rows", "fence"):  # a block read decompresses whole chunks
        chunks = f[name].chunks
        if chunks and chunks[0] * f[name].dtype.itemsize > MAX_CHUNK_BYTES:
            return f"dataset {name} has chunks of {chunks[0]} entries, more than {MAX_CHUNK_BYTES >> 20} MiB"
    n, block = int(f["keys"].shape[0]), int(attr_to_python(f.attrs["block"]))
    if f["rows"].shape[0] != n:
        return f"dataset rows has {f['rows'].shape[0]} entries, dataset keys {n}"
    if attr_to_python(f.attrs["entries"]) != n:
        return f"attribute entries is {attr_to_python(f.attrs['entries'])}, dataset keys holds {n}"
    if f["fence"].shape[0] != -(-n // block):
        return (f"dataset fence has {f['fence'].shape[0]} keys, expected {-(-n // block)} "
                f"(one per {block}-entry block of {n} keys)")
    if f["fence"].shape[0] * _KEY.itemsize > file_size:  # compressed: the file need not hold it
        return f"dataset fence declares {f['fence'].shape[0]} keys, more than the file's {file_size} bytes hold"
    return None


def _read(f: h5py.File, path: Path, name: str, key: slice) -> np.ndarray:
    try:
        return np.asarray(f[name][key])
    except OSError as exc:
        reason = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise StoreError(f"{path}: reuse index dataset {name} rows {key.start}:{key.stop}: checksum mismatch or read "
                         f"error ({reason}); build the index again (embedpipe reuse-index)") from None


def read_fence(f: h5py.File, path: Path) -> np.ndarray:
    """The fence, whole (its size checked by :func:`index_problem`), strictly increasing."""
    fence = _read(f, path, "fence", slice(0, int(f["fence"].shape[0])))
    drops = fence[1:] <= fence[:-1]
    if drops.any():
        i = int(np.argmax(drops)) + 1
        raise StoreError(f"{path}: reuse index dataset fence is not sorted (entry {i} is not above entry {i - 1}); "
                         "build the index again (embedpipe reuse-index)")
    return fence


def read_index_rows(f: h5py.File, path: Path, name: str, lo: int, hi: int) -> np.ndarray:
    """Entries ``lo:hi`` of ``keys`` (as S32) or ``rows`` (as int64), one line on a failed read."""
    values = _read(f, path, name, slice(lo, hi))
    return values if name == "keys" else values.astype(np.int64)


def check_block(keys: np.ndarray, rows: np.ndarray, fence: np.ndarray, b: int, block: int, path: Path) -> None:
    """Block ``b`` starts at its fence key, is strictly sorted and its rows are not negative:
    else a lookup would silently miss, or copy the wrong row."""
    lo = b * block
    why = None
    if not len(keys) or keys[0] != fence[b]:
        why = f"dataset keys row {lo} is not fence entry {b}"
    elif (keys[1:] <= keys[:-1]).any():
        why = f"dataset keys block {b} (rows {lo}:{lo + len(keys)}) is not sorted"
    elif (rows < 0).any():
        i = int(np.argmax(rows < 0))
        why = f"dataset rows row {lo + i} is {rows[i]}, negative"
    if why:
        raise StoreError(f"{path}: reuse index {why}; build the index again (embedpipe reuse-index)")


def check_row_range(rows: np.ndarray, n: int, index: Path, store: Path) -> None:
    """Rows the index points to lie in the store (``0..n-1``)."""
    outside = (rows < 0) | (rows >= n)
    if outside.any():
        bad = int(rows[int(np.argmax(outside))])
        raise StoreError(f"{index}: reuse index dataset rows points to row {bad}, outside 0..{n - 1} (the "
                         f"{n} records of {store}); build the index again (embedpipe reuse-index)")


def index_mismatch(index_attrs: dict[str, Any], f: h5py.File) -> str | None:
    """The first of :data:`BELONGS_ATTRS` the store ``f`` holds otherwise than its index records
    (read as ``build_index`` writes them), or None: the index belongs to this very store."""
    mine = {k: str(v) for k, v in read_root_attrs(f, only=list(BELONGS_ATTRS)).items() if k != "json_attrs"}
    for key in BELONGS_ATTRS:
        if str(index_attrs.get(key, "")) != mine.get(key, ""):
            return key
    return None


def open_indexed_store(path: Path, index_path: Path, index_attrs: dict[str, Any]) -> Any:
    """The store ``index_path`` indexes, opened, after checking it is that very store: its own
    ``store_uuid``, model and ``embed_identity`` (read from the store, not the index's copies)
    equal those the index records. A reuse job judges a source by its index's attributes
    before it opens the store, so an edited index would otherwise pass another model's rows."""
    from embedpipe.store.format import open_h5
    from embedpipe.store.reader import open_store

    store = open_store(path)
    try:
        with open_h5(path) as f:
            key = index_mismatch(index_attrs, f)
    except BaseException:
        store.close()
        raise
    if key is not None:
        store.close()
        if key == STORE_UUID_ATTR:
            raise StoreError(f"--reuse {path}: the store was rewritten since its reuse index {index_path} was built; "
                             "build the index again")
        raise StoreError(f"--reuse {path}: its reuse index {index_path} records another {key} than the store "
                         "itself (the index was edited, or built from another store); build the index again "
                         "(embedpipe reuse-index)")
    return store
