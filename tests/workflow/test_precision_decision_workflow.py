"""``precision: auto`` decided once per workflow run (docs/precision.md, "One decision per run"):
rule decide_precision runs before any embed job, every store of the run records its policy and
reason, a small group that runs first runs it too (it used to take the table's prior while a
large group measured, and merge refused the mix), a rerun keeps it, and a change of the model or
of ``layers`` decides again."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import pytest

from embedpipe.extraction import auto_precision
from embedpipe.runtime.auto_cache import Timing
from helpers.workflow_helpers import demo_config, snakemake, validate

pytestmark = pytest.mark.slow

MERGED = "out/embeddings.h5"


def _run(workdir: Path, config: Path, *targets: str) -> str:
    proc = snakemake(workdir, "--cores", "1", "--printshellcmds", *targets, configfile=config, timeout=600)
    return proc.stdout + proc.stderr


def _stores(workdir: Path) -> dict[str, dict]:
    found = {}
    for path in sorted((workdir / "out" / "stores").glob("shard-*.h5")):
        with h5py.File(path, "r") as f:
            found[path.name] = {k: f.attrs[k] for k in ("precision_policy", "precision_requested", "precision_reason",
                                                        "platform")}
    return found


def _job_blocks(output: str) -> dict[str, dict[str, str]]:
    """rule -> {"threads", "resources", "shell"} of the (last) job of each rule a dry run printed."""
    jobs: dict[str, dict[str, str]] = {}
    current: dict[str, str] = {}
    for line in output.splitlines():
        if line.startswith(("rule ", "localrule ")) and line.endswith(":"):
            current = jobs.setdefault(line.split()[1].rstrip(":"), {})
        elif line.strip().startswith(("threads:", "resources:")):
            key, _, value = line.strip().partition(": ")
            current[key] = value
        elif line.startswith("Shell command:"):
            current["shell"] = line
    return jobs


def _recomputed_policy(decision: dict) -> str:
    """The decision's choice from its own candidates, independently of ``pick``, by the rule
    docs/precision.md states: in the order fp32, bf16-mixed, fp16-mixed, int8-mixed, the last
    candidate whose cosine passes and whose median is at most 0.9 times that of every passing
    candidate before it (fp32 always passes: it is the reference)."""
    timings = {k: Timing(v["ms_per_1k_residues"], v["min_cosine"]) for k, v in decision["candidates"].items()}
    passing = [k for k in ("fp32", "bf16-mixed", "fp16-mixed", "int8-mixed") if k in timings
               and (k == "fp32" or timings[k].min_cosine >= auto_precision.PASS_COSINE)]
    chosen = "fp32"
    for i, k in enumerate(passing):
        if all(timings[k].ms_per_1k_residues <= 0.9 * timings[b].ms_per_1k_residues for b in passing[:i]):
            chosen = k
    return chosen


def _check_one_decision(workdir: Path) -> dict:
    decision = json.loads((workdir / "out" / "precision-decision.json").read_text())
    assert decision["policy"] == _recomputed_policy(decision)
    stores = _stores(workdir)
    assert len(stores) == 2
    for name, attrs in stores.items():
        assert (attrs["precision_policy"], attrs["precision_requested"], attrs["precision_reason"]) == (
            decision["policy"], "auto", decision["reason"]), name
    with h5py.File(workdir / MERGED, "r") as f:
        assert (f.attrs["precision_policy"], f.attrs["precision_reason"]) == (decision["policy"], decision["reason"])
    assert validate(workdir / MERGED).returncode == 0
    return decision


def test_one_decision_for_a_large_and_a_small_group_kept_on_rerun_redone_on_change(tmp_path: Path) -> None:
    # two shards, two groups: 25,000 tokens of short records, then the remainder (a few long ones);
    # the demo is too small to pay for the probe: auto_measure always, so that the run measures
    config = demo_config(tmp_path, precision="auto", auto_measure="always", tokens_per_shard=25000, per_residue=False)
    first = _run(tmp_path, config, "out/shards/manifest.tsv")
    listing = json.loads((tmp_path / "out" / "shards" / "shards.json").read_text())
    residues = [s["residues"] for s in listing["shards"]]
    assert listing["groups"] == [[0], [1]] and residues[1] < residues[0] / 2  # a large and a small group
    # the small group first, alone: the decision is made before it, for the whole input
    first = _run(tmp_path, config, "out/stores/group-00001.json")
    assert "decide-precision" in first and "--precision auto:out/precision-decision.json" in first
    assert not (tmp_path / "out" / "stores" / "shard-00000.h5").exists()
    decision_file = tmp_path / "out" / "precision-decision.json"
    decided = decision_file.read_bytes()
    _run(tmp_path, config, MERGED)
    decision = _check_one_decision(tmp_path)
    assert decision_file.read_bytes() == decided  # the large group ran the same decision

    # decided on the resources an embed job gets: the embed rule's threads, and what a profile sets for embed
    dry = snakemake(tmp_path, "--cores", "4", "--dry-run", MERGED, "--printshellcmds", "--forcerun", "decide_precision",
                    "embed", "--set-threads", "embed=3", "--set-resources", "embed:slurm_partition=gpu",
                    "embed:mem_mb=5000", configfile=config)
    jobs = _job_blocks(dry.stdout + dry.stderr)
    assert jobs["decide_precision"]["threads"] == jobs["embed"]["threads"] == "3"
    for resource in ("slurm_partition=gpu", "mem_mb=5000"):
        assert resource in jobs["decide_precision"]["resources"] and resource in jobs["embed"]["resources"]
    # no `threads` in the config: no --threads; Snakemake's OMP_NUM_THREADS (3 here) bounds both jobs
    assert "--threads" not in jobs["decide_precision"]["shell"] and "--threads" not in jobs["embed"]["shell"]
    dry = snakemake(tmp_path, "--cores", "4", "--dry-run", MERGED, "--printshellcmds", "--forcerun", "decide_precision",
                    "embed", "--set-threads", "embed=3", "--config", "threads=2", configfile=config)
    jobs = _job_blocks(dry.stdout + dry.stderr)
    assert jobs["decide_precision"]["threads"] == jobs["embed"]["threads"] == "3"  # the profile's wins
    assert "--threads 3" in jobs["decide_precision"]["shell"] and "--threads 3" in jobs["embed"]["shell"]

    # a rerun keeps it: nothing to do, the file untouched
    dry = snakemake(tmp_path, "--cores", "1", "--dry-run", MERGED, configfile=config)
    assert "Nothing to be done" in dry.stdout + dry.stderr
    assert decision_file.read_bytes() == decided

    # another `layers`: decided again, for the new key, and run by every store
    config = demo_config(tmp_path, precision="auto", auto_measure="always", tokens_per_shard=25000, per_residue=False,
                         layers=[0, -1])
    _run(tmp_path, config, MERGED)
    redone = _check_one_decision(tmp_path)
    assert redone["key"]["options"]["layers"] == [0, -1] != decision["key"]["options"]["layers"]
    assert redone["key"]["model"] == decision["key"]["model"]

    # another model (the test model's seed): decided again
    config = demo_config(tmp_path, precision="auto", auto_measure="always", tokens_per_shard=25000, per_residue=False,
                         layers=[0, -1], test_model={"layers": 2, "dim": 32, "heads": 4, "seed": 1})
    _run(tmp_path, config, MERGED)
    remodelled = _check_one_decision(tmp_path)
    assert remodelled["key"]["model"]["model_sha256"] != redone["key"]["model"]["model_sha256"]
    assert remodelled["key"]["options"] == redone["key"]["options"]
