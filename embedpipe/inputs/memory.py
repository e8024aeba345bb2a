"""Sequences held in memory (the Python API's input, ``search``'s queries) checked by the
FASTA path's rules.

Why its own module: ``embedpipe.Embedder.embed`` takes a list of strings, ``(id, sequence)``
pairs or a dict, not a file, yet must refuse what ``embed`` refuses, with one line naming the
record: the ID rules (:mod:`embedpipe.core.idtext`) and, through the one check every entry point
shares (:mod:`embedpipe.inputs.family_rules`), the limits and the model family's residue rules
(case kept, pairs). A record's position is shown as ``sequences:N`` (N counted from 1), where a
file shows its line. The input must have an order (a set's is arbitrary, and so its IDs would be).
"""

from __future__ import annotations

import reprlib
from collections.abc import Iterable, Mapping, Set
from typing import Union

from embedpipe.core.errors import InputError, quote
from embedpipe.core.idtext import bad_id_char
from embedpipe.core.options import FASTA_LIMITS, FastaLimits
from embedpipe.inputs.bounds import check_id
from embedpipe.inputs.family_rules import check_family_sequence

__all__ = ["DISPLAY", "Sequences", "check_records"]

#: how a message names the input (``sequences:3``: its third record)
DISPLAY = "sequences"

#: what the API takes: sequences (IDs are their positions, from 0), ``(id, sequence)`` pairs, or a dict
Sequences = Union[Iterable[str], Iterable[tuple[str, str]], Mapping[str, str]]


def _pairs(sequences: Sequences) -> list[tuple[object, object]]:
    """``(id, sequence)`` of every input record; a bare string is its position's record."""
    if isinstance(sequences, (str, bytes)):
        raise InputError(f"{DISPLAY}: give a list of sequences, (id, sequence) pairs or a dict, not one string")
    if isinstance(sequences, Mapping):
        return list(sequences.items())
    if isinstance(sequences, Set):  # its order, and so the records' order and IDs, would be arbitrary
        raise InputError(f"{DISPLAY}: a {type(sequences).__name__} has no order; give a list of sequences, "
                         "(id, sequence) pairs or a dict")
    if not isinstance(sequences, Iterable):
        raise InputError(f"{DISPLAY}: give a list of sequences, (id, sequence) pairs or a dict, not "
                         f"{type(sequences).__name__}")
    pairs: list[tuple[object, object]] = []
    for i, item in enumerate(sequences):
        if isinstance(item, str):
            pairs.append((str(i), item))
        elif isinstance(item, tuple) and len(item) == 2:
            pairs.append(item)
        else:
            raise InputError(f"{DISPLAY}:{i + 1}: {reprlib.repr(item)} is neither a sequence nor an (id, sequence) pair")
    return pairs


def check_records(sequences: Sequences, limits: FastaLimits = FASTA_LIMITS) -> list[tuple[str, str]]:
    """``(id, normalised sequence)`` of every record, in input order, read under the family's
    rules that ``limits`` carries; one :class:`InputError` naming the first record that ``embed``
    would refuse in a FASTA (a bad or duplicate ID, a record over ``limits``, a character that is
    no residue, mixed case or a broken pair where the family reads case or pairs, an empty
    sequence), or no records."""
    limits.check(InputError)
    out: list[tuple[str, str]] = []
    seen: set[str] = set()
    for i, (rid, seq) in enumerate(_pairs(sequences)):
        line = i + 1
        if not isinstance(rid, str) or not isinstance(seq, str):
            raise InputError(f"{DISPLAY}:{line}: IDs and sequences are text, not {type(rid).__name__} and "
                             f"{type(seq).__name__}")
        _check_id(rid, line, limits)
        if rid in seen:
            raise InputError(f"{DISPLAY}:{line}: duplicate ID {quote(rid)}: every record needs its own ID")
        seen.add(rid)
        raw = seq.encode("utf-8")
        checked = check_family_sequence(rid, raw, len(raw), DISPLAY, line, limits)
        if checked.invalid is not None:  # the FASTA path's words; a held record's place is its position
            raise InputError(checked.error(DISPLAY, line))
        out.append((rid, checked.data.decode("ascii")))
    if not out:
        raise InputError(f"{DISPLAY}: no records to embed")
    return out


def _check_id(rid: str, line: int, limits: FastaLimits) -> None:
    """The FASTA header's rules for an ID: not empty, one word, no control character, within the limit."""
    if not rid or rid.split(None, 1)[0] != rid:
        raise InputError(f"{DISPLAY}:{line}: ID {quote(rid)} must be one word (a FASTA header's first word), "
                         "not empty and without spaces")
    if (ch := bad_id_char(rid)) is not None:
        raise InputError(f"{DISPLAY}:{line}: ID {quote(rid)} contains the control character {ch}; IDs may not hold "
                         "control characters (stores and exports refuse them)")
    check_id(rid, DISPLAY, line, limits)
