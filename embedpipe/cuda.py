"""Every CUDA-only line of embedpipe, in one place (docs/architecture.md).

The varlen flash-attention call, the free-memory query, pinned host buffers and the events
that time device work. Everything else (the packed layout, segment pooling, batch sizing,
the choice of attention path) is device-agnostic and tested on the CPU, where each function
here has a plain stand-in: attention per sequence with SDPA, no pinning, wall-clock timing.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

#: flash attention (and so the varlen kernel) starts with Ampere
VARLEN_CAPABILITY = (8, 0)
VARLEN_DTYPES = (torch.float16, torch.bfloat16)


def varlen_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch.nn.attention.varlen.varlen_attn`` runs on ``device`` for ``dtype`` inputs."""
    if device.type != "cuda" or dtype not in VARLEN_DTYPES:
        return False
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401  (torch >= 2.9)
    except ImportError:
        return False
    return torch.cuda.get_device_capability(device) >= VARLEN_CAPABILITY


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     max_len: int) -> torch.Tensor:
    """Attention of packed (N, H, head_dim) q/k/v within each sequence of ``cu_seqlens``
    (int32, B + 1 offsets); q is pre-scaled. ``num_splits=1``: a sequence's result does not
    depend on the other sequences of its batch (no split-KV reduction order)."""
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, scale=1.0, num_splits=1)


def per_sequence_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: list[int]) -> torch.Tensor:
    """The CPU stand-in for :func:`varlen_attention`: SDPA over each sequence's rows alone."""
    out = torch.empty_like(q if q.dtype == v.dtype else v)
    for lo, hi in zip(offsets[:-1], offsets[1:]):
        # (T, H, d) -> (H, T, d) views; SDPA writes a fresh tensor, copied into the packed rows
        out[lo:hi] = F.scaled_dot_product_attention(
            q[lo:hi].transpose(0, 1), k[lo:hi].transpose(0, 1), v[lo:hi].transpose(0, 1), scale=1.0
        ).transpose(0, 1)
    return out


def free_memory(device: torch.device) -> int:
    """Bytes this process can still allocate on ``device`` (CUDA only): free at the driver plus
    what PyTorch's caching allocator holds unused (an earlier shard's batches, a model copy
    freed since), which the driver counts as taken."""
    free, _total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(free) + max(int(cached), 0)


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` on the CPU; from CUDA through a pinned buffer with an asynchronous copy, so
    the device is not stalled behind a pageable copy. Synchronises before returning."""
    if tensor.device.type != "cuda":
        return tensor.cpu()
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    torch.cuda.current_stream(tensor.device).synchronize()
    return host


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` (on the CPU) on ``device``; to CUDA from pinned memory, asynchronously."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


class BusyTimer:
    """Seconds the device spent in forward passes: CUDA events on the stream (read once, at
    the end, so timing never synchronises a batch), wall clock on the CPU."""

    def __init__(self) -> None:
        self._cpu_seconds = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._started: float | torch.cuda.Event | None = None

    def start(self, device: torch.device) -> None:
        if device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._started = event
        else:
            self._started = time.perf_counter()

    def stop(self, device: torch.device) -> None:
        if self._started is None:
            return
        if device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._events.append((self._started, event))
        else:
            self._cpu_seconds += time.perf_counter() - self._started
        self._started = None

    @property
    def seconds(self) -> float:
        """Total busy seconds so far (synchronises the recorded CUDA events)."""
        total = self._cpu_seconds
        for begin, end in self._events:
            end.synchronize()
            total += begin.elapsed_time(end) / 1000.0
        return total
