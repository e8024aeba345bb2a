"""``embed`` refuses, in one line and before the model loads, what it cannot read twice or write:

* a FASTA that is a pipe: a named FIFO hung forever (the first pass drained it, the second
  ``open`` waited for a writer), and ``<(cat in.fa)`` stored the records with the
  ``input_sha256`` of an empty input; the same check as ``shard``'s
  (embedpipe/inputs/fasta.py, ``check_regular_file``), and for the int8 calibration FASTA too.

Independent computation: the paths each line must name are the ones the test made."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from helpers.embed_helpers import write_fasta
from helpers.processes import ROOT

#: a refusal comes before the model loads: seconds; the hang it replaces never ended
TIMEOUT = 120


def _embed(args: list[str], cwd: Path, shell: bool = False) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if shell:  # a process substitution needs bash
        line = " ".join([f"'{sys.executable}'", "-m", "embedpipe.cli", "embed", *args])
        return subprocess.run(["bash", "-c", line], capture_output=True, text=True, env=env, cwd=cwd, timeout=TIMEOUT)
    return subprocess.run([sys.executable, "-m", "embedpipe.cli", "embed", *args], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=TIMEOUT)


def _one_line(proc: subprocess.CompletedProcess[str]) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    return lines[0]


PIPE = ("is a pipe (FIFO); embed needs a regular file (it reads the records, then the file again for the "
        "input_sha256 its store records), so write the stream to a file first")


def test_a_named_pipe_is_refused_in_one_line_not_waited_on(tmp_path, tiny_model_path) -> None:
    fifo = tmp_path / "in.fa"
    os.mkfifo(fifo)
    proc = _embed([str(fifo), "--model", str(tiny_model_path), "--out", "b.h5", "--device", "cpu"], tmp_path)
    assert _one_line(proc) == f"embedpipe: error: {fifo}: {PIPE}"
    assert not (tmp_path / "b.h5").exists()


def test_a_process_substitution_stores_nothing(tmp_path, tiny_model_path) -> None:
    """``embed <(cat in.fa)``: before, a store whose input_sha256 was the empty input's."""
    write_fasta(tmp_path / "in.fa", [("a", "MKTAYIAKQR"), ("b", "MKV")])
    proc = _embed(["<(cat in.fa)", "--model", f"'{tiny_model_path}'", "--out", "b.h5", "--device", "cpu"], tmp_path,
                  shell=True)
    line = _one_line(proc)
    assert line.startswith("embedpipe: error: /dev/fd/") and line.endswith(PIPE), line
    assert not (tmp_path / "b.h5").exists()


def test_a_group_with_a_pipe_among_its_shards_is_refused(tmp_path, tiny_model_path) -> None:
    shard = write_fasta(tmp_path / "shard-0.fasta", [("a", "MKTAYIAKQR")])
    fifo = tmp_path / "shard-1.fasta"
    os.mkfifo(fifo)
    proc = _embed([str(shard), str(fifo), "--model", str(tiny_model_path), "--out-dir", "stores", "--device", "cpu"],
                  tmp_path)
    assert _one_line(proc) == f"embedpipe: error: {fifo}: {PIPE}"
    assert not list((tmp_path / "stores").glob("*.h5"))


def test_an_int8_calibration_pipe_is_refused(tmp_path, tiny_model_path) -> None:
    fasta = write_fasta(tmp_path / "in.fa", [("a", "MKTAYIAKQR")])
    fifo = tmp_path / "calib.fa"
    os.mkfifo(fifo)
    proc = _embed([str(fasta), "--model", str(tiny_model_path), "--out", "b.h5", "--device", "cpu", "--precision",
                   "int8-mixed", "--int8-smoothing", f"smoothquant:{fifo}"], tmp_path)
    assert _one_line(proc) == ("embedpipe: error: --int8-smoothing smoothquant:FASTA (workflow: int8_calibration): "
                               f"{fifo}: is a pipe (FIFO); embed needs a regular file (it reads the set here, then "
                               "to calibrate and for its sha256), so write the stream to a file first")


