"""Where fp32 fallback records run is decided once, by ``resolve_run``: on a GPU the job's device
(``same``) when the fp32 copy of the model fits beside the policy's in the free memory, else the
CPU; never ``auto`` after resolution. The budget and the preparation only read the run's value.

No GPU is needed: the device is faked (tests/helpers/fake_cuda.py) with a chosen free memory, and
the expected answers are worked out from the model's own memory estimate, not the module's helpers.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from embedpipe.core.options import EmbedOptions
from embedpipe.extraction import resolved as resolved_module
from embedpipe.extraction.preparation import Preparation
from embedpipe.extraction.resolved import resolve_loaded, resolve_run
from embedpipe.model import load_model
from embedpipe.model.identity import ModelIdentity
from embedpipe.runtime.engine_override import EngineChoice
from embedpipe.runtime.precision import FP32, get_policy
from helpers.fake_cuda import fake_cuda

CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def loaded(tiny_model_path):
    return load_model(str(tiny_model_path))


def _weights(loaded, policy: str) -> int:
    return loaded.estimate_memory(get_policy(policy)).weight_bytes


def _run(loaded, free: int, precision: str = "fp16", fallback: str = "auto", device: torch.device = CUDA):
    with fake_cuda(free=free):
        return resolve_loaded(loaded, EmbedOptions(precision=precision), device, EngineChoice(fallback_device=fallback))


def _planned(loaded, run) -> torch.device:
    return Preparation(loaded, run, on_moved=lambda message: None).planned_device(FP32)


def test_the_fallback_runs_on_the_gpu_only_when_the_fp32_copy_fits_beside_the_policy(loaded):
    both = _weights(loaded, "fp16") + _weights(loaded, "fp32")
    fits, short = _run(loaded, both), _run(loaded, both - 1)
    assert (fits.fallback_device, short.fallback_device) == ("same", "cpu")
    assert (_planned(loaded, fits), _planned(loaded, short)) == (CUDA, CPU)
    # the override is taken as given, whatever fits
    assert _run(loaded, both - 1, fallback="same").fallback_device == "same"
    assert _run(loaded, 10 * both, fallback="cpu").fallback_device == "cpu"
    # no second model (fp32 itself, amp's fp32 weights), or the CPU: the job's device
    for precision in ("fp32", "amp-bf16"):
        assert _run(loaded, 1, precision=precision).fallback_device == "same"
    assert _run(loaded, 1, device=CPU).fallback_device == "same"


def test_a_prediction_without_the_model_leaves_the_gpu_fallback_unresolved_never_auto(loaded):
    identity = ModelIdentity(loaded.sha256, True, {}, loaded.family)

    def predict(precision: str, device: torch.device) -> str | None:
        with fake_cuda():
            return resolve_run(EmbedOptions(precision=precision), device, num_layers=loaded.num_layers, packs=True,
                               model=identity, width=loaded.embed_dim).fallback_device

    assert predict("fp16", CUDA) is None  # its size is the model's: decided once it is loaded
    assert predict("fp16", CPU) == predict("fp32", CPU) == "same"


@pytest.mark.parametrize("planted", ["same", "cpu"])
def test_the_budget_and_the_preparation_read_what_resolve_run_decided(loaded, monkeypatch, planted):
    # free memory where the fp32 copy would fit for one plant and not for the other: the budget
    # and the preparation follow the planted decision, as a run overridden to it does
    both = _weights(loaded, "fp16") + _weights(loaded, "fp32")
    free = both - 1 if planted == "same" else 10 * both
    overridden = _run(loaded, free, fallback=planted)
    monkeypatch.setattr(resolved_module, "resolve_fallback_device", lambda *args: planted)
    run = _run(loaded, free)
    assert run.fallback_device == overridden.fallback_device == planted
    assert run.tokens_per_batch == overridden.tokens_per_batch
    assert _planned(loaded, run) == (CUDA if planted == "same" else CPU)
    # a run with the value planted after resolution: the preparation reads that value only
    other = "cpu" if planted == "same" else "same"
    assert _planned(loaded, dataclasses.replace(run, fallback_device=other)) == (CUDA if other == "same" else CPU)
