"""The console entry point: every failure is one line on stderr with a non-zero exit code."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "embedpipe.cli", *args], capture_output=True, text=True)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("embed", "x.fa", "--model", "m.pt", "--out", "o.h5", "--layers", "abc"), "Invalid value for '--layers'"),
        (("info",), "Missing argument"),
        (("frobnicate",), "No such command 'frobnicate'"),
        (("shard", "/nonexistent/input.fasta", "--out", "shards"), "/nonexistent/input.fasta"),
        (
            ("embed", "x.fa", "--model", "m.pt", "--out", "o.h5", "--overflow-margin", "nan"),
            "--overflow-margin must be a number in (0, 1], not nan",
        ),
        (
            ("embed", "x.fa", "--model", "m.pt", "--out", "o.h5", "--overflow-margin", "0"),
            "--overflow-margin must be a number in (0, 1], not 0.0",
        ),
    ],
)
def test_usage_and_input_errors_are_one_line(args, message, tmp_path):
    result = subprocess.run([sys.executable, "-m", "embedpipe.cli", *args], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("embedpipe: error: ") and message in lines[0]


def test_version_and_help_exit_zero():
    assert _run("--version").returncode == 0
    result = _run("embed", "--help")
    assert result.returncode == 0 and "--precision" in result.stdout


@pytest.mark.parametrize("margin", [float("nan"), float("inf"), 0.0, -0.5, 1.5])
def test_overflow_margin_outside_0_1_is_refused(margin):
    from embedpipe.errors import EmbedpipeError
    from embedpipe.options import EmbedOptions

    with pytest.raises(EmbedpipeError, match=r"must be a number in \(0, 1\]"):
        EmbedOptions(overflow_margin=margin).validate()
    EmbedOptions(overflow_margin=1.0).validate()
