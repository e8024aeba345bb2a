"""An int8 linear layer for the CPU: int8 weights with one scale per output channel, int8
activations with one scale per token, int32 accumulation (W8A8; docs/precision.md, "int8-mixed").

Why these scales: a token's activations and a channel's weights each get the full int8 range
(absmax / 127, symmetric), so one outlier token or channel costs only its own precision. The
int32 sums are exact; the only rounding is the quantization of x and W and the fp32 rescale
``y = acc * s_x[token] * s_w[channel] + b``.

The int32 matmul runs on the engine :mod:`embedpipe.runtime.int8_kernels` measured fastest
among those exact on this CPU, for the layer's shape, at the run's weight range; the per-token
scale and the bias follow in one fp32 pass. The engines are private or not-quite-public
PyTorch API, so each layer also probes its engine on its own weights against the exact
(float64) sums when it is made, and takes the next fastest where that fails.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from embedpipe.runtime import int8_kernels
from embedpipe.runtime.int8_kernels import QMAX, Int8Matmul, KernelChoice

#: the smallest normal float32: a weight channel whose scale (absmax / qmax) falls below it
#: cannot be divided into int8 exactly, so its layer stays fp32 (:func:`weights_lost`)
NORMAL_MIN = float(torch.finfo(torch.float32).tiny)
#: activation rows whose absmax is below this are first multiplied by :data:`ACT_LIFT` (a power
#: of two: exact, subnormals included), so ``QMAX / absmax`` stays finite and ``absmax / QMAX``
#: normal; the lift is divided out of their output rows (:meth:`Int8Linear.__call__`). Why: a
#: fixed floor (1e-30) quantized every smaller token to zeros (docs/precision.md, "int8-mixed")
ACT_FLOOR = 2.0 ** -100
ACT_LIFT = 2.0 ** 100


def quantize_weight(weight: torch.Tensor, qmax: float = QMAX) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 (M, K) weights, fp32 (M,) scales): each output channel by its own absmax / ``qmax``."""
    w = weight.detach().float()
    absmax = w.abs().amax(dim=1)
    # no floor: an all-zero channel gets scale 1 (zeros either way); a tiny one keeps its own
    # scale, which weights_lost() checks (a floor once zeroed channels below 1e-30 silently)
    scale = torch.where(absmax > 0, absmax / qmax, torch.ones_like(absmax))
    return torch.round(w / scale[:, None]).clamp_(-qmax, qmax).to(torch.int8), scale


def weights_lost(weight: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> str:
    """Why int8 cannot hold this layer ('' when it can): output channels with non-zero weights
    whose scale is below float32's normal range (``w / scale`` inexact) or that quantized to
    all zeros; or channels so large that a rescaled int32 sum (up to ``qmax * max|w| * K``,
    before the token's scale) overflows float32. Such a layer stays an fp32 island
    (docs/precision.md, "int8-mixed")."""
    absmax = weight.detach().float().abs().amax(dim=1)
    small = (absmax > 0) & ((scale < NORMAL_MIN) | qweight.eq(0).all(dim=1))
    sums = float(qweight.abs().amax()) * weight.shape[1]  # the largest |int32 sum| a unit token gives
    large = scale.double() * QMAX * sums > float(torch.finfo(torch.float32).max)
    if bool(small.any()):
        return (f"{int(small.sum())} of {small.numel()} output channels have weights too small for int8 "
                f"(max |w| {float(absmax[small].min()):.3g}, scale below float32's normal range)")
    if bool(large.any()):
        return (f"{int(large.sum())} of {large.numel()} output channels have weights too large for int8 "
                f"(max |w| {float(absmax[large].max()):.3g}: the rescaled int32 sums overflow float32)")
    return ""


#: rows per eager pass: about 1 MiB of fp32 activations per thread, so the passes after the
#: first read from each core's L2 (4096 x 1920 quantized in 10 ms instead of 15 on one core here)
CHUNK_BYTES = 1 << 20


def row_chunks(n: int, k: int) -> range:
    """Start rows of the L2-sized chunks of an (n, k) fp32 tensor: 1 MiB per intra-op thread.

    Per thread, not per process: every pass over a chunk is one parallel region whose threads
    all wait for the slowest, and beside other work on the node a thread that lost its core
    makes each region wait a scheduler slice. A fixed 1 MiB chunk made a 4096-token fc2 over
    500 eager ops at any thread count; scaled, the regions fall with the threads while each
    thread's share of a chunk stays L2-sized (docs/benchmarks.md, "CPU contention")."""
    per_chunk = CHUNK_BYTES * max(1, torch.get_num_threads())
    return range(0, n, max(16, per_chunk // (4 * max(k, 1))))


def quantize_per_token(x: torch.Tensor, zero_point: int = 0,
                       inverse_smoothing: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 (N, K), fp32 (N, 1) scales) of a 2-D fp32 ``x``: each row by its own absmax / 127.

    ``zero_point`` 128: the same integers plus 128, as u8 (:data:`embedpipe.runtime.int8_kernels.U8_ZERO_POINT`).

    A NaN or inf row gets a NaN/inf scale, so the layer's output row is NaN/inf too: a
    broken record stays visible to the per-record checks and falls back to fp32. A row whose
    absmax is below :data:`ACT_FLOOR` gets its integers relative to the floor but its own scale
    (an all-zero row: zeros, scale 0), so its scale is at most ``ACT_FLOOR / 127``:
    :meth:`Int8Linear.__call__` finds such rows by it and quantizes them again, lifted.
    Per L2-sized chunk of rows, eager passes, each vectorised: amax, amin, scale into a reused
    buffer, round (:func:`_round_into`) and convert into the int8 result.
    ``inverse_smoothing`` (K,): the rows are first multiplied by it, column by column, into the
    buffer (SmoothQuant's ``x / s``, :mod:`embedpipe.runtime.int8_smoothing`), while the chunk is in L2.
    """
    n, k = x.shape
    q = torch.empty((n, k), dtype=torch.uint8 if zero_point else torch.int8, device=x.device)
    scale = torch.empty((n, 1), dtype=torch.float32, device=x.device)
    step = row_chunks(n, k).step
    buffer = torch.empty((min(step, n), k), dtype=torch.float32, device=x.device)
    for start in row_chunks(n, k):
        rows = x[start:start + step]
        if inverse_smoothing is not None:
            rows = torch.mul(rows, inverse_smoothing, out=buffer[:rows.shape[0]])
        # max(amax, -amin): two vectorised row reductions, 5-10x faster than ``vector_norm(inf)``
        # or ``abs().amax()`` here (no |x| temporary); both propagate NaN
        amax = torch.maximum(rows.amax(dim=1, keepdim=True), rows.amin(dim=1, keepdim=True).neg_())
        scaled = torch.mul(rows, QMAX / amax.clamp_min(ACT_FLOOR), out=buffer[:rows.shape[0]])
        _round_into(scaled, q[start:start + step], zero_point)
        torch.div(amax, QMAX, out=scale[start:start + step])
    return q, scale


#: 1.5 * 2**23: adding it to a float32 |v| < 2**22 rounds v to the nearest integer (ties to
#: even, as ``torch.round``) and leaves that integer in the low mantissa bits
ROUNDER = 12582912.0


def _round_into(scaled: torch.Tensor, out: torch.Tensor, zero_point: int = 0) -> torch.Tensor:
    """``out`` (int8, or u8 with ``zero_point`` 128) = ``round(scaled) + zero_point`` of fp32
    values in [-127, 127]; ``scaled`` is consumed.

    Why: ``round_()`` is a slow pass here (about 1.4x an add); adding :data:`ROUNDER` (plus the
    zero point) rounds in the add, and the int32 bit pattern's low byte is the result in two's
    complement, which the int32 -> int8/u8 conversion keeps. :func:`_rounder_works` checks that
    on this build once per type; where it does not hold, the plain passes run.
    """
    if _rounder_works(zero_point):
        return out.copy_(scaled.add_(ROUNDER + zero_point).view(torch.int32))
    scaled.round_()
    return out.copy_(scaled.add_(zero_point) if zero_point else scaled)


@functools.cache
def _rounder_works(zero_point: int = 0) -> bool:
    """Whether the :data:`ROUNDER` trick equals ``round`` here, ties and negatives included."""
    probe = torch.arange(-127.5, 127.75, 0.25, dtype=torch.float32)
    probe = probe.clamp(-QMAX, QMAX)
    want = (torch.round(probe) + zero_point).to(torch.uint8 if zero_point else torch.int8)
    got = torch.empty_like(want).copy_(probe.clone().add_(ROUNDER + zero_point).view(torch.int32))
    return bool(torch.equal(got, want))


def _rescale_(out: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, gelu: bool) -> None:
    """In place: ``out * scale + bias``, then the exact (erf) GELU when asked, as F.gelu's default.

    ``mul_`` then ``add_``: broadcasting ``addcmul`` is about 3x slower per pass here."""
    out.mul_(scale)
    if bias is not None:
        out.add_(bias)
    if gelu:
        torch.ops.aten.gelu_(out)


class Int8Linear:
    """``y = x W^T + b`` (optionally GELU'd) for fp32 ``x`` of any leading shape, in int8.

    ``kernels``: the run's weight range (:func:`embedpipe.runtime.int8_kernels.choose_weight_range`),
    whose ``used`` counts this layer's engine; without it the layer decides for its own shape.
    ``engine``: ``auto`` (the fastest exact engine), or one engine by name (tests, benchmarks).
    ``smoothing`` (K,), positive: SmoothQuant's per-input-channel factors ``s``; the weights are
    quantized from ``W * s`` and the activations from ``x / s``, so ``y`` is unchanged in exact
    arithmetic while an outlier channel's range moves from the activations to the weights."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, engine: str = "auto",
                 smoothing: torch.Tensor | None = None, kernels: KernelChoice | None = None) -> None:
        self.bias = None if bias is None else bias.detach().float()
        self.out_features, self.in_features = weight.shape
        source = weight = weight.detach().float()
        self.inverse_smoothing = None
        if smoothing is not None:
            smoothing = smoothing.detach().float().to(weight.device)
            weight = weight * smoothing[None, :]
            self.inverse_smoothing = smoothing.reciprocal()
        #: why this layer stays an fp32 island ('' when it runs in int8): see :func:`weights_lost`
        self.fp32_reason = ""
        self.fp32_weight: torch.Tensor | None = None
        shape = (self.out_features, self.in_features)
        if kernels is None:  # a layer made alone: the range its engine(s) are exact and fastest at
            kernels = int8_kernels.choose((shape,)) if engine == "auto" else int8_kernels.exact_range(engine, shape)
        self.weight_qmax = kernels.qmax
        self.qweight, self.weight_scale = quantize_weight(weight, self.weight_qmax)
        self.fp32_reason = weights_lost(weight, self.qweight, self.weight_scale)
        if self.fp32_reason:  # the exact fp32 linear, never a zeroed channel
            self.engine, self.zero_point, self.fp32_weight = "fp32", 0, source
            return
        tried = int8_kernels.fastest_engine(self.weight_qmax, shape) if engine == "auto" else [engine]
        for name in tried:  # fastest first; each probed on this layer's own weights
            matmul = int8_kernels.prepared(name, self.qweight, self.weight_scale)
            if matmul is not None:
                self._matmul: Int8Matmul = matmul
                self.engine, self.zero_point = name, matmul.zero_point
                kernels.used[name] += 1
                return
        raise RuntimeError(f"no int8 matmul engine reproduces the exact int32 sums of this layer at "
                           f"{int8_kernels.range_name(self.weight_qmax)} weights (tried {', '.join(tried) or 'none'})")

    @property
    def input_dtype(self) -> torch.dtype:
        """What :meth:`scaled_matmul` takes: int8, or u8 for a non-zero :attr:`zero_point`."""
        return torch.uint8 if self.zero_point else torch.int8

    def scaled_matmul(self, xq: torch.Tensor) -> torch.Tensor:
        """fp32 (N, M) ``((xq - zero_point) @ qweight^T) * weight_scale`` of (N, K) ``xq``
        (:attr:`input_dtype`), summed in int32."""
        return self._matmul(xq)

    def __call__(self, x: torch.Tensor, gelu: bool = False) -> torch.Tensor:
        lead = x.shape[:-1]
        if self.fp32_weight is not None:  # an fp32 island (weights_lost)
            y = F.linear(x.float(), self.fp32_weight, self.bias)
            return F.gelu(y) if gelu else y
        rows = x.reshape(-1, self.in_features).float()
        xq, scale = quantize_per_token(rows, self.zero_point, self.inverse_smoothing)
        out = self.scaled_matmul(xq)
        self._lift_tiny_rows(rows, out, scale)
        chunks = row_chunks(*out.shape)  # L2-sized, in place: no fresh buffers, one trip to memory
        for start in chunks:
            _rescale_(out[start:start + chunks.step], scale[start:start + chunks.step], self.bias, gelu)
        return out.view(*lead, self.out_features)

    def _lift_tiny_rows(self, rows: torch.Tensor, out: torch.Tensor, scale: torch.Tensor) -> None:
        """Rows quantized at :data:`ACT_FLOOR` (absmax at or below it: tiny, or zero) again,
        multiplied by :data:`ACT_LIFT` first: ``out`` gets their rescaled products with the lift
        divided out, and ``scale`` 1, so the rescale only adds the bias. A cheap (N, 1) test;
        the rows themselves are rare (zero rows: padding, or a layer of tiny activations)."""
        floored = (scale <= ACT_FLOOR / QMAX * (1 + 2.0 ** -20)).view(-1)  # the floor, whatever its rounding
        if not bool(floored.any()):
            return
        index = floored.nonzero().view(-1)
        lifted = rows.index_select(0, index) * ACT_LIFT
        xq, lifted_scale = quantize_per_token(lifted, self.zero_point, self.inverse_smoothing)
        out[index] = self.scaled_matmul(xq).mul_(lifted_scale).mul_(1.0 / ACT_LIFT)
        scale[index] = 1.0
