"""An index of one stored layer and pooling: the FAISS file, its IDs and its identity beside it.

Why the identity travels with the index: a query is only meaningful when it was embedded as the
store's vectors were (model, layer, pooling, policy, storage dtype). ``INDEX`` is FAISS's own
file; ``INDEX.json`` records what it holds and of which store (its uuid and sha256, so an index
whose store changed is refused); ``INDEX.ids.txt`` its rows' IDs, one a line. The three are
written together, atomically (:func:`embedpipe.core.atomic.atomic_paths`).

Why the description binds the files and itself: a search loads a model and embeds its queries,
so everything that can refuse it is checked first (:func:`open_index`). ``INDEX.json`` records
the FAISS file's and the IDs file's sizes and sha256, and ``describes_sha256``, a sha256 over
its own other fields, so a damaged or replaced file, or an edited field (a kind, a pooling), is
refused in one line naming the file. Every file is size-checked before it is read: the
description within :data:`MAX_META_BYTES`, the FAISS file walked (:mod:`.faiss_file`) before
FAISS allocates anything. Indexes written before these fields (version 1) are refused with a
line saying to rebuild them.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from types import ModuleType
from typing import Any

from embedpipe.core.checksums import file_sha256
from embedpipe.core.errors import EmbedpipeError
from embedpipe.core.jsonbounds import load_bounded_json
from embedpipe.core.options import POOLINGS
from embedpipe.neighbours.faiss_file import faiss_layout

__all__ = ["FORMAT", "IndexMeta", "LoadedIndex", "check_id", "describes_sha256", "faiss_module", "ids_path",
           "meta_path", "open_index", "read_meta"]

#: what ``INDEX.json``'s ``format`` says, and its version (2: the files' sizes and digests)
FORMAT = "embedpipe-index"
VERSION = 2
#: index kinds: exact cosine (a flat inner-product index of unit vectors) or HNSW (approximate)
KINDS = ("exact", "hnsw")
#: the largest ``INDEX.json`` read (embedpipe's own are a few KB: the store's options are small)
MAX_META_BYTES = 16 << 20
#: characters an ID may not hold: they would break ``INDEX.ids.txt`` and the hits' TSV
ID_BREAKS = ("\t", "\n", "\r")
_SHA256 = re.compile(r"[0-9a-f]{64}")
REBUILD = "rebuild it with embedpipe index"


def faiss_module() -> ModuleType:
    """FAISS, or one line saying how to install it (the ``search`` extra)."""
    try:
        import faiss
    except ImportError:
        raise EmbedpipeError("nearest-neighbour search needs faiss: pip install 'embedpipe[search]' "
                             "(or pip install faiss-cpu)") from None
    return faiss


def meta_path(index: Path) -> Path:
    return Path(f"{index}.json")


def ids_path(index: Path) -> Path:
    return Path(f"{index}.ids.txt")


def check_id(record_id: str, store: Path) -> None:
    """Refuse an ID the IDs file and the TSV could not hold (a tab, a newline)."""
    if any(c in record_id for c in ID_BREAKS):
        raise EmbedpipeError(f"{store}: record {record_id!r} has a tab or a line break in its ID, which an index's "
                             "IDs file and the hits' TSV cannot hold; rename it and embed it again")


@dataclass(frozen=True)
class IndexMeta:
    """What an index holds (``INDEX.json``): its store, the layer and pooling, the kind, the
    store's identity (its ``embed_identity``, the model and the options its vectors were made
    with), and the sizes and sha256 of the FAISS and IDs files."""

    store: str  # the store's path when indexed (absolute)
    store_uuid: str
    store_sha256: str
    layer: int  # absolute
    pooling: str
    kind: str  # exact | hnsw
    rows: int
    dim: int
    model_source: str
    model_sha256: str
    precision_policy: str
    storage_dtype: str
    embed_identity: str
    options: dict[str, Any]  # the store's embed options (its ``config``)
    faiss_bytes: int
    faiss_sha256: str
    ids_bytes: int
    ids_sha256: str
    metric: str = "cosine"
    format: str = FORMAT
    version: int = VERSION

    def to_json(self) -> str:
        body = asdict(self)
        return json.dumps(body | {"describes_sha256": describes_sha256(body)}, sort_keys=True, indent=1)

    def describe(self) -> str:
        return (f"layer {self.layer} ({self.pooling}) of {self.store} embedded with {self.model_source} "
                f"({self.precision_policy}, stored as {self.storage_dtype})")

    def check_store(self, index: Path) -> None:
        """Refuse an index whose store, still at its path, changed since it was indexed."""
        store = Path(self.store)
        if not store.is_file():
            return  # moved or removed: the index holds its vectors and IDs itself
        now = file_sha256(store, cache=True)
        if now != self.store_sha256:
            raise EmbedpipeError(f"{index}: its store {store} changed since it was indexed (sha256 "
                                 f"{self.store_sha256[:16]}..., now {now[:16]}...); {REBUILD}")


def describes_sha256(body: dict[str, Any]) -> str:
    """The sha256 of a description's fields (all but ``describes_sha256``), as canonical JSON."""
    fields_only = {k: v for k, v in body.items() if k != "describes_sha256"}
    return hashlib.sha256(json.dumps(fields_only, sort_keys=True).encode("utf-8")).hexdigest()


def _type_name(value: object) -> str:
    return "null" if value is None else type(value).__name__


def _checked_fields(data: dict[str, Any], path: Path) -> dict[str, Any]:
    """Every field present, of its type and within its values; no other field."""
    types = {f.name: f.type for f in fields(IndexMeta)}
    wanted = set(types) | {"describes_sha256"}
    for name in sorted(wanted - set(data)):
        raise EmbedpipeError(f"{path}: the field {name!r} is missing; {REBUILD}")
    for name in sorted(set(data) - wanted):
        raise EmbedpipeError(f"{path}: holds a field {name[:40]!r} embedpipe does not write; {REBUILD}")
    python = {"str": str, "int": int, "dict[str, Any]": dict}
    for name, kind in types.items():
        value, want = data[name], python[str(kind)]
        if not isinstance(value, want) or isinstance(value, bool):
            raise EmbedpipeError(f"{path}: the field {name!r} is {_type_name(value)}, not {want.__name__}; {REBUILD}")
    bad = [name for name, ok in (
        ("kind", data["kind"] in KINDS), ("pooling", data["pooling"] in POOLINGS), ("metric", data["metric"] == "cosine"),
        ("rows", data["rows"] >= 0), ("dim", data["dim"] >= 1), ("faiss_bytes", data["faiss_bytes"] >= 0),
        ("ids_bytes", data["ids_bytes"] >= 0),
        *((name, bool(_SHA256.fullmatch(data[name]))) for name in ("faiss_sha256", "ids_sha256")),
        ("describes_sha256", isinstance(data["describes_sha256"], str))) if not ok]
    if bad:
        raise EmbedpipeError(f"{path}: the field {bad[0]!r} holds a value embedpipe does not write; {REBUILD}")
    if data["describes_sha256"] != describes_sha256(data):
        raise EmbedpipeError(f"{path}: its fields were edited since the index was built (their sha256 differs "
                             f"from its describes_sha256); {REBUILD}")
    return data


def _read_bounded(path: Path, limit: int) -> bytes:
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size > limit:
            raise EmbedpipeError(f"{path}: {size} bytes, more than the {limit} an index description may hold; {REBUILD}")
        return fh.read(limit + 1)


def read_meta(index: Path) -> IndexMeta:
    """``INDEX.json``, checked: an index embedpipe wrote, every field present and of its type,
    none edited, its store unchanged. The FAISS and IDs files are checked by :func:`open_index`."""
    path = meta_path(index)
    if not Path(index).is_file() or not path.is_file():
        raise EmbedpipeError(f"{index}: not an embedpipe index (expected {index} and {path}; build one with "
                             "embedpipe index STORE.h5 --out INDEX)")
    raw = _read_bounded(path, MAX_META_BYTES)
    try:
        data = load_bounded_json(raw.decode("utf-8"), f"{path}", EmbedpipeError)
    except (UnicodeDecodeError, ValueError):
        raise EmbedpipeError(f"{path}: not valid JSON (damaged?); {REBUILD}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise EmbedpipeError(f"{path}: not an embedpipe index description")
    if data.get("version") != VERSION:
        version = data.get("version")
        shown = version if isinstance(version, int) and not isinstance(version, bool) else "unknown"
        raise EmbedpipeError(f"{path}: index version {shown}, this embedpipe reads {VERSION} (which records its "
                             f"files' sizes and sha256); {REBUILD}")
    data = _checked_fields(data, path)
    meta = IndexMeta(**{f.name: data[f.name] for f in fields(IndexMeta)})
    meta.check_store(Path(index))
    return meta


def _check_file(path: Path, size: int, sha256: str, meta: Path) -> None:
    """``path`` has the size and sha256 ``meta`` records (size first: no read of a wrong file)."""
    try:
        now = path.stat().st_size
        if now != size:
            raise EmbedpipeError(f"{path}: {now} bytes, {meta} records {size}; the index was changed or damaged: "
                                 f"{REBUILD}")
        if file_sha256(path, cache=True) != sha256:
            raise EmbedpipeError(f"{path}: its sha256 is not the one {meta} records; the index was changed or "
                                 f"damaged: {REBUILD}")
    except OSError as exc:
        raise EmbedpipeError(f"{path}: cannot read it ({exc.strerror or exc}); {REBUILD}") from None


@dataclass
class LoadedIndex:
    """An index checked whole and read: its description, its FAISS index and its rows' IDs."""

    path: Path
    meta: IndexMeta
    index: Any  # the faiss index
    ids: list[str]


def read_ids(index: Path, meta: IndexMeta) -> list[str]:
    """The IDs of the index's rows (``INDEX.ids.txt``, its size and sha256 checked), one a row."""
    path = ids_path(index)
    _check_file(path, meta.ids_bytes, meta.ids_sha256, meta_path(index))
    try:
        ids = path.read_bytes().decode("utf-8").split("\n")
    except UnicodeDecodeError:
        raise EmbedpipeError(f"{path}: not UTF-8 text; {REBUILD}") from None
    if ids[-1] != "" or len(ids) - 1 != meta.rows or any("\t" in i or "\r" in i for i in ids):
        raise EmbedpipeError(f"{path}: not {meta.rows} IDs, one a line; {REBUILD}")
    return ids[:-1]


def open_index(index: Path | str) -> LoadedIndex:
    """The index at ``index``, every file checked against its description (sizes, sha256, the
    FAISS file's kind, width and rows) before any is read whole; one line naming the file else."""
    index = Path(index)
    meta = read_meta(index)
    _check_file(index, meta.faiss_bytes, meta.faiss_sha256, meta_path(index))
    layout = faiss_layout(index)
    if (layout.kind, layout.dim, layout.rows) != (meta.kind, meta.dim, meta.rows):
        raise EmbedpipeError(f"{index}: holds {layout.rows} rows of {layout.dim} values ({layout.kind}), "
                             f"{meta_path(index)} says {meta.rows} of {meta.dim} ({meta.kind}); {REBUILD}")
    ids = read_ids(index, meta)
    faiss = faiss_module()
    try:
        loaded = faiss.read_index(str(index))
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise EmbedpipeError(f"{index}: FAISS cannot read it ({first}); {REBUILD}") from None
    return LoadedIndex(index, meta, loaded, ids)
