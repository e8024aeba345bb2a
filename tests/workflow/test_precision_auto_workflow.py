"""``precision: auto`` in the workflow: the rules pass ``--precision auto`` on (never resolved
when the config is parsed), each embed job chooses on its own node, and the merged store records
the request, the choice and why (docs/precision.md, "precision: auto")."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import embedpipe
from embedpipe.model import load_model
from embedpipe.runtime import auto_precision
from embedpipe.runtime.auto_precision import model_params
from helpers.workflow_helpers import demo_config, nothing_to_do, run_workflow, validate

pytestmark = pytest.mark.slow


def test_precision_auto_reaches_the_jobs_and_is_recorded(tmp_path: Path) -> None:
    config = demo_config(tmp_path, precision="auto", device="cpu")
    proc = run_workflow(tmp_path, config, "--printshellcmds")
    out = proc.stdout + proc.stderr
    assert "--precision auto" in out
    merged = tmp_path / "out" / "embeddings.h5"
    assert validate(merged).returncode == 0
    with embedpipe.open_store(merged) as store:
        provenance = store.provenance
    params = model_params(load_model(str(tmp_path / "out" / "model" / "esm2_test_t2_32.pt")))  # demo_config's
    policy, why = auto_precision.prior(torch.device("cpu"), params=params)  # the jobs ran on this machine
    # the demo's random 2-layer model: no table row was measured at a similar size, so fp32
    assert policy == "fp32" and "the table has no row" in why
    assert (provenance["precision_policy"], provenance["precision_requested"]) == (policy, "auto")
    # the demo's jobs are too small to pay for the probe: every one says so, in the same words
    assert provenance["precision_reason"] == (f"auto -> fp32: not measured (the job is too small to pay for the "
                                              f"probe, which may cost at most 10% of its residues); {why}")
    assert nothing_to_do(tmp_path, config)  # the same node class: the stores are current
