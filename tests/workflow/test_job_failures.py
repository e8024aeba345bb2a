"""A failing embed job says why in the terminal, and a refusal of its inputs is not retried with
more memory (issue 34, item 2; embedpipe.workflow.jobs)."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

from embedpipe.workflow import jobs
from helpers.workflow_helpers import demo_config, run_workflow

REFUSAL = "embedpipe: error: --int8-calibration: calib.fasta:4: record 'b': invalid character"


def _log(tmp_path: Path, *lines: str) -> Path:
    log = tmp_path / "group-00000.log"
    log.write_text("".join(line + "\n" for line in lines))
    return log


def test_a_refusal_is_kept_and_repeated_not_rerun(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = _log(tmp_path, "loading", f"{REFUSAL} '1'")
    assert jobs.failed(log, 1) == 1
    err = capsys.readouterr().err
    assert f"{REFUSAL} '1'" in err and "would refuse again" in err
    assert jobs.refused_marker(log).read_text() == f"{REFUSAL} '1'\n"
    assert [jobs.attempt_for(log, n) for n in (1, 2, 3)] == [1, 1, 1]
    log.write_text("")  # what Snakemake leaves before the retry
    assert jobs.start(log, again=True) == jobs.EXIT_USER_ERROR
    assert "not run again" in capsys.readouterr().err
    assert jobs.last_lines(log) == [f"{REFUSAL} '1'"]  # the log says why again
    assert jobs.start(log, again=False) == 0 and not jobs.refused_marker(log).exists()  # a new run: a new start


@pytest.mark.parametrize(("lines", "code"), [
    (["Traceback (most recent call last):", "MemoryError"], 1),  # a traceback: not the CLI's one line
    ([REFUSAL], 137),  # killed (the OOM killer) after printing it: not the CLI's exit
    ([REFUSAL], 143),  # SIGTERM: a SLURM time limit
])
def test_other_failures_are_retried_with_more(tmp_path: Path, lines: list[str], code: int) -> None:
    log = _log(tmp_path, *lines)
    assert jobs.failed(log, code) == code
    assert not jobs.refused_marker(log).exists()
    assert [jobs.attempt_for(log, n) for n in (1, 2, 3)] == [1, 2, 3]


def test_failure_lines_name_the_failed_jobs_of_this_run(tmp_path: Path) -> None:
    old = _log(tmp_path, "embedpipe: error: an earlier run's")
    failed = tmp_path / "group-00001.log"
    failed.write_text(f"progress\n{REFUSAL}\n")
    done = tmp_path / "group-00002.log"
    done.write_text("group of 1 shard(s) ... embedded\n")
    (tmp_path / "group-00002.json").write_text("{}")
    since = time.time() - 5
    os.utime(old, (since - 60, since - 60))
    pairs = [(p, p.with_suffix(".json")) for p in (old, failed, done)]
    assert jobs.failure_lines(pairs, since) == [f"{failed}: {REFUSAL}"]


@pytest.mark.slow
def test_a_refusing_embed_job_fails_once_with_its_line(tmp_path: Path) -> None:
    """A calibration FASTA whose second record is invalid: the start-up check reads its first
    record only, the job reads them all and refuses. Its retries keep the first attempt's
    memory, do not run embed again, and the run ends with the job's line."""
    (tmp_path / "calib.fasta").write_text(">a\nMKTAYIAKQR\n>b\nMK1!!\n")
    config = demo_config(tmp_path, precision="int8-mixed", int8_smoothing="smoothquant",
                         int8_calibration="calib.fasta", tokens_per_shard=10**6)
    proc = run_workflow(tmp_path, config, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1
    blocks = re.findall(r"rule embed:\n(?:    .*\n)*?    resources: (.*)\n", out)
    assert len(blocks) == 3, out[-3000:]  # the first attempt and Snakemake's two retries
    mem = [re.search(r"mem_mb=(\d+)", b).group(1) for b in blocks]  # type: ignore[union-attr]
    assert len(set(mem)) == 1 and [("refused=1" in b) for b in blocks] == [False, True, True]
    assert out.count("(refused by the previous attempt; not run again)") == 2
    line = f"{REFUSAL} '1' at column 3 (residue 3)"
    assert f"embedpipe: embed job failed: out/logs/embed/group-00000.log: {line}" in proc.stderr
    assert (tmp_path / "out" / "logs" / "embed" / "group-00000.log").read_text().strip().splitlines()[-1] == line
