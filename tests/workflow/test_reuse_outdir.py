"""Issue 30, item 3: a `reuse:` store inside the run's own `outdir` (its embeddings.h5 is the
merge of the embed jobs that would read it: Snakemake reported a cyclic graph and went on, and
every rerun failed) is refused at start, in one line, before any job
(embedpipe/workflow/config.py, `check_reuse`; docs/cluster.md, "Release to release")."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.workflow_helpers import demo_config, snakemake


@pytest.mark.parametrize("reuse", ["out/embeddings.h5", "out/stores/shard-00000.h5", "prev/embeddings.h5"])
def test_a_reuse_store_inside_the_outdir_is_refused_at_start(tmp_path: Path, reuse: str) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "prev").symlink_to("out")  # a symlink into the outdir is inside it too
    config = demo_config(tmp_path, reuse=[reuse])
    proc = snakemake(tmp_path, "--dry-run", "--cores", "1", configfile=config, check=False)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("embedpipe:")]
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert lines == [(f"embedpipe: config 'reuse': {reuse} lies inside outdir out, which this run writes (it would "
                      "reuse its own output); move the earlier release out of out or choose another outdir")]
    assert "Cyclic" not in proc.stdout + proc.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == []  # nothing ran


def test_a_reuse_store_beside_the_outdir_is_accepted(tmp_path: Path) -> None:
    (tmp_path / "release1").mkdir()
    (tmp_path / "release1" / "embeddings.h5").write_bytes(b"")  # only planned in a dry run
    config = demo_config(tmp_path, reuse=["release1/embeddings.h5"])
    proc = snakemake(tmp_path, "--dry-run", "--cores", "1", configfile=config, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not [line for line in proc.stderr.splitlines() if line.startswith("embedpipe:")]
