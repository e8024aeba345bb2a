"""Streaming protein FASTA reading: plain or gzip, validation and normalisation.

The reader works on large blocks of bytes (never the whole file) and does its per-record work
with C-level bytes operations (``find``, ``count``, ``translate``), so that it stays fast on
proteome-scale input. Every record comes out as a :class:`FastaRecord` whose ``data`` is the
normalised sequence (ASCII bytes) and whose ``invalid`` says why it cannot be embedded, if so.

Rules (the issue's validation table):

* a line ends at LF, CRLF or a lone CR (old-Mac files, or a stray CR inside an LF file), so
  every ``>`` that starts a line is one record; a leading UTF-8 byte-order mark is dropped;
* text other than blank lines before the first header, an empty header or ID, a header that
  is not UTF-8 or holds a NUL byte, and the same ID twice are *structural* errors:
  :class:`InputError` at once;
* blank lines, spaces and tabs inside a record are ignored;
* lowercase is upper-cased, one trailing ``*`` is stripped, ``J`` becomes ``X`` (counted in
  ``FastaRecord.normalised``); ``U O B Z X`` are kept (ESM has tokens for them);
* a ``*`` inside the sequence, ``-`` or ``.`` (an alignment), any other character, or an empty
  sequence make the record *invalid*: ``invalid`` holds the reason and ``error`` the message.
"""

from __future__ import annotations

import gzip
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Union

from embedpipe.errors import InputError

PathLike = Union[str, "os.PathLike[str]"]

#: Bytes read per block; records spanning blocks are carried over.
BLOCK_SIZE = 8 * 1024 * 1024

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
INVALID_REASONS = (EMPTY_SEQUENCE, INTERNAL_STOP, ALIGNMENT_GAP, INVALID_CHARACTER)

_WHITESPACE = b" \t\r\n\v\f"
_BOM = b"\xef\xbb\xbf"
_WHITESPACE_SET = frozenset(_WHITESPACE)
_LOWER = b"abcdefghijklmnopqrstuvwxyz"
_UPPER = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ"
# Everything that may appear in a sequence before normalisation: letters and '*'.
_ALLOWED = _LOWER + _UPPER + b"*"
# One pass: lowercase -> uppercase, J/j -> X.
_NORMALISE = bytes.maketrans(_LOWER + b"J", _UPPER.replace(b"J", b"X") + b"X")

_COMPRESSED_MAGIC = {
    b"BZh": "bzip2",
    b"\xfd7zXZ\x00": "xz",
    b"\x28\xb5\x2f\xfd": "zstd",
    b"PK\x03\x04": "zip",
}


@dataclass(slots=True)
class FastaRecord:
    """One FASTA record as read, validated and normalised.

    ``data`` is the normalised sequence as ASCII bytes (``sequence`` gives it as ``str``);
    for an invalid record it is the sequence with only whitespace removed. ``source`` is
    ``"path:line"`` of the header line (1-based).
    """

    id: str
    header: str
    data: bytes
    path: str
    line: int
    file_index: int
    normalised: tuple[str, ...] = ()
    invalid: str | None = None
    error: str | None = None

    @property
    def sequence(self) -> str:
        return self.data.decode("ascii", errors="replace")

    @property
    def source(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def length(self) -> int:
        return len(self.data)


# --------------------------------------------------------------------------------------------
# Opening files


def _open_binary(path: Path, display: str) -> tuple[BinaryIO, BinaryIO]:
    """Open ``path`` for reading; gzip is detected by its magic bytes, not by the name.

    Returns ``(stream, raw)``: ``raw.tell()`` is the position in the file on disk (progress).
    """
    try:
        raw = open(path, "rb")  # noqa: SIM115 - closed by the caller
    except FileNotFoundError:
        raise InputError(f"{display}: no such file") from None
    except IsADirectoryError:
        raise InputError(f"{display}: is a directory, not a FASTA file") from None
    except OSError as exc:
        raise InputError(f"{display}: cannot open: {exc.strerror or exc}") from None
    try:
        magic = raw.peek(6)[:6]  # peek, not read + seek: a pipe can be read once, in order
    except OSError as exc:
        raw.close()
        raise InputError(f"{display}: cannot read: {exc.strerror or exc}") from None
    if magic[:2] == b"\x1f\x8b":
        return gzip.GzipFile(fileobj=raw, mode="rb"), raw  # type: ignore[return-value]
    for prefix, kind in _COMPRESSED_MAGIC.items():
        if magic.startswith(prefix):
            raw.close()
            raise InputError(
                f"{display}: looks {kind}-compressed; only plain or gzip FASTA is supported "
                f"(decompress it first)"
            )
    return raw, raw


def _read_raw(stream: BinaryIO, display: str, block_size: int) -> Iterator[bytes]:
    while True:
        try:
            block = stream.read(block_size)
        except (OSError, EOFError, gzip.BadGzipFile) as exc:
            raise InputError(f"{display}: cannot read (corrupt or truncated gzip?): {exc}") from None
        if not block:
            return
        yield block


def _read_blocks(stream: BinaryIO, display: str, block_size: int) -> Iterator[bytes]:
    """Blocks of the file with every line end (``\\r\\n``, lone ``\\r``, ``\\n``) as ``\\n``.

    A leading UTF-8 byte-order mark is dropped. A block ending in ``\\r`` keeps it back until
    the next block shows whether a ``\\n`` follows, so a CRLF split across blocks is one line
    end and line numbers count the same for LF, CRLF and old-Mac CR files.
    """
    carry = b""
    head = True  # still looking for a byte-order mark
    for block in _read_raw(stream, display, block_size):
        if carry:
            block = carry + block
            carry = b""
        if head:
            if len(block) < len(_BOM) and _BOM.startswith(block):
                carry = block  # too short to tell yet
                continue
            head = False
            if block.startswith(_BOM):
                block = block[len(_BOM) :]
        if b"\r" in block:
            if block.endswith(b"\r"):
                block, carry = block[:-1], b"\r"
            block = block.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        if block:
            yield block
    if carry:  # a final lone CR, or a file that is only the start of a byte-order mark
        yield b"\n" if carry == b"\r" else carry


# --------------------------------------------------------------------------------------------
# Validation and normalisation of one record's sequence text


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


def _check(raw: bytes) -> tuple[bytes, tuple[str, ...], str | None, int]:
    """Normalise one record's raw sequence text (the bytes after the header line).

    Returns ``(data, normalised, invalid_reason, bad_residue_index)``.
    """
    seq = raw.translate(None, _WHITESPACE)
    if not seq:
        return seq, (), EMPTY_SEQUENCE, -1
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
    norm = seq.translate(_NORMALISE)
    if norm != seq:
        extra = []
        if len(seq.translate(None, _LOWER)) != len(seq):
            extra.append(UPPERCASED)
        if b"J" in seq or b"j" in seq:
            extra.append(J_TO_X)
        kinds = (*extra, *kinds)
        seq = norm
    return seq, kinds, None, -1


def _describe(reason: str, raw: bytes, data: bytes, bad_index: int, header_line: int) -> tuple[int, str]:
    """(line, message) for an invalid record; the line is that of the offending character."""
    if reason == EMPTY_SEQUENCE:
        return header_line, "empty sequence"
    offset, col = _locate(raw, bad_index)
    line = header_line + 1 + offset
    char = data[bad_index : bad_index + 1].decode("ascii", errors="backslashreplace")
    where = f"at column {col} (residue {bad_index + 1})"
    if reason == INTERNAL_STOP:
        return line, f"stop codon '*' inside the sequence {where}"
    if reason == ALIGNMENT_GAP:
        return line, f"gap character '{char}' {where}: this looks like an alignment, not raw sequences"
    quoted = f"'{char}'" if char.isprintable() and char.strip() else repr(char)
    return line, f"invalid character {quoted} {where}"


# --------------------------------------------------------------------------------------------
# The reader


def path_text(path: PathLike) -> str:
    """``path`` as UTF-8 text for files (the manifest's ``source``): non-UTF-8 bytes as ``\\xNN``.

    File names are bytes on POSIX; Python keeps undecodable ones as lone surrogates, which
    cannot be written to a UTF-8 file (docs/store-format.md, "Shard manifest").
    """
    return os.fsencode(path).decode("utf-8", errors="backslashreplace")


_CONTROL_ESCAPES = {c: f"\\x{c:02x}" for c in (*range(32), 127)} | {9: "\\t", 10: "\\n", 13: "\\r"}


def display_path(path: PathLike) -> str:
    """``path`` for a one-line message: :func:`path_text` with control characters escaped too."""
    return path_text(path).translate(_CONTROL_ESCAPES)


def _as_paths(paths: PathLike | Iterable[PathLike]) -> list[PathLike]:
    if isinstance(paths, (str, os.PathLike)):
        return [paths]  # type: ignore[list-item]
    return list(paths)


def iter_fasta(
    paths: PathLike | Iterable[PathLike],
    *,
    check_duplicate_ids: bool = True,
    on_bytes: Callable[[int], None] | None = None,
    block_size: int = BLOCK_SIZE,
) -> Iterator[FastaRecord]:
    """Stream the records of one or more FASTA files (plain or gzip), in input order.

    Structural problems raise :class:`InputError` naming the file and line: text before the
    first header, an empty header or ID, a header that is not UTF-8, and (with
    ``check_duplicate_ids``, across all ``paths``) an ID seen before, naming both lines.
    Invalid records are yielded with ``invalid``/``error`` set; the caller decides.
    ``on_bytes(n)`` is called with the number of on-disk bytes consumed (for progress bars).
    """
    path_list = _as_paths(paths)
    seen_ids: set[str] = set()  # a set, not a dict: the first line is looked up on error only
    displays = [display_path(p) for p in path_list]

    for file_index, path in enumerate(path_list):
        display = displays[file_index]
        stream, raw_fh = _open_binary(Path(path), display)
        try:
            disk_pos = 0
            line = 1  # line number of data[0]
            data = b""
            started = False  # seen the first header
            blocks = _read_blocks(stream, display, block_size)
            eof = False
            while not eof:
                block = next(blocks, None)
                if block is None:
                    eof = True
                else:
                    data = data + block if data else block
                    if on_bytes is not None:
                        now = raw_fh.tell()
                        on_bytes(now - disk_pos)
                        disk_pos = now
                pos = 0
                if not started:
                    # Skip leading blank lines; anything else before the first '>' is an error.
                    if data[:1] != b">":
                        nxt = data.find(b"\n>")
                        if nxt < 0 and not eof:
                            if data.strip(_WHITESPACE):
                                _raise_text_before(data, display, line)
                            continue  # only blank lines so far; keep them for line counting
                        head = data if nxt < 0 else data[: nxt + 1]
                        if head.strip(_WHITESPACE):
                            _raise_text_before(head, display, line)
                        if nxt < 0:
                            break  # blank-only file
                        line += data.count(b"\n", 0, nxt + 1)
                        pos = nxt + 1
                    started = True
                while True:
                    nxt = data.find(b"\n>", pos)
                    if nxt < 0:
                        if not eof:
                            break
                        end = len(data)
                    else:
                        end = nxt + 1
                    if end <= pos:
                        break
                    hend = data.find(b"\n", pos, end)
                    if hend < 0:
                        hend = end
                    header_b = data[pos + 1 : hend]
                    try:
                        header = header_b.decode("utf-8").strip()
                    except UnicodeDecodeError:
                        raise InputError(f"{display}:{line}: header is not valid UTF-8 text") from None
                    if not header:
                        raise InputError(f"{display}:{line}: empty header (a '>' line with no ID)")
                    if "\x00" in header:
                        raise InputError(
                            f"{display}:{line}: header contains a NUL byte (\\x00); headers must be text"
                        )
                    rid = header.split(None, 1)[0]
                    if check_duplicate_ids:
                        if rid in seen_ids:
                            first = _first_source(path_list, rid)
                            raise InputError(
                                f"{display}:{line}: duplicate ID '{rid}': first seen at {first}, "
                                f"again at {display}:{line}"
                            )
                        seen_ids.add(rid)
                    raw = data[hend + 1 : end]
                    seq, kinds, reason, bad = _check(raw)
                    record = FastaRecord(rid, header, seq, display, line, file_index, kinds)
                    if reason is not None:
                        err_line, msg = _describe(reason, raw, seq, bad, line)
                        record.invalid = reason
                        record.error = f"{display}:{err_line}: record '{rid}': {msg}"
                    yield record
                    line += data.count(b"\n", pos, end)
                    pos = end
                    if nxt < 0:
                        break
                data = data[pos:] if pos else data
                if eof:
                    break
            if on_bytes is not None:
                try:
                    now = raw_fh.tell()
                except (OSError, ValueError):
                    now = disk_pos
                if now > disk_pos:
                    on_bytes(now - disk_pos)
        finally:
            stream.close()
            if raw_fh is not stream:
                raw_fh.close()


def _first_source(paths: list[PathLike], rid: str) -> str:
    """``path:line`` of the first record with ID ``rid`` (error path: re-reads the input)."""
    for record in iter_fasta(paths, check_duplicate_ids=False):
        if record.id == rid:
            return record.source
    return "?"  # pragma: no cover - the ID was seen before


def _raise_text_before(text: bytes, display: str, first_line: int) -> None:
    for offset, chunk in enumerate(text.split(b"\n")):
        if chunk.strip(_WHITESPACE):
            raise InputError(
                f"{display}:{first_line + offset}: text before the first '>' header "
                f"(is this a FASTA file?)"
            )
    raise AssertionError("unreachable")  # pragma: no cover


def read_sequences(path: PathLike) -> Iterator[tuple[str, str]]:
    """Yield ``(id, normalised_sequence)`` for every record of a FASTA file to embed.

    Raises :class:`InputError` (naming file, line, ID and reason) at the first invalid record
    or duplicate ID.
    """
    for record in iter_fasta(path):
        if record.invalid is not None:
            raise InputError(record.error or f"{record.source}: record '{record.id}': {record.invalid}")
        yield record.id, record.data.decode("ascii")


def count_records(path: PathLike) -> int:
    """Number of records (``>`` header lines) in a FASTA file, without validating them."""
    path = Path(path)
    display = display_path(path)
    stream, raw_fh = _open_binary(path, display)
    try:
        total = 0
        last = b"\n"
        for block in _read_blocks(stream, display, BLOCK_SIZE):
            total += block.count(b"\n>") + (1 if last == b"\n" and block[:1] == b">" else 0)
            last = block[-1:]
        return total
    finally:
        stream.close()
        if raw_fh is not stream:
            raw_fh.close()


__all__ = [
    "FastaRecord",
    "iter_fasta",
    "read_sequences",
    "count_records",
    "display_path",
    "path_text",
    "NORMALISATION_KINDS",
    "INVALID_REASONS",
    "EMPTY_SEQUENCE",
    "INTERNAL_STOP",
    "ALIGNMENT_GAP",
    "INVALID_CHARACTER",
    "UPPERCASED",
    "STOP_STRIPPED",
    "J_TO_X",
]
