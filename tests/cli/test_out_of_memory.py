"""Running out of memory is never a refusal (embedpipe.core.errors.out_of_memory,
embedpipe.cli.exit, embedpipe.workflow.jobs): torch's allocator failing while the weights load
(what ``ulimit -v`` gives) was wrapped as ``embedpipe: error: cannot read checkpoint ...`` with
exit 1, which the workflow kept as a refusal and retried with the first attempt's memory
without running, so a job that needed more memory never got it. Now it ends with
``embedpipe: out of memory: ...`` and exit 3, and the job is retried with more memory; a
``MemoryError`` or an allocation failure while embedding ends the same way."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from embedpipe.cli.exit import EXIT_OUT_OF_MEMORY
from embedpipe.core.errors import ModelError, out_of_memory
from embedpipe.model import checkpoint
from embedpipe.model.checkpoint import load_checkpoint_safely
from embedpipe.workflow import jobs
from helpers.embed_helpers import random_sequences, write_fasta

ROOT = Path(__file__).resolve().parents[2]

#: what torch's CPU allocator raises when the address space is used up (``ulimit -v``)
ALLOCATOR = ("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you tried to "
             "allocate 1048576 bytes. Error code 12 (Cannot allocate memory)")

#: the child: the CLI with one allocation failing where SITE says (argv[1]), then the real CLI
CHILD = """
import sys
SITE, ALLOCATOR = sys.argv.pop(1), sys.argv.pop(1)
def fail(*args, **kwargs):
    if SITE == "memoryerror":
        raise MemoryError
    raise RuntimeError(ALLOCATOR)
if SITE == "load":
    import torch
    torch.load = fail
else:
    import embedpipe.extraction.engine as engine
    engine.Engine.embed = fail
sys.argv = ["embedpipe", *sys.argv[1:]]
from embedpipe.cli import run
run()
"""


def _embed(tmp_path: Path, model: Path, site: str) -> subprocess.CompletedProcess[str]:
    write_fasta(tmp_path / "x.fasta", random_sequences(3, (8, 30)))
    return subprocess.run([sys.executable, "-c", CHILD, site, ALLOCATOR, "embed", "x.fasta", "--model", str(model),
                           "--out", "x.h5", "--device", "cpu", "-q"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600, env=os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})


def test_an_allocation_failure_while_the_weights_load_is_not_a_corrupt_checkpoint(tiny_model_path, monkeypatch):
    def fail(*args, **kwargs):
        raise RuntimeError(ALLOCATOR)

    monkeypatch.setattr(torch, "load", fail)
    with pytest.raises(RuntimeError, match="can't allocate memory") as info:
        load_checkpoint_safely(tiny_model_path)
    assert not isinstance(info.value, ModelError) and out_of_memory(info.value)
    monkeypatch.setattr(checkpoint, "_load_weights_only", lambda path: (_ for _ in ()).throw(ValueError("bad zip")))
    with pytest.raises(ModelError, match="corrupt, truncated"):  # a real read failure is still refused
        load_checkpoint_safely(tiny_model_path)


@pytest.mark.parametrize(("site", "line"), [
    ("load", f"embedpipe: out of memory: RuntimeError: {ALLOCATOR}"),
    ("embed", f"embedpipe: out of memory: RuntimeError: {ALLOCATOR}"),
    ("memoryerror", "embedpipe: out of memory: MemoryError"),
])
def test_out_of_memory_ends_in_one_line_and_the_job_is_retried_with_more(tmp_path, tiny_model_path, monkeypatch,
                                                                         site, line):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    result = _embed(tmp_path, tiny_model_path, site)
    assert (result.returncode, result.stderr.splitlines()) == (EXIT_OUT_OF_MEMORY, [line])
    assert not (tmp_path / "x.h5").exists()
    log = tmp_path / "group-00000.log"  # what the embed rule's shell makes of it
    log.write_text(result.stderr)
    assert jobs.failed(log, result.returncode) == EXIT_OUT_OF_MEMORY
    assert not jobs.final_marker(log).exists()
    assert [jobs.attempt_for(log, n) for n in (1, 2, 3)] == [1, 2, 3]  # mem_mb x attempt


@pytest.mark.parametrize("exc", [MemoryError(), OSError(12, "Cannot allocate memory"),
                                 RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB"),
                                 RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate 8 bytes")])
def test_what_counts_as_out_of_memory(exc):
    assert out_of_memory(exc)


@pytest.mark.parametrize("exc", [ModelError("the fp16 model of m does not fit in memory on cuda:0"),
                                 OSError(28, "No space left on device"), RuntimeError("shape mismatch"),
                                 ValueError("out of memory")])
def test_what_does_not(exc):
    assert not out_of_memory(exc)
