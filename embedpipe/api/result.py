"""What :meth:`embedpipe.Embedder.embed` returns: the records in input order, their vectors as
the store would hold them, and how they were made, as plain data that cannot be changed.

Why the storage dtype here: the numbers a user gets in Python are the numbers ``embed --out``
stores for the same records and options, bit for bit (the store writer's cast, done once here),
and :meth:`Result.save` writes exactly them, with the provenance ``embed`` records.
Why frozen: a result is evidence of one run (its identity names how its numbers were made), so
its fields are tuples, a read-only mapping and read-only arrays; the resolved run and the
embedded records it was made from stay private (:func:`result_of` builds one).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np

from embedpipe.core.errors import EmbedpipeError, quote
from embedpipe.core.output_guard import STORE, writing_outputs
from embedpipe.extraction.resolved import ResolvedRun
from embedpipe.store import EmbeddedRecord, StoreWriter, utc_now

__all__ = ["Result", "result_of"]


@dataclass(frozen=True, init=False, repr=False, eq=False)
class Result:
    """The embedded records of one call, in input order, and how they were made.

    ``ids``, ``sequences`` (as embedded: the family's reading of each record),
    ``precision_used`` and ``fallback_reason``: one entry a record; ``rows``: each ID's row in
    the vectors; ``layers``: the stored layers, absolute (0 = token embedding); ``pooling``: the
    poolings embedded (the mean always); ``identity``: the store's ``embed_identity`` for these
    numbers; ``provenance``: the root attributes ``embed`` records. Made by
    :meth:`Embedder.embed <embedpipe.api.embedder.Embedder.embed>` and ``embedpipe.embed``."""

    ids: tuple[str, ...]
    sequences: tuple[str, ...]
    precision_used: tuple[str, ...]  # per record: the policy it ran in (float32 where it fell back)
    fallback_reason: tuple[str, ...]  # per record: why it was re-run in fp32 ('' when it was not)
    rows: Mapping[str, int]  # ID -> its row, built once
    layers: tuple[int, ...]
    pooling: tuple[str, ...]
    storage_dtype: str
    identity: str
    provenance: Mapping[str, Any]
    _records: tuple[EmbeddedRecord, ...]
    _run: ResolvedRun
    _model_files: tuple[Path, ...]
    _pooled: dict[tuple[str, int], np.ndarray]  # (pooling, layer) -> its vectors, cast once

    def __init__(self) -> None:
        raise TypeError("a Result is made by Embedder.embed or embedpipe.embed")

    def __repr__(self) -> str:
        return (f"Result({len(self)} records, layers={self.layers}, pooling={self.pooling}, "
                f"storage_dtype={self.storage_dtype!r}, precision_policy={self.provenance.get('precision_policy')!r})")

    def __len__(self) -> int:
        return len(self.ids)

    def layer(self, layer: int = -1) -> int:
        """The absolute index of ``layer``: a stored one, or a negative index into the stored layers."""
        if layer in self.layers:
            return int(layer)
        if layer < 0 and -len(self.layers) <= layer:
            return self.layers[layer]
        raise EmbedpipeError(f"layer {layer} was not embedded (embedded: {list(self.layers)}); pass layers=... to "
                             "the Embedder")

    def _cast(self, values: np.ndarray) -> np.ndarray:
        """As the store writer casts (embedpipe.store.writer): the storage dtype, nothing else;
        read-only (a record's own array already is: :func:`result_of`)."""
        with np.errstate(over="ignore", invalid="ignore"):
            cast = np.asarray(values).astype(self.storage_dtype, copy=False)
        cast.flags.writeable = False
        return cast

    def pooled(self, layer: int = -1, pooling: str = "mean") -> np.ndarray:
        """(N, D) pooled vectors of ``layer``, rows in input order, in the storage dtype (read-only)."""
        absolute = self.layer(layer)
        if pooling not in self.pooling:
            raise EmbedpipeError(f"pooling {pooling!r} was not embedded (embedded: {list(self.pooling)}); pass "
                                 "pooling=... to the Embedder")
        key = (pooling, absolute)
        if key not in self._pooled:
            rows = [(r.mean if pooling == "mean" else (r.bos or {}))[absolute] for r in self._records]
            self._pooled[key] = self._cast(np.stack(rows))
        return self._pooled[key]

    def mean(self, layer: int = -1) -> np.ndarray:
        """(N, D) mean-pooled vectors of ``layer``."""
        return self.pooled(layer, "mean")

    def bos(self, layer: int = -1) -> np.ndarray:
        """(N, D) BOS vectors of ``layer`` (``pooling=("mean", "bos")``)."""
        return self.pooled(layer, "bos")

    def per_residue(self, i: int | str, layer: int = -1) -> np.ndarray:
        """(length, D) per-residue vectors of record ``i`` (its position or ID; ``per_residue=True``), read-only."""
        absolute = self.layer(layer)
        record = self._records[self._position(i)]
        if record.per_residue is None:
            raise EmbedpipeError("per-residue vectors were not embedded; pass per_residue=True to the Embedder")
        return self._cast(record.per_residue[absolute])

    def _position(self, i: int | str) -> int:
        """The row of record ``i`` (its ID, or its position, negative from the end); one
        :class:`EmbedpipeError` naming it where there is none."""
        if isinstance(i, str):
            if (row := self.rows.get(i)) is None:
                raise EmbedpipeError(f"no record with ID {quote(i)} in this result ({len(self)} records)")
            return row
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
            raise EmbedpipeError(f"a record is named by its ID (str) or position (int), not {type(i).__name__}")
        if not -len(self) <= i < len(self):
            raise EmbedpipeError(f"record position {i} is out of range: this result holds {len(self)} records")
        return int(i) % len(self)

    def fallback_counts(self) -> dict[str, int]:
        """fp32 fallbacks by reason, as a store's ``fallback_reasons`` counts them."""
        return dict(Counter(reason for reason in self.fallback_reason if reason))

    def save(self, path: str | Path) -> Path:
        """Write the records as a store (atomically, the format and checks of ``embed --out``:
        the output guarded and locked, never one of the model's files, and replacing only a store)."""
        out = Path(path)
        fallback = self.fallback_counts()
        residue_rows = ([len(r.per_residue[self.layers[0]]) for r in self._records]
                        if self._run.options.per_residue else None)
        with writing_outputs("save", [("path", out, STORE)], self._model_files), StoreWriter(
            out, ids=list(self.ids), sequences=list(self.sequences), residue_rows=residue_rows,
            layers=list(self.layers), dim=int(self.mean().shape[1]), storage_dtype=self.storage_dtype,
            attrs=dict(self.provenance) | self._run.precision_attrs | {"embed_identity": self.identity},
            pooling=list(self.pooling),
        ) as writer:
            for index, record in enumerate(self._records):
                writer.write(index, record)
            writer.set_attrs(fallback_count=sum(fallback.values()),
                             fallback_reasons=json.dumps(fallback, sort_keys=True), finished_utc=utc_now())
        return out


def _read_only(record: EmbeddedRecord) -> EmbeddedRecord:
    """``record`` with its vectors made read-only: a Result's arrays are views of them."""
    for vectors in (record.mean, record.bos or {}, record.per_residue or {}):
        for values in vectors.values():
            values.flags.writeable = False
    return record


def result_of(records: Iterable[EmbeddedRecord], run: ResolvedRun, provenance: Mapping[str, Any],
              model_files: Iterable[Path] = ()) -> Result:
    """The :class:`Result` of ``records`` (in input order) embedded by ``run``, with the root
    attributes ``provenance``; ``model_files``: what :meth:`Result.save` never writes over."""
    kept = tuple(_read_only(r) for r in records)
    ids = tuple(r.id for r in kept)
    fields: dict[str, object] = {
        "ids": ids, "sequences": tuple(r.sequence for r in kept),
        "precision_used": tuple(r.precision_used for r in kept),
        "fallback_reason": tuple(r.fallback_reason for r in kept),
        "rows": MappingProxyType({rid: row for row, rid in enumerate(ids)}),
        "layers": tuple(run.layers), "pooling": tuple(run.pooling), "storage_dtype": run.options.storage_dtype,
        "identity": run.identity, "provenance": MappingProxyType(dict(provenance)),
        "_records": kept, "_run": run, "_model_files": tuple(model_files), "_pooled": {},
    }
    result = object.__new__(Result)
    for name, value in fields.items():
        object.__setattr__(result, name, value)
    return result
