"""``int8-mixed``: the linear layers in int8, everything else an fp32 island (CPU only).

What runs in int8: q/k/v, the attention's out projection and the feed-forward (fc1, fc2),
as :class:`embedpipe.runtime.int8_linear.Int8Linear` (int8 weights per output channel, int8
activations per token, int32 sums). What stays fp32: layer norms, the residual stream,
rotary tables and the rotation, attention scores and softmax, pooling. Per-token scales
(not one scale per batch) keep a record's numbers independent of its batch-mates. The
weights are quantized from the fp32 model when it is prepared, so the fp32 fallback shares
that model (docs/precision.md, "int8-mixed").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from embedpipe.core.errors import EmbedpipeError
from embedpipe.runtime import cpu_features
from embedpipe.runtime.int8_kernels import KernelChoice, choose_weight_range
from embedpipe.runtime.int8_linear import Int8Linear
from embedpipe.runtime.int8_smoothing import CalibratingLinear, Calibration
from embedpipe.runtime.precision import MixedPolicy, Packed, add_policies

#: root attributes of an int8-mixed store (docs/store-format.md)
SCHEME = ("W8A8 symmetric int8: weights per output channel (absmax/127, or absmax/63 where only 7-bit "
          "kernels are exact and fast on the CPU: see quantization_weight_range), activations per token "
          "(absmax/127, dynamic), int32 sums rescaled in fp32; q/k/v, out projection, fc1, fc2")
SCALES_FROM = ("weights: the checkpoint's fp32 weights when the model is prepared; activations: each "
               "token's own values at run time")
SCALES = f"{SCALES_FROM}; no smoothing"


@dataclass(frozen=True)
class Int8MixedPolicy(MixedPolicy):
    """fp32 weights and islands; the linear layers through their int8 copies.

    ``calibration``: SmoothQuant smoothing calibrated on that set (``--int8-smoothing
    smoothquant``; a policy of its own, made per run by :func:`embedpipe.extraction.calibration.configured_policy`,
    so the shared ``POLICIES`` entry stays unsmoothed); None: no smoothing.
    ``kernels``: the run's int8 weight range, measured on the CPU for the model's width
    (:meth:`for_width`, from :func:`embedpipe.extraction.resolved.resolve_run`); None: each layer
    decides for its own shape (a policy used outside a run)."""

    calibration: Calibration | None = None
    kernels: KernelChoice | None = None

    def for_width(self, width: int) -> Int8MixedPolicy:
        """This policy with the int8 weight range measured for a model of width ``width``."""
        return dataclasses.replace(self, kernels=choose_weight_range(width))

    def check_device(self, device: torch.device, cpu: cpu_features.CpuFeatures | None = None) -> list[str]:
        if device.type != "cpu":
            raise EmbedpipeError(
                f"precision {self.name!r} runs on the CPU only (oneDNN's int8 kernels); on {device.type} "
                "use bf16-mixed or fp16-mixed")
        return super().check_device(device, cpu)  # the CPU advice (runtime/advice.py)

    def provenance(self) -> dict[str, str]:
        scales = SCALES if self.calibration is None else f"{SCALES_FROM}; {self.calibration.describe()}"
        chosen = {} if self.kernels is None else {"quantization_weight_range": self.kernels.weight_range,
                                                  "quantization_kernels": self.kernels.reason}
        return super().provenance() | {"quantization_scheme": SCHEME, "quantization_scales": scales} | chosen

    def runner_provenance(self, fp32_layers: Mapping[str, str]) -> dict[str, str]:
        """``quantization_fp32_layers``: the linear layers int8 could not hold (weights below
        float32's normal range once scaled), kept fp32 like the other islands; ``none`` usually."""
        listed = "; ".join(f"{name}: {why}" for name, why in sorted(fp32_layers.items()))
        engines = {} if self.kernels is None else {"quantization_engines": self.kernels.engines()}
        return {"quantization_fp32_layers": listed or "none"} | engines

    @property
    def overflow_limit(self) -> float:
        # the activations live in fp32; the int8 scales are per token, so nothing saturates
        return float(torch.finfo(torch.float32).max)

    def memory_kind(self, attention_inputs: str) -> str:
        return "fp32"

    def attention_dtype(self, attention_inputs: str) -> torch.dtype:
        return torch.float32  # attention is an island: there is no int8 attention

    def attention_qk(self, q: torch.Tensor, k: torch.Tensor, attention_inputs: str) -> tuple[torch.Tensor, torch.Tensor]:
        return q, k

    def packs(self, prepack: bool) -> bool:
        return True  # the int8 copies are how this policy runs a linear, not an optimisation

    def pack(self, weight: torch.Tensor, bias: torch.Tensor | None) -> Packed | None:
        if self.calibration is not None:  # exact fp32 until calibrated (extraction/calibration.py)
            return CalibratingLinear(weight, bias, self.calibration.alpha, kernels=self.kernels)
        return Int8Linear(weight, bias, kernels=self.kernels)

    def calibration_records(self) -> Sequence[tuple[str, str]]:
        return () if self.calibration is None else self.calibration.records

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               packed: Packed | None = None, *, gelu: bool = False) -> torch.Tensor:
        if packed is None:
            raise RuntimeError(f"{self.name}: a linear layer without its int8 copy (the forward did not pack it)")
        # no row tiles (docs/precision.md, "Reproducibility"): a row's int8 result cannot depend on
        # its batch-mates. Its scale is its own (per token: a max, exact in any order), the int32
        # sums are exact whatever the kernel's blocking, and the rescale and bias are per element.
        # Tiles cost int8 a quarter of its time (benchmarks/batch_invariance.py) for nothing.
        return packed(x.float(), gelu=gelu)


add_policies("int8", Int8MixedPolicy)
