"""The long-sequence modes, defined once: what ``--long-sequences`` (the config key
``long_sequences``) does with a record over the model's trained window, and the value the
store's ``long_handling`` column records for it (docs/store-format.md, "Datasets").

One vocabulary: a mode is its entry here; the user's word (``chunk``) and the stored word
(``chunked``) are two fields of it, and nothing else spells either. Plain Python (no torch or
numpy): ``core/options.py`` takes the names from here, ``store/format.py`` the stored values,
``extraction/planning.py`` the spans a mode cuts a record into. A new mode is one entry.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

#: residues ``start:end`` of one forward window, and ``keep_start:keep_end``, the part of it
#: stitched into the record (absolute positions)
Span = tuple[int, int, int, int]
#: ``long_handling`` of a record within the window, whatever the mode
WITHIN_WINDOW = "none"


def window_starts(length: int, window: int, overlap: int) -> list[int]:
    """Evenly spread window starts so consecutive windows overlap by at least ``overlap``."""
    if length <= window:
        return [0]
    stride = window - overlap
    count = math.ceil((length - window) / stride) + 1
    last = length - window
    return [round(i * last / (count - 1)) for i in range(count)]


def _windows(length: int, window: int, overlap: int) -> list[Span]:
    """Overlapping windows; each residue kept from the window whose centre is nearest. The
    overlap is at most half a window, so that windows advance for models with short windows."""
    starts = window_starts(length, window, min(overlap, window // 2))
    centres = [s + window / 2 for s in starts]
    spans = []
    for i, start in enumerate(starts):
        keep_start = 0 if i == 0 else math.floor((centres[i - 1] + centres[i]) / 2)
        keep_end = length if i == len(starts) - 1 else math.floor((centres[i] + centres[i + 1]) / 2)
        spans.append((start, start + window, keep_start, keep_end))
    return spans


def _first_window(length: int, window: int, overlap: int) -> list[Span]:
    """The first ``window`` residues only."""
    return [(0, window, 0, window)]


def _whole(length: int, window: int, overlap: int) -> list[Span]:
    """The whole record in one forward, past the trained window."""
    return [(0, length, 0, length)]


@dataclass(frozen=True)
class LongSequenceMode:
    """``name``: the ``--long-sequences`` value; ``handling``: the ``long_handling`` stored
    for a record over the window (none: the mode refuses such a record); ``spans``: the
    windows it is cut into, from (length, window, overlap)."""

    name: str
    handling: str | None
    spans: Callable[[int, int, int], list[Span]] | None


MODES: tuple[LongSequenceMode, ...] = (
    LongSequenceMode("chunk", "chunked", _windows),
    LongSequenceMode("truncate", "truncated", _first_window),
    LongSequenceMode("error", None, None),
    LongSequenceMode("full", "full", _whole),
)
BY_NAME: dict[str, LongSequenceMode] = {m.name: m for m in MODES}
#: the ``--long-sequences`` values, in the order the help lists them
NAMES: tuple[str, ...] = tuple(m.name for m in MODES)
#: the values of the store's ``long_handling`` column
HANDLING: tuple[str, ...] = (WITHIN_WINDOW, *(m.handling for m in MODES if m.handling is not None))
#: the mode of ``embed`` and of the workflow config when none is given
DEFAULT = "chunk"
#: the modes that embed a record over the window (a refusal names them)
EMBEDDING: tuple[str, ...] = tuple(m.name for m in MODES if m.spans is not None)
