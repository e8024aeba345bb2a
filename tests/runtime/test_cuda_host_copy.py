"""embedpipe.runtime.cuda's read-back on the CPU: the pinned ring's reuse and bound, HostCopy's CPU
stand-in, and the sync counter's CPU answer.
The CUDA branches of HostCopy (copy stream, ring) run in tests/runtime/test_cuda_trace.py."""

from __future__ import annotations

import torch

from embedpipe.runtime import cuda
from helpers.fake_cuda import fake_cuda


def test_the_ring_reuses_buffers_and_keeps_at_most_keep_idle():
    ring = cuda.PinnedRing(keep=2, allocate=lambda n: torch.empty(n, dtype=torch.uint8))
    a, b = ring.take(100), ring.take(300)
    assert ring.allocated == 2
    ring.give(a)
    ring.give(b)
    assert ring.take(50) is a  # the smallest idle buffer that fits
    assert ring.take(200) is b
    assert ring.allocated == 2  # reused, none allocated
    ring.give(a), ring.give(b), ring.give(ring.take(1000))
    assert len(ring._free) == 2 and ring.idle_bytes == 300 + 1000  # the smallest dropped
    twin = ring.take(1000)
    ring.give(torch.empty(1000, dtype=torch.uint8))  # equal values are not the same buffer
    assert ring.take(1000) is not twin


def test_on_the_cpu_a_host_copy_is_the_tensor_itself():
    x = torch.arange(6.0).reshape(2, 3)
    assert cuda.HostCopy(x, cuda.PinnedRing()).wait().data_ptr() == x.data_ptr()


def test_on_a_gpu_the_copy_comes_back_from_the_ring_and_the_buffer_goes_back():
    with fake_cuda() as trace:
        ring = cuda.PinnedRing(keep=1)
        for _ in range(3):  # three batches of the same size: one buffer
            x = torch.zeros(4, 8, device="cuda")
            copy = cuda.HostCopy(x, ring)
            assert len(ring._free) == 0  # in flight
            copy.wait()
            assert len(ring._free) == 1
    assert ring.allocated == 1
    assert [e.split(" at ")[0] for e in trace.events].count("record_stream") == 3  # x kept for the copy stream
    assert all(not blocking for d, blocking, _ in trace.transfers if d == "D2H")


def test_the_sync_count_exists_on_cuda_only():
    with cuda.count_syncs(torch.device("cpu")) as syncs:
        float(torch.ones(1).sum())
    assert syncs.count is None and syncs.why == "sync debug mode exists on CUDA only"
