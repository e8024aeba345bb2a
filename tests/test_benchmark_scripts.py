"""Every benchmark script answers --help with its usage, and runs nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
#: scripts; modules named _*.py are helpers the scripts import (benchmarks/_gpu_acceptance_*.py)
SCRIPTS = sorted(p for p in BENCHMARKS.glob("*.py") if not p.name.startswith("_"))


def test_the_gpu_acceptance_script_is_among_the_scripts_checked():
    assert BENCHMARKS / "gpu_acceptance.py" in SCRIPTS
    assert not [p for p in SCRIPTS if p.name.startswith("_")]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_help_prints_usage_and_runs_nothing(script, tmp_path):
    proc = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.lstrip().startswith("usage:"), proc.stdout[:500]
    assert list(tmp_path.iterdir()) == []  # nothing written: nothing ran
