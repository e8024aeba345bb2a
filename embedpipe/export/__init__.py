"""``embedpipe export``: a store in the layouts downstream tools read (docs/exports.md).

* ``run``: ``export_store`` (checks, attributes, the stream of blocks to the format's module,
  found by its entry in :mod:`embedpipe.core.export_formats`)
* ``blocks``: the store as blocks of input IDs; ``keys``: HDF5 names
* ``h5_per_id``, ``parquet``, ``npy``: one module per format

Names are exported lazily, so the workflow's start-up reads the format list without h5py or
pyarrow.
"""

from __future__ import annotations

import importlib
from typing import Any

_MODULE_OF = {"ExportSummary": "run", "export_store": "run", "export_attrs": "run"}

__all__ = ["ExportSummary", "export_store"]


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'embedpipe.export' has no attribute {name!r}")
    return getattr(importlib.import_module(f"embedpipe.export.{_MODULE_OF[name]}"), name)
