"""The embedpipe HDF5 store (format in docs/store-format.md), one module per job:

* ``format``: version, encoding tags, attributes, string/array types, open and version check;
  ``create``: every dataset and group the writer and merge create
* ``columns``: ``EmbeddedRecord`` and ``COLUMNS``, the registry of per-record datasets
* ``encoding``: the check readers make of each object's encoding tags
* ``writer``: ``StoreWriter`` (atomic), the header and the final ``complete``
* ``reader``: ``open_store``, ``Store``, ``UnknownIdError`` (the public read API); ``opening``:
  the checks at open; ``lookup``: an ID to its row, checked
* ``validate``, ``info``: ``embedpipe validate`` and ``embedpipe info``; ``id_checks``: the ID
  checks validate and export share
* ``merge`` (+ ``aliases``): ``embedpipe merge``; ``sources``: how a merged store pins its shards
* ``meancheck``: stored means against per-residue rows; ``h5write``: atomic HDF5 files, full disks
* ``digests``: ``row_digest``, the digests of each record's stored vectors, and their check

Names are exported lazily: ``embedpipe validate`` and the embedding worker need not import
dask, which only the reader uses (about a second).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "columns": ("COLUMNS", "Column", "EmbeddedRecord"),
    "format": ("FORMAT", "FORMAT_VERSION", "LONG_HANDLING", "STORAGE_DTYPES", "utc_now"),
    "info": ("human_bytes", "render_info", "store_info"),
    "merge": ("MUST_AGREE", "MergeSummary", "merge_stores"),
    "reader": ("Store", "UnknownIdError", "open_store"),
    "validate": ("validate_report", "validate_store"),
    "writer": ("StoreWriter",),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'embedpipe.store' has no attribute {name!r}")
    return getattr(importlib.import_module(f"embedpipe.store.{_MODULE_OF[name]}"), name)
