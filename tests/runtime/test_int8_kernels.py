"""int8-mixed's kernels chosen by exactness and speed (embedpipe/runtime/int8_kernels.py): a
planted slow exact engine is not chosen, a fast inexact one never is, the weight range follows
exactness first and speed only where that cannot settle it, and what ran is what is recorded.
Properties, not CPUs: nothing here asserts which engine or range a CPU class "should" get."""

from __future__ import annotations

import time

import pytest
import torch

from embedpipe.runtime import int8_kernels
from embedpipe.runtime.int8_kernels import QMAX, QMAX_7BIT, IntMmMatmul
from embedpipe.runtime.int8_linear import Int8Linear, quantize_per_token
from embedpipe.runtime.precision import get_policy


class SlowExact(IntMmMatmul):
    """Exact (ATen's sums) and planted slow."""

    def __call__(self, xq: torch.Tensor) -> torch.Tensor:
        time.sleep(0.005)
        return super().__call__(xq)


class FastWrong(IntMmMatmul):
    """Planted fast and inexact: one off in every sum."""

    def __call__(self, xq: torch.Tensor) -> torch.Tensor:
        return super().__call__(xq).add_(self.scale)


@pytest.fixture
def planted(monkeypatch):
    """The real engines plus the planted ones; the memoised timings forgotten before and after."""
    def plant(**engines: type) -> None:
        monkeypatch.setattr(int8_kernels, "ENGINES", {**int8_kernels.ENGINES, **engines})
        int8_kernels._timing_ms.cache_clear()
        int8_kernels._CHOSEN.clear()
    yield plant
    int8_kernels._timing_ms.cache_clear()
    int8_kernels._CHOSEN.clear()


def test_a_slow_exact_engine_is_timed_and_not_chosen(planted) -> None:
    planted(slow=SlowExact)
    shape = (48, 64)
    qmax = int8_kernels.exact_range("int_mm", shape).qmax  # the widest range ATen's sums (and so "slow") are exact at
    order = int8_kernels.fastest_engine(qmax, shape)
    assert "slow" in order and order[-1] == "slow"  # exact, so timed, and the slowest
    assert int8_kernels.timing_ms("slow", qmax, shape) > max(int8_kernels.timing_ms(e, qmax, shape) or 0
                                                            for e in order if e != "slow")
    layer = Int8Linear(torch.randn(*shape), None, kernels=int8_kernels.KernelChoice(qmax, "planted"))
    assert layer.engine == order[0] != "slow"


def test_a_fast_inexact_engine_is_never_chosen(planted) -> None:
    planted(wrong=FastWrong)
    shape = (48, 64)
    assert int8_kernels.timing_ms("wrong", QMAX, shape) is None  # refused by the exactness probe, not timed
    assert "wrong" not in int8_kernels.fastest_engine(QMAX, shape)
    with pytest.raises(RuntimeError, match="no int8 matmul engine reproduces the exact int32 sums.*wrong"):
        Int8Linear(torch.randn(*shape), None, engine="wrong")


@pytest.mark.parametrize(("table", "want"), [
    # engine -> (ms at 8 bits or None: inexact, ms at 7 bits or None)
    ({"a": (5.0, 0.1), "b": (4.0, 4.0)}, QMAX),  # the same engines exact at both ranges: 8-bit, whatever the times
    ({"a": (30.0, 30.0), "b": (None, 1.0)}, QMAX_7BIT),  # AVX2-like: the 7-bit-only kernel is 30x faster
    ({"a": (30.0, 30.0), "b": (None, 20.0)}, QMAX),  # 1.5x faster is not worth half a bit
    ({"a": (None, 3.0), "b": (None, 2.0)}, QMAX_7BIT),  # nothing exact at 8 bits
])
def test_the_weight_range_follows_exactness_then_a_large_speed_gap(planted, monkeypatch, table, want) -> None:
    planted()
    monkeypatch.setattr(int8_kernels, "ENGINES", dict.fromkeys(table, IntMmMatmul))
    monkeypatch.setattr(int8_kernels, "timing_ms",
                        lambda engine, qmax, shape: table[engine][0 if qmax == QMAX else 1])
    choice = int8_kernels.choose(((32, 32), (128, 32)))
    assert choice.qmax == want and choice.weight_range == int8_kernels.range_name(want)
    assert choice.reason.startswith(int8_kernels.range_name(want))


def test_the_weight_range_is_decided_once_per_process_whatever_the_thread_count(planted, monkeypatch) -> None:
    """Timings that would choose 7-bit at one thread and 8-bit at two (noise, another process's
    load) give one range in a process: its stores do not differ by their thread count."""
    planted()
    monkeypatch.setattr(int8_kernels, "ENGINES", dict.fromkeys(("a", "b"), IntMmMatmul))
    seven_bit_faster = {1: 30.0, 2: 1.0}  # at 1 thread the 7-bit-only kernel is 30x faster; at 2 not

    def timing(engine: str, qmax: float, shape: tuple[int, int]) -> float | None:
        if engine == "b":
            return None if qmax == QMAX else 1.0
        return seven_bit_faster[torch.get_num_threads()]

    monkeypatch.setattr(int8_kernels, "timing_ms", timing)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        first = int8_kernels.choose(((32, 32),))
        torch.set_num_threads(2)
        again = int8_kernels.choose(((32, 32),))
    finally:
        torch.set_num_threads(threads)
    assert first.qmax == QMAX_7BIT  # decided at the first call's thread count, as the timings say
    assert again.qmax == first.qmax and again.reason == first.reason
    int8_kernels._CHOSEN.clear()
    torch.set_num_threads(2)
    try:
        assert int8_kernels.choose(((32, 32),)).qmax == QMAX  # the planted timings do differ at 2 threads
    finally:
        torch.set_num_threads(threads)


def test_no_exact_engine_is_one_clear_error(planted, monkeypatch) -> None:
    planted()
    monkeypatch.setattr(int8_kernels, "timing_ms", lambda engine, qmax, shape: None)
    with pytest.raises(RuntimeError, match="no int8 matmul engine reproduces the exact int32 sums here"):
        int8_kernels.choose(((32, 32),))


def test_the_recorded_range_and_engines_are_the_ones_the_layers_ran() -> None:
    policy = get_policy("int8-mixed").for_width(64)
    kernels = policy.kernels
    assert kernels is not None
    layers = [policy.pack(torch.randn(m, k), None) for m, k in int8_kernels.representative_shapes(64)]
    assert {layer.weight_qmax for layer in layers} == {kernels.qmax}
    assert kernels.used == {e: sum(layer.engine == e for layer in layers) for e in {layer.engine for layer in layers}}
    recorded = policy.provenance() | policy.runner_provenance({})
    assert recorded["quantization_weight_range"] == int8_kernels.range_name(kernels.qmax)
    assert recorded["quantization_kernels"] == kernels.reason
    assert recorded["quantization_engines"] == kernels.engines()
    # each layer's engine is exact on its own weights: the float64 sums of its own integers
    for layer in layers:
        x = torch.randn(9, layer.in_features)
        xq, sx = quantize_per_token(x)
        want = (xq.double() @ layer.qweight.double().t()) * sx.double() * layer.weight_scale.double()
        torch.testing.assert_close(layer(x).double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))

