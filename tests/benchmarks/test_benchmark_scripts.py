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
