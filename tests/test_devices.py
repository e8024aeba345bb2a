"""Device selection and the one-GPU-per-worker lock (exercised with lock files, no GPU needed)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from embedpipe.devices import claim_device, claim_slot, resolve_device
from embedpipe.errors import EmbedpipeError


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
        "import sys, os; from pathlib import Path; from embedpipe.devices import claim_slot;"
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
