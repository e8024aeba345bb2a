"""The record part of ``row_digest`` (format 3): one blake2b-128 digest over a record's ID, its
stored sequence and every other per-record column, so that an edit of any byte that describes
a record is caught, not only an edit of its vectors.

Format 2 digested the vectors alone: one residue of ``sequence/data`` edited in place, two
entries of ``ids`` swapped or a record's ``precision_used`` rewritten still validated, and
``embed --reuse`` copied the old vectors onto the edited sequence. The writer appends this
part to each record's vector digests (:func:`record_part`, from the values it stores); every
reader that trusts those fields recomputes it from the bytes it read (:func:`stored_parts`)
and compares (``embedpipe validate``, ``Store.records``, ``store[id]``, merge).
docs/store-format.md, "Row digests".
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from embedpipe.core.errors import StoreError
from embedpipe.core.interrupts import checkpoint
from embedpipe.store.attr_digests import attr_problems
from embedpipe.store.columns import COLUMNS, STR, Column
from embedpipe.store.digests import COVERED_SINCE, ROW_DIGEST, digest_parts, record_mismatches
from embedpipe.store.format import decode_strings, poolings_of
from embedpipe.store.sequences import read_sequences

_SIZE = 16
#: records checked per block when a whole store is checked (validate, merge)
BLOCK_ROWS = 1 << 14


def covered_columns() -> list[Column]:
    """Every per-record column but ``row_digest`` itself, in :data:`COLUMNS` order."""
    return [c for c in COLUMNS.values() if c.name != "row_digest"]


def _field(column: Column, value: Any) -> bytes:
    """One stored value as the bytes it is digested as: strings their UTF-8 (stored without
    NULs), numbers little-endian in the column's dtype."""
    if column.dtype == STR:
        if isinstance(value, (bytes, np.bytes_)):
            return bytes(value)
        return ("" if value is None else str(value)).encode("utf-8")
    dt = np.dtype(column.dtype).newbyteorder("<")
    return np.asarray(value).astype(dt).tobytes()


def _part(fields: Sequence[bytes], columns: Sequence[Column], skip: Sequence[bytes | None]) -> str:
    """Each column fed as its name, NUL, its byte length (8 bytes little-endian) and its bytes,
    in one call (a column added after format 3 at its default left out: as a store without it reads)."""
    message = b"".join(c.name.encode("utf-8") + b"\0" + len(data).to_bytes(8, "little") + data
                       for c, data, default in zip(columns, fields, skip) if data != default)
    return hashlib.blake2b(message, digest_size=_SIZE).hexdigest()


def _skipped(columns: Sequence[Column]) -> list[bytes | None]:
    """The default's bytes of each column added after format 3 (left out at its default), else None."""
    return [None if c.required_in(COVERED_SINCE) else _field(c, c.default) for c in columns]


def record_part(values: Sequence[Any], columns: Sequence[Column] | None = None) -> str:
    """blake2b-128 (hex) of one record's covered columns, each as name, length and bytes; a
    column added after format 3 (optional: older stores lack it) only where it is not its default."""
    columns = columns or covered_columns()
    return _part([_field(c, v) for c, v in zip(columns, values)], columns, _skipped(columns))


def _block_fields(column: Column, values: Any, n: int) -> list[bytes]:
    """One column's stored rows as :func:`_field` bytes, converted a block at a time."""
    if column.dtype == STR or isinstance(values, list):
        return [_field(column, v) for v in (values.tolist() if isinstance(values, np.ndarray) else values)]
    dt = np.dtype(column.dtype).newbyteorder("<")
    data, size = np.asarray(values).astype(dt).tobytes(), dt.itemsize
    return [data[i * size : (i + 1) * size] for i in range(n)]


def stored_parts(f: h5py.File, lo: int, hi: int, path: Path | str = "") -> list[str]:
    """The record part of rows ``lo:hi`` from the stored bytes (a column the store lacks reads
    as its default). Raises StoreError or OSError for a block that cannot be read."""
    columns = covered_columns()
    raw: list[Sequence[Any]] = []
    for column in columns:
        if column.name == "sequence":
            if "sequence" not in f:
                raise StoreError(f"{path}: dataset sequence is missing")
            raw.append(read_sequences(f, lo, hi, path))
        elif column.name in f:
            raw.append(f[column.name][lo:hi])
        elif column.required_in(COVERED_SINCE):
            raise StoreError(f"{path}: dataset {column.name} is missing")
        else:
            raw.append([column.default] * (hi - lo))
    fields = [_block_fields(c, values, hi - lo) for c, values in zip(columns, raw)]
    skip = _skipped(columns)
    return [_part([f[i] for f in fields], columns, skip) for i in range(hi - lo)]


def block_mismatches(f: h5py.File, parts: Sequence[str], lo: int, hi: int, id_of: Callable[[int], str],
                     path: Path | str = "") -> tuple[int, str | None]:
    """Rows ``lo:hi``: (records whose record part differs from ``row_digest``'s, the first as one line)."""
    recorded = decode_strings(f[ROW_DIGEST][lo:hi], f"{path}: dataset {ROW_DIGEST}" if path else f"dataset {ROW_DIGEST}", lo)
    return record_mismatches(parts, recorded, stored_parts(f, lo, hi, path), lo, id_of)


def store_mismatches(f: h5py.File, n: int, parts: Sequence[str], id_of: Callable[[int], str],
                     path: Path | str = "") -> tuple[int, str | None]:
    """Every record, :data:`BLOCK_ROWS` at a time (memory independent of N)."""
    failed, first = 0, None
    for lo in range(0, n, BLOCK_ROWS):
        checkpoint()
        count, problem = block_mismatches(f, parts, lo, min(n, lo + BLOCK_ROWS), id_of, path)
        failed, first = failed + count, first or problem
    return failed, first


def describe(failed: int, first: str | None) -> str | None:
    """One line: the first record that differs, and how many do."""
    if first is None:
        return None
    return first + (f"; {failed} record(s) differ" if failed > 1 else "")


def coverage_problems(f: h5py.File, n: int, layers: Sequence[int], ids: Sequence[str] | None,
                      path: Path | str = "") -> list[str]:
    """``embedpipe validate``'s check of a format-3 store: each root attribute that differs
    from what was written (named), then the first record whose ID, sequence or columns do
    (``ids`` None: ``row_digest`` or ``ids`` cannot be trusted, their problems are reported
    elsewhere). A block that cannot be read is left to the checksum and UTF-8 checks."""
    problems = attr_problems(f)
    if ids is None:
        return problems
    parts = digest_parts(poolings_of(f), layers, isinstance(f.get("per_residue"), h5py.Group))
    try:
        problem = describe(*store_mismatches(f, n, parts, lambda i: str(ids[i]), path))
    except (OSError, StoreError):
        return problems
    return problems + ([problem] if problem else [])
