"""docs/cluster.md, the SLURM profile, the rules and --help agree (issue 19, E): the embed
runtime default is one number everywhere; `model-info` is a visible command in --help and the
README; the offline failure is described as it happens (at parse time, before any job)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def _runtime(expression: object, attempt: int) -> int:
    return int(eval(str(expression), {}, {"attempt": attempt}))  # noqa: S307 - the profile's own expression


def test_embed_runtime_agrees_in_rule_profile_and_docs():
    rule = (ROOT / "workflows" / "rules" / "embed.smk").read_text()
    minutes = int(re.search(r"runtime=lambda wildcards, attempt: (\d+) \* attempt", rule)[1])
    profile = yaml.safe_load((ROOT / "workflows" / "profiles" / "slurm" / "config.yaml").read_text())
    fixed = profile["set-resources"]["embed"].get("runtime")
    if fixed is not None:  # a profile value replaces the rule's: it must be the same
        assert [_runtime(fixed, a) for a in (1, 2, 3)] == [minutes * a for a in (1, 2, 3)], fixed
    docs = (ROOT / "docs" / "cluster.md").read_text()
    assert re.search(rf"\| embed \(one group of shards\) \|[^\n]*\| {minutes} x attempt \|", docs)
    assert f"rule's default {minutes} min" in docs


def test_model_info_is_in_help_and_readme():
    out = subprocess.run([sys.executable, "-m", "embedpipe.cli", "--help"], capture_output=True, text=True,
                         env={"COLUMNS": "100", "PATH": ""}).stdout
    assert re.search(r"^\W*model-info\s", out, flags=re.M), out
    synopsis = (ROOT / "README.md").read_text().split("## The command line", 1)[1].split("```")[1]
    assert "embedpipe model-info NAME|PATH [--json]" in synopsis


def test_cluster_docs_say_an_offline_run_stops_at_parse_time():
    docs = " ".join((ROOT / "docs" / "cluster.md").read_text().split())
    assert "fails in its first job" not in docs
    assert "before any job runs" in docs and "at parse time" in docs
