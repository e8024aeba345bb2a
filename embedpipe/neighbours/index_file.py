"""An index of one stored layer and pooling: the FAISS file, its IDs and its identity beside it.

Why the identity travels with the index: a query is only meaningful when it was embedded as the
store's vectors were (model, layer, pooling, policy, storage dtype). ``INDEX`` is FAISS's own
file; ``INDEX.json`` records what it holds and of which store (its uuid and sha256, so an index
whose store changed is refused); ``INDEX.ids.txt`` its rows' IDs, one a line. The three are
written together, atomically (:func:`embedpipe.core.atomic.atomic_paths`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from embedpipe.core.checksums import file_sha256
from embedpipe.core.errors import EmbedpipeError
from embedpipe.core.jsonbounds import load_bounded_json

__all__ = ["FORMAT", "IndexMeta", "faiss_module", "ids_path", "meta_path", "read_ids", "read_meta"]

#: what ``INDEX.json``'s ``format`` says, and its version
FORMAT = "embedpipe-index"
VERSION = 1
#: index kinds: exact cosine (a flat inner-product index of unit vectors) or HNSW (approximate)
KINDS = ("exact", "hnsw")


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


@dataclass(frozen=True)
class IndexMeta:
    """What an index holds (``INDEX.json``): its store, the layer and pooling, the kind, and the
    store's identity (its ``embed_identity``, the model and the options its vectors were made with)."""

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
    metric: str = "cosine"
    format: str = FORMAT
    version: int = VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, indent=1)

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
                                 f"{self.store_sha256[:16]}..., now {now[:16]}...); rebuild it with embedpipe index")


def read_meta(index: Path) -> IndexMeta:
    """``INDEX.json``, checked: an index embedpipe wrote, every field present, its store unchanged."""
    path = meta_path(index)
    if not Path(index).is_file() or not path.is_file():
        raise EmbedpipeError(f"{index}: not an embedpipe index (expected {index} and {path}; build one with "
                             "embedpipe index STORE.h5 --out INDEX)")
    data = load_bounded_json(path.read_text(encoding="utf-8"), f"{path}", EmbedpipeError)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise EmbedpipeError(f"{path}: not an embedpipe index description")
    if data.get("version") != VERSION:
        raise EmbedpipeError(f"{path}: index version {data.get('version')!r}, this embedpipe reads {VERSION}; "
                             "rebuild it with embedpipe index")
    fields = set(IndexMeta.__dataclass_fields__)
    missing = sorted(fields - set(data))
    if missing:
        raise EmbedpipeError(f"{path}: the field {missing[0]!r} is missing; rebuild it with embedpipe index")
    meta = IndexMeta(**{k: data[k] for k in fields})
    meta.check_store(Path(index))
    return meta


def read_ids(index: Path, rows: int) -> list[str]:
    """The IDs of the index's rows (``INDEX.ids.txt``), as many as it has rows."""
    ids = ids_path(index).read_text(encoding="utf-8").split("\n")[:-1]
    if len(ids) != rows:
        raise EmbedpipeError(f"{ids_path(index)}: {len(ids)} IDs for an index of {rows} rows; rebuild it with "
                             "embedpipe index")
    return ids
