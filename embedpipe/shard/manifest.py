"""``manifest.tsv``: one row per input record, written by ``shard`` and read by ``merge``.

The format (docs/store-format.md, "Shard manifest"): UTF-8, a header row, tab-separated
cells, ``\\n`` line ends, and CSV's minimal quoting with ``"``: a cell that holds a tab, a
double quote, CR or LF is written between double quotes with its own quotes doubled. So a
path with a tab or newline in it cannot split a row, and ``csv.reader(fh, delimiter="\\t")``
or ``pandas.read_csv(path, sep="\\t", dtype=str, keep_default_na=False)`` read every cell back
unchanged.
"""

from __future__ import annotations

import csv
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import IO, BinaryIO

from embedpipe.core.errors import StoreError

MANIFEST = "manifest.tsv"
MANIFEST_COLUMNS = ("id", "source", "length", "sequence_sha256", "shard", "status", "duplicate_of", "normalised")
#: columns ``merge --manifest`` needs; the others are for people
REQUIRED_COLUMNS = ("id", "status", "sequence_sha256", "shard")
#: the csv dialect of the manifest (``csv.writer(fh, **DIALECT)``); files opened with newline=""
DIALECT = {"delimiter": "\t", "quotechar": '"', "doublequote": True, "quoting": csv.QUOTE_MINIMAL,
           "lineterminator": "\n"}
_SPECIAL = ("\t", '"', "\n", "\r")


def quote(cell: str) -> str:
    """One cell as the manifest writes it: unchanged unless it holds a tab, quote, CR or LF.

    The same rule as ``csv.writer`` with :data:`DIALECT`; the fast path for callers that
    format rows themselves (``shard`` writes millions of rows and quotes only its free-text
    cells: IDs and source paths).
    """
    if "\t" in cell or '"' in cell or "\n" in cell or "\r" in cell:
        return '"' + cell.replace('"', '""') + '"'
    return cell


def quote_all(cells: list[str]) -> list[str]:
    """``[quote(c) for c in cells]``, but ``cells`` itself when none needs quoting (one scan)."""
    joined = "".join(cells)
    if any(ch in joined for ch in _SPECIAL):
        return [quote(c) for c in cells]
    return cells


class ManifestWriter:
    """Writes the header, then rows: pre-formatted lines (fast) or cell tuples."""

    def __init__(self, fh: IO[str], columns: Sequence[str] = MANIFEST_COLUMNS) -> None:
        self._fh = fh
        self._csv = csv.writer(fh, **DIALECT)  # type: ignore[arg-type]
        self._csv.writerow(columns)

    def write_lines(self, text: str) -> None:
        """Rows already formatted with :func:`quote`, tab-joined and ``\\n``-terminated."""
        self._fh.write(text)

    def write_rows(self, rows: Iterable[Sequence[object]]) -> None:
        self._csv.writerows(rows)


def _decoded_lines(fh: BinaryIO, path: Path, counter: list[int]) -> Iterator[str]:
    """Lines of ``fh`` as text; a line that is not UTF-8 is an error naming it."""
    for raw in fh:
        counter[0] += 1
        try:
            yield raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            byte = raw[exc.start : exc.start + 1].hex()
            raise StoreError(
                f"manifest {path} line {counter[0]}: not UTF-8 text (byte 0x{byte} at column {exc.start + 1})"
            ) from None


def iter_manifest(path: Path, required: Sequence[str] = REQUIRED_COLUMNS) -> Iterator[tuple[int, dict[str, str]]]:
    """``(line, row)`` for every row of the manifest at ``path``; ``line`` is where the row starts.

    Streams the file (one row in memory at a time). Errors are :class:`StoreError` naming the
    manifest and line: not UTF-8, a missing required column, a row with the wrong number of
    cells, broken quoting. Blank lines are skipped.
    """
    path = Path(path)
    try:
        fh = open(path, "rb")  # noqa: SIM115 - closed below
    except OSError as exc:
        raise StoreError(f"manifest {path}: cannot read: {exc.strerror or exc}") from None
    with fh:
        counter = [0]
        reader = csv.reader(_decoded_lines(fh, path, counter), **DIALECT)  # type: ignore[arg-type]
        header: list[str] | None = None
        start = 1
        try:
            for cells in reader:
                line, start = start, counter[0] + 1
                if not cells or (len(cells) == 1 and not cells[0].strip()):
                    continue
                if header is None:
                    header = _check_header(path, cells, required)
                    continue
                if len(cells) != len(header):
                    raise StoreError(f"manifest {path} line {line}: {len(cells)} fields, header has {len(header)}")
                yield line, dict(zip(header, cells))
        except csv.Error as exc:
            raise StoreError(f"manifest {path} line {start}: {exc}") from None
        except OSError as exc:
            raise StoreError(f"manifest {path}: cannot read: {exc.strerror or exc}") from None
    if header is None:
        raise StoreError(f"manifest {path}: empty")


def _check_header(path: Path, header: list[str], required: Sequence[str]) -> list[str]:
    missing = [c for c in required if c not in header]
    if missing:
        raise StoreError(f"manifest {path}: missing column(s) {', '.join(missing)} (has {', '.join(header)})")
    return header


def read_manifest(path: Path, required: Sequence[str] = REQUIRED_COLUMNS) -> list[dict[str, str]]:
    """All rows of a (small) manifest; for large ones iterate :func:`iter_manifest`."""
    return [row for _, row in iter_manifest(path, required)]


__all__ = [
    "MANIFEST",
    "MANIFEST_COLUMNS",
    "REQUIRED_COLUMNS",
    "DIALECT",
    "ManifestWriter",
    "quote",
    "quote_all",
    "iter_manifest",
    "read_manifest",
]
