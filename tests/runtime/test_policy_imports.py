"""The int8 policy's module and the policy table import in either order (a script that
imports ``embedpipe.runtime.int8_policy`` first used to fail on a circular import)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from embedpipe.core.options import POLICY_NAMES

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("first", ["embedpipe.runtime.int8_policy", "embedpipe.runtime.precision"])
def test_either_module_first_gives_every_policy(first: str) -> None:
    code = (f"import {first}\nfrom embedpipe.runtime.precision import POLICIES\n"
            "print(' '.join(POLICIES)); print(type(POLICIES['int8-mixed']).__name__)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert done.returncode == 0, done.stderr[-2000:]
    names, cls = done.stdout.splitlines()
    assert names.split() == list(POLICY_NAMES) and cls == "Int8MixedPolicy"
