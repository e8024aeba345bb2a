"""--tokens-per-batch auto: sized from free device memory on CUDA, CPU_TOKENS_PER_BATCH elsewhere.

No GPU is needed: ``embedpipe.runtime.cuda.free_memory`` is patched, and a ``torch.device("cuda")``
object is only compared, never used. The expected budgets are worked out by hand from the
rule in docs/precision.md ("Batch size"), not from the module's own helpers.
"""

from __future__ import annotations

from dataclasses import dataclass
from unittest import mock

import pytest
import torch

from embedpipe.core.options import CPU_TOKENS_PER_BATCH, MIN_TOKENS_PER_BATCH, EmbedOptions
from embedpipe.extraction.budget import resolve_tokens_per_batch
from embedpipe.model.facts import MemoryEstimate
from embedpipe.runtime.precision import Policy, get_policy, resolve_attention_inputs

CUDA = torch.device("cuda")
MiB = 2**20
GiB = 2**30
PARAMETERS = 100 * MiB  # weights: 400 MiB in fp32, 200 MiB in 16 bits
DIM = 64
ACTIVATION = 10_000  # bytes per padded token of the forward itself (the layer in flight included)


@dataclass
class FakeModel:
    """The part of an EmbeddingModel the budget reads, with round numbers."""

    embed_dim: int = DIM
    hidden_itemsize: int = 4
    num_layers: int = 30

    def estimate_memory(self, policy: Policy, *, attention_inputs: str = "fp32") -> MemoryEstimate:
        return MemoryEstimate(host_bytes=0, weight_bytes=PARAMETERS * policy.weight_dtype.itemsize,
                              activation_bytes_per_token=ACTIVATION, hidden_itemsize=self.hidden_itemsize)


def budget(free: int, stored_layers: tuple[int, ...] = (30,), model: FakeModel | None = None,
           fallback_device: str = "same", attention_inputs: str = "auto", **options) -> int:
    chosen = EmbedOptions(**options)
    with mock.patch("embedpipe.runtime.cuda.free_memory", return_value=free) as free_memory:
        tokens = resolve_tokens_per_batch(chosen, model or FakeModel(), get_policy(chosen.precision), CUDA, list(stored_layers),
                                          attention_inputs=resolve_attention_inputs(attention_inputs, CUDA),
                                          fallback_device=fallback_device)
    free_memory.assert_called_once_with(CUDA)
    return tokens


def test_fp32_subtracts_its_weights_and_counts_the_stored_layers_beside_the_one_in_flight():
    # (8 GiB - 400 MiB) * 0.8 / 10_000 = 653_640.3 -> 653_568 (a multiple of 256): the one
    # stored layer is the layer in flight, already in the forward's working memory
    assert budget(8 * GiB) == 653_568
    # layers 0, 1 and the last: 2 more fp32 hidden states held, 2 x 64 x 4: / 10_512 = 621_803.1 -> 621_568
    assert budget(8 * GiB, stored_layers=(0, 1, 30)) == 621_568
    # layer 29 is the last layer's input, in the working memory already
    assert budget(8 * GiB, stored_layers=(29, 30)) == 653_568
    # fp32 hidden states need no fp32 copy for per-residue output
    assert budget(8 * GiB, stored_layers=(0, 1, 30), per_residue=True) == 621_568


def test_per_residue_adds_an_fp32_copy_of_each_16_bit_stored_layer_at_pooling():
    half, every = FakeModel(hidden_itemsize=2, num_layers=60), tuple(range(1, 61))
    # 60 stored 16-bit layers: the forward holds 10_000 + 58 x 128 = 17_424 bytes a token
    # (layers 1..58; 59 is the last layer's input);
    # pooling holds 60 x 128 plus 60 fp32 copies of 256: 23_040, the larger
    # (8 GiB - 200 MiB) * 0.8 / 23_040 = 290_912.4 -> 290_816
    assert budget(8 * GiB, stored_layers=every, model=half, precision="fp16", fallback_device="cpu",
                  per_residue=True) == 290_816
    # without per-residue vectors one fp32 copy at a time: the forward's 17_424 is the larger
    # / 17_424 = 384_766.1 -> 384_512
    assert budget(8 * GiB, stored_layers=every, model=half, precision="fp16", fallback_device="cpu") == 384_512


def test_a_16_bit_policy_counts_the_fp32_fallback_model_unless_it_runs_on_the_cpu():
    # bf16-mixed: 200 MiB of weights, plus the 400 MiB fp32 fallback model on the device
    # (8 GiB - 600 MiB) * 0.8 / 10_000 = 636_862.7 -> 636_672
    assert budget(8 * GiB, precision="bf16-mixed", fallback_device="same") == 636_672
    # (8 GiB - 200 MiB) * 0.8 / 10_000 = 670_418.3 -> 670_208
    assert budget(8 * GiB, precision="bf16-mixed", fallback_device="cpu") == 670_208


def test_amp_policies_share_the_fp32_model_with_the_fallback():
    # amp-bf16 keeps fp32 weights (400 MiB) and the fallback reuses that model: as fp32
    assert budget(8 * GiB, precision="amp-bf16") == budget(8 * GiB, precision="fp32") == 653_568


def test_the_budget_reads_the_resolved_fallback_device_and_decides_none():
    # 500 MiB free: the fp32 copy does not fit beside the 200 MiB fp16 model, but the budget
    # only reads where the run resolved it: `same` counts it (and clamps), `cpu` does not
    assert budget(500 * MiB, precision="fp16", fallback_device="same") == MIN_TOKENS_PER_BATCH
    # (500 - 200) MiB * 0.8 / 10_000 = 25_165.8 -> 25_088
    assert budget(500 * MiB, precision="fp16", fallback_device="cpu") == 25_088
    with pytest.raises(ValueError, match="not resolved"):
        budget(8 * GiB, precision="fp16", fallback_device="auto")


def test_clamped_to_the_minimum_and_the_maximum():
    assert budget(0) == MIN_TOKENS_PER_BATCH
    assert budget(300 * MiB) == MIN_TOKENS_PER_BATCH  # less than the weights
    # (400 MiB + 1_000_000 - 400 MiB) * 0.8 / 10_000 = 80.0: under one step, kept as is
    assert budget(400 * MiB + 1_000_000) == 80
    assert budget(10_000 * GiB) == 2**20


def test_an_explicit_number_is_kept_and_the_cpu_gets_its_default():
    with mock.patch("embedpipe.runtime.cuda.free_memory", side_effect=AssertionError("no memory query")):
        model, policy = FakeModel(), get_policy("fp32")

        def tokens(options: EmbedOptions, device: torch.device) -> int:
            return resolve_tokens_per_batch(options, model, policy, device, [30], attention_inputs="fp32",
                                            fallback_device="same")

        assert tokens(EmbedOptions(tokens_per_batch=1234), CUDA) == 1234
        assert tokens(EmbedOptions(tokens_per_batch=3), CUDA) == 3
        assert tokens(EmbedOptions(), torch.device("cpu")) == CPU_TOKENS_PER_BATCH
        assert tokens(EmbedOptions(tokens_per_batch=777), torch.device("cpu")) == 777


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_a_real_model_estimate_gives_a_budget_in_range(tiny_model_path, precision):
    from embedpipe.model import load_model

    loaded = load_model(str(tiny_model_path))
    options = EmbedOptions(precision=precision, per_residue=True)
    with mock.patch("embedpipe.runtime.cuda.free_memory", return_value=80 * GiB):
        tokens = resolve_tokens_per_batch(options, loaded, get_policy(precision), CUDA, [1, 2], attention_inputs="compute",
                                          fallback_device="same")
    assert tokens == 2**20  # a 2-layer dim-32 model: 80 GiB holds far more than the cap
    with mock.patch("embedpipe.runtime.cuda.free_memory", return_value=64 * MiB):
        tokens = resolve_tokens_per_batch(options, loaded, get_policy(precision), CUDA, [1, 2], attention_inputs="compute",
                                          fallback_device="same")
    assert MIN_TOKENS_PER_BATCH <= tokens < 2**20 and tokens % 256 == 0


def test_the_cost_of_one_more_batch_is_per_device():
    """The padded planner trades padding against batches at the device's own price: on the
    CPU 256 tokens (measured), on CUDA its own figure (issue 20: a CPU cost applied everywhere)."""
    from embedpipe.extraction.budget import BATCH_OVERHEAD_TOKENS, batch_overhead_tokens
    from embedpipe.extraction.planning import BATCH_OVERHEAD_TOKENS as PLANNER_DEFAULT

    assert batch_overhead_tokens(torch.device("cpu")) == PLANNER_DEFAULT == 256
    assert batch_overhead_tokens(CUDA) == BATCH_OVERHEAD_TOKENS["cuda"] != 256


def test_the_worker_plans_padded_batches_with_its_devices_overhead(tiny_model_path):
    from embedpipe.extraction.engine import Engine
    from embedpipe.extraction.planning import plan_record
    from embedpipe.model import load_model
    from helpers.engine import embedder_for

    embedder = embedder_for(load_model(str(tiny_model_path)), EmbedOptions(tokens_per_batch=4096), torch.device("cpu"))
    records = [(f"r{i}", "A" * n) for i, n in enumerate([500, 480, 40, 30, 20, 300, 290])]
    pieces = [p for i, (_, s) in enumerate(records) for p in plan_record(i, len(s), "chunk", window=1022)[0]]
    planner = __import__("embedpipe.extraction.planning").extraction.planning.plan_batches
    with mock.patch("embedpipe.extraction.engine.plan_batches", wraps=planner) as plan:
        embedder.plan(records)
    assert plan.call_args.args[2] == 256 and len(plan.call_args.args[0]) == len(pieces)
    embedder.device = CUDA  # only compared: the plan is host work
    with mock.patch("embedpipe.extraction.engine.plan_batches", return_value=[]) as plan, \
            mock.patch.object(Engine, "batch_layout", "padded"):
        embedder.plan(records)
    assert plan.call_args.args[2] == 1024
