"""The workflow keys ``max_record_length`` and ``max_id_length`` reach both steps that read
FASTA, shard and embed (embed reads the shards through the same reader, so raised limits must
reach it too: embedpipe.workflow.config.fasta_limit_args, docs/store-format.md, "Input limits")."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.workflow_helpers import demo_config, nothing_to_do, run_workflow, validate

pytestmark = pytest.mark.slow


def test_raised_limits_reach_shard_and_embed(tmp_path: Path) -> None:
    config = demo_config(tmp_path, max_record_length=200_000, max_id_length=2000)
    proc = run_workflow(tmp_path, config, "--printshellcmds")
    commands = (proc.stdout + proc.stderr).splitlines()
    for step in ("shard", "embed"):
        mine = [c for c in commands if f"embedpipe {step} " in c]
        assert mine and all("--max-record-length 200000 --max-id-length 2000" in c for c in mine), (step, commands)
    assert validate(tmp_path / "out" / "embeddings.h5").returncode == 0
    assert nothing_to_do(tmp_path, config)


def test_a_record_over_the_configured_limit_stops_shard_with_one_line(tmp_path: Path) -> None:
    config = demo_config(tmp_path, max_record_length=20)
    proc = run_workflow(tmp_path, config, check=False)
    assert proc.returncode != 0
    log = (tmp_path / "out" / "logs" / "shard.log").read_text()
    assert "is longer than --max-record-length (20 residues; it has " in log, log
    assert log.count("\n") == 1 and log.startswith("embedpipe: error: "), log
