"""Precision policies: which dtype the weights live in, which dtype each op computes in.

The policy names are a contract (docs/precision.md). What a policy does to a model's
weights is the model family's business (:meth:`embedpipe.model.base.EmbeddingModel.prepare`);
this module holds the policies and the contexts a forward pass runs in.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from embedpipe.core.errors import EmbedpipeError
from embedpipe.core.options import FP32_ISLAND_POLICIES, POLICY_NAMES, check_same_names


@dataclass(frozen=True)
class Policy:
    """How one precision policy runs the model.

    ``weight_dtype``: dtype of the model copy's weights.
    ``compute_dtype``: dtype of the matmuls (projections, feed-forward).
    ``autocast``: run under ``torch.autocast(compute_dtype)`` with fp32 weights (PyTorch picks per op).
    ``fp32_islands``: rotary tables, attention scores and softmax, layer norms, the residual
    stream and pooling stay in fp32 while weights and matmuls are low precision.
    """

    name: str
    weight_dtype: torch.dtype
    compute_dtype: torch.dtype
    autocast: bool = False
    fp32_islands: bool = False

    @property
    def is_reference(self) -> bool:
        """fp32 is the reference: no fallback is ever needed for it."""
        return self.compute_dtype == torch.float32


POLICIES: dict[str, Policy] = {
    "fp32": Policy("fp32", torch.float32, torch.float32),
    "fp16": Policy("fp16", torch.float16, torch.float16),
    "bf16": Policy("bf16", torch.bfloat16, torch.bfloat16),
    "amp-fp16": Policy("amp-fp16", torch.float32, torch.float16, autocast=True),
    "amp-bf16": Policy("amp-bf16", torch.float32, torch.bfloat16, autocast=True),
    "fp16-mixed": Policy("fp16-mixed", torch.float16, torch.float16, fp32_islands=True),
    "bf16-mixed": Policy("bf16-mixed", torch.bfloat16, torch.bfloat16, fp32_islands=True),
}
check_same_names("precision.POLICIES", POLICIES, POLICY_NAMES)
check_same_names("fp32-island policies", [n for n, p in POLICIES.items() if p.fp32_islands], FP32_ISLAND_POLICIES)
FP32 = POLICIES["fp32"]


def resolve_attention_inputs(option: str, device: torch.device) -> str:
    """``--attention-inputs auto`` -> ``compute`` on CUDA (tensor-core attention), else ``fp32``."""
    if option == "auto":
        return "compute" if device.type == "cuda" else "fp32"
    return option


def attention_dtype(policy: Policy, attention_inputs: str) -> torch.dtype:
    """dtype of q, k and v at the attention kernel (under autocast: the dtype autocast casts to).

    Only the fp32-island policies have a choice (``attention_inputs``, resolved: ``fp32`` or
    ``compute``); the plain casts attend in their weights' dtype (docs/precision.md).
    """
    if policy.autocast or (policy.fp32_islands and attention_inputs == "compute"):
        return policy.compute_dtype
    return torch.float32 if policy.fp32_islands else policy.weight_dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def get_policy(name: str) -> Policy:
    """The policy called ``name``; a clear error listing the valid names otherwise."""
    try:
        return POLICIES[name]
    except KeyError:
        raise EmbedpipeError(
            f"unknown precision policy {name!r}; choose one of: {', '.join(POLICIES)}"
        ) from None


def cpu_has_native_fp16() -> bool:
    """True when the CPU advertises native fp16 arithmetic (AVX512-FP16 or AMX-FP16)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_fp16" in flags or "amx_fp16" in flags


# Native bfloat16 arithmetic starts with Ampere (compute capability 8.0). Current torch's
# ``torch.cuda.is_bf16_supported()`` also answers True for older GPUs, where bfloat16 is
# emulated (slowly, through fp32), so it cannot be the test.
BF16_CAPABILITY = (8, 0)


def check_policy_on_device(policy: Policy, device: torch.device) -> list[str]:
    """Refuse combinations that cannot work; return warnings for ones that are merely slow."""
    notes: list[str] = []
    if device.type == "cuda" and policy.compute_dtype == torch.bfloat16:
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < BF16_CAPABILITY:
            name = torch.cuda.get_device_name(device)
            raise EmbedpipeError(
                f"precision {policy.name!r} needs bfloat16, which {name} (compute capability "
                f"{major}.{minor}) does not support natively (pre-Ampere GPU); use fp16-mixed or fp32"
            )
    if device.type == "cpu" and policy.compute_dtype == torch.float16 and not cpu_has_native_fp16():
        notes.append(
            f"precision {policy.name!r} on a CPU without native fp16 is emulated and several times "
            "slower than bf16; consider --precision bf16-mixed"
        )
    return notes


@contextlib.contextmanager
def true_fp32_matmuls() -> Iterator[None]:
    """fp32 means fp32: no TF32 (CUDA) or reduced-precision fp32 matmuls, whatever the process
    enabled globally; the settings are restored afterwards.

    These are process-wide flags, so the worker enters this once per run, not per batch.
    The legacy flags, not torch 2.13's ``fp32_precision`` ones: once both APIs are in use,
    torch refuses to read the legacy flags that callers may still use.
    """
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
             torch.get_float32_matmul_precision())
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[0], saved[1]
        torch.set_float32_matmul_precision(saved[2])


@contextlib.contextmanager
def forward_context(policy: Policy, device: torch.device) -> Iterator[None]:
    """Inference mode, and autocast for the amp policies. Run inside :func:`true_fp32_matmuls`,
    which keeps the reference (and every fp32 island) in true fp32."""
    with torch.inference_mode():
        if policy.autocast:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                ctx = torch.autocast(device_type=device.type, dtype=policy.compute_dtype)
            with ctx:
                yield
        else:
            yield


@contextlib.contextmanager
def exact_fp32(device: torch.device) -> Iterator[None]:
    """Plain fp32 inside any policy's forward context: autocast off (it would run an einsum in
    16 bits). For pooling, whose sums over a thousand residues overflow fp16."""
    with torch.autocast(device_type=device.type, enabled=False):
        yield
