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
    assert "runtime=lambda wildcards, attempt: embed_runtime(embed_attempt(wildcards, attempt))" in rule
    common = (ROOT / "workflows" / "rules" / "common.smk").read_text()
    minutes = int(re.search(r"\ndef embed_runtime\(attempt\):\n(?:    .*\n)*?    return (\d+) \* attempt\n", common)[1])
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


def _constants(names: tuple[str, ...]) -> list[int]:
    common = (ROOT / "workflows" / "rules" / "common.smk").read_text()
    return [int(re.search(rf"^{name} = (\d+)", common, flags=re.M)[1]) for name in names]


def test_shard_and_merge_memory_in_the_docs_are_the_rules_formulas():
    """docs/cluster.md's defaults table against the constants the rules compute mem_mb from (issue 34:
    the docs said 1 KiB per manifest row, the rule 8 B: 60 GB against 1 GB at UniRef50)."""
    docs = (ROOT / "docs" / "cluster.md").read_text()
    base, per_row, row_bytes = _constants(("MERGE_MEM_BASE_MB", "MERGE_MEM_BYTES_PER_RECORD", "MANIFEST_BYTES_PER_ROW"))
    assert f"| merge | 1 | {base} + {per_row} B per manifest row (rows estimated as bytes / {row_bytes}), x attempt |" in docs
    base, per_record, fasta_bytes, gzip = _constants(
        ("SHARD_MEM_BASE_MB", "SHARD_MEM_BYTES_PER_RECORD", "FASTA_BYTES_PER_RECORD", "GZIP_RATIO"))
    assert (f"| shard | 1 | {base} + {per_record} B per record (records estimated as input bytes / {fasta_bytes}, "
            f"x{gzip} gzipped), x attempt |") in docs


def test_the_readme_config_table_lists_every_schema_key():
    schema = yaml.safe_load((ROOT / "workflows" / "schemas" / "config.schema.yaml").read_text())
    table = (ROOT / "README.md").read_text().split("| key | meaning |", 1)[1].split("\n\n", 1)[0]
    keys = {key for row in table.splitlines()[2:] for key in re.findall(r"`(\w+)`", row.split("|")[1])}
    assert keys == set(schema["properties"])


def test_the_crosscheck_synopsis_names_every_option():
    out = subprocess.run([sys.executable, "-m", "embedpipe.cli", "crosscheck", "--help"], capture_output=True,
                         text=True, env={"COLUMNS": "200", "PATH": ""}).stdout
    options = set(re.findall(r"^\W*(--[a-z-]+)", out, flags=re.M)) - {"--help"}
    synopsis = (ROOT / "docs" / "crosscheck.md").read_text().split("```", 2)[1]
    assert options and sorted(o for o in options if o not in synopsis) == []
