"""JSON attributes parsed within bounds (docs/store-format.md, "Root attributes").

A store's JSON attributes (``config``, those in ``json_attrs``, a merged store's
``merged_sources``) come from a file anyone may have edited: a ``config`` nested 100,000 deep
raised RecursionError in ``open_store``, ``info`` and ``export``. So every reader parses them
here: at most :data:`MAX_JSON_DEPTH` levels and :data:`MAX_JSON_CHARS` characters (embedpipe's
own are a few levels; a 16,000-source merged store's ``shard_provenance`` is ~30 MB), else one
StoreError naming the file and the attribute. Attribute text that is not UTF-8 (h5py hands
a variable-length one over with lone surrogates, which printing or writing it as UTF-8 turned
into a traceback) is refused the same way (:func:`check_attr_text`).
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

from embedpipe.core.errors import StoreError

#: deepest nesting and most characters of a JSON attribute parsed
MAX_JSON_DEPTH = 64
MAX_JSON_CHARS = 256 << 20
_SURROGATE = re.compile("[\ud800-\udfff]")
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')


def json_depth(text: str) -> int:
    """Deepest bracket nesting outside string literals; C-speed (regex, numpy in 1 MiB steps)."""
    raw = np.frombuffer(_JSON_STRING.sub("", text).encode("utf-8"), dtype=np.uint8)
    deepest = level = 0
    for lo in range(0, len(raw), 1 << 20):
        b = raw[lo : lo + (1 << 20)]
        steps = ((b == 91) | (b == 123)).astype(np.int32) - ((b == 93) | (b == 125))
        levels = np.cumsum(steps, dtype=np.int64) + level
        if len(levels):
            deepest, level = max(deepest, int(levels.max())), int(levels[-1])
    return deepest


def load_json_attr(text: str, name: str, where: str = "") -> Any:
    """A JSON attribute parsed within :data:`MAX_JSON_DEPTH` / :data:`MAX_JSON_CHARS`; beyond
    them one StoreError naming ``where`` (the file) and the attribute. Invalid JSON: ValueError."""
    prefix = f"{where}: " if where else ""
    if len(text) > MAX_JSON_CHARS:
        raise StoreError(f"{prefix}root attribute {name!r} holds {len(text)} characters of JSON, more than "
                         f"{MAX_JSON_CHARS}: refusing to parse it")
    few = text.count("[") + text.count("{") <= MAX_JSON_DEPTH  # then no deeper either: no scan
    if not few and (depth := json_depth(text)) > MAX_JSON_DEPTH:
        raise StoreError(f"{prefix}root attribute {name!r} is JSON nested {depth} levels deep, more than "
                         f"{MAX_JSON_DEPTH}: refusing to parse it")
    return json.loads(text)


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
