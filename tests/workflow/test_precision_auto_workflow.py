"""``precision: auto`` in the workflow: never resolved when the config is parsed; rule
decide_precision decides once, before any embed job, every job runs that decision
(``--precision auto:FILE``, with the run's ``EMBEDPIPE_AUTO_CACHE``), and the merged store
records the request, the choice and why (docs/precision.md, "One decision per run")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import embedpipe
from embedpipe.extraction import auto_precision
from embedpipe.extraction.auto_precision import model_params
from embedpipe.model import load_model
from helpers.workflow_helpers import demo_config, nothing_to_do, run_workflow, validate

pytestmark = pytest.mark.slow


def test_precision_auto_reaches_the_jobs_and_is_recorded(tmp_path: Path) -> None:
    config = demo_config(tmp_path, precision="auto", device="cpu")
    proc = run_workflow(tmp_path, config, "--printshellcmds")
    out = proc.stdout + proc.stderr
    assert "embedpipe decide-precision" in out and "--precision auto:out/precision-decision.json" in out
    # the node's measurement cache: the run's own, given to every embed job in its environment
    assert "EMBEDPIPE_AUTO_CACHE=out/.cache/auto-precision embedpipe embed " in out and "--auto-cache" not in out
    merged = tmp_path / "out" / "embeddings.h5"
    assert validate(merged).returncode == 0
    decision = json.loads((tmp_path / "out" / "precision-decision.json").read_text())
    with embedpipe.open_store(merged) as store:
        provenance = store.provenance
    params = model_params(load_model(str(tmp_path / "out" / "model" / "esm2_test_t2_32.pt")))  # demo_config's
    policy, why = auto_precision.prior(torch.device("cpu"), params=params)  # decided on this machine
    # the demo's random 2-layer model: no table row was measured at a similar size, so fp32
    assert policy == "fp32" and "the table has no row" in why
    assert (provenance["precision_policy"], provenance["precision_requested"]) == (decision["policy"], "auto")
    assert decision["policy"] == policy and decision["candidates"] == {}  # nothing measured, no times invented
    # the demo is too small to pay for the probe: decided once for the run, in the same words in every store
    assert provenance["precision_reason"] == decision["reason"]
    assert decision["reason"].startswith(f"auto -> fp32: not measured (the run is too small to pay for the probe, "
                                         f"which may cost at most 10% of its residues); {why} (decided once for "
                                         "the run on ")
    assert nothing_to_do(tmp_path, config)  # the decision kept: the stores are current
