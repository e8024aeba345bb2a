"""Every CUDA-only line of embedpipe, in one place (docs/architecture.md).

The varlen flash-attention call, the free-memory query, pinned host buffers and the events
that time device work. Everything else (the packed layout, segment pooling, batch sizing,
the choice of attention path) is device-agnostic and tested on the CPU: the varlen kernel's
stand-in is :func:`embedpipe.runtime.packed.per_sequence_attention`, and the functions below act as
plain copies and wall-clock timing on the CPU.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from typing import cast
from collections.abc import Callable, Iterator

import torch

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
    if not torch.backends.cuda.is_flash_attention_available():  # a build without flash kernels
        return False
    return torch.cuda.get_device_capability(device) >= VARLEN_CAPABILITY


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     max_len: int) -> torch.Tensor:
    """Attention of packed (N, H, head_dim) q/k/v within each sequence of ``cu_seqlens``
    (int32, B + 1 offsets); q is pre-scaled. ``num_splits=1``: a sequence's result does not
    depend on the other sequences of its batch (no split-KV reduction order)."""
    from torch.nn.attention.varlen import varlen_attn

    out = varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, scale=1.0, num_splits=1)
    return out[0] if isinstance(out, tuple) else out  # (out, logsumexp) only when asked for


def free_memory(device: torch.device) -> int:
    """Bytes this process can still allocate on ``device`` (CUDA only): free at the driver plus
    what PyTorch's caching allocator holds unused (an earlier shard's batches, a model copy
    freed since), which the driver counts as taken."""
    free, _total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(free) + max(int(cached), 0)


@contextlib.contextmanager
def host_side() -> Iterator[None]:
    """A block of host-only tensor work inside the launch path: tokens and offsets built on
    the host, results read back from a :class:`HostCopy`. A no-op; it names the boundary
    between host and device work, which the fake-CUDA trace (tests/helpers/fake_cuda.py) runs on
    real tensors while everything else runs on a faked GPU."""
    yield


class PinnedRing:
    """Pinned host buffers for device-to-host copies, reused and bounded.

    Why not ``torch.empty(pin_memory=True)`` per copy: the caching host allocator rounds each
    buffer up to a power of two and keeps it, so one 1M-token per-residue layer of a 650M
    model (5.4 GB) would pin 8 GB per batch in flight. Here a buffer goes back to the ring
    once its contents are copied out (:meth:`HostCopy.wait`), the next copy of the same size
    reuses it, and at most ``keep`` idle buffers are held (the largest kept; a dropped one
    goes back to PyTorch's host cache). A run holds its batches in flight plus ``keep``."""

    def __init__(self, keep: int = 4, allocate: Callable[[int], torch.Tensor] | None = None) -> None:
        self.keep = keep
        self._allocate = allocate or (lambda nbytes: torch.empty(nbytes, dtype=torch.uint8, pin_memory=True))
        self._free: list[torch.Tensor] = []
        self.allocated = 0  # buffers allocated so far (a test counts reuse with it)

    def take(self, nbytes: int) -> torch.Tensor:
        """A (>= nbytes,) uint8 buffer: the smallest idle one that fits, else a new one."""
        fits = [i for i, b in enumerate(self._free) if b.numel() >= nbytes]
        if fits:  # by position: ``list.remove`` would compare tensors by value
            return self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
        self.allocated += 1
        return self._allocate(max(nbytes, 1))

    def give(self, buffer: torch.Tensor) -> None:
        """``buffer`` is idle again; beyond ``keep`` idle buffers the smallest is dropped."""
        self._free.append(buffer)
        if len(self._free) > self.keep:
            self._free.pop(min(range(len(self._free)), key=lambda i: self._free[i].numel()))

    @property
    def idle_bytes(self) -> int:
        return sum(b.numel() for b in self._free)


_COPY_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def copy_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream of ``device`` that results go to the host on: per-residue read-back
    does not wait behind the next batch's kernels on the compute stream."""
    if device not in _COPY_STREAMS:
        _COPY_STREAMS[device] = torch.cuda.Stream(device)
    return _COPY_STREAMS[device]


class HostCopy:
    """A tensor on its way to the host. From CUDA: an asynchronous copy on the device's copy
    stream into a buffer of ``ring``, so the next batch can be launched before this one's
    results are read; :meth:`wait` blocks until the copy is done. On the CPU: the tensor itself."""

    def __init__(self, tensor: torch.Tensor, ring: PinnedRing | None = None) -> None:
        self._event: torch.cuda.Event | None = None
        self._ring: PinnedRing | None = ring
        self._buffer: torch.Tensor | None = None
        if tensor.device.type != "cuda":
            self._host = tensor.detach()
            return
        self._ring = ring or PinnedRing(keep=0)
        nbytes = tensor.numel() * tensor.element_size()
        self._buffer = self._ring.take(nbytes)
        self._host = self._buffer[:nbytes].view(tensor.dtype).view(tensor.shape)
        stream = copy_stream(tensor.device)
        # the copy waits for the kernels that produced ``tensor`` (queued on the current
        # stream of the tensor's device, which need not be the current device), and the
        # allocator must not hand ``tensor``'s memory to the next batch before the copy ran
        stream.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(stream):
            self._host.copy_(tensor, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(stream)
        tensor.record_stream(stream)

    def wait(self) -> torch.Tensor:
        """The tensor on the host, the caller's to keep: from CUDA a pageable copy of the
        pinned buffer (the buffer goes back to the ring); on the CPU the tensor itself."""
        if self._event is None:
            return self._host
        self._event.synchronize()
        host = self._host.clone()
        assert self._ring is not None and self._buffer is not None  # set with the event
        self._ring.give(self._buffer)
        self._event, self._buffer = None, None
        self._host = host
        return host


class SyncCount:
    """Host syncs seen inside :func:`count_syncs` (``count`` stays None off CUDA)."""

    def __init__(self) -> None:
        self.count: int | None = None
        self.why: str | None = None


@contextlib.contextmanager
def count_syncs(device: torch.device) -> Iterator[SyncCount]:
    """Count the synchronising CUDA calls made inside (``torch.cuda.set_sync_debug_mode("warn")``,
    one warning each): the syncs a fake-CUDA trace cannot see, such as those inside C++ ops."""
    counted = SyncCount()
    if device.type != "cuda":
        counted.why = "sync debug mode exists on CUDA only"
        yield counted
        return
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield counted
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    counted.count = sum("synchroniz" in str(w.message) for w in caught)


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` (on the CPU) on ``device``; to CUDA from pinned memory, asynchronously."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


class BusyTimer:
    """Seconds the device spent in forward passes: CUDA events on the stream (never waited
    for while batches run, so timing never synchronises a batch), wall clock on the CPU.
    Pairs whose end event has completed are folded into the total as batches stop (a
    non-blocking query), so a long run holds only the events of batches still in flight."""

    def __init__(self) -> None:
        self._seconds = 0.0  # CPU batches, and CUDA pairs already folded in
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._started: float | torch.cuda.Event | None = None

    def start(self, device: torch.device) -> None:
        if device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(device))  # the stream the forward runs on
            self._started = event
        else:
            self._started = time.perf_counter()

    def stop(self, device: torch.device) -> None:
        if self._started is None:
            return
        if device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(device))
            self._events.append((cast(torch.cuda.Event, self._started), event))
            while self._events and self._events[0][1].query():  # done: no wait
                begin, end = self._events.pop(0)
                self._seconds += begin.elapsed_time(end) / 1000.0
        else:
            self._seconds += time.perf_counter() - cast(float, self._started)
        self._started = None

    @property
    def seconds(self) -> float:
        """Total busy seconds so far (synchronises the CUDA events still pending)."""
        total = self._seconds
        for begin, end in self._events:
            end.synchronize()
            total += begin.elapsed_time(end) / 1000.0
        return total
