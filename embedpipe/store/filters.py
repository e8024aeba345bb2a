"""The HDF5 filters of every stored dataset, defined once (docs/store-format.md, "File level").

Every stored (non-virtual) dataset carries a fletcher32 checksum, which ``validate`` and the
readers rely on. Text (fixed-width IDs and sequence letters) is gzip-compressed; numeric
tables that compress (offsets, index keys and rows) add the byte shuffle before gzip; the
embedding arrays are checksummed only, unless a caller asks to compress them. HDF5 records
the filters per dataset, so readers need no setting from here: changing one changes how new
stores are laid out on disk, not the format version.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

#: every stored dataset: checksummed, not compressed
PLAIN: Mapping[str, Any] = MappingProxyType({"fletcher32": True})
#: numeric tables that compress: byte shuffle, then gzip (level 4, h5py's default)
NUMBERS: Mapping[str, Any] = MappingProxyType({"compression": "gzip", "shuffle": True, "fletcher32": True})
#: text (fixed-width strings, sequence letters): gzip level 4, no shuffle (one byte per value)
TEXT: Mapping[str, Any] = MappingProxyType({"compression": "gzip", "compression_opts": 4, "fletcher32": True})


def numbers(compress: bool) -> Mapping[str, Any]:
    """The filters of a numeric dataset: :data:`NUMBERS` when ``compress``, else :data:`PLAIN`."""
    return NUMBERS if compress else PLAIN
