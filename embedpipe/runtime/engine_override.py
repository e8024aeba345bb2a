"""The engine choices a run derives (attention kernel, batch layout, q/k/v dtype at attention,
where fp32 fallback records run), and the one expert override of them: the environment
variable ``EMBEDPIPE_ENGINE`` (docs/precision.md, "Engine choices"), for tests and benchmarks.

Why not options: each has one right value per policy, device and family, which
:func:`embedpipe.extraction.resolved.resolve_run` derives (the ``auto`` rules of
:mod:`embedpipe.runtime.attention` and ``resolve_fallback_device``); the others give
up batch invariance or speed. ``resolve_run`` is the only reader of the variable, and records
what it resolved (``computed_as``, the store's attributes, the identity where the numbers change).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace

from embedpipe.core.errors import EmbedpipeError
from embedpipe.core.options import FP32_ISLAND_POLICIES

#: the variable's name
VARIABLE = "EMBEDPIPE_ENGINE"

#: each choice and its values, the derived one (``auto``, or sdpa for the kernel) first:
#: attention: sdpa (fused), math (explicit scores and softmax), fair-esm (fair-esm's own forward);
#: batch_layout: auto = packed where the varlen kernel runs (CUDA, compute capability 8.0+,
#: 16-bit q/k/v), else padded; attention_inputs: auto = compute (the policy's dtype) on CUDA,
#: fp32 elsewhere; fallback_device: auto = the job's device, the CPU when the fp32 model does
#: not fit there beside the low-precision one; same = the job's device or fail; cpu = the CPU
#: the attention kernels of the forward passes (the ESM-2 runner checks its argument against them)
ATTENTION_KERNELS = ("sdpa", "math", "fair-esm")
CHOICES: dict[str, tuple[str, ...]] = {
    "attention": ATTENTION_KERNELS,
    "batch_layout": ("auto", "packed", "padded"),
    "attention_inputs": ("auto", "fp32", "compute"),
    "fallback_device": ("auto", "same", "cpu"),
}


@dataclass(frozen=True)
class EngineChoice:
    """The engine choices as requested: the derived rules by default, or the override's."""

    attention: str = "sdpa"
    batch_layout: str = "auto"
    attention_inputs: str = "auto"
    fallback_device: str = "auto"

    def refusal(self, policy: str) -> str | None:
        """Why this choice cannot run ``policy`` (one line), or None."""
        if self.attention == "fair-esm" and policy in FP32_ISLAND_POLICIES:
            return (f"{VARIABLE} attention=fair-esm: --precision {policy} keeps fp32 islands inside the layers, "
                    "which fair-esm's own forward cannot do")
        return None


def parse(text: str) -> EngineChoice:
    """``key=value[,key=value...]`` (keys and values of :data:`CHOICES`); one line naming the
    variable for an unknown key, value, a repeated key or an impossible pair."""
    given: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = (s.strip() for s in item.partition("="))
        if not sep or key not in CHOICES:
            raise EmbedpipeError(f"{VARIABLE}: {item!r} is not KEY=VALUE with KEY one of {', '.join(CHOICES)}")
        if key in given:
            raise EmbedpipeError(f"{VARIABLE}: {key} given twice")
        if value not in CHOICES[key]:
            raise EmbedpipeError(f"{VARIABLE}: {key} must be one of {', '.join(CHOICES[key])}, not {value!r}")
        given[key] = value
    choice = replace(EngineChoice(), **given)
    if choice.batch_layout == "packed" and choice.attention != "sdpa":
        raise EmbedpipeError(f"{VARIABLE}: batch_layout=packed attends with sdpa; attention={choice.attention} "
                             "runs padded batches only")
    return choice


def from_environment(env: Mapping[str, str] = os.environ) -> EngineChoice:
    """The override the environment sets (the derived rules where it sets none)."""
    return parse(env.get(VARIABLE, ""))

