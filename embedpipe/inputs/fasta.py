"""Streaming protein FASTA reading: plain or gzip, each record validated and normalised.

The reader works on large blocks of bytes (never the whole file) and does its per-record work
with C-level bytes operations (``find``, ``count``, ``translate``), so that it stays fast on
proteome-scale input. Every record comes out as a :class:`FastaRecord` whose ``data`` is the
normalised sequence (ASCII bytes) and whose ``invalid`` says why it cannot be embedded, if so.

Rules (what a sequence may hold: :mod:`embedpipe.inputs.residue_rules`):

* a line ends at LF, CRLF or a lone CR (old-Mac files, or a stray CR inside an LF file), so
  every ``>`` that starts a line is one record; a leading UTF-8 byte-order mark is dropped;
* text other than blank lines before the first header, an empty header or ID, a header that
  is not UTF-8 or holds a NUL byte, an ID holding a control character, and the same ID twice
  are *structural* errors:
  :class:`InputError` at once;
* a record over :class:`~embedpipe.core.options.FastaLimits` (residues, ID characters, bytes of
  text) is a structural error too, found while the record streams (:mod:`embedpipe.inputs.bounds`);
* blank lines, spaces and tabs inside a record are ignored;
* lowercase is upper-cased (kept, for a family whose case is input: ``limits.keep_case``), one
  trailing ``*`` is stripped, ``J`` becomes ``X`` (counted in ``FastaRecord.normalised``);
  ``U O B Z X`` are kept (ESM has tokens for them);
* a ``*`` inside the sequence, ``-`` or ``.`` (an alignment), any other character, or an empty
  sequence make the record *invalid*: ``invalid`` holds the reason and ``error`` the message.
"""

from __future__ import annotations

import gzip
import os
import stat
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from embedpipe.core.errors import EmbedpipeError, InputError
from embedpipe.core.idtext import bad_id_char
from embedpipe.core.options import FASTA_LIMITS, FastaLimits
from embedpipe.core.paths import PathLike, display_path, path_text
from embedpipe.inputs.bounds import check_id, check_pending
from embedpipe.inputs.family_rules import check_family_sequence
from embedpipe.inputs.residue_rules import WHITESPACE

#: Bytes read per block; records spanning blocks are carried over.
BLOCK_SIZE = 8 * 1024 * 1024

_BOM = b"\xef\xbb\xbf"

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


def check_regular_file(path: Path, command: str, why: str) -> None:
    """``path`` is a regular file, or one InputError naming it: ``command`` reads it more than
    once (``why``), and a pipe (a FIFO, ``<(...)``) is drained by the first pass: the second
    ``open`` waited forever, or read nothing (embed recorded the sha256 of an empty input)."""
    shown = display_path(path)
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise InputError(f"{shown}: no such file") from None
    except OSError as exc:
        raise InputError(f"{shown}: cannot open: {exc.strerror or exc}") from None
    if stat.S_ISDIR(mode):
        raise InputError(f"{shown}: is a directory, not a FASTA file")
    if not stat.S_ISREG(mode):
        kind = "a pipe (FIFO)" if stat.S_ISFIFO(mode) else "not a regular file"
        raise InputError(f"{shown}: is {kind}; {command} needs a regular file ({why}), so write the stream to a "
                         "file first")


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
# The reader


def _as_paths(paths: PathLike | Iterable[PathLike]) -> list[PathLike]:
    if isinstance(paths, (str, os.PathLike)):
        return [paths]
    return list(paths)


def iter_fasta(
    paths: PathLike | Iterable[PathLike],
    *,
    check_duplicate_ids: bool = True,
    on_bytes: Callable[[int], None] | None = None,
    block_size: int = BLOCK_SIZE,
    limits: FastaLimits = FASTA_LIMITS,
) -> Iterator[FastaRecord]:
    """Stream the records of one or more FASTA files (plain or gzip), in input order.

    Structural problems raise :class:`InputError` naming the file and line: text before the
    first header, an empty header or ID, a header that is not UTF-8, and (with
    ``check_duplicate_ids``, across all ``paths``) an ID seen before, naming both lines.
    Invalid records are yielded with ``invalid``/``error`` set; the caller decides.
    ``on_bytes(n)`` is called with the number of on-disk bytes consumed (for progress bars).
    A record over ``limits`` raises as soon as the part read so far shows it.
    """
    path_list = _as_paths(paths)
    seen = _SeenIds(path_list, limits) if check_duplicate_ids else None
    for file_index, path in enumerate(path_list):
        display = display_path(path)
        stream, raw_fh = _open_binary(Path(path), display)
        try:
            blocks = _counted(_read_blocks(stream, display, block_size), raw_fh, on_bytes)
            yield from _parse(blocks, display, file_index, seen, limits)
        finally:
            stream.close()
            if raw_fh is not stream:
                raw_fh.close()


class _SeenIds:
    """The IDs seen so far across all inputs; the same ID twice is a structural error.

    A set, not a dict: the first line is looked up (by re-reading the input) on error only.
    """

    def __init__(self, paths: list[PathLike], limits: FastaLimits) -> None:
        self.paths = paths
        self.limits = limits
        self.ids: set[str] = set()

    def duplicate(self, rid: str, display: str, line: int) -> InputError:
        first = _first_source(self.paths, rid, self.limits)
        return InputError(f"{display}:{line}: duplicate ID '{rid}': first seen at {first}, again at {display}:{line}")


def _counted(blocks: Iterator[bytes], raw_fh: BinaryIO, on_bytes: Callable[[int], None] | None) -> Iterator[bytes]:
    """``blocks``, reporting the on-disk bytes read so far to ``on_bytes`` after each one."""
    if on_bytes is None:
        yield from blocks
        return
    disk_pos = 0
    for block in blocks:
        now = raw_fh.tell()
        on_bytes(now - disk_pos)
        disk_pos = now
        yield block
    try:
        now = raw_fh.tell()
    except (OSError, ValueError):
        now = disk_pos
    if now > disk_pos:
        on_bytes(now - disk_pos)


def _parse(blocks: Iterator[bytes], display: str, file_index: int, seen: _SeenIds | None,
           limits: FastaLimits) -> Iterator[FastaRecord]:
    """The records of one file's blocks; a record spanning blocks waits for the next one (at
    most ``limits`` of it: :func:`~embedpipe.inputs.bounds.check_pending`)."""
    line = 1  # line number of data[0]
    data = b""
    started = False  # seen the first header
    eof = False
    while not eof:
        block = next(blocks, None)
        if block is None:
            eof = True
        else:
            data = data + block if data else block
        pos = 0
        if not started:
            first = _first_header(data, display, line, eof)
            if first is None:  # only blank lines so far: count them, keep only the last (partial) one
                cut = data.rfind(b"\n") + 1
                line += data.count(b"\n", 0, cut)
                data = data[cut:]
                continue
            if first < 0:
                break  # blank-only file
            line += data.count(b"\n", 0, first)
            pos = first
            started = True
        pos, line = yield from _complete_records(data, pos, eof, display, line, file_index, seen, limits)
        if not eof:
            check_pending(data, pos, display, line, limits)
        data = data[pos:] if pos else data


def _first_header(data: bytes, display: str, line: int, eof: bool) -> int | None:
    """Offset of the first ``>`` header in ``data`` (None: not yet seen; -1: a blank-only file).

    Blank lines before it are skipped; anything else before it is an error.
    """
    if data[:1] == b">":
        return 0
    nxt = data.find(b"\n>")
    if nxt < 0 and not eof:
        if data.strip(WHITESPACE):
            _raise_text_before(data, display, line)
        return None
    head = data if nxt < 0 else data[: nxt + 1]
    if head.strip(WHITESPACE):
        _raise_text_before(head, display, line)
    return -1 if nxt < 0 else nxt + 1


def _complete_records(data: bytes, pos: int, eof: bool, display: str, line: int, file_index: int,
                      seen: _SeenIds | None, limits: FastaLimits) -> Generator[FastaRecord, None, tuple[int, int]]:
    """Yield every record of ``data[pos:]`` known to be complete (all of them at ``eof``);
    return where the incomplete rest starts and its line number."""
    seen_ids = None if seen is None else seen.ids
    max_id = limits.max_id_length
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
        header, rid = _header(data[pos + 1 : hend], display, line)
        if len(rid) > max_id:
            check_id(rid, display, line, limits)
        if seen_ids is not None:
            if rid in seen_ids:
                raise seen.duplicate(rid, display, line)  # type: ignore[union-attr]
            seen_ids.add(rid)
        checked = check_family_sequence(rid, data[hend + 1 : end], end - pos, display, line, limits)
        yield FastaRecord(rid, header, checked.data, display, line, file_index, checked.kinds, checked.invalid,
                          None if checked.invalid is None else checked.error(display))
        line += data.count(b"\n", pos, end)
        pos = end
        if nxt < 0:
            break
    return pos, line


def _header(header_b: bytes, display: str, line: int) -> tuple[str, str]:
    """(header text, ID) of one ``>`` line; an empty, non-UTF-8 or NUL-holding header is an error."""
    try:
        header = header_b.decode("utf-8").strip()
    except UnicodeDecodeError as exc:  # the column counts bytes, the '>' being column 1
        raise InputError(f"{display}:{line}: header is not valid UTF-8 text (byte 0x{header_b[exc.start]:02x} "
                         f"at column {exc.start + 2})") from None
    if not header:
        raise InputError(f"{display}:{line}: empty header (a '>' line with no ID)")
    if "\x00" in header:
        raise InputError(f"{display}:{line}: header contains a NUL byte (\\x00); headers must be text")
    rid = header.split(None, 1)[0]
    if (ch := bad_id_char(rid)) is not None:
        raise InputError(f"{display}:{line}: ID {rid!r} contains the control character {ch}; IDs may not hold "
                         "control characters (stores and exports refuse them)")
    return header, rid


def _first_source(paths: list[PathLike], rid: str, limits: FastaLimits) -> str:
    """``path:line`` of the first record with ID ``rid`` (error path: re-reads the input)."""
    for record in iter_fasta(paths, check_duplicate_ids=False, limits=limits):
        if record.id == rid:
            return record.source
    return "?"  # pragma: no cover - the ID was seen before


def _raise_text_before(text: bytes, display: str, first_line: int) -> None:
    for offset, chunk in enumerate(text.split(b"\n")):
        if chunk.strip(WHITESPACE):
            raise InputError(
                f"{display}:{first_line + offset}: text before the first '>' header "
                f"(is this a FASTA file?)"
            )
    raise AssertionError("unreachable")  # pragma: no cover


def read_sequences(path: PathLike, limits: FastaLimits = FASTA_LIMITS) -> Generator[tuple[str, str], None, None]:
    """Yield ``(id, normalised_sequence)`` for every record of a FASTA file to embed.

    Raises :class:`InputError` (naming file, line, ID and reason) at the first invalid record,
    duplicate ID or record over ``limits``.
    """
    for record in iter_fasta(path, limits=limits):
        if record.invalid is not None:
            raise InputError(record.error or f"{record.source}: record '{record.id}': {record.invalid}")
        yield record.id, record.data.decode("ascii")


__all__ = [
    "FastaRecord",
    "check_regular_file",
    "iter_fasta",
    "read_sequences",
    "display_path",
    "path_text",
]


#: how a calibration error names where the file was given (the command line, the workflow's key)
CALIBRATION = "--int8-smoothing smoothquant:FASTA (workflow: int8_calibration)"


def read_calibration(path: Path) -> tuple[tuple[str, str], ...]:
    """Every record of the calibration FASTA ``path``; one line naming the file (and record)
    when it is missing, unreadable, invalid FASTA or empty. Torch-free: the workflow's check
    and the job's calibration (embedpipe.runtime.int8_smoothing) read it alike
    (docs/cluster.md, "Before the first job")."""
    try:
        check_regular_file(path, "embed", "it reads the set here, then to calibrate and for its sha256")
        records = tuple(read_sequences(path))
    except InputError as error:  # already names the file (and line)
        raise EmbedpipeError(f"{CALIBRATION}: {error}") from None
    if not records:
        raise EmbedpipeError(f"{CALIBRATION}: {path}: no records to calibrate on")
    return records
