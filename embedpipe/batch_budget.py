"""``--tokens-per-batch``: a number, or ``auto`` sized to the device (docs/precision.md, "Batch size")."""

from __future__ import annotations

import torch

from embedpipe.model.base import EmbeddingModel
from embedpipe.options import AUTO, CPU_TOKENS_PER_BATCH, EmbedOptions
from embedpipe.precision import Policy


def resolve_tokens_per_batch(options: EmbedOptions, loaded: EmbeddingModel, policy: Policy,
                             device: torch.device) -> int:
    """The token budget a run uses: the number given, or for ``auto`` one that fits ``device``."""
    if options.tokens_per_batch != AUTO:
        return int(options.tokens_per_batch)
    return CPU_TOKENS_PER_BATCH
