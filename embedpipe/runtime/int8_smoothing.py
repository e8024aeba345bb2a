"""SmoothQuant-style smoothing for ``int8-mixed`` (``--int8-smoothing smoothquant``).

Why: per-token int8 scales spend a token's whole range on its largest channel, and trained
transformers have a few input channels far larger than the rest, so every other channel of
that token loses bits. SmoothQuant divides each input channel j by ``s_j`` and multiplies the
weight's column j by it: ``x W^T = (x / s)(W s)^T``, with
``s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)`` (alpha 0.5) balancing the two ranges.

``max|X_j|`` is calibrated, in fp32, on a fixed FASTA (the shipped
``embedpipe/data/int8_calibration.fasta`` unless ``--int8-smoothing smoothquant:FASTA`` names
another), not on the first batch: a store's numbers must not depend on which records came first
(docs/precision.md, "int8-mixed"). While a runner is calibrated its layers are
:class:`CalibratingLinear`\\ s that run the exact fp32 linear and record each input channel's
absmax; :meth:`CalibratingLinear.finish` then quantizes the layer with its factors.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from embedpipe.runtime.int8_kernels import KernelChoice
from embedpipe.runtime.int8_linear import Int8Linear

#: SmoothQuant's migration strength: half of the outlier range moves into the weights
ALPHA = 0.5
#: the calibration set shipped with the package: the first 16 records of examples/swissprot100.fasta
SHIPPED = Path(__file__).resolve().parents[1] / "data" / "int8_calibration.fasta"


def smoothquant_factors(x_absmax: torch.Tensor, w_absmax: torch.Tensor, alpha: float = ALPHA) -> torch.Tensor:
    """fp32 (K,) ``s_j = x_absmax_j^alpha / w_absmax_j^(1 - alpha)``, computed in float64.

    A channel that is zero (never active in calibration, or an all-zero weight column) or
    non-finite on either side gets ``s_j = 1`` (left as it is): never inf, NaN or 0."""
    ax, aw = x_absmax.double(), w_absmax.double()
    usable = (ax > 0) & (aw > 0) & torch.isfinite(ax) & torch.isfinite(aw)
    s = ax.clamp_min(1e-300).pow(alpha) / aw.clamp_min(1e-300).pow(1.0 - alpha)
    s = torch.where(usable, s, torch.ones_like(s)).float()
    return torch.where(torch.isfinite(s) & (s > 0), s, torch.ones_like(s))


_COLLECTING: contextvars.ContextVar[list | None] = contextvars.ContextVar("int8_calibrating", default=None)


@contextlib.contextmanager
def collecting() -> Iterator[list[CalibratingLinear]]:
    """The :class:`CalibratingLinear` layers made inside this block (one runner's), in order."""
    layers: list[CalibratingLinear] = []
    token = _COLLECTING.set(layers)
    try:
        yield layers
    finally:
        _COLLECTING.reset(token)


class CalibratingLinear:
    """A linear layer that runs in exact fp32 and records its input's per-channel absmax until
    :meth:`finish`, then runs as the smoothed :class:`Int8Linear`. Made inside
    :func:`collecting` (the calibration step must be able to find it)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, alpha: float = ALPHA,
                 kernels: KernelChoice | None = None) -> None:
        layers = _COLLECTING.get()
        if layers is None:
            raise RuntimeError("a calibrating int8 layer made outside a calibration (extraction/calibration.py)")
        layers.append(self)
        self.weight: torch.Tensor | None = weight.detach()  # a reference, dropped by finish()
        self.bias = None if bias is None else bias.detach().float()
        self.alpha, self.kernels = alpha, kernels  # the run's int8 weight range (runtime/int8_kernels.py)
        self.x_absmax = torch.zeros(weight.shape[1], dtype=torch.float32, device=weight.device)
        self.layer: Int8Linear | None = None

    def __call__(self, x: torch.Tensor, gelu: bool = False) -> torch.Tensor:
        if self.layer is not None:
            return self.layer(x, gelu=gelu)
        if self.weight is None:
            raise RuntimeError("a calibrating int8 layer used after finish() failed")
        x = x.float()
        seen = x.reshape(-1, x.shape[-1]).abs().amax(dim=0) if x.numel() else self.x_absmax
        torch.maximum(self.x_absmax, seen, out=self.x_absmax)  # NaN kept: finish() leaves it at s = 1
        y = F.linear(x, self.weight.float(), self.bias)
        return F.gelu(y) if gelu else y

    @property
    def smoothing(self) -> torch.Tensor:
        """The factors from what was recorded so far (see :func:`smoothquant_factors`)."""
        assert self.weight is not None
        return smoothquant_factors(self.x_absmax, self.weight.float().abs().amax(dim=0), self.alpha)

    @property
    def fp32_reason(self) -> str:
        """Why the finished layer stays fp32 (:attr:`Int8Linear.fp32_reason`); '' until finished."""
        return self.layer.fp32_reason if self.layer is not None else ""

    def finish(self) -> None:
        """Quantize with the calibrated factors and drop the fp32 weight reference."""
        if self.layer is None:
            assert self.weight is not None  # dropped only once the layer exists
            self.layer = Int8Linear(self.weight, self.bias, smoothing=self.smoothing, kernels=self.kernels)
            self.weight = None


@dataclass(frozen=True)
class Calibration:
    """A calibration set as read: where from, its records and its bytes' sha256."""

    name: str  # the file's name, as provenance records it
    records: tuple[tuple[str, str], ...]
    sha256: str
    alpha: float = ALPHA

    def describe(self) -> str:
        """The smoothing as ``quantization_scales`` records it (docs/store-format.md)."""
        return (f"SmoothQuant alpha {self.alpha:g} per input channel, calibrated in fp32 on {self.name} "
                f"({len(self.records)} records, sha256 {self.sha256[:16]})")


def load_calibration(path: str | Path | None) -> Calibration:
    """The calibration set at ``path`` (the shipped one when None); a one-line error naming
    the file when it is missing, unreadable, invalid FASTA or empty.

    Read once per embed job: the job resolves its policy once and hands it on
    (:func:`embedpipe.extraction.resolved.resolve_policy`), so nothing here is cached."""
    from embedpipe.inputs.fasta import read_calibration  # import-light callers (options) never need it

    where = SHIPPED if path is None else Path(path)
    records = read_calibration(where)  # as the workflow's start-up check reads it
    return Calibration(where.name, records, hashlib.sha256(where.read_bytes()).hexdigest())
