"""The int8 matmul kernels of int8-mixed, and which one runs: chosen by exactness and by speed,
measured on this CPU (docs/precision.md, "int8-mixed").

Why measured: a kernel's speed depends on which code PyTorch dispatches on the real part, which
its flags do not tell. On an AVX2-only EPYC, ``torch._int_mm`` is exact at 8 bits but took
1.82 s for a 4096 x 480 -> 1920 linear against fp32's 0.055 s, while oneDNN, exact there only at
7 bits (its AVX2 u8 x s8 pair sums saturate in int16), ran int8-mixed at 1.57x fp32. A fixed
order of engines picked the slow one. Here every engine and weight range that reproduces the
exact int32 sums is timed on the layer's own shape, and the fastest exact one runs.

Two decisions:

* the **weight range** of a run (8-bit, or 7-bit where only the saturating kernels are fast),
  from the model's width (:func:`choose_weight_range`): it changes the numbers, so it is part
  of the store's identity and must be known before any layer is packed, the same for every layer.
  Memoised per process and width, whatever the thread count: a process's stores do not differ
  by how many threads ran them (timed twice, at 1 and at 2 threads under another process's load,
  a width-64 model's two timings once fell on either side of the margin);
* the **engine** of each layer at that range (:func:`fastest_engine`): the fastest exact one on
  the layer's own shape, memoised per thread count; it does not change the numbers (every
  engine returns the exact sums).
"""

from __future__ import annotations

import functools
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

#: symmetric int8 range used for weights and activations (-128 is never used)
QMAX = 127.0
#: 7-bit weights: where the CPU has no int8 dot product (AVX2 without VNNI), oneDNN multiplies
#: u8 x s8 pairs into saturating int16 sums; |w| <= 63 keeps 2 * 255 * 63 below 32767
QMAX_7BIT = 63.0
#: the weight ranges, preferred first (8-bit keeps twice the resolution)
WEIGHT_RANGES = (QMAX, QMAX_7BIT)
#: activation rows each timing runs: a batch's share of one linear, small enough that even a
#: slow kernel (the 33x one above) is timed in a fraction of a second
TIMING_ROWS = 256
#: 7-bit weights are taken only when their fastest kernel is at least this much faster than the
#: fastest 8-bit one. Where 8-bit and 7-bit run the same kernels (VNNI, AMX) they time alike;
#: where they do not (AVX2: ATen's 8-bit path measured 33x oneDNN's) the gap is an order of
#: magnitude. 2x keeps timing noise from flipping the range, which changes the numbers
SEVEN_BIT_GAIN = 2.0


def range_name(qmax: float) -> str:
    """The weight range as the store records it (``quantization_weight_range``)."""
    return "+-127 (8-bit)" if qmax == QMAX else f"+-{qmax:.0f} (7-bit)"


class Int8Matmul:
    """``((xq - zero_point) @ qweight^T) * scale`` with int32 sums on one engine, prepared once."""

    zero_point = 0

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor) -> None:
        self.scale = scale
        self.out_features = qweight.shape[0]

    @property
    def input_dtype(self) -> torch.dtype:
        """What :meth:`__call__` takes: int8, or u8 for a non-zero zero point."""
        return torch.uint8 if self.zero_point else torch.int8

    def __call__(self, xq: torch.Tensor) -> torch.Tensor:
        """fp32 (N, M) of (N, K) ``xq`` (:attr:`input_dtype`)."""
        raise NotImplementedError


class OnednnMatmul(Int8Matmul):
    """oneDNN's int8 matmul (``qlinear_pointwise``: VNNI/AMX-INT8 where the CPU has them, int16
    pair sums on AVX2), the per-channel scales in its epilogue. Fed u8 with zero point 128: with
    s8 activations oneDNN has no fast kernel on AVX512-VNNI CPUs without AMX and ran its scalar
    reference one (docs/benchmarks.md)."""

    zero_point = 128

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__(qweight, scale)
        self._packed = torch.ops.onednn.qlinear_prepack(qweight, None)
        self._zero_points = torch.zeros(self.out_features, dtype=torch.long)

    def __call__(self, xq: torch.Tensor) -> torch.Tensor:
        return torch.ops.onednn.qlinear_pointwise(
            xq, 1.0, self.zero_point, self._packed, self.scale, self._zero_points, None, 1.0, 0,
            torch.float32, "none", [], "")


class IntMmMatmul(Int8Matmul):
    """ATen's ``torch._int_mm`` (s8 x s8 -> s32), rescaled in fp32."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__(qweight, scale)
        self._weight_t = qweight.t().contiguous()

    def __call__(self, xq: torch.Tensor) -> torch.Tensor:
        return torch._int_mm(xq, self._weight_t).float().mul_(self.scale)


#: int8 matmul engines by name; which one runs is measured (:func:`fastest_engine`)
ENGINES: dict[str, type[Int8Matmul]] = {"onednn": OnednnMatmul, "int_mm": IntMmMatmul}
#: the activations' zero point of oneDNN's u8 inputs
U8_ZERO_POINT = OnednnMatmul.zero_point


def prepared(engine: str, qweight: torch.Tensor, scale: torch.Tensor) -> Int8Matmul | None:
    """``engine`` on these weights when it reproduces the exact int32 sums here, else None.

    The probe's rows include all +127 and all -127 (the largest pair sums any weights give),
    compared per output channel in units of its scale, so tiny weights are probed as hard."""
    try:
        matmul = ENGINES[engine](qweight, scale)
        g = torch.Generator().manual_seed(0)
        probe = torch.randint(-127, 128, (17, qweight.shape[1]), generator=g, dtype=torch.int8)
        probe[:2] = torch.tensor([[127], [-127]], dtype=torch.int8)
        want = (probe.double() @ qweight.double().t()) * scale.double()
        got = matmul((probe.short() + matmul.zero_point).to(matmul.input_dtype))
    except (RuntimeError, AttributeError, TypeError, NotImplementedError):  # an engine this build or CPU lacks
        return None
    unit = scale.double()
    exact = got.shape == want.shape and bool(torch.allclose(got.double() / unit, want / unit, rtol=1e-5, atol=1e-6))
    return matmul if exact else None


def worst_case_weights(out_features: int, in_features: int, qmax: float) -> torch.Tensor:
    """int8 weights whose pair sums are the largest the range allows (rows of all +qmax and all
    -qmax, the rest random in range): an engine exact on them is exact on any weights."""
    g = torch.Generator().manual_seed(1)
    q = torch.randint(-int(qmax), int(qmax) + 1, (out_features, in_features), generator=g, dtype=torch.int8)
    q[0], q[min(1, out_features - 1)] = int(qmax), -int(qmax)
    return q


@functools.cache
def _timing_ms(engine: str, qmax: float, shape: tuple[int, int], threads: int) -> float | None:
    """Milliseconds of one (:data:`TIMING_ROWS`, K) x (K -> M) matmul on ``engine`` at ``qmax``,
    the best of a few calls after a warm-up; None when the engine is not exact at that range."""
    out_features, in_features = shape
    qweight = worst_case_weights(out_features, in_features, qmax)
    matmul = prepared(engine, qweight, torch.ones(out_features))
    if matmul is None:
        return None
    g = torch.Generator().manual_seed(2)
    xq = torch.randint(0, 255, (TIMING_ROWS, in_features), generator=g, dtype=torch.uint8).to(matmul.input_dtype)
    matmul(xq)  # warm-up: oneDNN's JIT, first-touch pages
    times: list[float] = []
    # the best of at least 5 calls (up to 50 or 0.2 s): noise only ever adds time
    while len(times) < 5 or (len(times) < 50 and sum(times) < 0.2):
        start = time.perf_counter()
        matmul(xq)
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def timing_ms(engine: str, qmax: float, shape: tuple[int, int]) -> float | None:
    """:func:`_timing_ms` at this process's current intra-op thread count (memoised per count)."""
    return _timing_ms(engine, float(qmax), (int(shape[0]), int(shape[1])), torch.get_num_threads())


def _timings(qmax: float, shape: tuple[int, int]) -> dict[str, float]:
    """engine -> ms of every engine exact at ``qmax`` on ``shape``, fastest first."""
    found: dict[str, float] = {}
    for engine in ENGINES:
        ms = timing_ms(engine, qmax, shape)
        if ms is not None:
            found[engine] = ms
    return dict(sorted(found.items(), key=lambda item: item[1]))


def fastest_engine(qmax: float, shape: tuple[int, int]) -> list[str]:
    """The engines exact at ``qmax`` on ``shape`` (M, K), fastest first: a layer tries them in
    this order against its own weights (:func:`prepared`)."""
    return list(_timings(qmax, shape))


@dataclass(frozen=True)
class KernelChoice:
    """The weight range of a run, why, and the engines its layers used (filled as they pack)."""

    qmax: float
    reason: str
    used: Counter[str] = field(default_factory=Counter, compare=False, hash=False, repr=False)

    @property
    def weight_range(self) -> str:
        return range_name(self.qmax)

    def engines(self) -> str:
        """The engines the packed layers use, with counts (``quantization_engines``)."""
        return ", ".join(f"{name}: {n} layers" for name, n in sorted(self.used.items())) or "none packed yet"


def representative_shapes(width: int) -> tuple[tuple[int, int], ...]:
    """A transformer layer's linear shapes (M, K) at model width ``width``: the attention
    projections and a 4x feed-forward. Known from the width alone, so a run's weight range is
    decided the same before its model loads (``--reuse``) and after."""
    return ((width, width), (4 * width, width), (width, 4 * width))


def _exact_everywhere(qmax: float, shapes: tuple[tuple[int, int], ...]) -> set[str]:
    """The engines exact at ``qmax`` on every one of ``shapes`` (exactness is deterministic)."""
    return {e for e in ENGINES if all(timing_ms(e, qmax, shape) is not None for shape in shapes)}


def _choose(shapes: tuple[tuple[int, int], ...], threads: int) -> KernelChoice:
    """The weight range, decided by exactness wherever that settles it, so timing noise cannot
    flip it: 8-bit where an engine exact at 7 bits is exact at 8 too (the same kernels run both
    ranges: 7 bits would only lose resolution); 7-bit where nothing is exact at 8; timed only
    where the engines exact at 7 bits alone differ from those exact at 8 (AVX2: oneDNN's
    saturating kernels against ATen's 8-bit path)."""
    eight, seven = _exact_everywhere(QMAX, shapes), _exact_everywhere(QMAX_7BIT, shapes)
    if not eight and not seven:
        raise RuntimeError("no int8 matmul engine reproduces the exact int32 sums here "
                           f"(tried {', '.join(ENGINES)} at 8 and 7 bits)")
    only_seven = seven - eight
    if not only_seven:
        return KernelChoice(QMAX, f"{range_name(QMAX)} weights: {', '.join(sorted(eight))} exact at 8 bits here")
    if not eight:
        return KernelChoice(QMAX_7BIT, f"{range_name(QMAX_7BIT)} weights: only {', '.join(sorted(seven))} exact "
                                       "here, at 7 bits (their int16 pair sums saturate at 8)")

    def total(qmax: float, engines: set[str]) -> float:
        return sum(min(float(timing_ms(e, qmax, shape) or 0.0) for e in engines) for shape in shapes)

    t8, t7 = total(QMAX, eight), total(QMAX_7BIT, only_seven)
    qmax = QMAX_7BIT if t8 > SEVEN_BIT_GAIN * t7 else QMAX
    return KernelChoice(qmax, (
        f"{range_name(qmax)} weights: measured here at {threads} threads, {TIMING_ROWS} rows per linear of "
        f"{', '.join(f'{m}x{k}' for m, k in shapes)}: exact at 8 bits {', '.join(sorted(eight))} {t8:.2f} ms, "
        f"exact at 7 bits only {', '.join(sorted(only_seven))} {t7:.2f} ms (7 bits taken at "
        f"{SEVEN_BIT_GAIN:.0f}x faster or more)"))


#: shapes -> the weight range chosen for them in this process (at the first call's thread count)
_CHOSEN: dict[tuple[tuple[int, int], ...], KernelChoice] = {}


def choose(shapes: tuple[tuple[int, int], ...]) -> KernelChoice:
    """The weight range for linears of ``shapes`` (M, K): 8-bit unless only 7-bit kernels are
    exact, or the fastest 7-bit ones are :data:`SEVEN_BIT_GAIN` times faster (decided once per
    process and shapes, at the thread count of the first call). A fresh :class:`KernelChoice`,
    whose ``used`` counts the engines of the layers made with it."""
    key = tuple((int(m), int(k)) for m, k in shapes)
    if key not in _CHOSEN:
        _CHOSEN[key] = _choose(key, torch.get_num_threads())
    chosen = _CHOSEN[key]
    return KernelChoice(chosen.qmax, chosen.reason)


def exact_range(engine: str, shape: tuple[int, int]) -> KernelChoice:
    """The widest weight range at which ``engine`` is exact on ``shape`` (8-bit where it can):
    for a layer made with one engine by name (tests, benchmarks)."""
    for qmax in WEIGHT_RANGES:
        if timing_ms(engine, qmax, shape) is not None:
            return KernelChoice(qmax, f"{range_name(qmax)} weights: the widest range {engine} is exact at")
    return KernelChoice(QMAX, f"{engine} is exact at no weight range here")


def choose_weight_range(width: int) -> KernelChoice:
    """A run's weight range, for a model of width ``width`` (:func:`representative_shapes`)."""
    return choose(representative_shapes(width))

