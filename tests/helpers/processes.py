"""Waiting on a child process from a test: until a condition holds, with a deadline only
against a hang, and the child's output in the failure when it ends first."""

from __future__ import annotations

import os
import subprocess
import sys
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
