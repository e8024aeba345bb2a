"""The per-record fp32 fallback: why a record's outputs cannot be stored as computed, its
windows re-run alone in fp32, and the one line when fp32 itself fails (docs/precision.md,
"The fallback").

Every record's stored outputs are checked for NaN/inf and for values the storage dtype cannot
hold, and under ``--overflow-margin`` its largest activation against the policy's limit.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from embedpipe.core.errors import EmbedpipeError
from embedpipe.extraction.planning import Piece
from embedpipe.extraction.stitching import PieceResult, Results
from embedpipe.runtime.precision import FP32, Policy
from embedpipe.store.storage_dtype import storage_limits


@dataclass(frozen=True)
class RecordCheck:
    """What a record's outputs must meet to be stored as computed."""

    storage_dtype: str
    storage_max: float  # the largest |value| ``storage_dtype`` holds
    overflow_margin: float | None  # --overflow-margin: a fraction of the policy's limit, or off

    @classmethod
    def for_storage(cls, storage_dtype: str, overflow_margin: float | None) -> RecordCheck:
        """The check for ``--storage-dtype``: its largest value is the dtype's own (a float's
        ``finfo``, a signed integer's ``iinfo``; :mod:`embedpipe.store.storage_dtype`)."""
        return cls(storage_dtype, storage_limits(storage_dtype).max_abs, overflow_margin)

    def reason(self, policy: Policy, result: PieceResult) -> str:
        """Why a piece's outputs cannot be stored as computed ('' when they can)."""
        # stored_max covers every stored output, BOS included (a NaN/inf there propagates)
        if not math.isfinite(result.stored_max) or not math.isfinite(result.max_abs):
            return "nonfinite"
        if not all(np.isfinite(total).all() for total in result.sums.values()):
            return "nonfinite"  # e.g. inf in a padding position reaching the masked sum as 0 * inf
        if result.stored_max > self.storage_max:
            return "overflow"
        margin = self.overflow_margin
        if margin is not None and not policy.is_reference and result.max_abs > margin * policy.overflow_limit:
            return "overflow-margin"
        return ""

    def reasons(self, policy: Policy, results: Results) -> str:
        """Every reason the record's pieces cannot be stored as computed, '+'-joined ('' if none)."""
        return "+".join(sorted({r for r in (self.reason(policy, res) for _, res in results) if r}))

    def failure(self, rid: str, results: Results, reason: str) -> str:
        """The one line for a record whose fp32 outputs cannot be stored either."""
        largest = max(res.stored_max for _, res in results)
        if reason == "overflow":
            return (
                f"record {rid!r}: fp32 values up to {largest:.4g} do not fit --storage-dtype "
                f"{self.storage_dtype}; use --storage-dtype float32"
            )
        return f"record {rid!r}: the fp32 forward itself produced non-finite values ({reason}); nothing was written for it"

    def rerun_fp32(self, rid: str, pieces: list[Piece], run_alone: Callable[[Piece], Results]) -> Results:
        """The record's own windows again, each alone (``run_alone``: one piece with the fp32
        model), checked as before; a record that fails in fp32 too is an error, never stored."""
        results: Results = []
        for piece in pieces:
            results.extend(run_alone(piece))
        problems = self.reasons(FP32, results)
        if problems:
            raise EmbedpipeError(self.failure(rid, results, problems))
        return results
