"""What a protein sequence may hold, and how it is normalised.

The normalisation kinds and invalid reasons below are what ``manifest.tsv`` records
(docs/store-format.md, "Shard manifest"):

* blank lines, spaces and tabs inside a record are ignored;
* lowercase is upper-cased, one trailing ``*`` is stripped, ``J`` becomes ``X`` (the
  normalisation kinds); ``U O B Z X`` are kept (ESM has tokens for them);
* for a family whose case is input (ProstT5: upper-case amino acids, lower-case 3Di;
  ``keep_case``) the case is kept (``j`` becomes ``x``), and a record mixing upper and lower
  case is invalid (``mixed-case``): it is neither;
* for a family that reads structure-aware sequences (SaProt: ``pairs``) every residue is two
  characters, an upper-case amino acid (or ``#``) and its lower-case 3Di state (or ``#``,
  masked); case is kept, nothing is normalised but one trailing ``*`` stripped, and an odd
  length or a character out of its place makes the record invalid (``not-pairs``);
* a ``*`` inside the sequence, ``-`` or ``.`` (an alignment), any other character, or an empty
  sequence make the record *invalid* (the invalid reasons).

Byte-level work only (``translate``, ``find``), so that it stays fast on proteome-scale input.
"""

from __future__ import annotations

__all__ = [
    "ALIGNMENT_GAP",
    "EMPTY_SEQUENCE",
    "INTERNAL_STOP",
    "INVALID_CHARACTER",
    "INVALID_REASONS",
    "J_TO_X",
    "MIXED_CASE",
    "NOT_PAIRS",
    "NORMALISATION_KINDS",
    "STOP_STRIPPED",
    "UPPERCASED",
    "WHITESPACE",
    "check_sequence",
    "describe_invalid",
]

# Normalisation kinds (FastaRecord.normalised, manifest column, summary).
UPPERCASED = "uppercased"
STOP_STRIPPED = "stop-stripped"
J_TO_X = "J-to-X"
NORMALISATION_KINDS = (UPPERCASED, STOP_STRIPPED, J_TO_X)

# Invalid-record reasons (FastaRecord.invalid; the manifest says ``skipped:<reason>``).
EMPTY_SEQUENCE = "empty-sequence"
INTERNAL_STOP = "internal-stop"
ALIGNMENT_GAP = "alignment-gap"
INVALID_CHARACTER = "invalid-character"
MIXED_CASE = "mixed-case"  # keep_case only (ProstT5): neither amino acids nor 3Di
NOT_PAIRS = "not-pairs"  # pairs only (SaProt): not amino-acid x 3Di pairs
INVALID_REASONS = (EMPTY_SEQUENCE, INTERNAL_STOP, ALIGNMENT_GAP, INVALID_CHARACTER, MIXED_CASE, NOT_PAIRS)

WHITESPACE = b" \t\r\n\v\f"
_WHITESPACE_SET = frozenset(WHITESPACE)
_LOWER = b"abcdefghijklmnopqrstuvwxyz"
_UPPER = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ"
# Everything that may appear in a sequence before normalisation: letters and '*'.
_ALLOWED = _LOWER + _UPPER + b"*"
# One pass: lowercase -> uppercase, J/j -> X.
_NORMALISE = bytes.maketrans(_LOWER + b"J", _UPPER.replace(b"J", b"X") + b"X")
# pairs: an amino acid's place (upper-case letters, '#') and a 3Di state's (its 20 letters, '#')
_PAIR_FIRST = frozenset(_UPPER + b"#")
_PAIR_SECOND = frozenset(b"acdefghiklmnpqrstvwy#")
# keep_case: J/j -> X/x only.
_NORMALISE_KEEPING_CASE = bytes.maketrans(b"Jj", b"Xx")


def _locate(raw: bytes, residue: int) -> tuple[int, int]:
    """(line offset within the record's sequence lines, 1-based column) of the n-th residue."""
    seen = 0
    for offset, text in enumerate(raw.split(b"\n")):
        for col, byte in enumerate(text, start=1):
            if byte in _WHITESPACE_SET:
                continue
            if seen == residue:
                return offset, col
            seen += 1
    return 0, 0  # pragma: no cover - the residue always exists


def _case_mixed_at(seq: bytes) -> int:
    """Index of the first letter whose case differs from the first letter's; -1 when one case."""
    if len(seq.translate(None, _LOWER)) in (0, len(seq)):
        return -1
    other = _LOWER if seq[:1].isupper() else _UPPER
    return next(i for i, byte in enumerate(seq) if byte in other)


def _pair_problem(seq: bytes) -> int:
    """Index of the first character out of its place in a structure-aware sequence (the last
    one of an odd length); -1 when every residue is an amino-acid x 3Di pair."""
    places = (_PAIR_FIRST, _PAIR_SECOND)
    bad = next((i for i, byte in enumerate(seq) if byte not in places[i % 2]), -1)
    return len(seq) - 1 if bad < 0 and len(seq) % 2 else bad


def check_sequence(raw: bytes, keep_case: bool = False,
                   pairs: bool = False) -> tuple[bytes, tuple[str, ...], str | None, int]:
    """Normalise one record's raw sequence text (the bytes after the header line); with
    ``keep_case`` its case is kept and a record of both cases is invalid (``mixed-case``);
    with ``pairs`` (SaProt) it is a structure-aware sequence, kept as it is.

    Returns ``(data, normalised, invalid_reason, bad_residue_index)``.
    """
    seq = raw.translate(None, WHITESPACE)
    if not seq:
        return seq, (), EMPTY_SEQUENCE, -1
    if pairs:
        stripped: tuple[str, ...] = (STOP_STRIPPED,) if seq[-1] == 42 else ()  # one trailing b"*"
        seq = seq[:-1] if stripped else seq
        if not seq:
            return seq, stripped, EMPTY_SEQUENCE, -1
        if (gap := next((i for i, byte in enumerate(seq) if byte in b"-.*"), -1)) >= 0:
            return seq, stripped, ALIGNMENT_GAP if seq[gap] != 42 else INTERNAL_STOP, gap
        bad_pair = _pair_problem(seq)
        return seq, stripped, (None if bad_pair < 0 else NOT_PAIRS), bad_pair
    bad = seq.translate(None, _ALLOWED)
    if bad:
        char = bad[:1]
        reason = ALIGNMENT_GAP if char in b"-." else INVALID_CHARACTER
        return seq, (), reason, seq.index(char)
    kinds: tuple[str, ...] = ()
    if seq[-1] == 42:  # b"*"
        seq = seq[:-1]
        kinds = (STOP_STRIPPED,)
        if not seq:
            return seq, kinds, EMPTY_SEQUENCE, -1
    star = seq.find(b"*")
    if star >= 0:
        return seq, kinds, INTERNAL_STOP, star
    if keep_case and (mixed := _case_mixed_at(seq)) >= 0:
        return seq, kinds, MIXED_CASE, mixed
    norm = seq.translate(_NORMALISE_KEEPING_CASE if keep_case else _NORMALISE)
    if norm != seq:
        extra = []
        if not keep_case and len(seq.translate(None, _LOWER)) != len(seq):
            extra.append(UPPERCASED)
        if b"J" in seq or b"j" in seq:
            extra.append(J_TO_X)
        kinds = (*extra, *kinds)
        seq = norm
    return seq, kinds, None, -1


def describe_invalid(reason: str, raw: bytes, data: bytes, bad_index: int, header_line: int) -> tuple[int, str]:
    """(line, message) for an invalid record; the line is that of the offending character."""
    if reason == EMPTY_SEQUENCE:
        return header_line, "empty sequence"
    offset, col = _locate(raw, bad_index)
    line = header_line + 1 + offset
    char = data[bad_index : bad_index + 1].decode("ascii", errors="backslashreplace")
    where = f"at column {col} (residue {bad_index + 1})"
    if reason == INTERNAL_STOP:
        return line, f"stop codon '*' inside the sequence {where}"
    if reason == MIXED_CASE:
        return line, (f"'{char}' {where} is in the other case than the record's first residue: this model reads "
                      "upper case as amino acids and lower case as 3Di, so one record must be all one case")
    if reason == NOT_PAIRS:
        what = (f"an odd number of characters ({len(data)})" if bad_index == len(data) - 1 and len(data) % 2
                else f"'{char}' at column {col} (character {bad_index + 1}) out of its place")
        return line, (f"{what}: this model reads structure-aware sequences, two characters a residue: an "
                      "upper-case amino acid (or '#') then its lower-case 3Di state (or '#' for a masked one)")
    if reason == ALIGNMENT_GAP:
        return line, f"gap character '{char}' {where}: this looks like an alignment, not raw sequences"
    if data[bad_index] >= 0x80:  # not text a residue can be: say which byte, not a decoded guess
        return line, (f"invalid character (non-ASCII byte 0x{data[bad_index]:02x}) {where}: sequences are ASCII letters "
                      "(a UTF-16 or binary file?)")
    quoted = f"'{char}'" if char.isprintable() and char.strip() else repr(char)
    return line, f"invalid character {quoted} {where}"
