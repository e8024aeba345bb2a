"""A failing embed job says why in the terminal; a refusal of its inputs and an interrupt by the
user are not retried (issue 34, item 2); running out of memory, however it shows, is retried
with more memory (embedpipe.workflow.jobs)."""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import pytest

from embedpipe.workflow import jobs
from helpers.workflow_helpers import _env, demo_config, run_workflow

REFUSAL = ("embedpipe: error: --int8-smoothing smoothquant:FASTA (workflow: int8_calibration): "
           "calib.fasta:4: record 'b': invalid character")


def _log(tmp_path: Path, *lines: str) -> Path:
    log = tmp_path / "group-00000.log"
    log.write_text("".join(line + "\n" for line in lines))
    return log


def test_a_refusal_is_kept_and_repeated_not_rerun(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = _log(tmp_path, "loading", f"{REFUSAL} '1'")
    assert jobs.failed(log, 1) == 1
    err = capsys.readouterr().err
    assert f"{REFUSAL} '1'" in err and "would refuse again" in err
    assert jobs.final_marker(log).read_text() == f"1 {REFUSAL} '1'\n"
    assert [jobs.attempt_for(log, n) for n in (1, 2, 3)] == [1, 1, 1]
    log.write_text("")  # what Snakemake leaves before the retry
    assert jobs.start(log, again=True) == jobs.EXIT_USER_ERROR
    assert "(refused by the previous attempt; not run again)" in capsys.readouterr().err
    assert jobs.last_lines(log) == [f"{REFUSAL} '1'"]  # the log says why again
    assert jobs.start(log, again=False) == 0 and not jobs.final_marker(log).exists()  # a new run: a new start


#: torch's allocator failing while the weights load (``ulimit -v``), as a loader that wrapped
#: every failure in a one-line error printed it
WRAPPED_ALLOCATION = ("embedpipe: error: cannot read checkpoint m.pt: [enforce fail at alloc_cpu.cpp:117] data. "
                      "DefaultCPUAllocator: can't allocate memory: you tried to allocate 1048576 bytes. Error code 12 "
                      "(Cannot allocate memory) (corrupt, truncated, or not a torch file)")


@pytest.mark.parametrize(("lines", "code", "slurm"), [
    (["Traceback (most recent call last):", "MemoryError"], 1, False),  # a traceback: not the CLI's one line
    ([WRAPPED_ALLOCATION], 1, False),  # out of memory in a refusal's words: still out of memory
    (["embedpipe: out of memory: RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB"], 3, False),
    ([REFUSAL], 137, False),  # killed (the OOM killer) after printing it: not the CLI's exit
    (["embedpipe: interrupted"], 143, True),  # SIGTERM in a SLURM job: a time limit, a preemption
])
def test_other_failures_are_retried_with_more(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lines: list[str],
                                              code: int, slurm: bool) -> None:
    if slurm:
        monkeypatch.setenv("SLURM_JOB_ID", "4242")
    else:
        monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    log = _log(tmp_path, *lines)
    assert jobs.failed(log, code) == code
    assert not jobs.final_marker(log).exists()
    assert [jobs.attempt_for(log, n) for n in (1, 2, 3)] == [1, 2, 3]
    assert jobs.start(log, again=False) == 0  # the retry runs


@pytest.mark.parametrize(("code", "slurm"), [(130, False), (130, True), (143, False)])
def test_an_interrupt_by_the_user_is_final_not_retried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str], code: int,
                                                       slurm: bool) -> None:
    """SIGINT anywhere, SIGTERM outside SLURM: the user's decision. Its retries keep the first
    attempt's resources and end at once with the same line and exit code."""
    if slurm:
        monkeypatch.setenv("SLURM_JOB_ID", "4242")
    else:
        monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    line = "embedpipe: interrupted during shard 2 of 3 (s1.fasta -> stores/s1.h5, not finished); done: stores/s0.h5"
    log = _log(tmp_path, "loading", line)
    assert jobs.failed(log, code) == code
    assert "interrupted by the user: not retried" in capsys.readouterr().err
    assert [jobs.attempt_for(log, n) for n in (1, 2, 3)] == [1, 1, 1]
    log.write_text("")
    assert jobs.start(log, again=True) == code
    assert f"{line} (interrupted in the previous attempt; not run again)" in capsys.readouterr().err
    assert jobs.last_lines(log) == [line]


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


#: ``embedpipe`` as the embed rule's shell finds it first on PATH: before an ``embed`` runs, the
#: calibration FASTA the start-up check accepted gets an invalid second record (a file edited
#: between the workflow's start and the job), so the real CLI refuses it in the job
EDITOR = """#!{python}
import sys
from pathlib import Path
if sys.argv[1:2] == ["embed"]:
    Path({calibration!r}).write_text(">a\\nMKTAYIAKQR\\n>b\\nMK1!!\\n")
sys.argv[0] = "embedpipe"
from embedpipe.cli import run
run()
"""


def _stand_in(tmp_path: Path, text: str) -> dict[str, str]:
    """The environment with ``text`` as the first ``embedpipe`` on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    worker = bin_dir / "embedpipe"
    worker.write_text(text)
    worker.chmod(0o755)
    env = _env()
    env["PATH"] = os.pathsep.join([str(bin_dir), env["PATH"]])
    env.pop("SLURM_JOB_ID", None)
    return env


@pytest.mark.slow
def test_a_refusing_embed_job_fails_once_with_its_line(tmp_path: Path) -> None:
    """A calibration FASTA valid when the workflow starts and invalid when the job reads it
    (the start-up check reads it in full, so only a later edit reaches the job): the job
    refuses; its retries keep the first attempt's memory, do not run embed again, and the run
    ends with the job's line."""
    calibration = tmp_path / "calib.fasta"
    calibration.write_text(">a\nMKTAYIAKQR\n>b\nMKTAYIAKQR\n")
    env = _stand_in(tmp_path, EDITOR.format(python=sys.executable, calibration=str(calibration)))
    config = demo_config(tmp_path, precision="int8-mixed", int8_smoothing="smoothquant",
                         int8_calibration="calib.fasta", tokens_per_shard=10**6)
    proc = run_workflow(tmp_path, config, check=False, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1
    blocks = re.findall(r"rule embed:\n(?:    .*\n)*?    resources: (.*)\n", out)
    assert len(blocks) == 3, out[-3000:]  # the first attempt and Snakemake's two retries
    mem = [re.search(r"mem_mb=(\d+)", b).group(1) for b in blocks]  # type: ignore[union-attr]
    assert len(set(mem)) == 1 and [("repeat=1" in b) for b in blocks] == [False, True, True]
    assert out.count("(refused by the previous attempt; not run again)") == 2
    line = f"{REFUSAL} '1' at column 3 (residue 3)"
    assert f"embedpipe: embed job failed: out/logs/embed/group-00000.log: {line}" in proc.stderr
    assert (tmp_path / "out" / "logs" / "embed" / "group-00000.log").read_text().strip().splitlines()[-1] == line


#: ``embedpipe`` as the embed rule's shell finds it first on PATH: the first ``embed`` sends
#: itself SIGINT once it starts embedding (a user's ``kill -INT`` of the worker while Snakemake,
#: in the background, gets no signal); every other call is the real CLI, unchanged
WORKER = """#!{python}
import os, signal, sys
from pathlib import Path
FLAG = Path({flag!r})
if sys.argv[1:2] == ["embed"] and not FLAG.exists():
    FLAG.write_text("interrupted once")
    import embedpipe.extraction.engine as engine
    def embed(self, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        return iter(())
    engine.Engine.embed = embed
sys.argv[0] = "embedpipe"
from embedpipe.cli import run
run()
"""


@pytest.mark.slow
def test_a_worker_interrupted_by_the_user_is_not_retried_and_the_run_fails(tmp_path: Path) -> None:
    """Before, the interrupted job was retried with twice the memory and runtime, the retry
    embedded everything and the run ended 0: the user's Ctrl-C turned into a success."""
    env = _stand_in(tmp_path, WORKER.format(python=sys.executable, flag=str(tmp_path / "interrupted")))
    config = demo_config(tmp_path, tokens_per_shard=10**6)
    proc = run_workflow(tmp_path, config, check=False, env=env)
    out = proc.stdout + proc.stderr
    assert (tmp_path / "interrupted").exists(), out[-3000:]
    assert proc.returncode != 0, out[-3000:]
    blocks = re.findall(r"rule embed:\n(?:    .*\n)*?    resources: (.*)\n", out)
    assert len(blocks) == 3, out[-3000:]  # the first attempt and Snakemake's two retries
    mem = [re.search(r"mem_mb=(\d+)", b).group(1) for b in blocks]  # type: ignore[union-attr]
    assert len(set(mem)) == 1 and [("repeat=1" in b) for b in blocks] == [False, True, True]
    assert out.count("(interrupted in the previous attempt; not run again)") == 2
    log = tmp_path / "out" / "logs" / "embed" / "group-00000.log"
    line = log.read_text().strip().splitlines()[-1]
    assert line.startswith("embedpipe: interrupted during shard 1 of "), line
    assert f"embedpipe: embed job failed: out/logs/embed/group-00000.log: {line}" in proc.stderr
    assert not (tmp_path / "out" / "embeddings.h5").exists()

