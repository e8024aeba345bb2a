"""One record's sequence read under its model family's rules: the one check every entry point
shares (a FASTA file, the Python API's sequences, ``search``'s queries).

Why one function: the family's token layout decides what a record may hold (case kept for
ProstT5, where it says amino acids or 3Di; two characters a residue for SaProt's pairs), and
the API once applied the amino-acid rules without it, so a SaProt or 3Di record was embedded
upper-cased. ``limits`` carries the layout's rules (``keep_case``, ``chars_per_residue``, set by
:func:`embedpipe.extraction.run.start_checks` from the model); every reader calls this, so a record
gets the same sequence, or the same refusal, whichever way it enters.
"""

from __future__ import annotations

from dataclasses import dataclass

from embedpipe.core.options import FastaLimits
from embedpipe.inputs.bounds import check_record, text_cap
from embedpipe.inputs.residue_rules import check_sequence, describe_invalid

__all__ = ["CheckedSequence", "check_family_sequence"]


@dataclass(frozen=True, slots=True)
class CheckedSequence:
    """A record's sequence as its family reads it: ``data`` (normalised ASCII), what was
    normalised (``kinds``), and, for a record that cannot be embedded, why (``invalid``), the
    reason in words (``message``) and the line of the offending character (``line``)."""

    rid: str
    data: bytes
    kinds: tuple[str, ...]
    invalid: str | None = None
    message: str = ""
    line: int = 0

    def error(self, display: str, line: int | None = None) -> str:
        """The one-line refusal, ``display:line: record 'ID': reason`` (``line``: a held
        record's position, where a file names the offending character's line)."""
        return f"{display}:{self.line if line is None else line}: record '{self.rid}': {self.message}"


def check_family_sequence(rid: str, raw: bytes, text_bytes: int, display: str, line: int,
                          limits: FastaLimits) -> CheckedSequence:
    """``raw`` (the record's sequence text, line ends and blanks included) of record ``rid``
    (header at ``display:line``; ``text_bytes``: the record's whole text) under the family's rules.

    A record over the limits (residues: characters over ``chars_per_residue``) raises
    :class:`~embedpipe.core.errors.InputError`; an invalid one comes back with its reason."""
    per_residue = limits.chars_per_residue
    data, kinds, reason, bad = check_sequence(raw, limits.keep_case, per_residue == 2)
    if len(data) > limits.max_length * per_residue or text_bytes > text_cap(limits):
        check_record(rid, len(data) // per_residue, text_bytes, display, line, limits)
    if reason is None:
        return CheckedSequence(rid, data, kinds)
    err_line, message = describe_invalid(reason, raw, data, bad, line)
    return CheckedSequence(rid, data, kinds, reason, message, err_line)
