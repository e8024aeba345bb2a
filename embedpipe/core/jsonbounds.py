"""JSON from files anyone may have edited, parsed within bounds (depth, size).

Python's ``json`` recurses once per nesting level: a ``config`` attribute nested 100,000 deep
raised RecursionError in ``open_store``, ``info`` and ``export``, and a model directory's
``config.json``, ``tokenizer.json``, weight index or safetensors header did the same in
``embed`` and ``model-info``. So every reader of such JSON parses it here: at most
:data:`MAX_JSON_DEPTH` levels and :data:`MAX_JSON_CHARS` characters (embedpipe's own are a few
levels; a tokenizer a handful; a 16,000-source merged store's ``shard_provenance`` is ~30 MB),
else one line naming what was read, in the caller's error type (a store's StoreError, a
model's ModelError). Torch-free and below every package that reads JSON.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

from embedpipe.core.errors import EmbedpipeError

#: deepest nesting and most characters of a JSON text parsed
MAX_JSON_DEPTH = 64
MAX_JSON_CHARS = 256 << 20
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')


def json_depth(text: str) -> int:
    """Deepest bracket nesting outside string literals; C-speed (regex, numpy in 1 MiB steps)."""
    raw = np.frombuffer(_JSON_STRING.sub("", text).encode("utf-8", "surrogatepass"), dtype=np.uint8)
    deepest = level = 0
    for lo in range(0, len(raw), 1 << 20):
        b = raw[lo : lo + (1 << 20)]
        steps = ((b == 91) | (b == 123)).astype(np.int32) - ((b == 93) | (b == 125))
        levels = np.cumsum(steps, dtype=np.int64) + level
        if len(levels):
            deepest, level = max(deepest, int(levels.max())), int(levels[-1])
    return deepest


def load_bounded_json(text: str, what: str, error: type[EmbedpipeError]) -> Any:
    """``text`` parsed within :data:`MAX_JSON_DEPTH` / :data:`MAX_JSON_CHARS`; beyond them one
    ``error`` whose line starts with ``what`` (the file, or the file and the attribute).
    Invalid JSON: ValueError, as ``json.loads``."""
    if len(text) > MAX_JSON_CHARS:
        raise error(f"{what} holds {len(text)} characters of JSON, more than {MAX_JSON_CHARS}: refusing to parse it")
    few = text.count("[") + text.count("{") <= MAX_JSON_DEPTH  # then no deeper either: no scan
    if not few and (depth := json_depth(text)) > MAX_JSON_DEPTH:
        raise error(f"{what} is JSON nested {depth} levels deep, more than {MAX_JSON_DEPTH}: refusing to parse it")
    return json.loads(text)
