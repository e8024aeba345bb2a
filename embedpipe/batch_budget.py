"""``--tokens-per-batch``: a number, or ``auto`` sized to the device (docs/precision.md, "Batch size").

On CUDA, ``auto`` divides the device memory the batches may use by what one padded token
costs. It is sized when the :class:`~embedpipe.worker.Embedder` is built, before any model is
on the device, so the weights the run will put there are subtracted here. The estimate is
rough on purpose: a batch that still runs out of memory is split in halves by the worker
(``Embedder._run_batch``). On the CPU, ``auto`` is :data:`~embedpipe.options.CPU_TOKENS_PER_BATCH`.
"""

from __future__ import annotations

import torch

from embedpipe import cuda
from embedpipe.model.base import EmbeddingModel
from embedpipe.options import AUTO, CPU_TOKENS_PER_BATCH, MIN_TOKENS_PER_BATCH, EmbedOptions
from embedpipe.precision import FP32, Policy

#: share of the memory left after the weights that batches may fill (the rest: the CUDA
#: context's growth, allocator fragmentation, what the estimate misses)
MEMORY_FRACTION = 0.8
#: an auto budget is rounded down to a multiple of this
TOKENS_STEP = 256
#: the largest auto budget: beyond it a batch is no faster, only a bigger loss on a split
MAX_AUTO_TOKENS = 2**20
#: bytes per value of a stored layer's hidden state (fp32 at most) and of its fp32 copy
FP32_BYTES = 4


def resolve_tokens_per_batch(options: EmbedOptions, loaded: EmbeddingModel, policy: Policy,
                             device: torch.device, stored_layers: int) -> int:
    """The token budget a run uses: the number given, or for ``auto`` one that fits ``device``
    (``stored_layers``: how many layers the run returns and stores)."""
    if options.tokens_per_batch != AUTO:
        return int(options.tokens_per_batch)
    if device.type != "cuda":
        return CPU_TOKENS_PER_BATCH
    free = cuda.free_memory(device)
    weights = device_weight_bytes(loaded, policy, options.fallback_device, free)
    per_token = bytes_per_token(loaded, policy, stored_layers, options.per_residue)
    return tokens_that_fit(free - weights, per_token)


def device_weight_bytes(loaded: EmbeddingModel, policy: Policy, fallback_device: str, free: int) -> int:
    """Weights the run puts on the device: the policy's model, plus the fp32 fallback model's
    when it goes there too.

    No fallback model for fp32 itself, and none for a policy whose weights are fp32 (the amp
    policies run the fp32 model, which the fallback reuses). ``--fallback-device cpu`` keeps
    it off the device; ``auto`` puts it there only if it fits beside the policy's model, so
    it is counted only when both fit in ``free``; ``same`` always counts it.
    """
    main = loaded.estimate_memory(policy).weight_bytes
    if policy.is_reference or policy.weight_dtype == torch.float32 or fallback_device == "cpu":
        return main
    fallback = loaded.estimate_memory(FP32).weight_bytes
    if fallback_device == "auto" and main + fallback > free:
        return main  # the worker will find it does not fit and run fallback records on the CPU
    return main + fallback


def bytes_per_token(loaded: EmbeddingModel, policy: Policy, stored_layers: int, per_residue: bool) -> int:
    """Device memory of one padded token: the forward's working memory, the hidden states of
    the stored layers the forward returns, and with per-residue output their fp32 copies
    (held until the batch's rows leave the device)."""
    width = loaded.embed_dim
    stored = stored_layers * width * FP32_BYTES
    copies = stored_layers * width * FP32_BYTES if per_residue else 0
    return loaded.estimate_memory(policy).activation_bytes_per_token + stored + copies


def tokens_that_fit(available: int, per_token: int) -> int:
    """:data:`MEMORY_FRACTION` of ``available`` bytes in tokens of ``per_token`` bytes, rounded
    down to :data:`TOKENS_STEP`, within [:data:`MIN_TOKENS_PER_BATCH`, :data:`MAX_AUTO_TOKENS`]."""
    if per_token <= 0:
        raise ValueError(f"bytes per token must be positive, not {per_token}")
    tokens = int(max(available, 0) * MEMORY_FRACTION) // per_token
    if tokens >= TOKENS_STEP:
        tokens -= tokens % TOKENS_STEP
    return max(MIN_TOKENS_PER_BATCH, min(MAX_AUTO_TOKENS, tokens))
