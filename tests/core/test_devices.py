"""Device selection and the one-GPU-per-worker lock (exercised with lock files, no GPU needed)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from embedpipe.core import devices
from embedpipe.core.devices import claim_device, claim_slot, resolve_device
from embedpipe.core.errors import EmbedpipeError


def test_resolve_device_on_a_cpu_machine(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("CPU") == torch.device("cpu")
    with pytest.raises(EmbedpipeError, match="CUDA is not available"):
        resolve_device("cuda")
    with pytest.raises(EmbedpipeError, match="unknown device 'gpu0'|unsupported device"):
        resolve_device("gpu0")
    with claim_device("cpu") as device:
        assert device.type == "cpu"


def test_resolve_device_index_beyond_visible_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(EmbedpipeError, match="only 2 CUDA device"):
        resolve_device("cuda:2")


def test_concurrent_workers_get_different_gpus(tmp_path):
    keys = ["GPU-aaaa", "GPU-bbbb", "GPU-cccc"]
    first, h1 = claim_slot(keys, tmp_path)
    second, h2 = claim_slot(keys, tmp_path)
    third, h3 = claim_slot(keys, tmp_path)
    assert sorted([first, second, third]) == [0, 1, 2]
    with pytest.raises(EmbedpipeError, match="no free GPU"):
        claim_slot(keys, tmp_path, poll_seconds=0.05, timeout=0.2)
    h2.close()  # a worker finishes: its GPU is free again
    again, h4 = claim_slot(keys, tmp_path, poll_seconds=0.05, timeout=1)
    assert again == second
    for handle in (h1, h3, h4):
        handle.close()


def test_lock_is_released_when_a_worker_process_dies(tmp_path):
    keys = ["GPU-only"]
    code = (
        "import sys, os; from pathlib import Path; from embedpipe.core.devices import claim_slot;"
        f"i, h = claim_slot({keys!r}, Path({str(tmp_path)!r})); os._exit(0)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    index, handle = claim_slot(keys, tmp_path, poll_seconds=0.05, timeout=1)
    assert index == 0
    handle.close()


def test_explicit_gpu_waits_for_that_gpu_only(tmp_path):
    keys = ["GPU-a", "GPU-b"]
    taken, handle = claim_slot(keys, tmp_path, candidates=[1])
    assert taken == 1
    with pytest.raises(EmbedpipeError, match="no free GPU"):
        claim_slot(keys, tmp_path, candidates=[1], poll_seconds=0.05, timeout=0.2)
    other, h2 = claim_slot(keys, tmp_path, candidates=[0], timeout=1)
    assert other == 0
    handle.close()
    h2.close()


def test_lock_dir_and_files_are_shared_whatever_the_umask(tmp_path):
    directory = tmp_path / "locks"
    old = os.umask(0o077)
    try:
        index, handle = claim_slot(["GPU-a"], directory)
    finally:
        os.umask(old)
    handle.close()
    assert stat.S_IMODE(directory.stat().st_mode) == 0o1777  # world-writable and sticky, like /tmp
    assert stat.S_IMODE((directory / "gpu-GPU-a.lock").stat().st_mode) == 0o666


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as a second user (seteuid)")
def test_a_second_user_can_claim_gpus_in_the_first_users_lock_dir():
    """Root makes the directory with umask 022 and holds GPU a; user 'nobody' then gets GPU b."""
    base = Path(tempfile.mkdtemp(dir="/tmp"))
    try:
        base.chmod(0o755)
        directory = base / "locks"
        old = os.umask(0o022)
        try:
            _, held = claim_slot(["GPU-a", "GPU-b"], directory, candidates=[0])
        finally:
            os.umask(old)
        pid = os.fork()
        if pid == 0:  # the second user: only os/fcntl work happens in this forked child
            code = 2
            try:
                os.seteuid(65534)
                index, handle = claim_slot(["GPU-a", "GPU-b"], directory, poll_seconds=0.05, timeout=1)
                code = 0 if index == 1 else 3
            except BaseException as exc:  # noqa: BLE001 - reported through the exit status
                print(f"second user: {exc!r}", file=sys.stderr)
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        held.close()
        assert os.waitstatus_to_exitcode(status) == 0
        assert (directory / "gpu-GPU-b.lock").stat().st_uid == 65534
    finally:
        shutil.rmtree(base)


def test_waiting_for_a_gpu_times_out_naming_the_lock_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(devices, "resolve_device", lambda spec: torch.device("cuda"))
    monkeypatch.setattr(devices, "_gpu_keys", lambda: ["GPU-busy"])
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    monkeypatch.setenv("EMBEDPIPE_GPU_LOCK_DIR", str(tmp_path))
    _, held = claim_slot(["GPU-busy"], tmp_path)
    monkeypatch.setenv("EMBEDPIPE_GPU_WAIT", "0.2")
    with pytest.raises(EmbedpipeError, match=rf"no free GPU after waiting 0s .*{tmp_path}.*EMBEDPIPE_GPU_WAIT"):
        with claim_device("cuda"):
            pass
    monkeypatch.setenv("EMBEDPIPE_GPU_WAIT", "soon")
    with pytest.raises(EmbedpipeError, match="EMBEDPIPE_GPU_WAIT='soon' is not a number"):
        with claim_device("cuda"):
            pass
    held.close()
    monkeypatch.setenv("EMBEDPIPE_GPU_WAIT", "0")
    with claim_device("cuda") as device:
        assert device == torch.device("cuda", 0)
    monkeypatch.delenv("EMBEDPIPE_GPU_WAIT")
    assert devices.gpu_wait_seconds() == 24 * 3600


def test_crosscheck_claims_the_gpu_before_loading_the_model(tmp_path, tiny_model_path, monkeypatch):
    """As embed does: a cross-check waiting for a GPU must not hold the model in memory."""
    import contextlib

    from embedpipe.crosscheck import reference
    from embedpipe.crosscheck.run import run_crosscheck
    from embedpipe.extraction.run import EmbedOptions, embed_fasta
    from helpers.embed_helpers import random_sequences, write_fasta

    fasta = write_fasta(tmp_path / "in.fasta", random_sequences(4, (10, 30), seed=3))
    embed_fasta(fasta, model=str(tiny_model_path), out=tmp_path / "s.h5", options=EmbedOptions(), quiet=True)
    events: list[str] = []
    real_load = reference.load_model

    @contextlib.contextmanager
    def claim(spec):
        events.append("claim")
        yield torch.device("cpu")
        events.append("release")

    def load(spec):
        events.append("load")
        return real_load(spec)

    monkeypatch.setattr(reference, "claim_device", claim)
    monkeypatch.setattr(reference, "load_model", load)
    run_crosscheck(tmp_path / "s.h5", out=tmp_path / "cc", sample=2, device="cuda", quiet=True)
    assert events == ["claim", "load", "release"]
