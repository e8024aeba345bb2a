"""``precision: auto`` in the workflow: never resolved when the config is parsed; rule
decide_precision decides once, before any embed job, every job runs that decision
(``--precision auto:FILE``), and the merged store records the request, the choice and why
(docs/precision.md, "One decision per run")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import embedpipe
from helpers.workflow_helpers import demo_config, nothing_to_do, run_workflow, validate

pytestmark = pytest.mark.slow


def test_precision_auto_reaches_the_jobs_and_is_recorded(tmp_path: Path) -> None:
    config = demo_config(tmp_path, precision="auto", device="cpu")
    proc = run_workflow(tmp_path, config, "--printshellcmds")
    out = proc.stdout + proc.stderr
    assert "embedpipe decide-precision" in out and "--precision auto:out/precision-decision.json" in out
    merged = tmp_path / "out" / "embeddings.h5"
    assert validate(merged).returncode == 0
    decision = json.loads((tmp_path / "out" / "precision-decision.json").read_text())
    with embedpipe.open_store(merged) as store:
        provenance = store.provenance
    assert (provenance["precision_policy"], provenance["precision_requested"]) == (decision["policy"], "auto")
    # measured once for the run, on this machine, and said in the same words by every job
    assert provenance["precision_reason"] == decision["reason"]
    assert decision["reason"].startswith(f"auto -> {decision['policy']}: decided once for the run on ")
    assert nothing_to_do(tmp_path, config)  # the decision kept: the stores are current
