"""The elementwise work between a layer's matmuls, as functions ``torch.compile`` can fuse (CPU).

Why not compile the whole layer: dynamo cannot trace the oneDNN-prepacked linears (their
weights are opaque mkldnn tensors) nor the per-record attention loop, so the layer is cut at
them and only the pieces between run compiled: layer norm + cast for the next matmul, the
residual add fused with the next norm, the rotary rotation with q's and v's casts. int8-mixed's
per-token quantize and rescale stay eager: compiled they made the run slower than its
L2-chunked eager passes (docs/benchmarks.md). Each piece is a pure tensor function; eager mode
runs each as several passes over memory, inductor as one or two loops. Compiled kernels round
at the ulp level differently from eager ones, so a compiled run is recorded as such
(docs/store-format.md, ``compiled``) and never reused as an eager store. Measured in
benchmarks/cpu_compile.py (docs/benchmarks.md, "torch.compile on the CPU").
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from embedpipe.core.errors import EmbedpipeError


def norm_cast(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
              out_dtype: torch.dtype) -> torch.Tensor:
    """Layer norm of the fp32 stream in fp32, cast to the next matmul's input dtype."""
    return F.layer_norm(x, x.shape[-1:], weight.float(), bias.float(), eps).to(out_dtype)


def add_norm_cast(residual: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                  eps: float, out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``x = residual + h`` (the stream, fp32) and its norm cast for the next matmul, one pass."""
    x = residual + h
    return x, norm_cast(x, weight, bias, eps, out_dtype)


def residual_add(residual: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """The layer's last residual add (a 16-bit ``h`` promoted inside it)."""
    return residual + h


def rotate_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               v_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(q and k rotated in fp32, (..., 2, H, d); v in ``v_dtype``) from the fused projection
    ``qkv`` (..., 3, H, d) with q/k rows in interleaved pair order (see
    :func:`embedpipe.model.esm2_forward.interleave_rotary_rows`): fair-esm's
    ``(x1 c - x2 s, x2 c + x1 s)`` per pair; ``cos``/``sin`` (..., 2, 1, d / 2), q's scaled."""
    pairs = qkv[..., :2, :, :].float().unflatten(-1, (-1, 2))
    x1, x2 = pairs[..., 0], pairs[..., 1]
    qk = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return qk, qkv[..., 2, :, :].to(v_dtype)


@dataclass(frozen=True)
class Fused:
    """The pieces, compiled (or eager, to test the cut itself): what a forward calls instead of
    its eager passes once :func:`compiled_pieces` made them."""

    norm_cast: Callable[..., torch.Tensor]
    add_norm_cast: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    residual_add: Callable[..., torch.Tensor]
    rotate_qkv: Callable[..., tuple[torch.Tensor, torch.Tensor]]


def compiled_pieces(backend: str = "inductor") -> Fused:
    """Every piece through ``torch.compile(dynamic=True)``: batch size and width vary per
    batch, so shapes are symbolic from the first call (no recompile per batch). ``backend``
    ``eager`` traces without generating code (tests of the cut)."""
    def comp(fn: Callable[..., Any]) -> Callable[..., Any]:
        return torch.compile(fn, backend=backend, dynamic=True)
    return Fused(comp(norm_cast), comp(add_norm_cast), comp(residual_add), comp(rotate_qkv))


#: ``--compile auto``'s break-even, in residues, for a policy :data:`AUTO_POLICIES` lists
#: (benchmarks/cpu_compile.py, docs/benchmarks.md "torch.compile on the CPU"): bf16-mixed's
#: with a cold inductor cache at the 150M shape on the quiet re-time (365k). The warm
#: break-even is not used: whether a cache is warm changes between a run and its rerun, and
#: the decision is part of the stores' identity, so it must not (a rerun would embed its kept
#: stores again)
COLD_BREAK_EVEN = 365_000
#: auto compiles only where the job's residues are this many break-evens: the measurement's
#: noise and other CPUs' compile speed are not known
MARGIN = 2.0
#: policies whose steady state the compiled pieces made faster at every measured shape, on a
#: quiet machine: none. Re-timed quiet (docs/benchmarks.md), bf16-mixed gained 0.98x at 35M and
#: 1.04x at 150M (1.17-1.18x in a first, lightly loaded run), fp32 0.93x, int8-mixed 0.87x. So
#: ``auto`` compiles nothing on the CPU until a CPU class measures a gain; ``--compile on`` does
AUTO_POLICIES: tuple[str, ...] = ()


def needs_residues(mode: str, policy: str) -> bool:
    """Whether :func:`decide_compile` reads the job's residues for ``mode`` and ``policy``: only
    auto, for a policy it may compile (the input is counted for nothing otherwise)."""
    return mode == "auto" and policy in AUTO_POLICIES


def decide_compile(mode: str, policy: str, device_type: str, residues: int) -> tuple[bool, str]:
    """(compile or not, why) for ``--compile`` ``mode``: ``auto`` compiles on the CPU, for the
    policies that gain, when the job's residues reach :data:`MARGIN` cold break-evens; never on
    CUDA, where it is not measured."""
    if mode == "off":
        return False, "--compile off"
    if mode == "on":
        return True, "--compile on"
    if device_type != "cpu":
        return False, f"auto: not on {device_type} (not measured there; --compile on to compile)"
    if not needs_residues(mode, policy):
        return False, f"auto: {policy} was not measured faster compiled on the CPU (--compile on to compile)"
    needed = int(MARGIN * COLD_BREAK_EVEN)
    if residues < needed:
        return False, f"auto: {residues} residues, below {needed}"
    return True, f"auto: {residues} residues, at least {needed}"


def check_cache(cache: str | None) -> None:
    """``--compile-cache`` up front, before the model loads: a directory that can be created and
    written, else one line naming the option. Inductor's own failure in an unwritable cache was
    a 499-line InductorError (which the workflow retried with more memory), and a file given as
    the cache ``File exists: in.fa``, naming no option. None: inductor's default, nothing to check."""
    if cache is None:
        return
    if os.path.lexists(cache) and not os.path.isdir(cache):
        raise EmbedpipeError(f"--compile-cache {cache}: exists and is not a directory (inductor's cache is a "
                             "directory)")
    try:
        os.makedirs(cache, exist_ok=True)
        with tempfile.TemporaryFile(dir=cache):
            pass
    except OSError as exc:
        raise EmbedpipeError(f"--compile-cache {cache}: cannot create or write this directory: "
                             f"{exc.strerror or exc}") from None


def use_cache(cache: str | None) -> None:
    """Point inductor at ``cache`` (``--compile-cache``, checked by :func:`check_cache`) before
    anything compiles: shard jobs that share it compile once (docs/cluster.md). None: inductor's
    own default."""
    if cache is not None:
        check_cache(cache)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.abspath(cache)
