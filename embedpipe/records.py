"""The per-record result that flows from the embedding worker to the store writer."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class EmbeddedRecord:
    """Everything the store keeps about one embedded record.

    ``mean`` and ``per_residue`` are keyed by absolute layer index (0 = token embedding,
    L = last layer, after the final layer norm as in fair-esm). Arrays are float32 on the
    host; the writer casts to the storage dtype.
    """

    id: str
    sequence: str
    precision_used: str
    fallback_reason: str = ""
    mean: dict[int, np.ndarray] = field(default_factory=dict)  # layer -> (D,)
    per_residue: dict[int, np.ndarray] | None = None  # layer -> (length, D), or None
    max_abs_activation: float = float("nan")  # largest |x| of the residual stream, every layer, requested-policy pass
    long_handling: str = "none"  # none | chunked | truncated | full
    embedded_length: int = -1  # residues actually embedded (== length unless truncated)
    windows: int = 1  # forward windows used (chunked long sequences)

    @property
    def length(self) -> int:
        return len(self.sequence)
