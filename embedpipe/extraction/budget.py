"""``--tokens-per-batch``: a number, or ``auto`` sized to the device (docs/precision.md, "Batch size").

On CUDA, ``auto`` divides the device memory the batches may use by what one padded token
costs. It is sized when the run is resolved (:func:`~embedpipe.extraction.resolved.resolve_run`), before any model is
on the device, so the weights the run will put there are subtracted here. The estimate is
rough on purpose: a batch that still runs out of memory is split in halves by the worker
(``Engine._run_batch``). On the CPU, ``auto`` is :data:`~embedpipe.core.options.CPU_TOKENS_PER_BATCH`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from embedpipe.core.options import AUTO, CPU_TOKENS_PER_BATCH, MIN_TOKENS_PER_BATCH, EmbedOptions
from embedpipe.extraction.planning import BATCH_OVERHEAD_TOKENS as CPU_BATCH_OVERHEAD_TOKENS
from embedpipe.model.base import EmbeddingModel
from embedpipe.runtime import cuda
from embedpipe.runtime.precision import FP32, Policy

#: share of the memory left after the weights that batches may fill (the rest: the CUDA
#: context's growth, allocator fragmentation, what the estimate misses)
MEMORY_FRACTION = 0.8
#: an auto budget is rounded down to a multiple of this
TOKENS_STEP = 256
#: the largest auto budget: beyond it a batch is no faster, only a bigger loss on a split
MAX_AUTO_TOKENS = 2**20
#: bytes per value of an fp32 copy of a hidden state
FP32_BYTES = 4
#: what one more forward call costs, in padded tokens, per device type: on the CPU measured
#: (Python and oneDNN dispatch, docs/benchmarks.md); on CUDA an estimate, not yet measured:
#: 2-4 ms of kernel launches per forward at about 3e5 tokens/s (650M, H100-class GPU)
BATCH_OVERHEAD_TOKENS = {"cpu": CPU_BATCH_OVERHEAD_TOKENS, "cuda": 1024}
#: no kernel input of an auto-sized batch may hold more elements (int32 indexing)
MAX_KERNEL_ELEMENTS = 2**31 - 1


def resolve_tokens_per_batch(options: EmbedOptions, loaded: EmbeddingModel, policy: Policy,
                             device: torch.device, stored_layers: Sequence[int], *, attention_inputs: str,
                             fallback_device: str) -> int:
    """The token budget a run uses: the number given, or for ``auto`` one that fits ``device``
    (``stored_layers``: the resolved layers the run returns and stores; ``attention_inputs``
    and ``fallback_device``, ``same`` or ``cpu``: as the run resolved them). Called once per run, by
    :func:`embedpipe.extraction.resolved.resolve_run`, which records the number."""
    if options.tokens_per_batch != AUTO:
        return int(options.tokens_per_batch)
    if device.type != "cuda":
        return CPU_TOKENS_PER_BATCH
    free = cuda.free_memory(device)
    weights = device_weight_bytes(loaded, policy, fallback_device)
    per_token = bytes_per_token(loaded, policy, stored_layers, options.per_residue, attention_inputs=attention_inputs)
    return min(tokens_that_fit(free - weights, per_token), kernel_token_cap(loaded, policy))


def device_weight_bytes(loaded: EmbeddingModel, policy: Policy, fallback_device: str) -> int:
    """Weights the run puts on the device: the policy's model, plus the fp32 fallback model's
    (:func:`fallback_weight_bytes`) when the run resolved the fallback device ``same``; ``cpu``
    keeps it off the device. Where it runs is decided by ``resolve_run`` only; here it is read."""
    if fallback_device not in ("same", "cpu"):
        raise ValueError(f"fallback device {fallback_device!r} is not resolved (same or cpu)")
    main = loaded.estimate_memory(policy).weight_bytes
    return main + (fallback_weight_bytes(loaded, policy) if fallback_device == "same" else 0)


def fallback_weight_bytes(loaded: EmbeddingModel, policy: Policy) -> int:
    """Bytes of the fp32 fallback model ``policy`` needs beside its own: none for fp32 itself, and
    none for a policy whose weights are fp32 (the amp policies run the fp32 model, which the
    fallback reuses)."""
    if policy.is_reference or policy.weight_dtype == torch.float32:
        return 0
    return loaded.estimate_memory(FP32).weight_bytes


def bytes_per_token(loaded: EmbeddingModel, policy: Policy, stored_layers: Sequence[int], per_residue: bool, *,
                    attention_inputs: str = "compute") -> int:
    """Device memory of one token at the batch's peak, the larger of two moments:

    - the forward, in its last layer (every layer needs the same working memory, which
      holds the layer's input): plus the hidden states of the stored layers before that
      input, kept until pooling (none for the default, the last layer);
    - pooling: every stored hidden state, plus fp32 copies of those not already fp32 (all of
      them with per-residue output, held until the rows leave the device; one at a time
      otherwise).
    Checked against a traced forward at the 650M and 3B shapes (tests/runtime/test_cuda_memory.py).
    ``attention_inputs``: the attention inputs as resolved (``compute`` is CUDA's default)."""
    estimate = loaded.estimate_memory(policy, attention_inputs=attention_inputs)
    hidden = loaded.embed_dim * estimate.hidden_itemsize
    held = sum(1 for layer in stored_layers if layer < loaded.num_layers - 1)
    forward = estimate.activation_bytes_per_token + held * hidden
    count = len(stored_layers)
    copies = 0 if estimate.hidden_itemsize == FP32_BYTES else (count if per_residue else 1) * loaded.embed_dim * FP32_BYTES
    return max(forward, count * hidden + copies)


def kernel_token_cap(loaded: EmbeddingModel, policy: Policy) -> int:
    """Tokens a batch may hold so that no tensor the forward makes passes 2^31 elements
    (32-bit indexing in CUDA kernels): at 2^20 tokens the 650M FFN's hidden layer has 5.4e9."""
    widest = loaded.estimate_memory(policy).widest_values_per_token
    if widest <= 0:
        return MAX_AUTO_TOKENS
    return max(MIN_TOKENS_PER_BATCH, (MAX_KERNEL_ELEMENTS // widest) // TOKENS_STEP * TOKENS_STEP)


def tokens_that_fit(available: int, per_token: int) -> int:
    """:data:`MEMORY_FRACTION` of ``available`` bytes in tokens of ``per_token`` bytes, rounded
    down to :data:`TOKENS_STEP`, within [:data:`MIN_TOKENS_PER_BATCH`, :data:`MAX_AUTO_TOKENS`]."""
    if per_token <= 0:
        raise ValueError(f"bytes per token must be positive, not {per_token}")
    tokens = int(max(available, 0) * MEMORY_FRACTION) // per_token
    if tokens >= TOKENS_STEP:
        tokens -= tokens % TOKENS_STEP
    return max(MIN_TOKENS_PER_BATCH, min(MAX_AUTO_TOKENS, tokens))


def batch_overhead_tokens(device: torch.device) -> int:
    """The padded planner's cost of one more batch on ``device`` (:func:`embedpipe.extraction.planning.plan_batches`)."""
    return BATCH_OVERHEAD_TOKENS.get(device.type, BATCH_OVERHEAD_TOKENS["cuda"])
