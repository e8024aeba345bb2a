"""``--precision auto``, decided in this one module (docs/precision.md, "precision: auto"): the
candidates a device supports, the choice without a measurement from the table
(``embedpipe/data/auto_precision_table.json``, read by :mod:`embedpipe.runtime.advice`), the
probe that times each candidate through the :class:`~embedpipe.extraction.engine.Engine` on the
job's own loaded model and records, and the rules that pick from its timings. Storage lives
elsewhere: the node's cache of measurements (:mod:`embedpipe.runtime.auto_cache`) and the run's
one decision file (:mod:`embedpipe.extraction.auto_decision`).

Why measured: which policy is fastest depends on the kernels PyTorch dispatches on the real
CPU, the model's shape and the node's load, which no table follows (an AVX2-only EPYC ran the
table's int8-mixed more than 10x slower than fp32 until its int8 engines were measured too).
Why through the Engine: the probe then times exactly what the job will run (the batch layout,
the int8 kernels, the fallback of records that fail), not a stand-in.

Why rounds, a median and a margin: one measurement per candidate, the smallest time taken however
close the others were, chose int8-mixed four times and fp32 once in five fresh measurements on
one node. The candidates are timed in :data:`ROUNDS` interleaved rounds (each times every
candidate once, in :data:`ORDER`, so a slow spell falls on all of them), compared by their
median, and a policy other than fp32 is chosen only when at least :data:`MARGIN` faster than
every passing policy before it (:func:`pick`). In each round a candidate's runner is prepared,
warmed up by one pass, timed and freed: the probe never holds two low-precision copies of the
model, at the price of preparing each once a round (not part of the time compared).

Why fp32 for a small job: a job too small to pay for the probe (:data:`PROBE_SHARE`) is not
measured, and the table's speed-ups do not carry to a model of another size (a 2-layer demo
model took the table's bf16-mixed, measured at 650M, and ran slower than fp32), so it runs
fp32 unless the table has a row measured on this CPU class at a similar model size
(:data:`SIMILAR_SIZE`), and says which. On CUDA it takes the mixed policy the GPU computes
natively (:func:`prior`).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch

from embedpipe.core.cpus import CpuAllocation
from embedpipe.core.errors import EmbedpipeError
from embedpipe.core.options import AUTO_MEASURE_ALWAYS as ALWAYS
from embedpipe.core.options import EmbedOptions, Thresholds
from embedpipe.core.progress import say
from embedpipe.extraction.engine import Engine
from embedpipe.extraction.resolved import AutoChoice, ResolvedRun, resolve_run
from embedpipe.model import capabilities
from embedpipe.model.base import EmbeddingModel
from embedpipe.model.identity import ModelIdentity
from embedpipe.model.layout import ESM2_LAYOUT, TokenLayout
from embedpipe.runtime import advice, auto_cache, cpu_features
from embedpipe.runtime.auto_cache import Timing
from embedpipe.runtime.engine_override import EngineChoice
from embedpipe.runtime.precision import CUDA_CAPABILITY

Records = Sequence[tuple[str, str]]

#: the policies auto times on the CPU: the reference and the two fast CPU policies
CPU_CANDIDATES = ("fp32", "bf16-mixed", "int8-mixed")
#: the pooled cosine to fp32 a candidate must reach on the probe records: the cross-check's pass bar
PASS_COSINE = Thresholds().pass_cosine
#: the probe's records: up to this many residues, drawn across the job's first input
PROBE_RESIDUES = 2048
#: interleaved rounds: each round times every candidate once, in :data:`ORDER`
ROUNDS = 3
#: timed passes per candidate in each round, after one warm-up pass
TIMED_PASSES = 1
#: the probe may cost at most this share of the job's residues; a smaller job is not measured
PROBE_SHARE = 0.10
#: a policy other than fp32 is chosen only when its median is at least this much below the
#: median of every passing policy before it in :data:`ORDER` (0.10: at least 10% faster)
MARGIN = 0.10
#: the order of preference a near-tie goes to: fp32, the reference; the 16-bit mixed policies
#: (bf16 first: fp32's range, fewer records fall back); int8-mixed, the furthest from fp32, last
ORDER = ("fp32", "bf16-mixed", "fp16-mixed", "int8-mixed")
#: a table row is used for a job too small to measure only when the model it was measured on
#: has within this factor of the job's model's parameters (either way)
SIMILAR_SIZE = 4.0
#: how a user measures regardless of the job's size
MEASURE_ALWAYS = "auto_measure: always (decide-precision --auto-measure always; auto_measure=\"always\" in Python)"

#: the model's parameter count, which a job too small to measure compares with the table's rows
model_params = capabilities.parameter_count


# -- the candidates, and the choice without a measurement (the table) --------------------------
def candidates(device: torch.device) -> tuple[str, ...]:
    """The policies auto may choose on ``device``: on the CPU :data:`CPU_CANDIDATES`; on CUDA
    fp32 and the mixed policies of the dtypes the GPU computes natively."""
    if device.type != "cuda":
        return CPU_CANDIDATES if device.type == "cpu" else ("fp32",)
    capability = torch.cuda.get_device_capability(device)
    mixed = [f"{name}-mixed" for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16))
             if capability >= CUDA_CAPABILITY[dtype]]
    return ("fp32", *mixed)


def usable_candidates(engine: EngineChoice, device: torch.device) -> list[str]:
    """The device's candidates the engine choices allow (fair-esm's forward runs no mixed
    policy): auto never chooses one the job would then refuse."""
    return [name for name in candidates(device) if engine.refusal(name) is None]


def similar_size(a: int, b: int, factor: float) -> bool:
    """Whether parameter counts ``a`` and ``b`` are within ``factor`` of each other (either way)."""
    return a > 0 and b > 0 and max(a, b) <= factor * min(a, b)


def cpu_choice(cpu: cpu_features.CpuFeatures, *, params: int | None = None) -> tuple[str, str]:
    """The choice on the CPU without a measurement, and why: the advised policy of ``cpu``'s
    class only where its row was measured on a real CPU of the class at a model size similar
    to ``params`` (None: not known), else fp32."""
    row, words = advice.advice_for(cpu), advice.size_words
    where = f"CPU class {cpu.cpu_class} (flags: {cpu.named()})"
    if not row.trusted:
        return "fp32", (f"the table has no row measured on this CPU class: {where}: its row is {row.basis} "
                        f"({row.measured}), so fp32; {MEASURE_ALWAYS} measures regardless")
    at = words(row.model_params) if row.model_params else "an unrecorded size"
    if params is None or row.model_params is None or not similar_size(params, row.model_params, SIMILAR_SIZE):
        this = "this model's size is not known here" if params is None else f"this model has {words(params)}"
        return "fp32", (f"the table has no row for this CPU class at this model size: {where} was measured at "
                        f"{at} parameters, {this} (similar: within {SIMILAR_SIZE:g}x), so fp32; {MEASURE_ALWAYS} "
                        "measures regardless")
    measured = f"{row.factor:.2f}x fp32's speed" if row.factor else "none measured faster"
    return row.advised, (f"the table's row for this CPU class at a similar model size: {where}: "
                         f"{row.advised}, {measured} at {at} parameters (this model {words(params)}), "
                         f"on {row.measured}")


def prior(device: torch.device, cpu: cpu_features.CpuFeatures | None = None, *,
          params: int | None = None) -> tuple[str, str]:
    """(policy, why) without a measurement: a GPU by its compute capability (the table's CUDA
    rows); the CPU by :func:`cpu_choice` (``params``: the model's parameter count, None: not known)."""
    if device.type == "cuda":
        name, capability = torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device)
        policy, why = next((policy, why) for need, policy, why in advice.CUDA_CHOICES if capability >= need)
        return policy, f"the table's prior: {name}, compute capability {capability[0]}.{capability[1]}: {why}"
    if device.type == "cpu":
        return cpu_choice(cpu or cpu_features.detect(), params=params)
    return "fp32", f"{device.type}: no measured advice for this device"


def from_table(device: torch.device, why_not: str = "no measurement on this job", *,
               params: int | None = None) -> AutoChoice:
    """The choice of a job that does not measure (``why_not``): :func:`prior` for a model of
    ``params`` parameters, in words that depend on the node and the model only (a merged store
    keeps one reason)."""
    policy, why = prior(device, params=params)
    return AutoChoice(policy, f"auto -> {policy}: not measured ({why_not}); {why}")


# -- the rules that pick from a measurement ---------------------------------------------------
def passes(timing: Timing) -> bool:
    """Whether a candidate's pooled cosine to fp32 reaches :data:`PASS_COSINE`."""
    return timing.min_cosine >= PASS_COSINE


def rank(name: str) -> int:
    """``name``'s place in :data:`ORDER` (a policy not listed: after them all)."""
    return ORDER.index(name) if name in ORDER else len(ORDER)


def _passing(timings: Mapping[str, Timing]) -> list[str]:
    """The candidates whose cosine passes (fp32 always: it is the reference), in :data:`ORDER`."""
    return sorted((name for name, t in timings.items() if name == "fp32" or passes(t)),
                  key=lambda name: (rank(name), name))


def _fastest(timings: Mapping[str, Timing], names: Sequence[str]) -> str:
    return min(names, key=lambda name: (timings[name].ms_per_1k_residues, rank(name), name))


def pick(timings: Mapping[str, Timing], *, margin: float = MARGIN) -> str:
    """The policy ``auto`` runs, from each candidate's median time and cosine.

    In :data:`ORDER` (a policy not listed after them, by name), a candidate is *eligible* when
    its cosine passes (fp32 always does) and its median is at most ``(1 - margin)`` times that
    of every passing candidate before it; fp32, first, always is. The choice is the last
    eligible one, which is also the fastest of them. So a near-tie goes to the earlier policy:
    fp32 100, int8-mixed 95 ms gives fp32; fp32 100, bf16-mixed 95, int8-mixed 89 gives fp32
    too; fp32 100, bf16-mixed 85, int8-mixed 80 gives bf16-mixed. A candidate whose cosine
    fails is neither chosen nor compared against."""
    passing = _passing(timings)
    eligible = [name for i, name in enumerate(passing)
                if all(timings[name].ms_per_1k_residues <= (1.0 - margin) * timings[before].ms_per_1k_residues
                       for before in passing[:i])]
    # none only when fp32 was not measured: the fastest passing one, ties by order
    return eligible[-1] if eligible else _fastest(timings, passing)


def rule(timings: Mapping[str, Timing]) -> str:
    """Why :func:`pick` chose what it did, in words (the end of ``precision_reason``)."""
    chosen, fastest = pick(timings), _fastest(timings, _passing(timings))
    order = ", ".join(name for name in ORDER if name in timings)
    why = (f"the median of {ROUNDS} interleaved rounds; a policy other than fp32 is chosen only when at least "
           f"{MARGIN:.0%} faster than every passing policy before it in the order {order}")
    if fastest == chosen:
        return f"{chosen} chosen ({why})"
    ms = {name: t.ms_per_1k_residues for name, t in timings.items()}
    gain = 1.0 - ms[fastest] / ms[chosen]
    blocker = next((before for before in sorted(timings, key=lambda name: (rank(name), name))
                    if (rank(before), before) < (rank(fastest), fastest) and (before == "fp32" or passes(timings[before]))
                    and ms[fastest] > (1.0 - MARGIN) * ms[before]), chosen)
    if blocker == chosen:
        return f"{chosen} chosen: {fastest} was {gain:.0%} faster, short of that margin ({why})"
    return (f"{chosen} chosen: {fastest} was {gain:.0%} faster than {chosen} but {1.0 - ms[fastest] / ms[blocker]:.0%} "
            f"faster than {blocker}, short of that margin ({why})")


def describe(timings: Mapping[str, Timing]) -> str:
    """Each candidate's median time and cosine, then the rule that chose (``precision_reason``)."""
    parts = []
    for name, t in timings.items():
        verdict = "" if name == "fp32" or passes(t) else f", below the pass cosine {PASS_COSINE}: refused"
        parts.append(f"{name} {t.ms_per_1k_residues:.1f} ms per 1,000 residues (min pooled cosine to fp32 "
                     f"{t.min_cosine:.6f}{verdict})")
    return "; ".join(parts) + f"; {rule(timings)}"


def measured_note(policy: str, timings: Mapping[str, Timing], when: str) -> str:
    """The warning for a named ``policy`` where this node's own measurement chose another one
    ('' when it chose ``policy`` or did not measure it): it replaces the table's warning, which
    must never recommend what the node measured slower."""
    if policy not in timings or (chosen := pick(timings)) == policy:
        return ""
    ours, theirs = timings[policy].ms_per_1k_residues, timings[chosen].ms_per_1k_residues
    if theirs < ours:
        how = f"({ours / theirs:.2f}x faster) and passed the cross-check's cosine"
    elif passes(timings[policy]):
        how = f"and {policy} was not at least {MARGIN:.0%} faster than it"
    else:
        how = f"and {policy} fell below the cross-check's pass cosine {PASS_COSINE}"
    return (f"precision {policy!r} ran {ours:.1f} ms per 1,000 residues when measured on this node at {when}; "
            f"{chosen} ran {theirs:.1f} {how}: --precision auto would choose it")


# -- a job's decision: the node's cache, or the probe ------------------------------------------
def _key(options: EmbedOptions, engine: EngineChoice, device: torch.device, model: ModelIdentity) -> dict[str, object]:
    """The cache key: with the options and engine choices that change every candidate's work."""
    work: dict[str, object] = {name: str(getattr(options, name)) for name in
                               ("layers", "pooling", "per_residue", "storage_dtype", "long_sequences")}
    work |= {name: getattr(engine, name) for name in ("attention", "batch_layout", "attention_inputs")}
    return auto_cache.cache_key(device, json.dumps(model.fields(), sort_keys=True), torch.get_num_threads(),
                                work, candidates(device))


def _from_cache(found: auto_cache.Cached, usable: Sequence[str], directory: Path) -> AutoChoice:
    timings = {k: v for k, v in found.timings.items() if k in usable}  # what these options allow
    chosen = pick(timings)
    return AutoChoice(chosen, f"auto -> {chosen}: measured on this node at {found.measured_utc} (cache {directory}): "
                              f"{describe(timings)}")


def cached(options: EmbedOptions, engine: EngineChoice, device: torch.device, model: ModelIdentity,
           directory: Path) -> AutoChoice | None:
    """The decision a measurement already cached on this node gives, without the model loaded
    (``--reuse`` predicts a job's identity so); None when nothing usable is cached."""
    found = auto_cache.read_cached(directory, _key(options, engine, device, model)).found
    return None if found is None else _from_cache(found, usable_candidates(engine, device), directory)


def notes(run: ResolvedRun, model: ModelIdentity, directory: Path, table_notes: Sequence[str]) -> list[str]:
    """The warnings for running ``run``'s policy: from this node's measurement when one is cached
    for the model (it overrules the table), else the table's (``table_notes``); a named policy's
    run says once why a cache entry or directory was not used (auto's said so when it decided)."""
    read = auto_cache.read_cached(directory, _key(run.options, run.engine, run.device, model))
    if read.found is None:
        unused = [f"{read.problem}: not used"] if read.problem and not run.precision_requested else []
        return unused + list(table_notes)
    return [note for note in (measured_note(run.policy.name, read.found.timings, read.found.measured_utc),) if note]


def decide(loaded: EmbeddingModel, options: EmbedOptions, engine: EngineChoice, device: torch.device,
           model: ModelIdentity, records: Records, job_residues: int, directory: Path, *, threads: CpuAllocation,
           quiet: bool = True) -> AutoChoice:
    """``auto`` for this job (the job's ``measure``, asked by ``resolve_run`` with the engine
    choices it read): a cached measurement, a new one (timed here with the job's ``engine`` and
    ``threads``, then cached), or, for a job too small to pay for measuring unless
    ``--auto-measure always``, :func:`from_table`. A cache directory other users can write to is
    not used, and an unusable entry is measured anew, each with one warning."""
    usable = usable_candidates(engine, device)
    if not usable:
        raise EmbedpipeError("--precision auto: no policy it measures is allowed with these options; name one")
    key = _key(options, engine, device, model)
    sample = probe_records(records, layout=capabilities.layout_of(loaded))
    small = len(usable) == 1 or too_small(usable, sample, options, job_residues)
    params = model_params(loaded)
    if (unsafe := auto_cache.unsafe_directory(directory)) is not None:
        say(f"warning: {unsafe}: not used (nothing read from it or written to it)", quiet=quiet)
        if small:
            return _prior(device, usable, params)
        return _measured(measure_candidates(loaded, options, engine, device, model, sample, usable, threads, quiet),
                         "not cached")
    with auto_cache.measuring(directory, key):
        read = auto_cache.read_cached(directory, key)
        if read.found is not None:
            return _from_cache(read.found, usable, directory)
        if read.problem is not None:
            say(f"warning: {read.problem}: not used{'' if small else '; measured anew'}", quiet=quiet)
        if small:
            return _prior(device, usable, params)
        timings = measure_candidates(loaded, options, engine, device, model, sample, usable, threads, quiet)
        written = auto_cache.write_cached(directory, key, timings)
    if isinstance(written, str):
        if read.problem is None:  # else its one warning was said
            say(f"warning: {written}", quiet=quiet)
        return _measured(timings, "not cached")
    return _measured(timings, f"cache {written}")


def _measured(timings: dict[str, Timing], where: str) -> AutoChoice:
    policy = pick(timings)
    return AutoChoice(policy, f"auto -> {policy}: measured on this node now ({where}): {describe(timings)}")


def _prior(device: torch.device, usable: Sequence[str], params: int) -> AutoChoice:
    if len(usable) == 1:
        return AutoChoice(usable[0], f"auto -> {usable[0]}: the only policy these options allow")
    # the same words for every job too small of the run (only the node's and the model's): a
    # merged store keeps one reason
    choice = from_table(device, f"the job is too small to pay for the probe, which may cost at most "
                                f"{PROBE_SHARE:.0%} of its residues", params=params)
    if choice.policy not in usable:
        return AutoChoice("fp32", f"{choice.reason}; {choice.policy} is not allowed with these options: fp32")
    return choice


# -- the probe --------------------------------------------------------------------------------
def probe_records(records: Records, budget: int = PROBE_RESIDUES,
                  layout: TokenLayout = ESM2_LAYOUT) -> list[tuple[str, str]]:
    """Records spread evenly over ``records`` (a length-sorted shard: short to long) whose
    residues add up to at most ``budget``; the shortest record cut to ``budget`` when none fits
    (whole residues: ``layout``'s characters a residue, SaProt's pairs never split)."""
    if not records:
        return []
    budget *= layout.chars_per_residue  # in characters from here: a cut keeps whole residues
    order = sorted(range(len(records)), key=lambda i: len(records[i][1]))
    picked: list[tuple[str, str]] = []
    used = 0
    for i in order[::max(1, len(order) // 16)]:  # up to 16 lengths from across the input
        if used + len(records[i][1]) <= budget:
            picked.append(records[i])
            used += len(records[i][1])
    return picked or [(records[order[0]][0], records[order[0]][1][:budget])]


def probe_cost(usable: Sequence[str], sample: Records) -> int:
    """Residues the probe runs: every candidate, each round, its warm-up and timed passes."""
    return len(usable) * ROUNDS * (1 + TIMED_PASSES) * sum(len(s) for _, s in sample)


def too_small(usable: Sequence[str], sample: Records, options: EmbedOptions, residues: int | None) -> bool:
    """Whether work of ``residues`` (a job's, or the whole run's for its one decision) is too small
    to pay for the probe: it would cost more than :data:`PROBE_SHARE` of them; never with
    ``auto_measure: always``, nor when their count is not given."""
    if residues is None or options.auto_measure == ALWAYS:
        return False
    return probe_cost(usable, sample) > PROBE_SHARE * residues


def measure_candidates(loaded: EmbeddingModel, options: EmbedOptions, engine: EngineChoice, device: torch.device,
                       model: ModelIdentity, sample: Records, usable: Sequence[str], threads: CpuAllocation,
                       quiet: bool) -> dict[str, Timing]:
    """Each usable candidate timed on ``sample`` in :data:`ROUNDS` interleaved rounds (each
    prepared, warmed up, timed and freed before the next), its time the median of its rounds,
    its pooled cosine to fp32 from the first round (a job's decision and the run's one
    decision both measure through it). Keyed by candidate in ``usable``'s order."""
    say(f"precision auto: measuring {', '.join(usable)} on {len(sample)} records of this job, "
        f"{ROUNDS} interleaved rounds", quiet=quiet)
    runs: dict[str, ResolvedRun] = {}
    for name in usable:  # resolved once: a run holds the policy, not its prepared weights
        chosen = dataclasses.replace(options, precision=name)
        runs[name] = resolve_run(chosen, device, num_layers=loaded.num_layers, packs=capabilities.packs(loaded),
                                 model=model, width=loaded.embed_dim, loaded=loaded, threads=threads, engine=engine)
    order = sorted(usable, key=lambda name: (rank(name), name))  # the same order every round
    residues = max(1, sum(len(s) for _, s in sample))
    rounds: dict[str, list[float]] = {name: [] for name in usable}
    means: dict[str, list[dict[int, np.ndarray]]] = {}
    for _ in range(ROUNDS):
        for name in order:
            seconds, got = _time(loaded, runs[name], sample)
            rounds[name].append(seconds * 1e6 / residues)  # ms per 1,000 residues
            means.setdefault(name, got)
    return {name: Timing.from_rounds(rounds[name], 1.0 if name == "fp32" else _min_cosine(means[name], means["fp32"]))
            for name in usable}


def _time(loaded: EmbeddingModel, run: ResolvedRun, sample: Records) -> tuple[float, list[dict[int, np.ndarray]]]:
    """One round of one candidate: its runner prepared and warmed up by a pass of ``sample``,
    the best of its timed passes (seconds), each record's pooled means; the runner freed."""
    embedder = Engine(loaded, run)
    plan = embedder.plan(sample)
    results = dict(embedder.embed(sample, plan))  # warm-up: prepares the policy's weights
    best = float("inf")
    for _ in range(TIMED_PASSES):
        start = time.perf_counter()
        results = dict(embedder.embed(sample, plan))
        best = min(best, time.perf_counter() - start)
    means = [results[i].mean for i in range(len(sample))]
    del embedder, results
    gc.collect()
    return best, means


def _min_cosine(got: list[dict[int, np.ndarray]], want: list[dict[int, np.ndarray]]) -> float:
    """The lowest pooled cosine over records and stored layers, in float64 (a NaN counts as -1)."""
    lowest = 1.0
    for a, b in zip(got, want):
        for layer, vector in a.items():
            x, y = vector.astype(np.float64), b[layer].astype(np.float64)
            denominator = float(np.linalg.norm(x) * np.linalg.norm(y))
            cos = float(x @ y) / denominator if denominator > 0 else float(np.array_equal(x, y))
            lowest = min(lowest, cos if np.isfinite(cos) else -1.0)
    return lowest
