"""Under CI=true a skipped slurm, browser or peer test fails the run; elsewhere it stays a skip."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SAMPLE = '''
import pytest

@pytest.mark.slurm
@pytest.mark.skip(reason="no SLURM cluster here")
def TEST_needs_slurm():
    pass

@pytest.mark.browser
def TEST_needs_browser():
    pytest.skip("no chromium")

@pytest.mark.slow
@pytest.mark.skip(reason="an ordinary skip")
def TEST_ordinary_skip():
    pass

def TEST_passes():
    assert True
'''


def _run(tmp_path: Path, ci: str | None) -> subprocess.CompletedProcess:
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    # the sample's test names are spelled TEST_ here so that only the inner run collects them
    (tmp_path / "test_sample.py").write_text(SAMPLE.replace("def TEST_", "def test_"))
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    # the copied conftest imports the shared fixtures from tests/helpers
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(__file__).parent), env.get("PYTHONPATH")) if p)
    if ci is not None:
        env["CI"] = ci
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", str(tmp_path)],
        capture_output=True, text=True, cwd=tmp_path, env=env,
    )


@pytest.mark.parametrize("ci", ["true", "1"])
def test_must_run_skips_fail_under_ci(tmp_path, ci):
    proc = _run(tmp_path, ci)
    assert proc.returncode == 1, proc.stdout
    # a skip in setup (skip marker) fails as an error, one in the test body as a failure
    assert "1 failed, 1 passed, 1 skipped" in proc.stdout and "1 error" in proc.stdout
    assert "slurm test skipped under CI=true (it must run in CI): no SLURM cluster here" in proc.stdout
    assert "browser test skipped under CI=true" in proc.stdout and "no chromium" in proc.stdout


def test_skips_stay_skips_outside_ci(tmp_path):
    proc = _run(tmp_path, None)
    assert proc.returncode == 0, proc.stdout
    assert "1 passed, 3 skipped" in proc.stdout
    assert "no SLURM cluster here" in proc.stdout  # the reason is printed (-rA / -ra)
