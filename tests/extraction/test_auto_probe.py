"""``--precision auto`` measured on the node (embedpipe/extraction/auto_precision.py): the faster of two
planted policies is chosen, one that fails the cosine is refused, the measurement is cached
per node and key and reused by the next job, a job too small for the probe takes the table's
prior, and the store records what was measured. No timing assertions: the planted timings
decide, the real ones only have to be recorded."""

from __future__ import annotations

import dataclasses
import json
import socket

import h5py
import numpy as np
import pytest
import torch

from embedpipe.core.cpus import thread_count
from embedpipe.core.options import EmbedOptions
from embedpipe.extraction import auto_precision
from embedpipe.model import load_model
from embedpipe.model.identity import ModelIdentity
from embedpipe.runtime import advice, auto_cache, cpu_features
from embedpipe.runtime.engine_override import EngineChoice
from helpers.embed_helpers import embed_store, random_sequences

CPU = torch.device("cpu")
AUTO = EmbedOptions(precision="auto", device="cpu")
RECORDS = random_sequences(12, (20, 80), seed=11)
#: the timed runs of one measurement: every CPU candidate once a round
MEASURED = len(auto_precision.CPU_CANDIDATES) * auto_precision.ROUNDS


def _planted(seconds: dict[str, float], off: tuple[str, ...] = ()):
    """A stand-in for one candidate's timed passes: planted seconds; pooled means equal to
    fp32's, or (for ``off``) turned by a large angle (cosine about 0.9)."""
    calls: list[str] = []

    def timed(loaded, run, sample):
        name = run.policy.name
        calls.append(name)
        rng = np.random.default_rng(0)
        means = [{layer: rng.standard_normal(8).astype(np.float32) for layer in run.layers} for _ in sample]
        if name in off:
            for m in means:
                for layer, v in m.items():
                    m[layer] = v + 0.5 * np.linalg.norm(v) * np.eye(8, dtype=np.float32)[0]
        return seconds[name], means
    return timed, calls


@pytest.fixture
def loaded(tiny_model_path):
    return load_model(str(tiny_model_path))


def _decide(loaded, tmp_path, options=AUTO, model=None, residues=10**9):
    model = model or ModelIdentity(loaded.sha256, True, {}, loaded.family)
    return auto_precision.decide(loaded, options, EngineChoice(), CPU, model, RECORDS, residues, tmp_path / "cache",
                             threads=thread_count(None))


def test_the_fastest_passing_policy_is_chosen_and_a_failing_one_refused(loaded, tmp_path, monkeypatch) -> None:
    timed, calls = _planted({"fp32": 1.0, "bf16-mixed": 0.3, "int8-mixed": 0.6}, off=("bf16-mixed",))
    monkeypatch.setattr(auto_precision, "_time", timed)
    choice = _decide(loaded, tmp_path)
    assert sorted(calls) == sorted(auto_precision.CPU_CANDIDATES * auto_precision.ROUNDS)  # once a round each
    assert choice.policy == "int8-mixed"  # bf16-mixed was faster but below the pass cosine
    assert choice.reason.startswith("auto -> int8-mixed: measured on this node now (cache ")
    assert "bf16-mixed" in choice.reason and "below the pass cosine 0.999: refused" in choice.reason
    residues = sum(len(s) for _, s in auto_precision.probe_records(RECORDS))
    assert f"int8-mixed {0.6 * 1e6 / residues:.1f} ms per 1,000 residues" in choice.reason


def test_the_cache_is_reused_by_the_next_job_and_measured_again_when_a_key_changes(loaded, tmp_path,
                                                                                   monkeypatch) -> None:
    timed, calls = _planted({"fp32": 1.0, "bf16-mixed": 0.5, "int8-mixed": 0.7})
    monkeypatch.setattr(auto_precision, "_time", timed)
    first = _decide(loaded, tmp_path)
    assert first.policy == "bf16-mixed" and len(calls) == MEASURED
    again = _decide(loaded, tmp_path)  # the next job on the node: read, not measured
    assert again.policy == "bf16-mixed" and len(calls) == MEASURED
    assert again.reason.startswith("auto -> bf16-mixed: measured on this node at ")
    other_model = ModelIdentity("f" * 64, True, {}, loaded.family)
    saved = torch.get_num_threads()
    changes = {
        "model": lambda: _decide(loaded, tmp_path, model=other_model),
        "layers": lambda: _decide(loaded, tmp_path, options=dataclasses.replace(AUTO, layers=(0, -1))),
        "node": lambda: (monkeypatch.setattr(socket, "gethostname", lambda: "another-node"), _decide(loaded, tmp_path)),
        "threads": lambda: (torch.set_num_threads(1 if saved != 1 else 2), _decide(loaded, tmp_path)),
        "torch": lambda: (monkeypatch.setattr(torch, "__version__", "0.0.0-other"), _decide(loaded, tmp_path)),
    }
    try:
        for what, change in changes.items():
            before = len(calls)
            change()
            assert len(calls) == before + MEASURED, what  # a new key: measured again
    finally:
        torch.set_num_threads(saved)
    entries = list((tmp_path / "cache").glob("*.json"))
    assert len(entries) == 1 + len(changes)
    assert {json.loads(p.read_text())["key"]["version"] for p in entries} == {auto_cache.CACHE_VERSION}


def test_a_job_too_small_for_the_probe_runs_fp32_where_the_table_has_no_row_at_its_size(loaded, tmp_path,
                                                                                      monkeypatch) -> None:
    timed, calls = _planted({"fp32": 1.0, "bf16-mixed": 0.5, "int8-mixed": 0.7})
    monkeypatch.setattr(auto_precision, "_time", timed)
    small = sum(len(s) for _, s in RECORDS)
    choice = _decide(loaded, tmp_path, residues=small)
    assert calls == []  # nothing measured
    params = auto_precision.model_params(loaded)
    assert params < 10**5  # the 2-layer test model: no table row is within 4x of it
    want, why = auto_precision.prior(CPU, params=params)
    assert choice.policy == want == "fp32"
    assert choice.reason == (f"auto -> fp32: not measured (the job is too small to pay for the probe, which may cost "
                             f"at most 10% of its residues); {why}")
    assert "the table has no row" in why and "--auto-measure always" in why
    assert not list((tmp_path / "cache").glob("*.json"))  # no measurement cached from a prior
    again = _decide(loaded, tmp_path, residues=small // 2)  # another job of the run: the same words
    assert again == choice


AVX2 = cpu_features.CpuFeatures(frozenset({"avx2"}))
ESM2_35M = 35_000_000  # the model the table's AVX2 row was measured on ("12 x 480 ESM-2")


def test_a_job_too_small_takes_a_table_row_measured_at_a_similar_model_size(loaded, tmp_path, monkeypatch) -> None:
    timed, calls = _planted({"fp32": 1.0, "bf16-mixed": 0.5, "int8-mixed": 0.7})
    monkeypatch.setattr(auto_precision, "_time", timed)
    monkeypatch.setattr(cpu_features, "detect", lambda: AVX2)  # a row measured on a real AVX2 EPYC at 35M
    row = advice.ADVICE["avx2"]
    assert row.trusted and row.model_params == ESM2_35M
    for params, want in [(ESM2_35M // 4, "int8-mixed"), (ESM2_35M * 4, "int8-mixed"),
                         (ESM2_35M // 5, "fp32"), (ESM2_35M * 5, "fp32")]:
        monkeypatch.setattr(auto_precision, "model_params", lambda loaded, params=params: params)
        choice = _decide(loaded, tmp_path, residues=1)
        assert choice.policy == want, params
        if want == "fp32":
            assert "the table has no row for this CPU class at this model size" in choice.reason
        else:
            assert "the table's row for this CPU class at a similar model size: CPU class avx2" in choice.reason
    assert calls == []


def test_auto_measure_always_measures_a_small_job(loaded, tmp_path, monkeypatch) -> None:
    timed, calls = _planted({"fp32": 1.0, "bf16-mixed": 0.5, "int8-mixed": 0.7})
    monkeypatch.setattr(auto_precision, "_time", timed)
    always = dataclasses.replace(AUTO, auto_measure="always")
    choice = _decide(loaded, tmp_path, options=always, residues=1)
    assert len(calls) == MEASURED and choice.policy == "bf16-mixed"
    assert choice.reason.startswith("auto -> bf16-mixed: measured on this node now (cache ")
    assert _decide(loaded, tmp_path, residues=1).policy == "bf16-mixed"  # the cache serves auto too: one key
    assert len(calls) == MEASURED


def test_the_candidates_are_timed_in_interleaved_rounds_in_a_fixed_order(loaded, tmp_path, monkeypatch) -> None:
    """Round r times every candidate once, fp32 first, and frees each one's embedder before the
    next: never two candidates' runners alive at once."""
    import weakref

    from embedpipe.extraction import engine

    alive: list[weakref.ref] = []
    order: list[str] = []
    real = auto_precision._time

    def recorded(loaded, run, sample):
        assert not [r for r in alive if r() is not None], "an earlier candidate's embedder is still alive"
        made = []
        original = engine.Engine.__init__

        def init(self, *a, **k):
            original(self, *a, **k)
            made.append(weakref.ref(self))
        monkeypatch.setattr(engine.Engine, "__init__", init)
        try:
            result = real(loaded, run, sample)
        finally:
            monkeypatch.setattr(engine.Engine, "__init__", original)
        alive.extend(made)
        order.append(run.policy.name)
        return result

    monkeypatch.setattr(auto_precision, "_time", recorded)
    timings = auto_precision.measure_candidates(loaded, AUTO, EngineChoice(), CPU,
                                            ModelIdentity(loaded.sha256, True, {}, loaded.family),
                                            auto_precision.probe_records(RECORDS), list(auto_precision.CPU_CANDIDATES),
                                            thread_count(None), True)
    assert order == ["fp32", "bf16-mixed", "int8-mixed"] * auto_precision.ROUNDS
    assert list(timings) == list(auto_precision.CPU_CANDIDATES) and timings["fp32"].min_cosine == 1.0
    assert all(t.ms_per_1k_residues > 0 and auto_precision.passes(t) for t in timings.values())  # the tiny model: all pass


def test_the_median_round_is_compared_so_one_slow_round_moves_nothing(loaded, tmp_path, monkeypatch) -> None:
    """A slow spell on the node during one round of fp32's (5x) does not hand the choice to a
    policy that is otherwise no faster."""
    slow = iter([5.0, 1.0, 1.0])

    def timed(loaded, run, sample):
        name = run.policy.name
        seconds = next(slow) if name == "fp32" else {"bf16-mixed": 1.2, "int8-mixed": 0.98}[name]
        return seconds, [{layer: np.ones(8, dtype=np.float32) for layer in run.layers} for _ in sample]
    monkeypatch.setattr(auto_precision, "_time", timed)
    choice = _decide(loaded, tmp_path)
    assert choice.policy == "fp32", choice.reason
    assert "fp32 chosen: int8-mixed was 2% faster, short of that margin" in choice.reason


def test_three_fresh_decisions_on_one_quiet_node_agree(loaded, tmp_path, monkeypatch) -> None:
    """Three real probes of the tiny model, each in a fresh cache (so measured anew), their times
    planted as a quiet node's: int8-mixed 3% faster than fp32, each run jittered by up to 8%
    and one round of a random candidate slowed 3x. The margin rule keeps fp32 each time."""
    import random

    base = {"fp32": 1.0, "bf16-mixed": 1.3, "int8-mixed": 0.97}
    real = auto_precision._time
    choices = []
    for probe in range(3):
        rng = random.Random(probe)
        outlier = (rng.randrange(auto_precision.ROUNDS), rng.choice(list(base)))
        count = dict.fromkeys(base, 0)

        def timed(loaded, run, sample, rng=rng, outlier=outlier, count=count):
            name = run.policy.name
            _, means = real(loaded, run, sample)  # the real run: its pooled means give the cosine
            slowed = 3.0 if (count[name], name) == outlier else 1.0
            count[name] += 1
            return base[name] * rng.uniform(0.92, 1.08) * slowed, means
        monkeypatch.setattr(auto_precision, "_time", timed)
        choices.append(_decide(loaded, tmp_path / f"fresh-{probe}"))
        assert all(n == auto_precision.ROUNDS for n in count.values())
    assert [c.policy for c in choices] == ["fp32"] * 3, [c.reason for c in choices]
    assert all(c.reason.startswith("auto -> fp32: measured on this node now (cache ") for c in choices)


def test_the_probe_draws_records_across_the_input_within_its_budget() -> None:
    records = [(f"r{i}", "A" * n) for i, n in enumerate(range(10, 2010, 10))]
    sample = auto_precision.probe_records(records, budget=2048)
    lengths = [len(s) for _, s in sample]
    assert sum(lengths) <= 2048 and len(sample) > 3 and max(lengths) > 5 * min(lengths)  # short to long
    assert auto_precision.probe_records([("long", "A" * 5000)], budget=2048) == [("long", "A" * 2048)]


def test_a_measured_auto_store_records_the_measurement_and_the_next_job_reads_it(tiny_model_path, tmp_path,
                                                                                 monkeypatch) -> None:
    cache = str(tmp_path / "cache")  # auto_measure="always": the tiny test job measures for real
    first = embed_store(tmp_path, tiny_model_path, RECORDS, "first", precision="auto", device="cpu", auto_cache=cache,
                        auto_measure="always")
    second = embed_store(tmp_path, tiny_model_path, RECORDS, "second", precision="auto", device="cpu", auto_cache=cache)
    with h5py.File(first, "r") as f, h5py.File(second, "r") as g:
        policy = str(f.attrs["precision_policy"])
        assert policy in auto_precision.CPU_CANDIDATES and f.attrs["precision_requested"] == "auto"
        reason = str(f.attrs["precision_reason"])
        assert reason.startswith(f"auto -> {policy}: measured on this node now (cache ")
        for name in auto_precision.CPU_CANDIDATES:  # every candidate's time and cosine
            assert f"{name} " in reason and "ms per 1,000 residues (min pooled cosine to fp32" in reason
        assert str(g.attrs["precision_reason"]).startswith(f"auto -> {policy}: measured on this node at ")
        assert g.attrs["precision_policy"] == policy and g.attrs["embed_identity"] == f.attrs["embed_identity"]
        assert json.loads(f.attrs["embed_identity"])["precision"] == policy  # the identity holds what ran
        assert set(np.asarray(f["precision_used"]).astype(str)) <= {policy, "fp32"}


def test_a_named_policy_is_warned_from_the_node_measurement_not_the_table() -> None:
    timings = {"fp32": auto_cache.Timing(100.0, 1.0), "bf16-mixed": auto_cache.Timing(80.0, 0.9999),
               "int8-mixed": auto_cache.Timing(50.0, 0.9)}  # int8 fastest but fails the cosine
    note = auto_precision.measured_note("fp32", timings, "2026-12-02T00:00:00Z")
    assert "bf16-mixed ran 80.0 (1.25x faster)" in note and "int8" not in note
    assert auto_precision.measured_note("bf16-mixed", timings, "then") == ""  # the fastest that passes
    assert auto_precision.measured_note("amp-bf16", timings, "then") == ""  # not measured: nothing to say
