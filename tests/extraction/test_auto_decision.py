"""``precision: auto`` decided once for a run (embedpipe/extraction/auto_decision.py): the decision
file written by ``decide-precision``, run by every job given it (``--precision auto:FILE``)
through ``resolve_run``, kept for the same key and redone for another, refused for a job of
another key, read only when well formed, and run on hardware of another class with a note.
The measurement is planted where the choice must be known in advance (the real one only has to
be recorded: no timing assertions)."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from embedpipe.core.errors import EmbedpipeError
from embedpipe.core.options import FASTA_LIMITS, EmbedOptions
from embedpipe.core.stats import DECISION_SAMPLE_FILES, spread
from embedpipe.extraction import auto_decision, auto_precision
from embedpipe.extraction.auto_decision import read_decision, split_precision
from embedpipe.extraction.run import embed_fasta
from embedpipe.model.layout import ESM2_LAYOUT
from embedpipe.runtime import cpu_features
from embedpipe.runtime.auto_cache import Timing
from embedpipe.runtime.platform import describe as describe_platform
from helpers.embed_helpers import random_sequences, write_fasta
from helpers.processes import run_cli

ROOT = Path(__file__).resolve().parents[2]
AUTO = EmbedOptions(precision="auto", device="cpu", threads=1)
#: bf16-mixed fastest and passing, int8-mixed faster but below the pass cosine: the choice is bf16-mixed,
#: neither the table's prior on most CPUs nor what this machine would measure for the tiny model
PLANTED = {"fp32": Timing(10.0, 1.0), "bf16-mixed": Timing(6.0, 0.99999), "int8-mixed": Timing(3.0, 0.99)}


@pytest.fixture
def planted(monkeypatch):
    """The decision's measurement planted (PLANTED); the calls counted."""
    calls: list[list[str]] = []

    def measure(loaded, options, engine, device, model, sample, usable, threads, quiet):
        calls.append(list(usable))
        assert sample, "the probe drew no records"
        return {name: PLANTED[name] for name in usable}
    monkeypatch.setattr(auto_decision, "measure_candidates", measure)
    return calls


@pytest.fixture
def inputs(tmp_path):
    """Two FASTAs, short then long records (shards as the workflow writes them)."""
    short = write_fasta(tmp_path / "short.fasta", random_sequences(8, (20, 40), seed=1))
    long = write_fasta(tmp_path / "long.fasta", [(f"long{i}", s) for i, (_, s) in
                                                 enumerate(random_sequences(3, (150, 200), seed=2))])
    return [short, long]


def _decide(inputs, model, out, options=AUTO) -> str:
    return auto_decision.decide_run(inputs, model=str(model), options=options, out=out, quiet=True)


def _attrs(store: Path) -> dict:
    with h5py.File(store, "r") as f:
        return {k: (v.decode() if isinstance(v, bytes) else v) for k, v in f.attrs.items()}


def test_the_decision_file_holds_the_measurement_and_its_key(tmp_path, tiny_model_path, inputs, planted):
    out = tmp_path / "decision.json"
    said = _decide(inputs, tiny_model_path, out)
    data = json.loads(out.read_text())
    assert planted == [list(auto_precision.CPU_CANDIDATES)]
    # the choice recomputed from the file's own candidates: the fastest passing one
    timings = {k: Timing(v["ms_per_1k_residues"], v["min_cosine"]) for k, v in data["candidates"].items()}
    passing = [k for k, t in timings.items() if t.min_cosine >= auto_precision.PASS_COSINE]
    assert data["policy"] == min(passing, key=lambda k: timings[k].ms_per_1k_residues) == "bf16-mixed"
    assert data["reason"].startswith("auto -> bf16-mixed: decided once for the run on ")
    assert "int8-mixed 3.0 ms per 1,000 residues (min pooled cosine to fp32 0.990000, below the pass cosine" \
        in data["reason"]
    assert said.startswith(f"decided bf16-mixed for the run -> {out}")
    # the key: the model's weights (the checkpoint's own bytes) and the options as given
    assert data["key"]["model"]["model_sha256"] == hashlib.sha256(tiny_model_path.read_bytes()).hexdigest()
    assert data["key"]["options"]["layers"] == [-1] and data["key"]["device"] == "cpu"
    assert not {"threads", "tokens_per_batch", "precision", "auto_cache"} & set(data["key"]["options"])
    # where and on what it was decided
    features = cpu_features.detect()
    assert (data["cpu_class"], data["threads"], data["torch"], data["gpu"]) == (
        features.cpu_class, 1, torch.__version__, "")
    assert data["node"] == os.uname().nodename and data["platform"] == describe_platform(torch.device("cpu"))
    # records drawn from both files: the long ones too
    assert data["sample"]["records"] >= 2 and data["sample"]["residues"] > 150


def test_every_job_given_the_decision_runs_it(tmp_path, tiny_model_path, inputs, planted):
    out = tmp_path / "decision.json"
    _decide(inputs, tiny_model_path, out)
    decision = json.loads(out.read_text())
    stores = []
    for k, records in enumerate([random_sequences(2, (10, 12), seed=5), random_sequences(30, (50, 90), seed=6)]):
        fasta = write_fasta(tmp_path / f"job{k}.fasta", records)
        stores.append(tmp_path / f"job{k}.h5")
        embed_fasta(fasta, model=str(tiny_model_path), out=stores[-1], options=AUTO, quiet=True,
                    decision=read_decision(out))
    assert planted == [list(auto_precision.CPU_CANDIDATES)]  # measured once, by the decision: no job measured
    for store in stores:
        attrs = _attrs(store)
        assert (attrs["precision_policy"], attrs["precision_requested"], attrs["precision_reason"]) == (
            "bf16-mixed", "auto", decision["reason"])


def test_the_same_key_is_kept_and_another_decided_again(tmp_path, tiny_model_path, inputs, planted):
    out = tmp_path / "decision.json"
    _decide(inputs, tiny_model_path, out)
    before = out.read_bytes()
    os.utime(out, (1_000_000_000, 1_000_000_000))
    said = _decide(inputs, tiny_model_path, out, EmbedOptions(precision="auto", device="cpu", threads=2))
    assert said.startswith(f"kept {out}") and out.read_bytes() == before  # threads decide no numbers
    assert out.stat().st_mtime > 1_000_000_000  # renewed: newer than the inputs that reran it
    assert len(planted) == 1
    _decide(inputs, tiny_model_path, out, EmbedOptions(precision="auto", device="cpu", threads=1, layers=(0, -1)))
    assert len(planted) == 2 and json.loads(out.read_text())["key"]["options"]["layers"] == [0, -1]


def test_a_run_too_small_to_pay_for_the_probe_is_not_measured_unless_always(tmp_path, tiny_model_path, inputs,
                                                                             planted):
    """The job's rule for the whole run: the probe may cost at most PROBE_SHARE of the run's
    residues. A smaller run takes fp32 or the table's row (what ``prior`` says for this CPU and
    model size), holds no invented times, and every job runs it; ``always`` measures it."""
    out = tmp_path / "decision.json"
    sample = auto_decision.sample_records(inputs, FASTA_LIMITS, ESM2_LAYOUT)
    cost = len(auto_precision.CPU_CANDIDATES) * auto_precision.ROUNDS * (1 + auto_precision.TIMED_PASSES) \
        * sum(len(s) for _, s in sample)  # the probe's residues, counted here
    small, large = int(cost / auto_precision.PROBE_SHARE) - 1, int(cost / auto_precision.PROBE_SHARE) + 1
    said = auto_decision.decide_run(inputs, model=str(tiny_model_path), options=AUTO, out=out, run_residues=small,
                                    quiet=True)
    data = json.loads(out.read_text())
    from embedpipe.model import load_model
    policy, why = auto_precision.prior(torch.device("cpu"),
                                       params=auto_precision.model_params(load_model(str(tiny_model_path))))
    assert planted == [] and data["candidates"] == {} and data["policy"] == policy, said
    assert data["reason"].startswith(f"auto -> {policy}: not measured (the run is too small to pay for the probe, "
                                     f"which may cost at most 10% of its residues); {why} (decided once for the run")
    store = tmp_path / "job.h5"
    embed_fasta(inputs[0], model=str(tiny_model_path), out=store, options=AUTO, quiet=True, decision=read_decision(out))
    assert (_attrs(store)["precision_policy"], _attrs(store)["precision_reason"]) == (policy, data["reason"])
    # kept on a rerun of the same run; measured once asked to, whatever the size
    assert auto_decision.decide_run(inputs, model=str(tiny_model_path), options=AUTO, out=out, run_residues=small,
                                    quiet=True).startswith("kept")
    always = EmbedOptions(precision="auto", device="cpu", threads=1, auto_measure="always")
    auto_decision.decide_run(inputs, model=str(tiny_model_path), options=always, out=out, run_residues=small,
                             quiet=True)
    assert len(planted) == 1 and json.loads(out.read_text())["policy"] == "bf16-mixed"
    # a run just large enough measures without being asked
    auto_decision.decide_run(inputs, model=str(tiny_model_path), options=AUTO, out=tmp_path / "large.json",
                             run_residues=large, quiet=True)
    assert len(planted) == 2


def test_a_job_of_other_options_or_another_model_is_refused(tmp_path, tiny_model_path, model_factory, inputs,
                                                              planted):
    out = tmp_path / "decision.json"
    _decide(inputs, tiny_model_path, out)
    fasta = inputs[0]
    with pytest.raises(EmbedpipeError) as refused:
        embed_fasta(fasta, model=str(tiny_model_path), out=tmp_path / "a.h5", quiet=True, decision=read_decision(out),
                    options=EmbedOptions(precision="auto", device="cpu", threads=1, per_residue=True))
    assert str(refused.value) == (f"--precision auto:{out}: decided for other options (per_residue) than this job's; "
                                  "run `embedpipe decide-precision` for these, or give --precision auto")
    with pytest.raises(EmbedpipeError, match=rf"auto:{out}: decided for another model than this job's"):
        embed_fasta(fasta, model=str(model_factory(seed=3)), out=tmp_path / "b.h5", quiet=True,
                    decision=read_decision(out), options=AUTO)
    assert not (tmp_path / "a.h5").exists() and not (tmp_path / "b.h5").exists()


def test_a_job_on_another_hardware_class_runs_the_decision_and_says_so(tmp_path, tiny_model_path, inputs, planted,
                                                                        capsys):
    out = tmp_path / "decision.json"
    _decide(inputs, tiny_model_path, out)
    data = json.loads(out.read_text())
    here = cpu_features.detect().cpu_class
    elsewhere = "amx" if here != "amx" else "avx2"
    out.write_text(json.dumps(data | {"cpu_class": elsewhere, "cpu_model": "another CPU"}))
    store = tmp_path / "a.h5"
    embed_fasta(inputs[0], model=str(tiny_model_path), out=store, options=AUTO, quiet=False, decision=read_decision(out))
    attrs = _attrs(store)
    note = (f"run here on cpu {here}, another class than the decision's (cpu {elsewhere}), which the run's one "
            "decision keeps (this job's platform is recorded as its own)")
    assert attrs["precision_policy"] == data["policy"]
    assert attrs["precision_reason"] == f"{data['reason']}; {note}"
    assert attrs["platform"] == describe_platform(torch.device("cpu"))  # its own, not the decision's
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: precision auto")]
    assert warnings == [f"warning: precision auto: {note}"]


@pytest.mark.parametrize("text, what", [
    ("{not json", "not valid JSON"),
    ('{"format": "something else"}', 'no "format": "embedpipe.precision-decision"'),
    ("[1, 2]", 'no "format": "embedpipe.precision-decision"'),
])
def test_a_damaged_or_foreign_file_is_one_line_naming_it(tmp_path, text, what):
    path = tmp_path / "decision.json"
    path.write_text(text)
    with pytest.raises(EmbedpipeError) as refused:
        read_decision(path)
    assert str(refused.value) == (f"{path}: not a precision decision embedpipe writes ({what}); delete it and run "
                                  "`embedpipe decide-precision` again")


def test_a_tampered_decision_is_refused(tmp_path, tiny_model_path, inputs, planted):
    out = tmp_path / "decision.json"
    _decide(inputs, tiny_model_path, out)
    data = json.loads(out.read_text())
    for change, what in [({"policy": "fp16"}, "its policy is not one of its candidates"),
                         ({"candidates": data["candidates"] | {"fp32": {"ms_per_1k_residues": -1, "min_cosine": 1}}},
                          "the timing of fp32 is not a positive time"),
                         ({"reason": "auto -> fp32: planted"}, "its reason does not name its policy"),
                         ({"extra": 1}, "other fields than a decision's")]:
        out.write_text(json.dumps(data | change))
        with pytest.raises(EmbedpipeError, match=rf"^{out}: not a precision decision embedpipe writes \({what}"):
            read_decision(out)
    # decide-precision refuses to overwrite what it cannot read (it may not be its file)
    with pytest.raises(EmbedpipeError, match=rf"^{out}: not a precision decision"):
        _decide(inputs, tiny_model_path, out)
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    with pytest.raises(EmbedpipeError, match="not a regular file"):
        read_decision(fifo)


def test_precision_auto_file_is_split_from_the_policy() -> None:
    assert split_precision("auto:out/precision-decision.json") == ("auto", Path("out/precision-decision.json"))
    assert split_precision("auto") == ("auto", None)
    assert split_precision("int8-mixed") == ("int8-mixed", None)
    with pytest.raises(EmbedpipeError, match="needs the decision file"):
        split_precision("auto:")


def test_the_probe_draws_from_files_spread_over_the_whole_input(tmp_path):
    # 40 files, file k holding one record of 10 + 10k residues
    fastas = [write_fasta(tmp_path / f"s{k:02d}.fasta", [(f"r{k}", "A" * (10 + 10 * k))]) for k in range(40)]
    lengths = sorted(len(s) for _, s in auto_decision.sample_records(fastas, FASTA_LIMITS, ESM2_LAYOUT))
    assert sum(lengths) <= auto_precision.PROBE_RESIDUES
    assert lengths[0] == 10 and lengths[-1] > 10 + 10 * 15  # the first file, and beyond the first 16
    picked = spread(list(range(40)), DECISION_SAMPLE_FILES)
    assert picked[0] == 0 and picked[-1] == 39 and len(picked) == DECISION_SAMPLE_FILES
    assert np.all(np.diff(picked) >= 2)  # evenly spaced over all 40
    for n in range(0, 50):
        once = spread(list(range(n)), 16)
        assert spread(once, 16) == once and len(once) == min(n, 16) and len(set(once)) == len(once)
        assert not once or (once[0], once[-1]) == (0, n - 1)


def test_the_rule_draws_as_many_shards_as_the_command_reads() -> None:
    common = (ROOT / "workflows" / "rules" / "common.smk").read_text()
    assert "spread(shard_fastas(), workflow_stats.DECISION_SAMPLE_FILES)" in common  # the one constant
    assert not re.search(r"^\w+ = 16\b", common, re.M)  # no copy of it


def test_the_command_line_refuses_a_mismatch_in_one_line(tmp_path, tiny_model_path, inputs):
    out = tmp_path / "decision.json"
    decided = run_cli("decide-precision", *map(str, inputs), "--model", str(tiny_model_path), "--out", str(out),
                      "--device", "cpu", "--threads", "1", "-q")
    assert decided.returncode == 0, decided.stderr
    data = read_decision(out)
    assert data.policy in auto_precision.CPU_CANDIDATES
    ran = run_cli("embed", str(inputs[0]), "--model", str(tiny_model_path), "--out", str(tmp_path / "a.h5"),
                  "--precision", f"auto:{out}", "--device", "cpu", "--threads", "1", "--layers", "0", "-q")
    assert ran.returncode != 0
    assert ran.stderr.strip().splitlines() == [
        f"embedpipe: error: --precision auto:{out}: decided for other options (layers) than this job's; "
        "run `embedpipe decide-precision` for these, or give --precision auto"]
