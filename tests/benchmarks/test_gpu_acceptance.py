"""benchmarks/gpu_acceptance.py, smoke-run on the CPU (tiny stand-in shapes, --quick): the JSON
has every field the GPU run fills, its correctness checks hold, and the Markdown is printed.

The run happens once per module (about 10-40 s on 2 shared cores, --threads 1: one thread per
process is faster where other jobs share the cores). The expected keys below are written out
here, apart from the script's own REQUIRED_FIELDS, so that a field the script stops filling
fails this test even if the script's list loses it too.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_acceptance.py"
HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None

TOP = {"schema", "complete", "date", "command", "python_version", "torch_version", "fair_esm_version",
       "transformers_version", "transformers_version_why", "embedpipe_version", "embedpipe_path", "git_commit",
       "quick", "seconds_total", "missing_fields", "markdown", "device", "shapes", "correctness", "speed",
       "overflow_fallback", "proxy", "targets"}
DEVICE = {"type", "name", "capability", "capability_why", "total_memory_gib", "total_memory_why",
          "bf16_peak_flops", "bf16_peak_flops_why", "threads"}
SHAPE = {"skipped", "name", "real_shape", "run_shape", "scaled_down", "scaled_down_why", "checkpoint",
         "parameters", "seconds"}
LAYOUT = {"asked", "batch_layout", "attention_path", "attention_inputs", "tokens_per_batch",
          "max_abs_diff_mean_vs_fair_esm", "max_abs_diff_per_residue_vs_fair_esm", "within_tolerance"}
POLICY = {"batch_layout", "attention_path", "attention_inputs", "tokens_per_batch", "finite", "fallback",
          "min_cosine_to_fp32", "batch_invariance"}
# every policy runs in the CPU smoke run; on CUDA the script leaves out the CPU-only int8-mixed
POLICIES = {"fp32", "fp16", "bf16", "amp-fp16", "amp-bf16", "fp16-mixed", "bf16-mixed", "int8-mixed"}
SYSTEMS = {"fair-esm-fp32", "fair-esm-fp16", "hf-sdpa-bf16", "embedpipe-fp32", "embedpipe-bf16",
           "embedpipe-bf16-mixed", "embedpipe-bf16-mixed-padded", "embedpipe-bf16-mixed-fp32-attention",
           "embedpipe-fp16-mixed"}
ROW = {"skipped", "seconds", "residues_per_s", "tokens_per_batch", "batch_layout", "attention_path", "attention_inputs",
       "padding_efficiency", "peak_memory_mib", "peak_memory_kind", "peak_memory_why", "busy_seconds",
       "idle_fraction", "mfu", "mfu_why", "min_cosine_to_fp32", "x_fair_esm_fp32", "x_hf_sdpa_bf16", "fallback",
       "syncs", "syncs_why", "warmup_seconds", "residues_per_s_with_warmup"}
MIXED_LAYOUTS = {"packed_attention_path", "padded_attention_path", "min_cosine_tolerance",
                 "max_relative_diff_tolerance", "min_pooled_cosine", "max_relative_diff_per_residue", "within_tolerance"}
SPEED = {"records", "residues", "tokens", "flops", "flops_formula", "recipe_tokens_per_batch",
         "peer_tokens_per_batch", "warmup_records", "cosine_reference", "systems"}
PROXY = {"skipped", "shape", "records", "residues", "median_length", "max_length", "records_over_1022",
         "records_over_5000", "chunked_records", "precision", "seconds", "residues_per_s", "peak_rss_mib",
         "fallback", "padding_efficiency", "command"}
#: target -> (comparison, threshold), from issue 13
TARGETS = {"mfu_650m_bf16_mixed_packed": (">=", 0.40), "proxy_seconds": ("<=", 60.0),
           "x_hf_sdpa_bf16_650m": (">=", 3.0), "x_fair_esm_fp32_650m": (">=", 8.0),
           "bf16_mixed_cosine_650m": (">=", 0.9999)}
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[dict, str]:
    """(results.json, stdout) of one CPU smoke run of the script, with this tree's embedpipe."""
    out = tmp_path_factory.mktemp("gpu_acceptance") / "results.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--threads", "1",
                           "--out", str(out)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


@pytest.fixture(scope="module")
def results(run) -> dict:
    return run[0]


def test_the_json_has_every_field_the_gpu_run_fills(results):
    assert TOP <= set(results)
    assert results["complete"] is True and results["missing_fields"] == []
    assert DEVICE <= set(results["device"])
    assert set(results["shapes"]) == {"650M"}  # --quick: the targets' shape only
    for key, shape in results["shapes"].items():
        assert SHAPE <= set(shape)
        assert shape["real_shape"] == {"layers": 33, "dim": 1280, "heads": 20}
        assert shape["scaled_down"] is True and shape["scaled_down_why"]
        correctness = results["correctness"][key]
        assert LAYOUT <= set(correctness["packed"]) and LAYOUT <= set(correctness["padded"])
        assert set(correctness["policies"]) == POLICIES
        for policy in correctness["policies"].values():
            assert POLICY <= set(policy)
            assert set(policy["batch_invariance"]) >= {"records", "max_abs_diff", "equal"}
        speed = results["speed"][key]
        assert SPEED <= set(speed)
        assert set(speed["systems"]) == SYSTEMS
        for row in speed["systems"].values():
            assert ROW <= set(row)
    assert PROXY <= set(results["proxy"])
    assert set(results["targets"]) == set(TARGETS)
    for target in results["targets"].values():
        assert {"what", "comparison", "threshold", "value", "met", "why"} <= set(target)


def test_values_that_cannot_exist_on_a_cpu_are_null_with_a_reason(results):
    device = results["device"]
    assert device["type"] == "cpu"
    for name, why in (("capability", "capability_why"), ("total_memory_gib", "total_memory_why"),
                      ("bf16_peak_flops", "bf16_peak_flops_why")):
        assert device[name] is None and isinstance(device[why], str) and device[why], name
    for row in results["speed"]["650M"]["systems"].values():
        assert row["mfu"] is None and (row["mfu_why"] or row["skipped"])
    for name, target in results["targets"].items():
        assert target["met"] is None and target["why"], name


def test_targets_are_the_issues(results):
    for name, (comparison, threshold) in TARGETS.items():
        assert (results["targets"][name]["comparison"], results["targets"][name]["threshold"]) == (comparison, threshold)
    row = results["speed"]["650M"]["systems"]["embedpipe-bf16-mixed"]
    assert results["targets"]["bf16_mixed_cosine_650m"]["value"] == row["min_cosine_to_fp32"]
    assert results["targets"]["proxy_seconds"]["value"] == results["proxy"]["seconds"]


def test_both_layouts_equal_fair_esm_and_each_other(results):
    correctness = results["correctness"]["650M"]
    for layout in ("packed", "padded"):
        got = correctness[layout]
        assert got["max_abs_diff_per_residue_vs_fair_esm"] <= TOLERANCE
        assert got["max_abs_diff_mean_vs_fair_esm"] <= TOLERANCE
        assert got["within_tolerance"] is True
    assert correctness["max_abs_diff_packed_vs_padded"] <= TOLERANCE
    assert correctness["tf32"] is False


def test_bf16_mixed_packed_is_compared_with_padded_at_a_stated_tolerance(results):
    """On CUDA fp32 packed is the per-sequence stand-in: bf16-mixed packed is what runs flash."""
    mixed = results["correctness"]["650M"]["bf16_mixed_packed_vs_padded"]
    assert set(mixed) == MIXED_LAYOUTS
    assert mixed["packed_attention_path"] == "packed-sdpa-per-sequence"  # the CPU's stand-in; on CUDA varlen flash
    assert mixed["padded_attention_path"] == "padded-sdpa"
    assert mixed["min_pooled_cosine"] >= mixed["min_cosine_tolerance"] == 0.9999
    # on the CPU both layouts attend each record alone, tile the same rows and pool in order:
    # bit-identical (docs/precision.md, "Reproducibility"); on CUDA flash against SDPA differ
    assert mixed["max_relative_diff_per_residue"] == 0.0 < mixed["max_relative_diff_tolerance"] == 2.0**-5
    assert mixed["within_tolerance"] is True


def test_every_policy_is_finite_close_to_fp32_and_batch_invariance_is_reported(results):
    for name, policy in results["correctness"]["650M"]["policies"].items():
        assert policy["finite"] is True, name
        assert policy["min_cosine_to_fp32"] >= 0.999, name
        invariance = policy["batch_invariance"]
        assert invariance["records"] == 3
        assert math.isfinite(invariance["max_abs_diff"])
        assert invariance["equal"] == (invariance["max_abs_diff"] == 0.0), name
        batchings = policy["two_batchings"]  # every record again in small batches: bit for bit
        assert batchings["batches"] > 1 and batchings["records_not_bit_equal"] == 0, (name, batchings)
        assert batchings["equal"] is True and batchings["max_abs_diff"] == 0.0, name
    assert results["correctness"]["650M"]["policies"]["fp32"]["batch_invariance"]["max_abs_diff"] <= TOLERANCE


def test_fp16_overflow_fallback_is_exact(results):
    overflow = results["overflow_fallback"]
    assert overflow["records_with_c"] == 3
    assert set(overflow["policies"]) == {"fp16", "fp16-mixed"}
    for name, policy in overflow["policies"].items():
        assert policy["fallback"] == 3 and policy["fallback_ids_match"] is True, name
        assert policy["reasons"] == {"nonfinite": 3}, name
        assert policy["exact"] is True and policy["max_abs_diff_vs_fp32_alone"] == 0.0, name
        assert policy["finite"] is True


def test_speed_rows_are_consistent(results):
    rows = results["speed"]["650M"]["systems"]
    if not HAVE_TRANSFORMERS:
        assert rows["hf-sdpa-bf16"]["skipped"] == "transformers is not installed"
    for name, row in rows.items():
        if row["skipped"]:
            continue
        assert row["residues_per_s"] == pytest.approx(results["speed"]["650M"]["residues"] / row["seconds"])
        assert 0.0 <= row["idle_fraction"] <= 1.0, name
        assert 0.0 < row["padding_efficiency"] <= 1.0, name
        assert row["peak_memory_mib"] is not None or row["peak_memory_why"], name
        assert row["min_cosine_to_fp32"] >= 0.999, name
        recipe = rows["fair-esm-fp32"]["residues_per_s"]
        assert row["x_fair_esm_fp32"] == pytest.approx(row["residues_per_s"] / recipe), name
    assert rows["fair-esm-fp32"]["x_fair_esm_fp32"] == pytest.approx(1.0)
    assert rows["embedpipe-bf16-mixed-padded"]["batch_layout"] == "padded"
    assert rows["embedpipe-bf16-mixed-fp32-attention"]["attention_inputs"] == "float32"
    for name, row in rows.items():  # the sync count exists on CUDA only; the warm-up is timed everywhere
        if not row["skipped"]:
            assert row["syncs"] is None and row["syncs_why"] == "sync debug mode exists on CUDA only", name
            assert row["warmup_seconds"] > 0, name
            assert row["residues_per_s_with_warmup"] < row["residues_per_s"], name


def test_proxy_chunks_its_long_records(results):
    proxy = results["proxy"]
    assert proxy["skipped"] is None and proxy["precision"] == "bf16-mixed" and proxy["shape"] == "650M"
    assert proxy["records"] == 4  # 40 on the CPU, /10 with --quick
    assert proxy["records_over_1022"] >= 1 and proxy["chunked_records"] == proxy["records_over_1022"]
    assert proxy["fallback"] == 0
    assert proxy["residues_per_s"] == pytest.approx(proxy["residues"] / proxy["seconds"])


def test_markdown_tables_are_printed(run):
    results, stdout = run
    assert results["markdown"] in stdout
    assert "| shape | system | attention path | q/k/v | residues/s | x fair-esm fp32 | x HF SDPA bf16 |" in stdout
    assert "CPU smoke" in stdout
    for system in SYSTEMS:
        assert f"| 650M | {system} |" in stdout
    assert "| target | threshold | value | met |" in stdout
    assert "gpu_acceptance.py --device cpu --quick --threads 1 --out" in results["command"]


def test_the_scripts_own_field_check_notices_a_missing_field(results):
    gpu_acceptance = _module("gpu_acceptance")

    assert gpu_acceptance.missing_fields(results) == []
    broken = json.loads(json.dumps(results))
    del broken["speed"]["650M"]["systems"]["hf-sdpa-bf16"]["idle_fraction"]
    del broken["correctness"]["650M"]["packed"]["batch_layout"]
    assert set(gpu_acceptance.missing_fields(broken)) == {
        "speed.650M.systems.hf-sdpa-bf16.idle_fraction", "correctness.650M.packed.batch_layout"}


def _module(name: str):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    return importlib.import_module(name)


def test_targets_on_a_gpu_are_judged_and_the_mfu_one_needs_the_packed_layout():
    """The GPU branch of the target logic, on made-up numbers (no GPU here)."""
    import torch

    gpu_acceptance = _module("gpu_acceptance")
    row = {"mfu": 0.45, "x_hf_sdpa_bf16": 2.5, "x_fair_esm_fp32": 9.0, "min_cosine_to_fp32": 0.99995,
           "batch_layout": "packed"}
    results = {"speed": {"650M": {"systems": {"embedpipe-bf16-mixed": row}}},
               "proxy": {"skipped": None, "records": 20_000, "seconds": 75.0}}
    got = gpu_acceptance.targets(results, torch.device("cuda"))
    assert {name: t["met"] for name, t in got.items()} == {
        "mfu_650m_bf16_mixed_packed": True, "proxy_seconds": False, "x_hf_sdpa_bf16_650m": False,
        "x_fair_esm_fp32_650m": True, "bf16_mixed_cosine_650m": True}
    row["batch_layout"] = "padded"
    results["proxy"]["records"] = 2000
    got = gpu_acceptance.targets(results, torch.device("cuda"))
    assert got["mfu_650m_bf16_mixed_packed"]["met"] is False and "padded" in got["mfu_650m_bf16_mixed_packed"]["why"]
    assert got["proxy_seconds"]["met"] is None and got["proxy_seconds"]["why"]
    # --shapes without 650M: the proxy target is still judged, the 650M ones say why not
    results = {"speed": {"35M": {"systems": {}}}, "proxy": {"skipped": None, "records": 20_000, "seconds": 50.0}}
    got = gpu_acceptance.targets(results, torch.device("cuda"))
    assert got["proxy_seconds"]["met"] is True
    assert got["mfu_650m_bf16_mixed_packed"]["met"] is None and "650M" in got["mfu_650m_bf16_mixed_packed"]["why"]


class Clock:
    """A made-up clock: seconds advance only when a test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_shape_is_skipped_when_the_measured_rate_says_it_would_not_finish():
    budget_module = _module("_gpu_acceptance_budget")
    clock = Clock()
    budget = budget_module.Budget(8.0, clock=clock)  # 480 s, 150 s kept for the overflow check and the proxy
    assert budget.shape_skip(1e15) is None  # nothing measured yet: the first shape starts
    clock.now += 100.0
    budget.measured("650M", 2e15, 100.0)  # 5e-14 s per FLOP
    assert budget.estimate(4e15) == pytest.approx(200.0)
    assert budget.shape_skip(4e15) is None  # 200 s expected, 230 s left
    why = budget.shape_skip(5e15)  # 250 s expected
    assert why.startswith("time budget: estimated 250 s (650M's measured rate x the FLOPs ratio) but 230 s left")
    budget.measured("35M", 1e14, 20.0)  # a slower rate (2e-13 s per FLOP) wins: estimates stay conservative
    assert budget.rate_from == "35M" and budget.estimate(1e15) == pytest.approx(200.0)
    clock.now += 240.0  # 340 s elapsed: past the reserve
    assert "time budget: 340 s elapsed of 8 min" in budget.shape_skip(1.0)
    assert budget_module.Budget(None, clock=clock).shape_skip(1e30) is None


def test_the_proxy_is_refused_or_time_boxed_from_the_budget_left():
    budget_module = _module("_gpu_acceptance_budget")
    clock = Clock()
    budget = budget_module.Budget(8.0, clock=clock)
    clock.now += 400.0  # 80 s left, 20 of them for the overflow check
    limit, why = budget.proxy_limit(1_000_000, residues_per_s=50_000.0)  # 1.5 x 20 s = 30 s expected
    assert (limit, why) == (pytest.approx(60.0), None)
    limit, why = budget.proxy_limit(4_000_000, residues_per_s=50_000.0)  # 120 s expected
    assert limit is None and why.startswith("time budget: the proxy would take about 120 s")
    assert budget.proxy_limit(4_000_000, residues_per_s=None) == (pytest.approx(60.0), None)  # no rate: the limit
    assert budget_module.Budget(None).proxy_limit(10**9, 1.0) == (None, None)
    seconds, _rss, stopped = budget_module.timed_with_limit([sys.executable, "-c", "import time; time.sleep(30)"],
                                                            dict(os.environ), 0.5)
    assert seconds is None and stopped == "time budget: the proxy was stopped after 0 s"
    seconds, _rss, stopped = budget_module.timed_with_limit([sys.executable, "-c", "pass"], dict(os.environ), 30)
    assert seconds > 0 and stopped is None


def test_the_time_budget_skips_shapes_that_would_start_too_late(tmp_path):
    gpu_acceptance = _module("gpu_acceptance")
    assert gpu_acceptance.RUN_ORDER[0] == "650M" and set(gpu_acceptance.RUN_ORDER) == set(gpu_acceptance.SHAPES)
    out = tmp_path / "results.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--threads", "1",
                           "--budget-minutes", "0", "--out", str(out)], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["complete"] and results["missing_fields"] == []
    assert results["shapes"]["650M"]["skipped"].startswith("time budget")
    assert "650M" not in results["speed"]
    assert results["proxy"]["skipped"].startswith("time budget") and results["proxy"]["seconds"] is None
    mfu = results["targets"]["mfu_650m_bf16_mixed_packed"]
    assert mfu["met"] is None and mfu["value"] is None


def test_bf16_peaks_by_gpu_name():
    setup = _module("_gpu_acceptance_setup")
    assert setup.bf16_peak("NVIDIA H200")[0] == 989e12
    assert setup.bf16_peak("NVIDIA H100 80GB HBM3")[0] == 989e12
    assert setup.bf16_peak("NVIDIA H100 PCIe")[0] == 756e12
    assert setup.bf16_peak("NVIDIA H100 NVL")[0] == 835e12 and setup.bf16_peak("NVIDIA H200 NVL")[0] == 835e12
    assert setup.bf16_peak("NVIDIA A100-SXM4-80GB")[0] == 312e12
    peak, why = setup.bf16_peak("NVIDIA L4")
    assert peak is None and "L4" in why


# Last in the file, so that under -x every other check has run before it.
def test_each_layout_ran_as_asked(results):
    correctness = results["correctness"]["650M"]
    assert correctness["padded"]["batch_layout"] == "padded"
    # On the CPU a packed batch runs the per-sequence SDPA stand-in: it must report "packed".
    assert correctness["packed"]["batch_layout"] == "packed"
    assert results["speed"]["650M"]["systems"]["embedpipe-bf16-mixed"]["batch_layout"] == "packed"


def test_the_cuda_run_leaves_out_cpu_only_policies(monkeypatch):
    """On CUDA the correctness section covers only policies the device runs (int8-mixed is refused)."""
    import torch

    correctness = _module("_gpu_acceptance_correctness")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    on_cuda = correctness.runnable_policies(torch.device("cuda"))
    assert "int8-mixed" not in on_cuda and on_cuda[0] == "fp32"
    assert set(on_cuda) | {"int8-mixed"} == POLICIES
    assert set(correctness.runnable_policies(torch.device("cpu"))) == POLICIES

