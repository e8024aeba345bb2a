"""The workflow keys ``int8_smoothing`` and ``int8_calibration`` reach the embed jobs: a demo
run with int8-mixed and smoothquant on a calibration file of its own passes both as one flag
(``--int8-smoothing smoothquant:FASTA``), and
the merged store says it was smoothed and calibrated on that file, and a changed calibration
file reruns the embed jobs (docs/precision.md, "int8-mixed")."""

from __future__ import annotations

from pathlib import Path

import pytest

import embedpipe
from embedpipe.inputs.fasta import read_sequences
from helpers.embed_helpers import write_fasta
from helpers.workflow_helpers import EXAMPLE, demo_config, job_counts, nothing_to_do, run_workflow, validate

pytestmark = pytest.mark.slow


def test_the_smoothing_keys_reach_the_embed_jobs_and_the_store(tmp_path: Path) -> None:
    calibration = write_fasta(tmp_path / "my-calibration.fasta", list(read_sequences(EXAMPLE))[:4])
    config = demo_config(tmp_path, precision="int8-mixed", int8_smoothing="smoothquant",
                         int8_calibration=str(calibration))
    proc = run_workflow(tmp_path, config, "--printshellcmds")
    out = proc.stdout + proc.stderr
    assert f"--int8-smoothing smoothquant:{calibration}" in out and "--int8-calibration" not in out
    merged = tmp_path / "out" / "embeddings.h5"
    assert validate(merged).returncode == 0
    with embedpipe.open_store(merged) as store:
        scales = store.provenance["quantization_scales"]
        assert store.provenance["precision_policy"] == "int8-mixed"
    assert "SmoothQuant alpha 0.5" in scales and "my-calibration.fasta (4 records" in scales, scales
    assert nothing_to_do(tmp_path, config)
    write_fasta(calibration, list(read_sequences(EXAMPLE))[4:8])  # other contents, a newer file
    rerun = run_workflow(tmp_path, config, "--dry-run")
    assert "embed" in job_counts(rerun.stdout + rerun.stderr), rerun.stdout[-2000:]
