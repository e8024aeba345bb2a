"""Per-record fields: :class:`EmbeddedRecord`, what the embedding worker hands the store
writer, and :data:`COLUMNS`, the one registry of per-record datasets that the writer, the
reader (``Store.__getitem__``, ``Store.records``), merge and validate all use.

Adding a per-record field (say per-record seconds) is: a field on ``EmbeddedRecord`` and one
``Column`` here, with ``required_since=None`` (additive within a format version: older stores
lack it, read it as ``default``, and still validate and merge). docs/store-format.md,
"Datasets" and "Version rule".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import h5py
import numpy as np

from embedpipe.store.create import create_array_dataset, create_fixed_string_dataset, create_string_dataset
from embedpipe.store.format import (
    ARRAY,
    SMALL_CHUNK_BYTES,
    STRINGS,
    chunk_rows,
    decode_strings,
)

#: ``Column.dtype`` of a fixed-length UTF-8 string column
STR = "str"


@dataclass
class EmbeddedRecord:
    """Everything the store keeps about one embedded record.

    ``mean``, ``bos`` and ``per_residue`` are keyed by absolute layer index (0 = token
    embedding, L = last layer, after the final layer norm as in fair-esm). ``bos`` is the
    hidden state at the BOS token of the record's first window, present when the store keeps
    it (``--pooling bos``). Arrays are float32 on the host; the writer casts to the storage dtype.
    """

    id: str
    sequence: str
    precision_used: str
    fallback_reason: str = ""
    mean: dict[int, np.ndarray] = field(default_factory=dict)  # layer -> (D,)
    per_residue: dict[int, np.ndarray] | None = None  # layer -> (length, D), or None
    bos: dict[int, np.ndarray] | None = None  # layer -> (D,), or None
    max_abs_activation: float = float("nan")  # largest |x| of the residual stream, every layer, requested-policy pass
    long_handling: str = "none"  # core/long_sequences.py: WITHIN_WINDOW or a mode's handling
    embedded_length: int = -1  # residues actually embedded (== length unless truncated)
    windows: int = 1  # forward windows used (chunked long sequences)
    reused_from: str = ""  # store_uuid of the store it was copied from (embed --reuse); "" = computed
    row_digest: str = ""  # set by the writer from the bytes it stores (embedpipe.store.digests); a value given is replaced
    chars_per_residue: int = 1  # characters of ``sequence`` a residue takes (SaProt: 2), not stored per record

    @property
    def length(self) -> int:
        """Residues (the ``length`` column): characters over ``chars_per_residue``."""
        return len(self.sequence) // self.chars_per_residue


@dataclass(frozen=True)
class Column:
    """One per-record dataset of shape (N,)."""

    name: str  # dataset name
    dtype: str  # STR (fixed-length UTF-8), or a numpy dtype name
    default: Any  # the value of every record of a store that lacks the column
    attr: str = ""  # the EmbeddedRecord attribute it is filled from; "" = ``name``
    required_since: int | None = 1  # format_version from which every store has it; None = optional
    announced: bool = False  # known from ids and sequences alone: written when the store is created

    @property
    def encoding(self) -> str:
        return STRINGS if self.dtype == STR else ARRAY

    def value(self, record: EmbeddedRecord) -> Any:
        return getattr(record, self.attr or self.name)

    def required_in(self, version: int) -> bool:
        """Whether a store of format ``version`` must have this column (validate, merge)."""
        return self.required_since is not None and version >= self.required_since

    def to_python(self, raw: Any, where: str = "a stored string", row: int = 0) -> Any:
        """One stored value -> str, int or float (``where``, ``row``: how bytes that are not
        UTF-8 are named)."""
        if self.dtype == STR:
            return decode_strings(np.asarray([raw]), where, row)[0]
        return int(raw) if np.dtype(self.dtype).kind in "iu" else float(raw)

    def to_table(self, raw: np.ndarray, where: str = "a stored string", start: int = 0) -> np.ndarray:
        """Stored rows from ``start`` -> a table column (strings as an object array)."""
        return np.array(decode_strings(raw, where, start), dtype=object) if self.dtype == STR else raw

    def default_table(self, n: int) -> np.ndarray:
        """The table column of a store that lacks this column."""
        return np.full(n, self.default, dtype=object if self.dtype == STR else self.dtype)

    def buffer(self, n: int) -> list[str] | np.ndarray:
        """``n`` defaults, to be filled row by row and written with :func:`write_column`."""
        return [self.default] * n if self.dtype == STR else np.full(n, self.default, dtype=self.dtype)

    def fill(self, buffer: list[str] | np.ndarray, row: int, record: EmbeddedRecord) -> None:
        value = self.value(record)
        buffer[row] = ("" if value is None else str(value)) if self.dtype == STR else value


#: every per-record dataset, in the order of ``Store.records()`` (by name; a test may add one)
COLUMNS: dict[str, Column] = {
    c.name: c
    for c in (
        Column("ids", STR, "", attr="id", announced=True),
        Column("sequence", STR, "", announced=True),
        Column("length", "int64", 0, announced=True),
        Column("precision_used", STR, ""),
        Column("fallback_reason", STR, ""),
        Column("max_abs_activation", "float32", float("nan")),
        Column("long_handling", STR, "none"),
        Column("embedded_length", "int64", 0),
        Column("windows", "int64", 1),
        Column("reused_from", STR, "", required_since=3),  # embed --reuse (docs/store-format.md); optional before 3
        Column("row_digest", STR, "", required_since=3),  # the writer's digests (vectors; from 3 the record too)
    )
}


def required_columns(version: int) -> list[Column]:
    return [c for c in COLUMNS.values() if c.required_in(version)]


def create_column(group: h5py.Group, column: Column, n: int, *, width: int = 1) -> h5py.Dataset:
    """An (n,) dataset for ``column`` to be filled by the caller (merge copies into it)."""
    if column.dtype == STR:
        return create_fixed_string_dataset(group, column.name, n, width)
    return create_array_dataset(group, column.name, shape=(n,), dtype=column.dtype,
                                rows=chunk_rows(8, n, target=SMALL_CHUNK_BYTES), compress=True)


def write_column(group: h5py.Group, column: Column, values: Sequence[Any] | np.ndarray) -> h5py.Dataset:
    """The whole ``column`` from its values in row order."""
    if column.dtype == STR:
        return create_string_dataset(group, column.name, values)
    data = np.asarray(values, dtype=column.dtype)
    return create_array_dataset(group, column.name, shape=data.shape, dtype=column.dtype, data=data,
                                rows=chunk_rows(8, len(data), target=SMALL_CHUNK_BYTES), compress=True)
