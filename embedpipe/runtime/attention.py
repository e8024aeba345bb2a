"""Which batch layout and attention kernel a run uses, from its options, policy and device.

One place for the decision that the worker records in the store (``batch_layout``,
``attention_path``, ``attention_inputs``, the resume identity) and that the ESM-2 runner acts
on, so the two can never disagree (docs/precision.md, "Batch layout" and "Attention inputs").
"""

from __future__ import annotations

import torch

from embedpipe.runtime import cuda
from embedpipe.runtime.engine_override import EngineChoice
from embedpipe.runtime.packed_linear import tile_rows
from embedpipe.runtime.precision import Policy, attention_dtype, resolve_attention_inputs


def packed_kernel(device: torch.device, dtype: torch.dtype) -> str:
    """The kernel a packed batch attends with: ``varlen-flash`` where it runs for ``dtype``
    q/k/v on ``device``, else the per-sequence SDPA stand-in (:mod:`embedpipe.runtime.packed`)."""
    return "varlen-flash" if cuda.varlen_available(device, dtype) else "sdpa-per-sequence"


def qkv_dtype(engine: EngineChoice, policy: Policy, device: torch.device) -> torch.dtype:
    """dtype of q, k and v at the attention kernel (the attention inputs resolved for ``device``)."""
    return attention_dtype(policy, resolve_attention_inputs(engine.attention_inputs, device))


def batch_layout(engine: EngineChoice, policy: Policy, device: torch.device) -> str:
    """The batch layout: ``auto`` packs where the varlen kernel runs (embedpipe's own sdpa
    forward only) and pads elsewhere."""
    if engine.batch_layout != "auto":
        return engine.batch_layout
    if engine.attention == "sdpa" and packed_kernel(device, qkv_dtype(engine, policy, device)) == "varlen-flash":
        return "packed"
    return "padded"


def attention_path(engine: EngineChoice, policy: Policy, device: torch.device) -> str:
    """As recorded in the store: ``packed-varlen-flash``, ``packed-sdpa-per-sequence``, or
    ``padded-`` plus the attention kernel."""
    if batch_layout(engine, policy, device) == "packed":
        return "packed-" + packed_kernel(device, qkv_dtype(engine, policy, device))
    return f"padded-{engine.attention}"


def invariance_attrs(path: str, device: torch.device) -> dict[str, bool | int]:
    """Root attributes ``batch_invariant`` and ``batch_tile_rows`` (docs/store-format.md): whether a
    record's numbers were independent of its batch, given the attention ``path`` it ran through
    (docs/precision.md, "Reproducibility"). Yes for the packed paths (each sequence attended
    alone) and for padded SDPA on the CPU (each record at its own length); not for
    ``padded-math``, ``padded-fair-esm`` or padded CUDA batches (one masked kernel over the pad length)."""
    invariant = path.startswith("packed-") or (path == "padded-sdpa" and device.type == "cpu")
    return {"batch_invariant": invariant, "batch_tile_rows": tile_rows(device)}
