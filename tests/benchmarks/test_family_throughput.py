"""benchmarks/family_throughput.py (issue 22, "Benchmarks"): the recipes' batching and a --quick run.

--help is checked with every other script in tests/test_benchmark_scripts.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import _family_recipes as recipes  # noqa: E402

HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


def quick_run(tmp_path: Path, families: list[str], policies: list[str]) -> tuple[subprocess.CompletedProcess, dict]:
    """``family_throughput.py --quick`` on ``families`` and ``policies``: (the finished process,
    its results.json rows by system); a failed run fails the test with its stderr."""
    out = tmp_path / "bench"
    env = dict(os.environ, PYTHONPATH=str(BENCHMARKS.parent))
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "family_throughput.py"), "--quick", "--families",
                           *families, "--policies", *policies, "--out-dir", str(out)],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, {r["system"]: r for r in json.loads((out / "results.json").read_text())}


def test_batches_follow_prott5_embedders_rules() -> None:
    """Longest first; a batch closes at 4000 residues (the last one counted twice), after a
    record over 1000 residues, at 100 records, and at the end."""
    lengths = {"a": 1500, "b": 900, "c": 900, "d": 900, "e": 900, "f": 10, "g": 20}
    seqs = {k: "A" * n for k, n in lengths.items()}
    got = [[sid for sid, _ in batch] for batch in recipes.prott5_batches(seqs)]
    # a: 1500 > 1000 alone; b, c, d: 2700 + 900 = 3600 < 4000, then e: 3600 + 900 + 900 >= 4000
    assert got == [["a"], ["b", "c", "d", "e"], ["g", "f"]]
    many = {f"s{i}": "M" for i in range(250)}
    assert [len(b) for b in recipes.prott5_batches(many)] == [100, 100, 50]


def test_read_fasta_keeps_the_first_word_and_drops_gaps(tmp_path: Path) -> None:
    path = tmp_path / "in.fasta"
    path.write_text(">sp|P1|X_HUMAN some protein\nmk-t\nAY\n>q2\nW\n")
    assert recipes.read_fasta(path) == {"sp|P1|X_HUMAN": "MKTAY", "q2": "W"}


@pytest.mark.peer
@pytest.mark.skipif(not HAVE_TRANSFORMERS, reason="transformers is not installed")
def test_quick_run_agrees_with_the_recipes(tmp_path: Path) -> None:
    """A --quick run of a T5 family and hf-esm: every system's means against the recipe's.
    embedpipe's fp32 and the transformers recipe are independent implementations."""
    proc, rows = quick_run(tmp_path, ["prot-t5", "hf-esm"], ["fp32"])
    assert set(rows) == {"prot-t5 recipe", "prot-t5 embedpipe fp32", "hf-esm recipe", "fair-esm",
                         "hf-esm embedpipe fp32 (.pt)", "hf-esm embedpipe fp32"}
    for row in rows.values():
        assert row["records"] == 6
        assert row["min_cosine"] > 0.99999, row
        assert row["residues_per_s"] > 0
    assert "| prot-t5 | embedpipe fp32 |" in proc.stdout
    assert "fastest embedpipe policy here: **fp32**" in proc.stdout


def test_a_t5_test_model_takes_the_real_models_proportions(tmp_path: Path) -> None:
    """make_hf_test_model(d_kv=, d_ff=): the benchmark's scaled-down ProtT5 keeps ProtT5-XL's
    d_kv 128 and d_ff 16 x d_model; config.json and the weights agree, and embedpipe loads it."""
    from safetensors.torch import load_file

    from embedpipe.model import load_model
    from embedpipe.model.random_hf import make_hf_test_model

    out = make_hf_test_model(tmp_path / "t5", family="prot-t5", layers=1, dim=16, heads=2, d_kv=24, d_ff=256)
    config = json.loads((out / "config.json").read_text())
    assert (config["d_kv"], config["d_ff"]) == (24, 256)
    weights = load_file(str(out / "model.safetensors"))
    assert tuple(weights["encoder.block.0.layer.0.SelfAttention.q.weight"].shape) == (48, 16)
    assert tuple(weights["encoder.block.0.layer.1.DenseReluDense.wi.weight"].shape) == (256, 16)
    shape = load_model(str(out)).shape
    assert (shape.d_kv, shape.d_ff, shape.num_heads) == (24, 256, 2)


@pytest.mark.peer
@pytest.mark.skipif(not HAVE_TRANSFORMERS, reason="transformers is not installed")
def test_quick_esmc_run_agrees_with_transformers_esmc(tmp_path: Path) -> None:
    """ESM C beside transformers' EsmcModel (SDPA) in fp32 and bf16: embedpipe's fp32 means equal
    the fp32 recipe's; the bf16 ones (both sides) stay close to it."""
    _, rows = quick_run(tmp_path, ["esmc"], ["fp32", "bf16-mixed"])
    assert set(rows) == {"esmc recipe", "esmc recipe bf16", "esmc embedpipe fp32", "esmc embedpipe bf16-mixed"}
    assert rows["esmc recipe"]["attention"] == "sdpa"
    assert rows["esmc embedpipe fp32"]["min_cosine"] > 0.99999
    assert min(r["min_cosine"] for r in rows.values()) > 0.99
    assert all(r["records"] == 6 and r["residues_per_s"] > 0 for r in rows.values())
