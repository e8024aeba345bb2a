"""Linear layers with their weights prepacked once for oneDNN, for CPU inference.

Why: on CPU, ``F.linear`` runs fp32 through the generic BLAS path and re-lays out a bf16
weight on every call. A weight reordered once into oneDNN's blocked layout runs the same
matmuls faster (measured in docs/benchmarks.md, "What the speed comes from"), and the
GELU after ``fc1`` runs in the matmul's epilogue, on the fp32 accumulator (one rounding to
bf16 instead of two). This is the same prepacking PyTorch's own compiler applies to
frozen CPU models; here it is done without compiling anything.

The oneDNN ops are private PyTorch API, so every pack is probed against ``F.linear`` when
it is made, and anything unexpected (a build without oneDNN, a changed signature, a
mismatch) falls back to ``F.linear``. Costs one extra copy of the packed weights.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)

#: rows of every matmul a linear layer runs, by device type (docs/precision.md,
#: "Reproducibility"): each policy's linear computes its rows in tiles of exactly this many,
#: the last one padded, so a row goes through the same kernel, blocking and shape whatever the
#: batch's row count. CPU: a multiple of the AMX (16) and AVX-512 (8, 16, 32) row blocks, small
#: enough that padding the last tile costs little at CPU batch sizes; CUDA: enough rows for
#: cuBLAS's 128 x 256 tiles to fill an H100's SMs in the feed-forward of a 650M model, few enough
#: that the padded tile held beside the output stays inside the memory estimate
#: (tests/runtime/test_cuda_memory.py)
BATCH_TILE_ROWS = {"cpu": 128, "cuda": 1024}

def tile_rows(device: torch.device) -> int:
    """The matmul row tile on ``device`` (:data:`BATCH_TILE_ROWS`; a device type not listed: CUDA's)."""
    return BATCH_TILE_ROWS.get(device.type, BATCH_TILE_ROWS["cuda"])


def row_tiled(linear: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``linear(x)`` over x's rows (any leading shape), computed :func:`tile_rows` rows at a time.

    Why: a GEMM's kernel and blocking follow its row count (oneDNN's small-M and AMX paths,
    BLAS's GEMV), so a record's row rounded differently with every batch it sat in. Each tile
    is one matmul of the same (tile, K) shape; the last is padded to it with copies of its
    last row (zeros would send int8's per-token quantization down its tiny-row path, and
    a copy leaves int8 calibration's per-channel absmax as it is). One copy of the
    output (tile results into one buffer of the real rows) and one tile of each held beside
    it are the cost, measured in
    benchmarks/batch_invariance.py."""
    lead, width, tile = x.shape[:-1], x.shape[-1], tile_rows(x.device)
    rows = x.reshape(-1, width)
    n = rows.shape[0]
    out: torch.Tensor | None = None
    if n == 0:
        return linear(x)
    for start in range(0, n, tile):
        part = rows[start:start + tile]
        if part.shape[0] < tile:  # the last tile: padded with copies of its last row, outputs dropped
            part = torch.cat((part, part[-1:].expand(tile - part.shape[0], width)))
        y = linear(part)
        if out is None:
            out = torch.empty((n, y.shape[-1]), dtype=y.dtype, device=y.device)
        out[start:start + tile] = y[:n - start]
    assert out is not None
    return out.view(*lead, out.shape[-1])


class PackedLinear:
    """``y = x W^T + b`` (optionally GELU'd) with ``W`` in oneDNN's layout."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
        self.bias = None if bias is None else bias.detach()

    def __call__(self, x: torch.Tensor, gelu: bool = False) -> torch.Tensor:
        # oneDNN reads the input as dense row-major: a strided view would be misread.
        x = x.contiguous()
        if gelu:  # exact (erf) GELU, as F.gelu's default
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "gelu", [], "none")
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


def pack_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> PackedLinear | None:
    """A :class:`PackedLinear` when this build, device and dtype support it and it reproduces
    ``F.linear`` (and ``F.gelu``) on a probe input; ``None`` otherwise (use ``F.linear``)."""
    if weight.device.type != "cpu" or weight.dtype not in PACKABLE_DTYPES or weight.dim() != 2:
        return None
    if bias is not None and bias.dtype != weight.dtype:
        return None
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return None
    try:
        packed = PackedLinear(weight, bias)
        generator = torch.Generator().manual_seed(0)
        probe = torch.randn(2, 3, weight.shape[1], generator=generator).to(weight.dtype)
        want = F.linear(probe, weight, bias).float()
        got = packed(probe)
        got_gelu = packed(probe, gelu=True)
    except (RuntimeError, AttributeError, TypeError):
        return None
    # bf16 outputs are rounded once from fp32 accumulators; sums in another order may round
    # one step apart. fp32: the accumulation order alone.
    tolerance = 1e-2 if weight.dtype == torch.bfloat16 else 1e-4
    if got.shape != want.shape or got.dtype != weight.dtype:
        return None
    if not torch.allclose(got.float(), want, rtol=tolerance, atol=tolerance):
        return None
    if not torch.allclose(got_gelu.float(), F.gelu(want), rtol=tolerance, atol=tolerance):
        return None
    return packed
