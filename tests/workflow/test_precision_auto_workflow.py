"""``precision: auto`` in the workflow: the rules pass ``--precision auto`` on (never resolved
when the config is parsed), each embed job chooses on its own node, and the merged store records
the request, the choice and why (docs/precision.md, "precision: auto")."""

from __future__ import annotations

from pathlib import Path

import pytest

import embedpipe
from embedpipe.runtime import advice, cpu_features
from helpers.workflow_helpers import demo_config, nothing_to_do, run_workflow, validate

pytestmark = pytest.mark.slow


def test_precision_auto_reaches_the_jobs_and_is_recorded(tmp_path: Path) -> None:
    config = demo_config(tmp_path, precision="auto", device="cpu")
    proc = run_workflow(tmp_path, config, "--printshellcmds")
    out = proc.stdout + proc.stderr
    assert "--precision auto" in out
    merged = tmp_path / "out" / "embeddings.h5"
    assert validate(merged).returncode == 0
    policy, why = advice.cpu_choice(cpu_features.detect())  # the jobs ran on this machine
    with embedpipe.open_store(merged) as store:
        provenance = store.provenance
    assert (provenance["precision_policy"], provenance["precision_requested"]) == (policy, "auto")
    # the demo's jobs are too small to pay for the probe: every one takes the table's prior, in the same words
    assert provenance["precision_reason"] == (f"auto -> {policy}: not measured (the job is too small to pay for the "
                                              f"probe, which may cost at most 10% of its residues); the table's prior: "
                                              f"{why}")
    assert nothing_to_do(tmp_path, config)  # the same node class: the stores are current
