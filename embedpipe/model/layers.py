"""Which hidden states a run stores: ``--layers`` resolved against the model's depth.

Torch-free: ``extraction/resolved.py`` resolves a run's layers with it, ``extraction/combinations.py`` checks
``--layers`` against a model's facts before any job.
"""

from __future__ import annotations

from collections.abc import Sequence

from embedpipe.core.errors import EmbedpipeError


def resolve_layers(requested: Sequence[int], num_layers: int) -> list[int]:
    """Absolute, sorted, unique layer indices; negative ones count from the last (-1 = last)."""
    resolved = set()
    for layer in requested:
        absolute = layer if layer >= 0 else num_layers + 1 + layer
        if not 0 <= absolute <= num_layers:
            raise EmbedpipeError(
                f"layer {layer} does not exist: the model has layers 0..{num_layers} "
                f"(0 = token embedding, -1 = last)"
            )
        resolved.add(absolute)
    if not resolved:
        raise EmbedpipeError("no layers requested")
    return sorted(resolved)
