"""The most one FASTA record may hold (:class:`embedpipe.core.options.FastaLimits`), checked
while the file streams.

:mod:`embedpipe.inputs.fasta` keeps the record it is still reading in memory until the next
``>`` line; without a bound a hostile input (a 2 MB gzip holding one 2 GiB record, a 2 MiB ID)
is read whole. Here each record, complete or still being read, is held to three limits, so
memory holds at most one limit plus one block (docs/store-format.md, "Input limits"):

* its residues (non-blank bytes of its sequence lines): ``--max-record-length``;
* its ID's characters: ``--max-id-length``;
* its text in bytes, header, blank lines and spaces included: twice the record length plus
  :data:`TEXT_SLACK` (the blanks of any real layout fit; a file of mostly blanks does not).

Every violation is one :class:`InputError` naming the file, the header's line, the ID and the
option to raise.
"""

from __future__ import annotations

from embedpipe.core.errors import InputError
from embedpipe.core.options import FastaLimits
from embedpipe.inputs.residue_rules import WHITESPACE

__all__ = ["TEXT_SLACK", "check_id", "check_pending", "check_record", "text_cap"]

#: bytes a record's text may hold beyond twice its residue limit (headers with descriptions)
TEXT_SLACK = 1 << 20
_SHOWN = 40  # characters of an over-long ID quoted in a message


def text_cap(limits: FastaLimits) -> int:
    """Bytes one record's text may take (header and line ends included)."""
    return 2 * limits.max_length * limits.chars_per_residue + 4 * limits.max_id_length + TEXT_SLACK


def _shown(rid: str) -> str:
    """An ID for a one-line message: a long one shortened (the lead unifies this later)."""
    return rid if len(rid) <= _SHOWN else f"{rid[:_SHOWN]}..."


def _too_long(display: str, line: int, rid: str, residues: str, limits: FastaLimits) -> InputError:
    return InputError(
        f"{display}:{line}: record '{_shown(rid)}' is longer than --max-record-length "
        f"({limits.max_length:,} residues; {residues}): raise --max-record-length "
        f"(workflow: max_record_length) if it is a real protein"
    )


def _too_much_text(display: str, line: int, rid: str, limits: FastaLimits) -> InputError:
    return InputError(
        f"{display}:{line}: record '{_shown(rid)}' spans more than {text_cap(limits):,} bytes of text "
        f"(header, blank lines and spaces included; the bound follows --max-record-length, "
        f"workflow: max_record_length)"
    )


def check_id(rid: str, display: str, line: int, limits: FastaLimits) -> None:
    """Refuse an ID of more than ``max_id_length`` characters."""
    if len(rid) > limits.max_id_length:
        raise InputError(
            f"{display}:{line}: ID '{_shown(rid)}' ({len(rid):,} characters) is longer than "
            f"--max-id-length ({limits.max_id_length:,} characters): raise --max-id-length "
            f"(workflow: max_id_length) if it is real"
        )


def check_record(rid: str, residues: int, text: int, display: str, line: int, limits: FastaLimits) -> None:
    """A complete record: its residues and its text in bytes within the limits."""
    if residues > limits.max_length:
        raise _too_long(display, line, rid, f"it has {residues:,}", limits)
    if text > text_cap(limits):
        raise _too_much_text(display, line, rid, limits)


def _residues(data: bytes, start: int) -> int:
    """Non-blank bytes of ``data[start:]`` (C-level counts, no copy)."""
    return len(data) - start - sum(data.count(bytes((c,)), start) for c in WHITESPACE)


def check_pending(data: bytes, pos: int, display: str, line: int, limits: FastaLimits) -> None:
    """The record still being read, ``data[pos:]`` (its header at ``line``): stop as soon as it
    is over a limit, not once the file has been read to its next header."""
    size = len(data) - pos
    if size <= limits.max_id_length + 1 and size <= limits.max_length:
        return  # the common case: nothing to count
    hend = data.find(b"\n", pos)
    if hend < 0:  # the header line itself is still incomplete
        head = data[pos + 1 : pos + 2 + 4 * limits.max_id_length].lstrip()  # 4 bytes a character at most
        first = head.split(None, 1)[0] if head else b""
        rid = first.decode("utf-8", errors="backslashreplace")
        if len(first) < len(head):  # the ID ends inside ``head``
            check_id(rid, display, line, limits)
        elif len(head) > 4 * limits.max_id_length:
            raise InputError(
                f"{display}:{line}: ID '{_shown(rid)}' is longer than --max-id-length ({limits.max_id_length:,} "
                f"characters): raise --max-id-length (workflow: max_id_length) if it is real"
            )
        if size > text_cap(limits):
            raise _too_much_text(display, line, rid, limits)
        return
    words = data[pos + 1 : hend].split(None, 1)
    rid = words[0].decode("utf-8", errors="backslashreplace") if words else ""
    check_id(rid, display, line, limits)
    if len(data) - hend - 1 > limits.max_length and (n := _residues(data, hend + 1)) > limits.max_length:
        raise _too_long(display, line, rid, f"{n:,} read so far", limits)
    if size > text_cap(limits):
        raise _too_much_text(display, line, rid, limits)
