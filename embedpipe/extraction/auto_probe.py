"""``--precision auto`` measured where the job runs: each candidate policy timed on the loaded
model and records drawn from the job's own input, checked against fp32, the fastest that
passes chosen (docs/precision.md, "precision: auto"); the rules are
:mod:`embedpipe.runtime.auto_precision`, the node's cache (its one reader) :mod:`embedpipe.runtime.auto_cache`.

Why through the :class:`~embedpipe.extraction.engine.Engine`: the probe then times exactly what
the job will run (the batch layout, the int8 kernels, the fallback of records that fail), not
a stand-in.

Why rounds that prepare anew: the candidates are timed in
:data:`~embedpipe.runtime.auto_precision.ROUNDS` interleaved rounds (each round times every
candidate once, in :data:`~embedpipe.runtime.auto_precision.ORDER`), so a slow spell on a
shared node falls on every candidate rather than on whichever ran then, and the median round
decides. In each round a candidate's runner is prepared, warmed up by one pass of the probe
records (which also prepares its weights), timed for
:data:`~embedpipe.runtime.auto_precision.TIMED_PASSES` pass, and freed before the next
candidate: the probe never holds two low-precision copies of the model, at the price of
preparing each one once a round (not part of the time compared; on a 6 x 320 ESM-2 on a shared
2-core node, int8-mixed's preparation took 1-4 s against 1.4-2.6 s for a pass of the probe records).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from embedpipe.core.cpus import CpuAllocation
from embedpipe.core.errors import EmbedpipeError
from embedpipe.core.options import AUTO_MEASURE_ALWAYS as ALWAYS
from embedpipe.core.options import EmbedOptions
from embedpipe.core.progress import say
from embedpipe.extraction.engine import Engine
from embedpipe.extraction.resolved import ResolvedRun, resolve_run
from embedpipe.model import capabilities
from embedpipe.model.base import EmbeddingModel
from embedpipe.model.identity import ModelIdentity
from embedpipe.model.layout import ESM2_LAYOUT, TokenLayout
from embedpipe.runtime import auto_cache, auto_precision
from embedpipe.runtime.auto_precision import AutoChoice, Timing
from embedpipe.runtime.engine_override import EngineChoice

Records = Sequence[tuple[str, str]]


def usable_candidates(engine: EngineChoice, device: torch.device) -> list[str]:
    """The device's candidates that the engine choices allow (fair-esm's forward runs no mixed
    policy): auto chooses among those, never one the job would then refuse. The options were
    checked once, with ``auto`` (no smoothing), so they allow every policy."""
    return [name for name in auto_precision.candidates(device) if engine.refusal(name) is None]


def probe_records(records: Records, budget: int = auto_precision.PROBE_RESIDUES,
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
    step = max(1, len(order) // 16)  # up to 16 lengths from across the input
    for i in order[::step]:
        n = len(records[i][1])
        if used + n <= budget:
            picked.append(records[i])
            used += n
    return picked or [(records[order[0]][0], records[order[0]][1][:budget])]


def _cache_options(options: EmbedOptions, engine: EngineChoice) -> dict[str, object]:
    """The options and engine choices that change every candidate's work (so a cached measurement applies)."""
    work = {name: str(getattr(options, name)) for name in
            ("layers", "pooling", "per_residue", "storage_dtype", "long_sequences")}
    return work | {name: getattr(engine, name) for name in ("attention", "batch_layout", "attention_inputs")}


def _key(options: EmbedOptions, engine: EngineChoice, device: torch.device, model: ModelIdentity) -> dict[str, object]:
    return auto_cache.cache_key(device, json.dumps(model.fields(), sort_keys=True), torch.get_num_threads(),
                                    _cache_options(options, engine))


def _from_cache(found: auto_cache.Cached, usable: Sequence[str], directory: Path) -> AutoChoice:
    timings = {k: v for k, v in found.timings.items() if k in usable}  # what these options allow
    chosen = auto_precision.pick(timings)
    return AutoChoice(chosen, f"auto -> {chosen}: measured on this node at {found.measured_utc} (cache {directory}): "
                                f"{auto_precision.describe(timings)}")


def cached(options: EmbedOptions, engine: EngineChoice, device: torch.device, model: ModelIdentity,
           directory: Path) -> AutoChoice | None:
    """The decision a measurement already cached on this node gives, without the model loaded
    (``--reuse`` predicts a job's identity so); None when nothing usable is cached for this key
    (the job then decides with its model loaded, and warns there of a bad entry)."""
    found = auto_cache.read_cached(directory, _key(options, engine, device, model)).found
    return None if found is None else _from_cache(found, usable_candidates(engine, device), directory)


def notes(run: ResolvedRun, model: ModelIdentity, directory: Path, table_notes: Sequence[str]) -> list[str]:
    """The warnings for running ``run``'s policy: from this node's measurement when one is cached
    for the model (it overrules the table), else the table's (``table_notes``); a named policy's
    run says once why a cache entry or directory was not used (auto's said so when it decided)."""
    policy = run.policy.name
    read = auto_cache.read_cached(directory, _key(run.options, run.engine, run.device, model))
    if read.found is None:
        unused = [f"{read.problem}: not used"] if read.problem and not run.precision_requested else []
        return unused + list(table_notes)
    return [note for note in (auto_precision.measured_note(policy, read.found.timings, read.found.measured_utc),)
            if note]


#: the model's parameter count, which a job too small to measure compares with the table's rows
model_params = capabilities.parameter_count


def probe_cost(usable: Sequence[str], sample: Records) -> int:
    """Residues the probe runs: every candidate, each round, its warm-up and timed passes."""
    passes = auto_precision.ROUNDS * (1 + auto_precision.TIMED_PASSES)
    return len(usable) * passes * sum(len(s) for _, s in sample)


def decide(loaded: EmbeddingModel, options: EmbedOptions, engine: EngineChoice, device: torch.device,
           model: ModelIdentity, records: Records, job_residues: int, directory: Path, *, threads: CpuAllocation,
           quiet: bool = True) -> AutoChoice:
    """``auto`` for this job (asked by :func:`~embedpipe.extraction.resolved.resolve_run`, with the
    engine choices it read): a cached measurement, a new one (timed here, then cached), or,
    where the job is too small to pay for measuring and ``--auto-measure`` is not ``always``,
    fp32 unless the table has a row for this CPU class at a similar model size. Each candidate
    runs with the same ``engine`` and ``threads`` as the job. A cache directory other users can
    write to is not used, and an unusable entry is measured anew, each with one warning."""
    usable = usable_candidates(engine, device)
    if not usable:
        raise EmbedpipeError("--precision auto: no policy it measures is allowed with these options; name one")
    key = _key(options, engine, device, model)
    sample = probe_records(records, layout=capabilities.layout_of(loaded))
    cost = probe_cost(usable, sample)
    small = len(usable) == 1 or (options.auto_measure != ALWAYS and cost > auto_precision.PROBE_SHARE * job_residues)
    params = model_params(loaded)
    if (unsafe := auto_cache.unsafe_directory(directory)) is not None:
        say(f"warning: {unsafe}: not used (nothing read from it or written to it)", quiet=quiet)
        if small:
            return _prior(device, usable, params)
        timings = measure_candidates(loaded, options, engine, device, model, sample, usable, threads, quiet)
        return _measured(timings, "not cached")
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
    policy = auto_precision.pick(timings)
    return AutoChoice(policy, f"auto -> {policy}: measured on this node now ({where}): "
                              f"{auto_precision.describe(timings)}")


def measure_candidates(loaded: EmbeddingModel, options: EmbedOptions, engine: EngineChoice, device: torch.device,
             model: ModelIdentity, sample: Records, usable: Sequence[str], threads: CpuAllocation,
             quiet: bool) -> dict[str, Timing]:
    """Each usable candidate timed on ``sample`` in interleaved rounds (round r times every
    candidate once, in :data:`~embedpipe.runtime.auto_precision.ORDER`; each one's runner
    prepared, warmed up, timed and freed before the next), its time the median of its rounds,
    and its pooled cosine to fp32 (from the first round; a job's own decision and a run's one
    decision both measure through it). Keyed by candidate in ``usable``'s order."""
    say(f"precision auto: measuring {', '.join(usable)} on {len(sample)} records of this job, "
        f"{auto_precision.ROUNDS} interleaved rounds", quiet=quiet)
    runs: dict[str, ResolvedRun] = {}
    for name in usable:  # resolved once: a run holds the policy, not its prepared weights
        chosen = dataclasses.replace(options, precision=name)
        runs[name] = resolve_run(chosen, device, num_layers=loaded.num_layers, packs=capabilities.packs(loaded),
                                 model=model, width=loaded.embed_dim, loaded=loaded, threads=threads, engine=engine)
    order = sorted(usable, key=lambda name: (auto_precision.rank(name), name))  # the same order every round
    residues = max(1, sum(len(s) for _, s in sample))
    rounds: dict[str, list[float]] = {name: [] for name in usable}
    means: dict[str, list[dict[int, np.ndarray]]] = {}
    for _ in range(auto_precision.ROUNDS):
        for name in order:
            seconds, got = _time(loaded, runs[name], sample)
            rounds[name].append(seconds * 1e6 / residues)  # ms per 1,000 residues
            means.setdefault(name, got)
    return {name: Timing.from_rounds(rounds[name],
                                     1.0 if name == "fp32" else _min_cosine(means[name], means["fp32"]))
            for name in usable}


def _prior(device: torch.device, usable: Sequence[str], params: int) -> AutoChoice:
    if len(usable) == 1:
        return AutoChoice(usable[0], f"auto -> {usable[0]}: the only policy these options allow")
    # the same words for every job too small of the run (no counts of its own, only the node's
    # and the model's): a merged store keeps one reason
    choice = AutoChoice.from_table(device, f"the job is too small to pay for the probe, which may cost at most "
                                           f"{auto_precision.PROBE_SHARE:.0%} of its residues", params=params)
    if choice.policy not in usable:
        return AutoChoice("fp32", f"{choice.reason}; {choice.policy} is not allowed with these options: fp32")
    return choice


def _time(loaded: EmbeddingModel, run: ResolvedRun, sample: Records) -> tuple[float, list[dict[int, np.ndarray]]]:
    """One round of one candidate: its runner prepared and warmed up by a pass of ``sample``,
    the best of its timed passes (seconds), each record's pooled means; the runner freed."""
    embedder = Engine(loaded, run)
    plan = embedder.plan(sample)
    results = dict(embedder.embed(sample, plan))  # warm-up: prepares the policy's weights
    best = float("inf")
    for _ in range(auto_precision.TIMED_PASSES):
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
