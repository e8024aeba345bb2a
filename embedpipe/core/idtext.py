"""What an ID may hold: no control characters (C0, DEL, C1) and no Unicode line or paragraph
separators. A newline or CR inside an ID split one line of an export's ``ids.txt`` into two
(more lines than the matrix has rows); line-based tools split on the others. The writer and
merge refuse such IDs, ``embedpipe validate`` reports them, and ``embedpipe shard`` refuses a
FASTA header whose ID holds one. Imports only ``core.errors`` (``fasta.py`` imports it).
docs/store-format.md, "Strings".
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from embedpipe.core.errors import quote

_FORBIDDEN = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def bad_id_char(value: str) -> str | None:
    """The first forbidden character of ``value`` as an escape (``'\\n'``), or None."""
    m = _FORBIDDEN.search(value)
    return None if m is None else repr(m.group())[1:-1]


def first_bad_id(ids: Iterable[str]) -> tuple[int, str, str] | None:
    """(position, ID, escaped character) of the first ID holding a forbidden character."""
    values = ids if isinstance(ids, list) else list(ids)
    if _FORBIDDEN.search(" ".join(values)) is None:  # one regex pass over all IDs
        return None
    for i, value in enumerate(values):
        if (ch := bad_id_char(value)) is not None:
            return i, value, ch
    return None  # pragma: no cover - the joined search found one


def bad_id_message(ids: Iterable[str], what: str = "id", start: int = 0) -> str | None:
    """One line naming the first ID with a forbidden character (None when all are clean);
    ``start``: the row of ``ids[0]`` (a block of a larger dataset)."""
    hit = first_bad_id(ids)
    if hit is None:
        return None
    i, value, ch = hit
    return (f"{what} {quote(value)} (row {start + i}) holds the control character {ch}: IDs may not contain control "
            "characters or line separators (an export's ids.txt would gain lines)")
