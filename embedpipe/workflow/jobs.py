"""Why an embed job failed, said in the terminal, and a failure that a retry would only repeat
not retried with more memory.

The embed rule (workflows/rules/embed.smk) runs ``python -m embedpipe.workflow.jobs start LOG
AGAIN`` before ``embedpipe embed`` and ``python -m embedpipe.workflow.jobs failed LOG RC`` after
it fails. Two failures are final (:func:`final_failure`): a refusal, whose exit code is the
CLI's user error (:data:`EXIT_USER_ERROR`) and whose log ends with the CLI's one line
(``embedpipe: error: ...``: embed's own checks; the same inputs refuse again, whatever the
memory), and an interrupt by the user (exit 130, SIGINT; or 143, SIGTERM, outside a SLURM job:
inside one SIGTERM is SLURM's own stop at a time limit or a preemption, retried). The line is
kept beside the log (``LOG.final``); Snakemake's retry of that job then gets the first
attempt's resources (the rule's resource functions ask :func:`attempt_for`) and repeats the
failure at once instead of embedding again, so the run ends failed. Any other failure is
retried, with more memory: running out of memory while loading or running
(``embedpipe: out of memory: ...``, a ``MemoryError`` traceback, a line that says an
allocation failed even inside an ``embedpipe: error:``), a kill by the kernel's OOM killer
(137), a time limit. The workflow's ``onerror`` prints each failed job's last line
(:func:`failure_lines`): on SLURM the job's own stderr is in a file the terminal never shows.
docs/cluster.md, "When a job fails".
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

from embedpipe.core.atomic import write_text_atomic
from embedpipe.core.errors import says_out_of_memory

#: the exit code of ``embedpipe`` for a user error (embedpipe.cli.exit): bad input, refused options
EXIT_USER_ERROR = 1
#: how the CLI starts the one line of a user error
ERROR_PREFIX = "embedpipe: error: "
#: the exit codes of an interrupted ``embedpipe`` (embedpipe.cli.exit): 128 + SIGINT, 128 + SIGTERM
EXIT_INTERRUPTED, EXIT_TERMINATED = 130, 143
#: how the CLI starts the one line of an interrupt
INTERRUPTED_PREFIX = "embedpipe: interrupted"
#: set in every SLURM job: there SIGTERM is SLURM's stop (time limit, preemption), not the user's
SLURM_JOB_ENV = "SLURM_JOB_ID"
#: log lines the failing job prints to its stderr (the terminal, or the SLURM job's log)
TAIL_LINES = 5


def final_marker(log: str | Path) -> Path:
    """Where a final failure keeps its exit code and its one line: beside its log."""
    return Path(f"{log}.final")


def last_lines(log: str | Path, count: int = TAIL_LINES) -> list[str]:
    """The last ``count`` non-empty lines of ``log`` ([] when it cannot be read)."""
    try:
        with open(log, "rb") as fh:
            fh.seek(0, 2)
            fh.seek(max(0, fh.tell() - 64 * 1024))
            text = fh.read().decode("utf-8", errors="replace")
    except OSError:
        return []
    return [line for line in text.splitlines() if line.strip()][-count:]


def refusal(log: str | Path, code: int) -> str | None:
    """The CLI's one line when exit ``code`` and ``log`` say the job refused its inputs; else
    None. A line that reports an allocation failure is never a refusal: more memory may help."""
    lines = last_lines(log, 1)
    if code == EXIT_USER_ERROR and lines and lines[-1].startswith(ERROR_PREFIX) and not says_out_of_memory(lines[-1]):
        return lines[-1]
    return None


def interruption(log: str | Path, code: int) -> str | None:
    """The job's line when exit ``code`` says the user interrupted it (SIGINT; SIGTERM outside
    a SLURM job); else None."""
    if code != EXIT_INTERRUPTED and (code != EXIT_TERMINATED or os.environ.get(SLURM_JOB_ENV)):
        return None
    lines = last_lines(log, 1)
    return lines[-1] if lines and lines[-1].startswith(INTERRUPTED_PREFIX) else f"{INTERRUPTED_PREFIX} (exit {code})"


def final_failure(log: str | Path, code: int) -> str | None:
    """The line of a failure a retry would only repeat (a refusal, the user's interrupt); else None."""
    return refusal(log, code) or interruption(log, code)


def attempt_for(log: str | Path, attempt: int) -> int:
    """The attempt a retried job's resources are sized for: the first again after a final failure."""
    return 1 if attempt > 1 and final_marker(log).exists() else attempt


def start(log: str | Path, again: bool) -> int:
    """Before a job runs: a retry after a final failure repeats its line and exit code; a first
    attempt removes a marker left by an earlier run."""
    marker = final_marker(log)
    if again and marker.exists():
        code_text, _, line = marker.read_text(encoding="utf-8").strip().partition(" ")
        how = "refused by" if line.startswith(ERROR_PREFIX) else "interrupted in"
        print(f"{line} ({how} the previous attempt; not run again)", file=sys.stderr)
        with open(log, "a", encoding="utf-8") as fh:  # Snakemake empties the log before a retry
            fh.write(line + "\n")
        return int(code_text) if code_text.isdigit() else EXIT_USER_ERROR
    marker.unlink(missing_ok=True)
    return 0


def failed(log: str | Path, code: int) -> int:
    """After a job failed with ``code``: its last log lines to stderr, a final failure kept (see
    the module's docstring); returns ``code`` for the shell to exit with."""
    lines = last_lines(log)
    print(f"embed job failed (exit {code}); the last lines of {log}:", file=sys.stderr)
    for line in lines:
        print(f"    {line}", file=sys.stderr)
    final = final_failure(log, code)
    if final is not None:
        write_text_atomic(final_marker(log), f"{code} {final}\n")
        why = ("a refusal of these inputs: retrying with more memory would refuse again" if code == EXIT_USER_ERROR
               else "interrupted by the user: not retried (rerun the workflow to go on)")
        print(f"    {why}", file=sys.stderr)
    return code


def failure_lines(jobs: Sequence[tuple[Path, Path]], since: float) -> list[str]:
    """``LOG: LAST LINE`` for each (log, output) of ``jobs`` whose log was written since
    ``since`` (a time) and whose output is missing: what ``onerror`` prints when a run fails."""
    out = []
    for log, output in sorted(jobs):
        try:
            recent = log.stat().st_mtime >= since
        except OSError:
            continue
        lines = last_lines(log, 1)
        if recent and not output.exists():
            out.append(f"{log}: {lines[-1] if lines else '(empty log)'}")
    return out


def main(argv: Sequence[str]) -> int:
    """``start LOG 0|1`` or ``failed LOG CODE`` (the embed rule's shell)."""
    if len(argv) != 3 or argv[0] not in ("start", "failed"):
        print("usage: python -m embedpipe.workflow.jobs start LOG 0|1 | failed LOG CODE", file=sys.stderr)
        return 2
    if argv[0] == "start":
        return start(argv[1], argv[2] == "1")
    return failed(argv[1], int(argv[2]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
