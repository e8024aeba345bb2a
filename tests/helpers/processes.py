"""Waiting on a child process from a test: until a condition holds, with a deadline only
against a hang, and the child's output in the failure when it ends first."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

#: the checkout whose package the child processes import
ROOT = Path(__file__).resolve().parents[2]

T = TypeVar("T")


def wait_until(proc: subprocess.Popen, ready: Callable[[], T], what: str, timeout: float = 300) -> T:
    """Poll ``ready()`` until it is truthy and return it; fail naming ``what`` if the child ends
    first or ``timeout`` seconds pass (the child is killed then)."""
    deadline = time.monotonic() + timeout
    while not (found := ready()):
        if proc.poll() is not None:
            raise AssertionError(f"the child ended before {what}: {proc.communicate()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)
    return found


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """``python -m embedpipe.cli ARGS``, output captured, with this checkout's package first on the path."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "embedpipe.cli", *args], capture_output=True, text=True, env=env)


def _high_water(pid: int) -> int:
    """VmHWM of ``pid`` in bytes (0 once it has exited): the peak RSS of its own address space."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def run_measured(args: list[str], timeout: float = 300, env: dict[str, str] | None = None
                 ) -> tuple[int, str, str, int]:
    """(exit code, stdout, stderr, peak RSS in bytes) of one child process.

    The peak is the child's VmHWM, polled until it exits: its address space starts anew at
    exec. ``wait4``'s ``ru_maxrss`` would not do: Linux carries the parent's RSS at fork into
    the child's, so a child of a pytest process grown to 2 GB reports 2 GB."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(args, stdout=out, stderr=err, env=env if env is not None else {**os.environ})
        peak, deadline = 0, time.monotonic() + timeout
        while proc.poll() is None:
            peak = max(peak, _high_water(proc.pid))
            if time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                raise AssertionError(f"{args} ran past {timeout} s")
            time.sleep(0.01)
        out.seek(0)
        err.seek(0)
        return proc.returncode, out.read(), err.read(), peak
