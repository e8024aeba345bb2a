"""``--precision auto``: the candidates a device supports, the table's prior, the choice from a
measurement on the node, and the per-node cache of that measurement (docs/precision.md,
"precision: auto").

Why measured: which policy is fastest depends on the kernels PyTorch dispatches on the real
CPU, the model's shape and the node's load, which no table follows (an AVX2-only EPYC ran the
table's int8-mixed more than 10x slower than fp32 until its int8 engines were measured too).
The embed job times each candidate on its own loaded model and records
(:mod:`embedpipe.embed.auto_probe`), checks each one's pooled cosine to fp32 against the
cross-check's pass threshold, and runs the fastest that passes. The result is cached per node,
CPU model and flags, torch version, model, threads and device, in a directory the workflow's
jobs share, so a node measures once (:mod:`embedpipe.runtime.auto_cache`). A job too small to pay for the measurement takes the
table's prior (:mod:`embedpipe.runtime.advice`), and says so.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from embedpipe.core.options import Thresholds
from embedpipe.runtime import advice, cpu_features
from embedpipe.runtime.precision import CUDA_CAPABILITY

#: the policies auto times on the CPU: the reference and the two fast CPU policies
CPU_CANDIDATES = ("fp32", "bf16-mixed", "int8-mixed")
#: the pooled cosine to fp32 a candidate must reach on the probe records: the cross-check's pass bar
PASS_COSINE = Thresholds().pass_cosine
#: the probe's records: up to this many residues, drawn across the job's first input
PROBE_RESIDUES = 2048
#: timed passes per candidate, after one warm-up pass (which also prepares its weights)
TIMED_PASSES = 2
#: the probe may cost at most this share of the job's residues; a smaller job takes the table's prior
PROBE_SHARE = 0.10


def candidates(device: torch.device) -> tuple[str, ...]:
    """The policies auto may choose on ``device``: on the CPU :data:`CPU_CANDIDATES`; on CUDA
    fp32 and the mixed policies of the dtypes the GPU computes natively."""
    if device.type != "cuda":
        return CPU_CANDIDATES if device.type == "cpu" else ("fp32",)
    capability = torch.cuda.get_device_capability(device)
    mixed = [f"{name}-mixed" for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16))
             if capability >= CUDA_CAPABILITY[dtype]]
    return ("fp32", *mixed)


def prior(device: torch.device, cpu: cpu_features.CpuFeatures | None = None) -> tuple[str, str]:
    """(policy, why) from the table alone: a GPU by its compute capability, the CPU by its class."""
    if device.type == "cuda":
        return advice.cuda_choice(torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device))
    if device.type == "cpu":
        return advice.cpu_choice(cpu or cpu_features.detect())
    return "fp32", f"{device.type}: no measured advice for this device"


@dataclass(frozen=True)
class AutoChoice:
    """What ``auto`` resolved to on a job, and why (the store's ``precision_reason``)."""

    policy: str
    reason: str

    @classmethod
    def from_table(cls, device: torch.device, why_not: str = "no measurement on this job") -> AutoChoice:
        """The table's prior, for a job that does not measure (``why_not``)."""
        policy, why = prior(device)
        return cls(policy, f"auto -> {policy}: not measured ({why_not}); the table's prior: {why}")


@dataclass(frozen=True)
class Timing:
    """One candidate on the probe: milliseconds per 1,000 residues and its lowest pooled cosine to fp32."""

    ms_per_1k_residues: float
    min_cosine: float

    def passes(self) -> bool:
        return self.min_cosine >= PASS_COSINE


def pick(timings: Mapping[str, Timing]) -> str:
    """The fastest candidate whose pooled cosine passes (fp32 always does: it is the reference)."""
    passing = {name: t for name, t in timings.items() if name == "fp32" or t.passes()}
    return min(passing, key=lambda name: (passing[name].ms_per_1k_residues, name != "fp32"))


def describe(timings: Mapping[str, Timing]) -> str:
    """Each candidate's time and cosine, in words (``precision_reason``)."""
    parts = []
    for name, t in timings.items():
        verdict = "" if name == "fp32" or t.passes() else f", below the pass cosine {PASS_COSINE}: refused"
        parts.append(f"{name} {t.ms_per_1k_residues:.1f} ms per 1,000 residues (min pooled cosine to fp32 "
                     f"{t.min_cosine:.6f}{verdict})")
    return "; ".join(parts)


def measured_note(policy: str, timings: Mapping[str, Timing], when: str) -> str:
    """The warning for a named ``policy`` where this node's own measurement found another one
    faster that passes ('' when ``policy`` was the fastest or was not measured): it replaces the
    table's warning, which must never recommend what the node measured slower."""
    if policy not in timings:
        return ""
    fastest = pick(timings)
    if fastest == policy:
        return ""
    ours, theirs = timings[policy].ms_per_1k_residues, timings[fastest].ms_per_1k_residues
    return (f"precision {policy!r} ran {ours:.1f} ms per 1,000 residues when measured on this node at {when}; "
            f"{fastest} ran {theirs:.1f} ({ours / theirs:.2f}x faster) and passed the cross-check's cosine: "
            "--precision auto would choose it")
