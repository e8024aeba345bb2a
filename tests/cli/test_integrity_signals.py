"""Issue 19, C: SIGTERM (scancel, a SLURM time limit) ends a command as Ctrl-C does, with its
temporary removed and exit 143; temporaries that a killed process (SIGKILL) left are removed
by the next run that writes the same output (embedpipe/cli/exit.py, embedpipe/core/atomic.py).

The runs are real subprocesses of the console entry point. To signal them mid-run
deterministically, the child replaces the step after the temporary is created with an
endless sleep, and the test signals only once the temporary exists."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import h5py
import pytest

from embedpipe.core.atomic import temp_path_for
from embedpipe.core.options import EmbedOptions
from embedpipe.export import export_store
from embedpipe.extraction.run import embed_fasta
from helpers.embed_helpers import random_sequences, write_fasta
from helpers.processes import wait_until

ROOT = Path(__file__).resolve().parents[2]

#: the child: the embed forward (or the export's block reader) never ends, then the real CLI
CHILD = """
import sys, time
import embedpipe.extraction.engine, embedpipe.export.run
def endless(*args, **kwargs):
    while True:
        time.sleep(0.02)
        yield from ()
embedpipe.extraction.engine.Engine.embed = endless
embedpipe.export.run.iter_blocks = endless
sys.argv = ["embedpipe", *sys.argv[1:]]
from embedpipe.cli import run
run()
"""


def _start(args: list[str], cwd: Path) -> subprocess.Popen:
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", CHILD, *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _temporaries(directory: Path, name: str) -> list[Path]:
    return sorted(directory.glob(f".{name}.*.tmp"))


def _wait_for_temporary(proc: subprocess.Popen, directory: Path, name: str) -> Path:
    """Block until the child has created its temporary."""
    return wait_until(proc, lambda: _temporaries(directory, name), f"a temporary of {name} appeared")[0]


def test_sigterm_on_embed_says_interrupted_exits_143_and_removes_the_temporary(tmp_path, tiny_model_path):
    write_fasta(tmp_path / "x.fasta", random_sequences(4, (8, 30)))
    proc = _start(["embed", "x.fasta", "--model", str(tiny_model_path), "--out", "x.h5", "--device", "cpu", "-q"],
                  tmp_path)
    tmp = _wait_for_temporary(proc, tmp_path, "x.h5")
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 143, stderr
    assert stderr.strip().splitlines()[-1] == "embedpipe: interrupted"
    assert not tmp.exists() and _temporaries(tmp_path, "x.h5") == [] and not (tmp_path / "x.h5").exists()


@pytest.fixture
def store(tmp_path, tiny_model_path) -> Path:
    fasta = write_fasta(tmp_path / "x.fasta", random_sequences(4, (8, 30)))
    embed_fasta(fasta, model=str(tiny_model_path), out=tmp_path / "x.h5", options=EmbedOptions(device="cpu"),
                quiet=True)
    return tmp_path / "x.h5"


def test_the_rerun_of_a_killed_export_removes_the_temporary_it_left(tmp_path, store):
    proc = _start(["export", str(store), "--format", "h5-per-id", "--out", "e.h5", "-q"], tmp_path)
    left = _wait_for_temporary(proc, tmp_path, "e.h5")
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=300)
    assert left.exists()  # SIGKILL runs no cleanup: the next run must
    export_store(store, fmt="h5-per-id", out=tmp_path / "e.h5", quiet=True)
    assert _temporaries(tmp_path, "e.h5") == []
    with h5py.File(tmp_path / "e.h5", "r") as f:
        assert len(f.keys()) == 4


def test_a_live_writers_temporary_is_left_alone(tmp_path):
    out = tmp_path / "o.h5"
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        theirs = tmp_path / temp_path_for(out).name.replace(f".{os.getpid()}-", f".{live.pid}-")
        theirs.write_bytes(b"partial")
        mine = temp_path_for(out)  # a new writer of o.h5 starts
        assert theirs.exists() and mine.exists()
    finally:
        live.kill()
        live.wait()
    temp_path_for(out)  # now that writer is gone: its temporary goes
    assert not theirs.exists()
