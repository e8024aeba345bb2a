"""``--precision auto`` measured on the node (embedpipe/embed/auto_probe.py): the faster of two
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
from embedpipe.embed import auto_probe
from embedpipe.model import load_model
from embedpipe.model.identity import ModelIdentity
from embedpipe.runtime import advice, auto_cache, auto_precision, cpu_features
from embedpipe.runtime.engine_override import EngineChoice
from helpers.embed_helpers import embed_store, random_sequences

CPU = torch.device("cpu")
AUTO = EmbedOptions(precision="auto", device="cpu")
RECORDS = random_sequences(12, (20, 80), seed=11)


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
    return auto_probe.decide(loaded, options, EngineChoice(), CPU, model, RECORDS, residues, tmp_path / "cache",
                             threads=thread_count(None))


def test_the_fastest_passing_policy_is_chosen_and_a_failing_one_refused(loaded, tmp_path, monkeypatch) -> None:
    timed, calls = _planted({"fp32": 1.0, "bf16-mixed": 0.3, "int8-mixed": 0.6}, off=("bf16-mixed",))
    monkeypatch.setattr(auto_probe, "_time", timed)
    choice = _decide(loaded, tmp_path)
    assert sorted(calls) == sorted(auto_precision.CPU_CANDIDATES)  # each candidate measured once
    assert choice.policy == "int8-mixed"  # bf16-mixed was faster but below the pass cosine
    assert choice.reason.startswith("auto -> int8-mixed: measured on this node now (cache ")
    assert "bf16-mixed" in choice.reason and "below the pass cosine 0.999: refused" in choice.reason
    residues = sum(len(s) for _, s in auto_probe.probe_records(RECORDS))
    assert f"int8-mixed {0.6 * 1e6 / residues:.1f} ms per 1,000 residues" in choice.reason


def test_the_cache_is_reused_by_the_next_job_and_measured_again_when_a_key_changes(loaded, tmp_path,
                                                                                   monkeypatch) -> None:
    timed, calls = _planted({"fp32": 1.0, "bf16-mixed": 0.5, "int8-mixed": 0.7})
    monkeypatch.setattr(auto_probe, "_time", timed)
    first = _decide(loaded, tmp_path)
    assert first.policy == "bf16-mixed" and len(calls) == 3
    again = _decide(loaded, tmp_path)  # the next job on the node: read, not measured
    assert again.policy == "bf16-mixed" and len(calls) == 3
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
            assert len(calls) == before + 3, what  # a new key: measured again
    finally:
        torch.set_num_threads(saved)
    entries = list((tmp_path / "cache").glob("*.json"))
    assert len(entries) == 1 + len(changes)
    assert {json.loads(p.read_text())["key"]["version"] for p in entries} == {auto_cache.CACHE_VERSION}


def test_a_job_too_small_for_the_probe_takes_the_table_prior(loaded, tmp_path, monkeypatch) -> None:
    timed, calls = _planted({"fp32": 1.0, "bf16-mixed": 0.5, "int8-mixed": 0.7})
    monkeypatch.setattr(auto_probe, "_time", timed)
    small = sum(len(s) for _, s in RECORDS)
    choice = _decide(loaded, tmp_path, residues=small)
    assert calls == []  # nothing measured
    want, why = advice.cpu_choice(cpu_features.detect())
    assert choice.policy == want
    assert choice.reason.startswith(f"auto -> {want}: not measured (the job is too small to pay for the probe")
    assert choice.reason.endswith(why)
    assert not list((tmp_path / "cache").glob("*.json"))  # no measurement cached from a prior


def test_the_probe_draws_records_across_the_input_within_its_budget() -> None:
    records = [(f"r{i}", "A" * n) for i, n in enumerate(range(10, 2010, 10))]
    sample = auto_probe.probe_records(records, budget=2048)
    lengths = [len(s) for _, s in sample]
    assert sum(lengths) <= 2048 and len(sample) > 3 and max(lengths) > 5 * min(lengths)  # short to long
    assert auto_probe.probe_records([("long", "A" * 5000)], budget=2048) == [("long", "A" * 2048)]


def test_a_measured_auto_store_records_the_measurement_and_the_next_job_reads_it(tiny_model_path, tmp_path,
                                                                                 monkeypatch) -> None:
    monkeypatch.setattr(auto_precision, "PROBE_SHARE", 10.0)  # the tiny test job measures for real
    cache = str(tmp_path / "cache")
    first = embed_store(tmp_path, tiny_model_path, RECORDS, "first", precision="auto", device="cpu", auto_cache=cache)
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
    timings = {"fp32": auto_precision.Timing(100.0, 1.0), "bf16-mixed": auto_precision.Timing(80.0, 0.9999),
               "int8-mixed": auto_precision.Timing(50.0, 0.9)}  # int8 fastest but fails the cosine
    note = auto_precision.measured_note("fp32", timings, "2026-12-02T00:00:00Z")
    assert "bf16-mixed ran 80.0 (1.25x faster)" in note and "int8" not in note
    assert auto_precision.measured_note("bf16-mixed", timings, "then") == ""  # the fastest that passes
    assert auto_precision.measured_note("amp-bf16", timings, "then") == ""  # not measured: nothing to say
