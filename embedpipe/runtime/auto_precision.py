"""``--precision auto``: the candidates a device supports, the table's prior, the choice from a
measurement on the node, and the per-node cache of that measurement (docs/precision.md,
"precision: auto").

Why measured: which policy is fastest depends on the kernels PyTorch dispatches on the real
CPU, the model's shape and the node's load, which no table follows (an AVX2-only EPYC ran the
table's int8-mixed more than 10x slower than fp32 until its int8 engines were measured too).
The embed job times each candidate on its own loaded model and records
(:mod:`embedpipe.extraction.auto_probe`), checks each one's pooled cosine to fp32 against the
cross-check's pass threshold, and runs the fastest that passes by a margin. The result is cached per node,
CPU model and flags, torch version, model, threads and device, in a directory the workflow's
jobs share, so a node measures once (:mod:`embedpipe.runtime.auto_cache`).

Why rounds, a median and a margin: one measurement per candidate, and the smallest time taken
however close the others were, chose int8-mixed four times and fp32 once in five fresh
measurements on one node. The candidates are now timed in :data:`ROUNDS` interleaved rounds
(each round times every candidate once, in a fixed order, so a slow spell on the node falls on
all of them), compared by their median round, and a policy other than fp32 is chosen only when
it is at least :data:`MARGIN` faster than every passing policy before it in :data:`ORDER`
(:func:`pick`): a near-tie keeps the earlier policy, fp32 first.

Why fp32 for a small job: a job too small to pay for the probe (:data:`PROBE_SHARE`) is not
measured. The table (:mod:`embedpipe.runtime.advice`) was measured on particular models; its
speed-ups do not carry to a model of another size (a demo run of a 2-layer model took the
table's bf16-mixed, measured at 650M, and logged less throughput than fp32 on 2 of its 3
shards), so such a job runs fp32 unless the table has a row measured on this CPU class at a
similar model size (:data:`SIMILAR_SIZE`), and says which. ``--auto-measure always`` measures
regardless of the job's size. On CUDA such a job takes the mixed policy the GPU computes
natively (:func:`prior`).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
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
#: interleaved rounds: each round times every candidate once, in :data:`ORDER`
ROUNDS = 3
#: timed passes per candidate in each round, after one warm-up pass (its runner is prepared anew
#: each round and freed after it: the probe never holds two low-precision copies of the model)
TIMED_PASSES = 1
#: the probe may cost at most this share of the job's residues; a smaller job is not measured
#: (fp32, unless the table has a row for this CPU class at a similar model size)
PROBE_SHARE = 0.10
#: a policy other than fp32 is chosen only when its median is at least this much below the
#: median of every passing policy before it in :data:`ORDER` (0.10: at least 10% faster)
MARGIN = 0.10
#: the fixed order of preference, which a near-tie goes to: fp32, the reference, first; then the
#: mixed policies with 16-bit weights (bf16 before fp16: fp32's range, so fewer records fall back);
#: int8-mixed, the furthest from fp32, last
ORDER = ("fp32", "bf16-mixed", "fp16-mixed", "int8-mixed")
#: "a similar model size": a table row is used for a job too small to measure only when the
#: model it was measured on has within this factor of the job's model's parameters (either way)
SIMILAR_SIZE = 4.0
#: how a user measures regardless of the job's size
MEASURE_ALWAYS = "--auto-measure always (workflow: auto_measure: always)"


def candidates(device: torch.device) -> tuple[str, ...]:
    """The policies auto may choose on ``device``: on the CPU :data:`CPU_CANDIDATES`; on CUDA
    fp32 and the mixed policies of the dtypes the GPU computes natively."""
    if device.type != "cuda":
        return CPU_CANDIDATES if device.type == "cpu" else ("fp32",)
    capability = torch.cuda.get_device_capability(device)
    mixed = [f"{name}-mixed" for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16))
             if capability >= CUDA_CAPABILITY[dtype]]
    return ("fp32", *mixed)


def prior(device: torch.device, cpu: cpu_features.CpuFeatures | None = None, *,
          params: int | None = None) -> tuple[str, str]:
    """(policy, why) without a measurement: a GPU by its compute capability; the CPU fp32 unless
    the table has a row measured on a real CPU of its class at a model size similar to
    ``params`` (the model's parameter count; None: not known, so fp32)."""
    if device.type == "cuda":
        policy, why = advice.cuda_choice(torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device))
        return policy, f"the table's prior: {why}"
    if device.type == "cpu":
        return advice.cpu_choice(cpu or cpu_features.detect(), params=params, similar=SIMILAR_SIZE,
                                 measure=MEASURE_ALWAYS)
    return "fp32", f"{device.type}: no measured advice for this device"


@dataclass(frozen=True)
class AutoChoice:
    """What ``auto`` resolved to on a job, and why (the store's ``precision_reason``)."""

    policy: str
    reason: str

    @classmethod
    def from_table(cls, device: torch.device, why_not: str = "no measurement on this job", *,
                   params: int | None = None) -> AutoChoice:
        """The choice of a job that does not measure (``why_not``): :func:`prior` for a model of
        ``params`` parameters. Its words depend on the node and the model only, never on the job
        (a merged store keeps one reason)."""
        policy, why = prior(device, params=params)
        return cls(policy, f"auto -> {policy}: not measured ({why_not}); {why}")


@dataclass(frozen=True)
class Timing:
    """One candidate on the probe: milliseconds per 1,000 residues (the median of its rounds:
    :meth:`from_rounds`) and its lowest pooled cosine to fp32."""

    ms_per_1k_residues: float
    min_cosine: float

    @classmethod
    def from_rounds(cls, rounds: Sequence[float], min_cosine: float) -> Timing:
        """The timing of a candidate measured in ``rounds`` (ms per 1,000 residues each): their
        median, so one round slowed by other work on the node moves nothing."""
        if not rounds:
            raise ValueError("a timing needs at least one round")
        return cls(statistics.median(rounds), min_cosine)

    def passes(self) -> bool:
        return self.min_cosine >= PASS_COSINE


def rank(name: str) -> int:
    """``name``'s place in :data:`ORDER` (a policy not listed: after them all)."""
    return ORDER.index(name) if name in ORDER else len(ORDER)


def pick(timings: Mapping[str, Timing], *, margin: float = MARGIN) -> str:
    """The policy ``auto`` runs, from each candidate's median time and cosine.

    The rule: order the candidates by :data:`ORDER` (fp32, bf16-mixed, fp16-mixed, int8-mixed;
    a policy not listed after them, by name). A candidate is *eligible* when its pooled cosine
    passes (fp32 always does: it is the reference) and its median time is at most
    ``(1 - margin)`` times the median of every passing candidate before it: at least ``margin``
    (:data:`MARGIN`, 10%) faster than each. fp32, with nothing before it, is always eligible.
    The choice is the last eligible candidate in that order; each eligible one being at least
    ``margin`` faster than every earlier eligible one, it is also the fastest of them.

    So a near-tie goes to the earlier policy: fp32 100, int8-mixed 95 ms gives fp32; fp32 100,
    bf16-mixed 95, int8-mixed 89 gives fp32 too (int8-mixed is within 10% of bf16-mixed, which
    is within 10% of fp32); fp32 100, bf16-mixed 85, int8-mixed 80 gives bf16-mixed. A
    candidate whose cosine fails is neither chosen nor compared against."""
    passing = sorted((name for name, t in timings.items() if name == "fp32" or t.passes()),
                     key=lambda name: (rank(name), name))
    eligible: list[str] = []
    for i, name in enumerate(passing):
        ms = timings[name].ms_per_1k_residues
        if all(ms <= (1.0 - margin) * timings[before].ms_per_1k_residues for before in passing[:i]):
            eligible.append(name)
    if not eligible:  # only when fp32 was not measured: the fastest passing one, ties by order
        return min(passing, key=lambda name: (timings[name].ms_per_1k_residues, rank(name), name))
    return eligible[-1]


def rule(timings: Mapping[str, Timing]) -> str:
    """Why :func:`pick` chose what it did, in words (the end of ``precision_reason``)."""
    chosen = pick(timings)
    fastest = min((name for name, t in timings.items() if name == "fp32" or t.passes()),
                  key=lambda name: (timings[name].ms_per_1k_residues, rank(name), name))
    order = ", ".join(name for name in ORDER if name in timings)
    why = (f"the median of {ROUNDS} interleaved rounds; a policy other than fp32 is chosen only when at least "
           f"{MARGIN:.0%} faster than every passing policy before it in the order {order}")
    if fastest == chosen:
        return f"{chosen} chosen ({why})"
    ms = {name: t.ms_per_1k_residues for name, t in timings.items()}
    gain = 1.0 - ms[fastest] / ms[chosen]
    blocker = next((before for before in sorted(timings, key=lambda name: (rank(name), name))
                    if (rank(before), before) < (rank(fastest), fastest) and (before == "fp32" or timings[before].passes())
                    and ms[fastest] > (1.0 - MARGIN) * ms[before]), chosen)
    if blocker == chosen:
        return f"{chosen} chosen: {fastest} was {gain:.0%} faster, short of that margin ({why})"
    return (f"{chosen} chosen: {fastest} was {gain:.0%} faster than {chosen} but {1.0 - ms[fastest] / ms[blocker]:.0%} "
            f"faster than {blocker}, short of that margin ({why})")


def describe(timings: Mapping[str, Timing]) -> str:
    """Each candidate's median time and cosine, then the rule that chose (``precision_reason``)."""
    parts = []
    for name, t in timings.items():
        verdict = "" if name == "fp32" or t.passes() else f", below the pass cosine {PASS_COSINE}: refused"
        parts.append(f"{name} {t.ms_per_1k_residues:.1f} ms per 1,000 residues (min pooled cosine to fp32 "
                     f"{t.min_cosine:.6f}{verdict})")
    return "; ".join(parts) + f"; {rule(timings)}"


def measured_note(policy: str, timings: Mapping[str, Timing], when: str) -> str:
    """The warning for a named ``policy`` where this node's own measurement chose another one
    (:func:`pick`; '' when it chose ``policy`` or ``policy`` was not measured): it replaces the
    table's warning, which must never recommend what the node measured slower."""
    if policy not in timings:
        return ""
    chosen = pick(timings)
    if chosen == policy:
        return ""
    ours, theirs = timings[policy].ms_per_1k_residues, timings[chosen].ms_per_1k_residues
    if theirs < ours:
        how = f"({ours / theirs:.2f}x faster) and passed the cross-check's cosine"
    elif timings[policy].passes():
        how = f"and {policy} was not at least {MARGIN:.0%} faster than it"
    else:
        how = f"and {policy} fell below the cross-check's pass cosine {PASS_COSINE}"
    return (f"precision {policy!r} ran {ours:.1f} ms per 1,000 residues when measured on this node at {when}; "
            f"{chosen} ran {theirs:.1f} {how}: --precision auto would choose it")
