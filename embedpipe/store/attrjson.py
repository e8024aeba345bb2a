"""JSON attributes parsed within bounds (docs/store-format.md, "Root attributes").

A store's JSON attributes (``config``, those in ``json_attrs``, a merged store's
``merged_sources``) come from a file anyone may have edited: a ``config`` nested 100,000 deep
raised RecursionError in ``open_store``, ``info`` and ``export``. So every reader parses them
here, through the bounded parser model directories are read with too
(:mod:`embedpipe.core.jsonbounds`): beyond its depth or size, one StoreError naming the file
and the attribute. Attribute text that is not UTF-8 (h5py hands a variable-length one over
with lone surrogates, which printing or writing it as UTF-8 turned into a traceback) is
refused the same way (:func:`check_attr_text`).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from embedpipe.core.errors import StoreError
from embedpipe.core.jsonbounds import load_bounded_json

_SURROGATE = re.compile("[\ud800-\udfff]")


def load_json_attr(text: str, name: str, where: str = "") -> Any:
    """A JSON attribute parsed within the bounds of :mod:`embedpipe.core.jsonbounds`; beyond
    them one StoreError naming ``where`` (the file) and the attribute. Invalid JSON: ValueError."""
    return load_bounded_json(text, f"{where}: root attribute {name!r}" if where else f"root attribute {name!r}",
                             StoreError)


def check_attr_text(raw: Any, name: str, where: str = "") -> None:
    """One StoreError naming ``where`` and the attribute when ``raw`` (as h5py read it: bytes,
    a str, or an array of them) holds text that is not UTF-8."""
    for value in (raw.ravel().tolist() if isinstance(raw, np.ndarray) else [raw]):
        if isinstance(value, bytes):
            try:
                value.decode("utf-8")
            except UnicodeDecodeError as exc:
                shown = value[max(0, exc.start - 20) : exc.start + 20]
                raise StoreError(f"{where + ': ' if where else ''}root attribute {name!r}: {shown!r} is not valid "
                                 "UTF-8") from None
        elif isinstance(value, str) and (m := _SURROGATE.search(value)):
            shown = value[max(0, m.start() - 20) : m.start() + 20].encode("utf-8", "surrogateescape")
            raise StoreError(f"{where + ': ' if where else ''}root attribute {name!r}: {shown!r} is not valid UTF-8")
