"""Precision policies: which dtype the weights live in, which dtype each op computes in.

The policy names are a contract (DESIGN.md section 6). A policy never patches fair-esm
globally: low-precision weights live in a private copy of the model, so other models in the
same process (and the fp32 fallback copy) are untouched.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from embedpipe.errors import EmbedpipeError
from embedpipe.options import FP32_ISLAND_POLICIES, POLICY_NAMES, check_same_names


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


def reset_rotary_caches(model: torch.nn.Module) -> None:
    """Drop fair-esm's rotary cos/sin caches.

    fair-esm caches the tables in whatever dtype they were first built in and rebuilds them
    only when the sequence length or device changes, not the dtype: a cache built under one
    precision would otherwise leak into another (including through ``copy.deepcopy``).
    """
    for module in model.modules():
        if hasattr(module, "_cos_cached") and hasattr(module, "_seq_len_cached"):
            module._seq_len_cached = None
            module._cos_cached = None
            module._sin_cached = None


def prepare_model(model: torch.nn.Module, policy: Policy, device: torch.device, *,
                  private: bool = False) -> torch.nn.Module:
    """The model as ``policy`` runs it on ``device``: a private copy whenever weights change dtype
    (or when ``private``), otherwise ``model`` itself moved to ``device``.

    The fp32 source model is never modified except for that move, so it can serve as the fp32
    fallback. If the move runs out of memory, the source is moved back before the error
    propagates: it is never left split across devices.
    """
    reset_rotary_caches(model)
    if policy.weight_dtype == torch.float32 and not private:
        prepared = _move(model, device)
    else:
        prepared = _cast_copy(model, policy, device)
    reset_rotary_caches(prepared)
    prepared.eval()
    for param in prepared.parameters():
        param.requires_grad_(False)
    return prepared


def _move(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """``model.to(device)``, undone on out-of-memory."""
    home = next(model.parameters()).device
    try:
        return model.to(device)
    except torch.cuda.OutOfMemoryError:
        model.to(home)
        raise


def _cast_copy(model: torch.nn.Module, policy: Policy, device: torch.device) -> torch.nn.Module:
    """Copy ``model`` with its tensors already in their target dtypes, on ``device``.

    Casting while copying (through ``deepcopy``'s memo) never holds a second fp32 copy of the
    weights: for a 15B model that is 60 GB of host memory saved; each tensor is made on
    ``device`` directly. The mixed policies keep layer-norm weights and the rotary frequencies
    (``inv_freq``) in fp32; a plain cast converts everything, as ``.half()`` would.
    """
    fp32_ids: set[int] = set()
    if policy.fp32_islands:
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                fp32_ids.update(id(p) for p in module.parameters(recurse=False))
            if hasattr(module, "inv_freq"):
                fp32_ids.add(id(module.inv_freq))
    memo: dict[int, torch.Tensor] = {}
    for param in model.parameters():
        dtype = torch.float32 if id(param) in fp32_ids else policy.weight_dtype
        memo[id(param)] = torch.nn.Parameter(param.detach().to(device, dtype, copy=True), requires_grad=False)
    for buffer in model.buffers():
        if buffer.is_floating_point():
            dtype = torch.float32 if id(buffer) in fp32_ids else policy.weight_dtype
            memo[id(buffer)] = buffer.detach().to(device, dtype, copy=True)
        else:
            memo[id(buffer)] = buffer.detach().to(device, copy=True)
    return copy.deepcopy(model, memo).to(device)  # any tensor not listed above


@contextlib.contextmanager
def _true_fp32_matmuls(device: torch.device) -> Iterator[None]:
    """fp32 means fp32: no TF32 (CUDA) or reduced-precision fp32 matmuls, whatever the process
    enabled globally; the settings are restored afterwards."""
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
    """Inference mode, autocast for the amp policies, and true fp32 (no TF32) for the reference."""
    with torch.inference_mode(), (_true_fp32_matmuls(device) if policy.is_reference else contextlib.nullcontext()):
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
    16 bits) and no TF32. For pooling, whose sums over a thousand residues overflow fp16."""
    with torch.autocast(device_type=device.type, enabled=False), _true_fp32_matmuls(device):
        yield
