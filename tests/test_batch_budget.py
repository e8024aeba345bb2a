"""--tokens-per-batch auto: sized from free device memory on CUDA, CPU_TOKENS_PER_BATCH elsewhere.

No GPU is needed: ``embedpipe.cuda.free_memory`` is patched, and a ``torch.device("cuda")``
object is only compared, never used. The expected budgets are worked out by hand from the
rule in docs/precision.md ("Batch size"), not from the module's own helpers.
"""

from __future__ import annotations

from dataclasses import dataclass
from unittest import mock

import pytest
import torch

from embedpipe.batch_budget import resolve_tokens_per_batch
from embedpipe.model.facts import MemoryEstimate
from embedpipe.options import CPU_TOKENS_PER_BATCH, MIN_TOKENS_PER_BATCH, EmbedOptions
from embedpipe.precision import Policy, get_policy

CUDA = torch.device("cuda")
MiB = 2**20
GiB = 2**30
PARAMETERS = 100 * MiB  # weights: 400 MiB in fp32, 200 MiB in 16 bits
DIM = 64
ACTIVATION = 10_000  # bytes per padded token of the forward itself


@dataclass
class FakeModel:
    """The part of an EmbeddingModel the budget reads, with round numbers."""

    embed_dim: int = DIM

    def estimate_memory(self, policy: Policy) -> MemoryEstimate:
        return MemoryEstimate(host_bytes=0, weight_bytes=PARAMETERS * policy.weight_dtype.itemsize,
                              activation_bytes_per_token=ACTIVATION)


def budget(free: int, stored_layers: int = 1, **options) -> int:
    chosen = EmbedOptions(**options)
    with mock.patch("embedpipe.cuda.free_memory", return_value=free) as free_memory:
        tokens = resolve_tokens_per_batch(chosen, FakeModel(), get_policy(chosen.precision), CUDA, stored_layers)
    free_memory.assert_called_once_with(CUDA)
    return tokens


def test_fp32_subtracts_its_weights_and_counts_the_stored_layer():
    # (8 GiB - 400 MiB) * 0.8 / (10_000 + 1 layer x 64 x 4 bytes) = 637_324.3 -> 637_184 (a multiple of 256)
    assert budget(8 * GiB) == 637_184
    assert budget(8 * GiB) % 256 == 0


def test_per_residue_adds_an_fp32_copy_of_each_stored_layer():
    # 3 stored layers: 3 x 64 x 4 for the returned hidden states, 3 x 64 x 4 for the copies
    # (8 GiB - 400 MiB) * 0.8 / (10_000 + 768 + 768) = 566_609.0 -> 566_528
    assert budget(8 * GiB, stored_layers=3, per_residue=True) == 566_528
    # without per-residue vectors: / (10_000 + 768) = 607_021.9 -> 606_976
    assert budget(8 * GiB, stored_layers=3, per_residue=False) == 606_976


def test_a_16_bit_policy_counts_the_fp32_fallback_model_unless_it_runs_on_the_cpu():
    # bf16-mixed: 200 MiB of weights, plus the 400 MiB fp32 fallback model on the device
    # (8 GiB - 600 MiB) * 0.8 / 10_256 = 620_966.4 -> 620_800
    assert budget(8 * GiB, precision="bf16-mixed") == 620_800
    assert budget(8 * GiB, precision="bf16-mixed", fallback_device="same") == 620_800
    # (8 GiB - 200 MiB) * 0.8 / 10_256 = 653_683.1 -> 653_568
    assert budget(8 * GiB, precision="bf16-mixed", fallback_device="cpu") == 653_568


def test_amp_policies_share_the_fp32_model_with_the_fallback():
    # amp-bf16 keeps fp32 weights (400 MiB) and the fallback reuses that model: as fp32
    assert budget(8 * GiB, precision="amp-bf16") == budget(8 * GiB, precision="fp32") == 637_184


def test_auto_fallback_that_cannot_fit_beside_the_model_is_not_counted():
    # 500 MiB free: the 200 MiB bf16 model fits, the 400 MiB fp32 one does not beside it, so
    # --fallback-device auto will run it on the CPU: (500 - 200) MiB * 0.8 / 10_256 = 24_537.5 -> 24_320
    assert budget(500 * MiB, precision="fp16") == 24_320
    # with `same` it is counted (and the worker will report that it does not fit)
    assert budget(500 * MiB, precision="fp16", fallback_device="same") == MIN_TOKENS_PER_BATCH


def test_clamped_to_the_minimum_and_the_maximum():
    assert budget(0) == MIN_TOKENS_PER_BATCH
    assert budget(300 * MiB) == MIN_TOKENS_PER_BATCH  # less than the weights
    # (400 MiB + 1_000_000 - 400 MiB) * 0.8 / 10_256 = 78.0: under one step, kept as is
    assert budget(400 * MiB + 1_000_000) == 78
    assert budget(10_000 * GiB) == 2**20


def test_an_explicit_number_is_kept_and_the_cpu_gets_its_default():
    with mock.patch("embedpipe.cuda.free_memory", side_effect=AssertionError("no memory query")):
        model, policy = FakeModel(), get_policy("fp32")
        assert resolve_tokens_per_batch(EmbedOptions(tokens_per_batch=1234), model, policy, CUDA, 1) == 1234
        assert resolve_tokens_per_batch(EmbedOptions(tokens_per_batch=3), model, policy, CUDA, 1) == 3
        assert resolve_tokens_per_batch(EmbedOptions(), model, policy, torch.device("cpu"), 1) == CPU_TOKENS_PER_BATCH
        assert resolve_tokens_per_batch(EmbedOptions(tokens_per_batch=777), model, policy, torch.device("cpu"), 1) == 777


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_a_real_model_estimate_gives_a_budget_in_range(tiny_model_path, precision):
    from embedpipe.model import load_model

    loaded = load_model(str(tiny_model_path))
    options = EmbedOptions(precision=precision, per_residue=True)
    with mock.patch("embedpipe.cuda.free_memory", return_value=80 * GiB):
        tokens = resolve_tokens_per_batch(options, loaded, get_policy(precision), CUDA, 2)
    assert tokens == 2**20  # a 2-layer dim-32 model: 80 GiB holds far more than the cap
    with mock.patch("embedpipe.cuda.free_memory", return_value=64 * MiB):
        tokens = resolve_tokens_per_batch(options, loaded, get_policy(precision), CUDA, 2)
    assert MIN_TOKENS_PER_BATCH <= tokens < 2**20 and tokens % 256 == 0
