"""Ctrl-C and SIGTERM during `embedpipe merge` (issue 30): always one line, 130 or 143, and
no output that is not complete. Raised inside h5py's Cython code, the interrupt had ended 4 of
22 merges with ``SystemError: FastRLock.__exit__ ...`` and exit 1 (embedpipe/core/interrupts.py
holds it back to the points between files and blocks)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from embedpipe.store import EmbeddedRecord, open_store
from embedpipe.store.validate import validate_store
from helpers.processes import wait_until
from helpers.stores import write_store

ROOT = Path(__file__).resolve().parents[2]

#: the child: every h5py dataset write first signals the process itself (SIGTERM or SIGINT)
#: and gives the handler time to run; a marker says whether the write itself then completed
CHILD_IN_H5PY = """
import os, signal, sys, time
import h5py
real = h5py.Dataset.__setitem__
sig = getattr(signal, sys.argv[1])
marker = sys.argv[2]
def signalled(self, key, value):
    if not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getpid(), sig)
        time.sleep(0.2)  # the handler runs now, inside this h5py call
        real(self, key, value)
        open(marker, "a").write("write completed")
        return
    real(self, key, value)
h5py.Dataset.__setitem__ = signalled
sys.argv = ["embedpipe", *sys.argv[3:]]
from embedpipe.cli import run
run()
"""


def _records(k: int) -> list[EmbeddedRecord]:
    out = []
    for i in range(6):
        rows = np.cos(np.arange((5 + i) * 4, dtype=np.float32).reshape(5 + i, 4) + i + k)
        out.append(EmbeddedRecord(id=f"s{k}_{i}", sequence="ACDEFGHIKLMNPQRSTVWY"[:5 + i], precision_used="fp32",
                                  mean={2: rows.sum(axis=0, dtype=np.float32) / np.float32(len(rows))},
                                  per_residue={2: rows}, embedded_length=len(rows)))
    return out


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    d = tmp_path_factory.mktemp("stores")
    return [write_store(d / f"s{k:03d}.h5", _records(k)) for k in range(40)]


def _env() -> dict[str, str]:
    return os.environ | {"PYTHONPATH": str(ROOT)}


def _leftovers(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith("."))


@pytest.mark.parametrize(("name", "code"), [("SIGTERM", 143), ("SIGINT", 130)])
def test_a_signal_inside_an_h5py_call_is_raised_after_it(tmp_path: Path, stores: list[Path], name: str,
                                                        code: int) -> None:
    """Deterministic: the signal arrives inside the first dataset write of the merge."""
    out, marker = tmp_path / "merged.h5", tmp_path / "marker"
    proc = subprocess.run([sys.executable, "-c", CHILD_IN_H5PY, name, str(marker), "merge", *map(str, stores),
                           "--out", str(out), "-q"], capture_output=True, text=True, env=_env(), timeout=300)
    assert (proc.returncode, proc.stderr) == (code, "embedpipe: interrupted\n")
    assert marker.read_text() == "write completed"  # main: the interrupt was raised inside the write
    assert not out.exists()
    assert _leftovers(out) == []


#: the child: each block copy of the merge takes 10 ms longer, so that a merge of 40 small
#: stores lasts seconds on any machine and a signal at a random moment lands mid-merge
CHILD_SLOWER = """
import sys, time
import embedpipe.store.merge as merge
real = merge._copy_rows
def slower(*args, **kwargs):
    time.sleep(0.01)
    return real(*args, **kwargs)
merge._copy_rows = slower
sys.argv = ["embedpipe", *sys.argv[1:]]
from embedpipe.cli import run
run()
"""


def test_signals_at_random_times_during_merge_end_in_one_line(tmp_path: Path, stores: list[Path]) -> None:
    """12 merges, each signalled at a random moment once it has begun writing (SIGINT and
    SIGTERM in turn): 130 or 143 with one line, no temporary left, and an output only when it
    is complete (the signal came as it was being renamed into place, or after)."""
    rng = random.Random(30)
    outcomes = []
    for run in range(12):
        out = tmp_path / f"run{run}" / "merged.h5"
        out.parent.mkdir()
        sig, code = (signal.SIGINT, 130) if run % 2 == 0 else (signal.SIGTERM, 143)
        proc = subprocess.Popen([sys.executable, "-c", CHILD_SLOWER, "merge", *map(str, stores), "--out", str(out),
                                 "-q"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
        wait_until(proc, lambda: _leftovers(out) or out.exists(), "the merge began writing")  # noqa: B023 - waited on here
        time.sleep(rng.uniform(0, 1.5))
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=300)
        outcomes.append((proc.returncode, err))
        assert (proc.returncode, err) in ((code, "embedpipe: interrupted\n"), (0, ""), (-sig, "")), (run, err)
        assert _leftovers(out) == [], run
        if out.exists():  # complete, never a partial file
            assert validate_store(out) == [], run
            assert len(open_store(out).ids) == 6 * len(stores)
    assert sum(rc in (130, 143) for rc, _ in outcomes) >= 6, outcomes  # most were interrupted mid-merge


#: the child: the signal arrives while typer parses the arguments, before the command runs
CHILD_PARSING = """
import os, signal, sys, time
import typer.core
real = typer.core.TyperCommand.make_context
sig = getattr(signal, sys.argv[1])
def signalled(self, *args, **kwargs):
    os.kill(os.getpid(), sig)
    time.sleep(0.2)
    return real(self, *args, **kwargs)
typer.core.TyperCommand.make_context = signalled
sys.argv = ["embedpipe", *sys.argv[2:]]
from embedpipe.cli import run
run()
"""


@pytest.mark.parametrize(("name", "code"), [("SIGTERM", 143), ("SIGINT", 130)])
def test_a_signal_while_the_arguments_are_parsed_is_one_line_too(tmp_path: Path, stores: list[Path], name: str,
                                                                code: int) -> None:
    """typer turned an interrupt outside the command into a silent 130 (SIGTERM included)."""
    out = tmp_path / "merged.h5"
    proc = subprocess.run([sys.executable, "-c", CHILD_PARSING, name, "merge", *map(str, stores[:2]), "--out",
                           str(out), "-q"], capture_output=True, text=True, env=_env(), timeout=300)
    assert (proc.returncode, proc.stderr) == (code, "embedpipe: interrupted\n")
    assert not out.exists()
