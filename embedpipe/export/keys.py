"""HDF5 dataset names for input IDs: a documented, reversible encoding (docs/exports.md).

HDF5 link names cannot hold ``/`` (the path separator) and ``.`` alone names the group
itself, yet FASTA IDs such as ``sp|X|Y/Z`` exist. Percent-encoding only ``%``, ``/`` and a
leading ``.`` keeps every ordinary ID (UniProt ``sp|P12345|NAME`` included) unchanged, so
tools that read the dataset name as the ID (protspace, bio_embeddings) see the ID itself.
The exact ID is also stored in each dataset's ``original_id`` attribute.
"""

from __future__ import annotations

_ESCAPES = {"%": "%25", "/": "%2F"}
_UNESCAPES = {"25": "%", "2F": "/", "2E": "."}


def encode_key(record_id: str) -> str:
    """The HDF5 dataset name for ``record_id``."""
    key = "".join(_ESCAPES.get(c, c) for c in record_id)
    return "%2E" + key[1:] if key.startswith(".") else key


def decode_key(key: str) -> str:
    """The input ID a dataset name written by :func:`encode_key` stands for."""
    out, i = [], 0
    while i < len(key):
        if key[i] == "%" and key[i + 1 : i + 3] in _UNESCAPES:
            out.append(_UNESCAPES[key[i + 1 : i + 3]])
            i += 3
        else:
            out.append(key[i])
            i += 1
    return "".join(out)
