"""Every benchmark script answers --help with its usage, and runs nothing."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
#: scripts; modules named _*.py are helpers the scripts import (benchmarks/_gpu_acceptance_*.py)
SCRIPTS = sorted(p for p in BENCHMARKS.glob("*.py") if not p.name.startswith("_"))


def test_the_gpu_acceptance_script_is_among_the_scripts_checked():
    assert BENCHMARKS / "gpu_acceptance.py" in SCRIPTS
    assert not [p for p in SCRIPTS if p.name.startswith("_")]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_help_prints_usage_and_runs_nothing(script, tmp_path):
    proc = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.lstrip().startswith("usage:"), proc.stdout[:500]
    assert list(tmp_path.iterdir()) == []  # nothing written: nothing ran


@pytest.mark.peer
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
def test_hf_peer_in_bf16_writes_fp32_means_close_to_fair_esm(tiny_model_path, fair_esm_reference, tmp_path):
    """The CPU throughput table's bf16 peer (embed_throughput.py: hf-transformers-bf16)."""
    import torch

    sys.path.insert(0, str(BENCHMARKS))
    import hf_esm_peer

    rng = np.random.default_rng(0)
    seqs = ["".join(rng.choice(list("ACDEFGHIKLMNPQRSTVWY"), n)) for n in (30, 75, 12)]
    fasta = tmp_path / "in.fasta"
    fasta.write_text("".join(f">p{i}\n{s}\n" for i, s in enumerate(seqs)))
    hf_esm_peer.run_hf(tiny_model_path, fasta, tmp_path / "out", threads=1, dtype="bfloat16")

    stats = json.loads((tmp_path / "out" / "_stats.json").read_text())
    assert (stats["dtype"], stats["attention"]) == ("bfloat16", "sdpa")
    model, alphabet = fair_esm_reference(tiny_model_path)
    for i, seq in enumerate(seqs):
        got = torch.load(tmp_path / "out" / f"p{i}.pt", weights_only=True)["mean_representations"][model.num_layers]
        assert got.dtype == torch.float32
        _, _, toks = alphabet.get_batch_converter()([("x", seq)])
        with torch.no_grad():
            want = model(toks, repr_layers=[model.num_layers])["representations"][model.num_layers][0, 1 : len(seq) + 1].mean(0)
        cosine = float(got @ want / (got.norm() * want.norm()))
        assert 0.999 < cosine < 1.0  # bf16: close, and not fp32's bit-for-bit answer


def run_tiny(script: str, *args: str, cwd: Path) -> str:
    """stdout of one benchmark script on a tiny configuration (no timing is asserted)."""
    proc = subprocess.run([sys.executable, str(BENCHMARKS / script), *args], capture_output=True, text=True,
                          cwd=cwd, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("machine: "), proc.stdout[:300]  # every table under the machine header
    return proc.stdout


def table_rows(stdout: str) -> list[list[str]]:
    """The cells of every Markdown row below a header in ``stdout``."""
    return [[c.strip() for c in line.strip("|").split("|")] for line in stdout.splitlines()
            if line.startswith("| ") and not line.startswith("|---")]


def test_batch_invariance_cost_sets_up_the_previous_path_and_both_agree(tmp_path):
    """The untiled, batched-attention pass this script sets up in its own process computes the
    same embeddings up to rounding (the invariant path is the product's)."""
    out = run_tiny("batch_invariance.py", "cost", "--shapes", "tiny", "--policies", "fp32", "--records", "6",
                   "--median", "60", "--rounds", "1", cwd=tmp_path)
    header, row = table_rows(out)
    assert header[:2] == ["shape", "policy"] and row[:2] == ["tiny", "fp32"]
    assert float(row[-1]) < 1e-4  # max pooled difference between the two paths


def test_batch_invariance_bits_finds_every_record_bit_equal(tmp_path):
    out = run_tiny("batch_invariance.py", "bits", "--records", "5", "--precisions", "fp32", cwd=tmp_path)
    _, row = table_rows(out)
    assert row[0] == "fp32" and row[2].startswith("0/5, 0 pooled") and row[3].startswith("0/5, 0 pooled")


def test_batch_layout_kernels_rate_each_kernel_against_fused_fp32(tmp_path):
    out = run_tiny("batch_layout.py", "kernels", "--repeats", "1", "--threads", "1", cwd=tmp_path)
    rows = [r for r in table_rows(out) if r[0] != "batch x length"]
    assert len(rows) == 15 and all(r[-1] == "1.00" for r in rows if r[1] == "sdpa fp32")
    for r in rows:  # the ratio column is the ms column over its shape's sdpa fp32 ms
        base = next(float(b[2]) for b in rows if b[0] == r[0] and b[1] == "sdpa fp32")
        assert float(r[3]) == pytest.approx(float(r[2]) / base, abs=0.06)


def test_export_scale_checks_and_scale_tiny(tmp_path):
    out = run_tiny("export_scale.py", "checks", "--records", "20", "--dim", "4", "--repeat", "1", cwd=tmp_path)
    assert [r[0] for r in table_rows(out)[1:]] == ["`npy`", "`parquet`", "`h5-per-id`", "`npy --per-residue`"]
    out = run_tiny("export_scale.py", "scale", "--records", "100", "--formats", "npy", "--out",
                   str(tmp_path / "r.json"), cwd=tmp_path)
    assert table_rows(out)[1][:2] == ["100", "npy"]
    assert json.loads((tmp_path / "r.json").read_text())[0]["peak_mib"] > 0


def test_keep_check_tiny(tmp_path):
    out = run_tiny("keep_check.py", "--records", "10", "--length", "5", "--dim", "4", "--repeat", "1", cwd=tmp_path)
    assert [r[:2] for r in table_rows(out)[1:]] == [["per-residue + mean", "10"], ["mean only", "10"]]
