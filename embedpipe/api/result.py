"""What :meth:`embedpipe.Embedder.embed` returns: the records in input order, their vectors as
the store would hold them, and how they were made.

Why the storage dtype here: the numbers a user gets in Python are the numbers ``embed --out``
stores for the same records and options, bit for bit (the store writer's cast, done once here),
and :meth:`Result.save` writes exactly them, with the provenance ``embed`` records.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from embedpipe.core.errors import EmbedpipeError, quote
from embedpipe.core.output_guard import STORE, writing_outputs
from embedpipe.extraction.resolved import ResolvedRun
from embedpipe.store import EmbeddedRecord, StoreWriter, utc_now

__all__ = ["Result"]


@dataclass
class Result:
    """The embedded records of one call, in input order (``ids``), and the run that made them.

    ``run``: the resolved run (policy, device, layers, poolings); ``identity``: the store's
    ``embed_identity`` for these numbers; ``provenance``: the root attributes ``embed`` records."""

    records: list[EmbeddedRecord]
    run: ResolvedRun
    provenance: dict[str, Any]
    model_files: Sequence[Path] = ()
    _cache: dict[tuple[str, int], np.ndarray] = field(default_factory=dict, repr=False)
    _rows: dict[str, dict[str, int]] = field(default_factory=dict, repr=False)  # ID -> row, built once

    @property
    def ids(self) -> list[str]:
        return [r.id for r in self.records]

    @property
    def identity(self) -> str:
        return self.run.identity

    @property
    def layers(self) -> list[int]:
        """The stored layers, absolute (0 = token embedding)."""
        return list(self.run.layers)

    @property
    def storage_dtype(self) -> str:
        return self.run.options.storage_dtype

    @property
    def precision_used(self) -> list[str]:
        """Per record: the policy it was computed in (``float32`` where it fell back)."""
        return [r.precision_used for r in self.records]

    @property
    def fallback_reason(self) -> list[str]:
        """Per record: why it was re-run in fp32 ('' when it was not)."""
        return [r.fallback_reason for r in self.records]

    def __len__(self) -> int:
        return len(self.records)

    def layer(self, layer: int = -1) -> int:
        """The absolute index of ``layer``: a stored one, or a negative index into the stored layers."""
        layers = self.layers
        if layer in layers:
            return int(layer)
        if layer < 0 and -len(layers) <= layer:
            return layers[layer]
        raise EmbedpipeError(f"layer {layer} was not embedded (embedded: {layers}); pass layers=... to the Embedder")

    def _cast(self, values: np.ndarray) -> np.ndarray:
        """As the store writer casts (embedpipe.store.writer): the storage dtype, nothing else."""
        with np.errstate(over="ignore", invalid="ignore"):
            return np.asarray(values).astype(self.storage_dtype, copy=False)

    def pooled(self, layer: int = -1, pooling: str = "mean") -> np.ndarray:
        """(N, D) pooled vectors of ``layer``, rows in input order, in the storage dtype."""
        absolute = self.layer(layer)
        if pooling not in self.run.pooling:
            raise EmbedpipeError(f"pooling {pooling!r} was not embedded (embedded: {list(self.run.pooling)}); pass "
                                 "pooling=... to the Embedder")
        key = (pooling, absolute)
        if key not in self._cache:
            rows = [(r.mean if pooling == "mean" else (r.bos or {}))[absolute] for r in self.records]
            self._cache[key] = self._cast(np.stack(rows))
        return self._cache[key]

    def mean(self, layer: int = -1) -> np.ndarray:
        """(N, D) mean-pooled vectors of ``layer``."""
        return self.pooled(layer, "mean")

    def bos(self, layer: int = -1) -> np.ndarray:
        """(N, D) BOS vectors of ``layer`` (``pooling=("mean", "bos")``)."""
        return self.pooled(layer, "bos")

    def per_residue(self, i: int | str, layer: int = -1) -> np.ndarray:
        """(length, D) per-residue vectors of record ``i`` (its position or ID; ``per_residue=True``)."""
        absolute = self.layer(layer)
        record = self.records[self._position(i)]
        if record.per_residue is None:
            raise EmbedpipeError("per-residue vectors were not embedded; pass per_residue=True to the Embedder")
        return self._cast(record.per_residue[absolute])

    def _position(self, i: int | str) -> int:
        """The row of record ``i`` (its ID, or its position, negative from the end); one
        :class:`EmbedpipeError` naming it where there is none."""
        if isinstance(i, str):
            if "positions" not in self._rows:
                self._rows["positions"] = {rid: row for row, rid in enumerate(self.ids)}
            if (row := self._rows["positions"].get(i)) is None:
                raise EmbedpipeError(f"no record with ID {quote(i)} in this result ({len(self)} records)")
            return row
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
            raise EmbedpipeError(f"a record is named by its ID (str) or position (int), not {type(i).__name__}")
        if not -len(self) <= i < len(self):
            raise EmbedpipeError(f"record position {i} is out of range: this result holds {len(self)} records")
        return int(i) % len(self)

    def fallback_counts(self) -> dict[str, int]:
        """fp32 fallbacks by reason, as a store's ``fallback_reasons`` counts them."""
        return dict(Counter(r.fallback_reason for r in self.records if r.fallback_reason))

    def save(self, path: str | Path) -> Path:
        """Write the records as a store (atomically, the format and checks of ``embed --out``:
        the output guarded and locked, never one of the model's files, and replacing only a store)."""
        out = Path(path)
        fallback = self.fallback_counts()
        residue_rows = ([len(r.per_residue[self.layers[0]]) for r in self.records]
                        if self.run.options.per_residue else None)
        with writing_outputs("save", [("path", out, STORE)], self.model_files), StoreWriter(
            out, ids=self.ids, sequences=[r.sequence for r in self.records], residue_rows=residue_rows,
            layers=self.layers, dim=int(self.mean().shape[1]), storage_dtype=self.storage_dtype,
            attrs=self.provenance | self.run.precision_attrs | {"embed_identity": self.identity},
            pooling=list(self.run.pooling),
        ) as writer:
            for index, record in enumerate(self.records):
                writer.write(index, record)
            writer.set_attrs(fallback_count=sum(fallback.values()),
                             fallback_reasons=json.dumps(fallback, sort_keys=True), finished_utc=utc_now())
        return out
