"""The packed (unpadded) batch layout on the CPU: layout, segment reductions, the per-sequence
attention stand-in, the forward against fair-esm's own, the CUDA branch through a CPU
stand-in for the varlen kernel, and the choice of layout and attention inputs
(docs/precision.md, "Batch layout" and "Attention inputs")."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from embedpipe.core.errors import EmbedpipeError
from embedpipe.core.options import EmbedOptions
from embedpipe.model import load_model
from embedpipe.runtime import cuda, engine_override
from embedpipe.runtime.packed import PackedTokens, per_sequence_attention, range_max, range_segments, range_sums
from embedpipe.runtime.precision import POLICIES, attention_dtype, resolve_attention_inputs
from helpers.embed_helpers import fair_esm_bos, fair_esm_forward, random_sequences
from helpers.engine import embedder_for

CPU = torch.device("cpu")
ATOL = 1e-5


def test_packing_a_padded_batch_keeps_each_rows_real_tokens_in_order():
    tokens = torch.tensor([[0, 5, 6, 2, 1, 1], [0, 7, 2, 1, 1, 1], [0, 8, 9, 10, 11, 2]])
    packed = PackedTokens.from_padded(tokens, [4, 3, 6])
    assert packed.tokens.tolist() == [0, 5, 6, 2, 0, 7, 2, 0, 8, 9, 10, 11, 2]
    assert packed.positions.tolist() == [0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4, 5]
    assert packed.offsets.dtype == torch.int32 and packed.offsets.tolist() == [0, 4, 7, 13]
    assert packed.host_offsets == (0, 4, 7, 13) and packed.max_len == 6 and packed.batch_size == 3
    table = torch.arange(6) * 10
    assert packed.rows(table).tolist() == [0, 10, 20, 30, 0, 10, 20, 0, 10, 20, 30, 40, 50]
    with pytest.raises(ValueError, match="do not fit"):
        PackedTokens.from_padded(tokens, [4, 3, 7])


def test_range_sums_and_max_equal_a_loop_over_each_sequences_rows():
    generator = torch.Generator().manual_seed(0)
    offsets = (0, 5, 6, 14)
    x = torch.randn(14, 3, generator=generator)
    ranges = [(1, 4), (0, 0), (2, 8)]
    segments = range_segments(offsets, ranges)
    sums = range_sums(x, segments)
    per_token = x.abs().amax(-1)
    maxes = range_max(per_token, segments)
    for i, (lo, hi) in enumerate(ranges):
        rows = x[offsets[i] + lo : offsets[i] + hi].double()
        np.testing.assert_allclose(sums[i].numpy(), rows.sum(0).numpy(), atol=1e-6)
        assert maxes[i].item() == (per_token[offsets[i] + lo : offsets[i] + hi].max().item() if hi > lo else 0.0)
    poisoned = per_token.clone()
    poisoned[offsets[2] + 3] = float("nan")
    assert math.isnan(range_max(poisoned, segments)[2].item()) and not math.isnan(range_max(poisoned, segments)[0].item())
    with pytest.raises(ValueError, match="outside a sequence"):
        range_segments(offsets, [(0, 6), (0, 1), (0, 1)])


def test_per_sequence_attention_equals_explicit_softmax_attention_per_sequence():
    generator = torch.Generator().manual_seed(1)
    offsets = (0, 3, 10, 11)
    q, k, v = (torch.randn(11, 2, 4, generator=generator, dtype=torch.float64) for _ in range(3))
    got = per_sequence_attention(q, k, v, offsets)
    for lo, hi in zip(offsets[:-1], offsets[1:]):
        for head in range(2):
            scores = q[lo:hi, head] @ k[lo:hi, head].T
            want = torch.softmax(scores, -1) @ v[lo:hi, head]
            np.testing.assert_allclose(got[lo:hi, head].numpy(), want.numpy(), atol=1e-12)


def _embed(loaded, records, **options):
    embedder = embedder_for(loaded, options, CPU)
    return embedder, dict(embedder.embed(records))


@pytest.mark.parametrize("tokens_per_batch", [4096, 300])
def test_packed_fp32_equals_fair_esm_own_forward(tiny_model_path, fair_esm_reference, tokens_per_batch):
    """Every layer's per-residue rows, mean and BOS, record by record, to 1e-5 (windows of
    long records included: each window is fair-esm's forward on that window)."""
    loaded = load_model(str(tiny_model_path))
    layers = list(range(loaded.num_layers + 1))
    records = random_sequences(9, (5, 120), seed=21)
    embedder, got = _embed(loaded, records, batch_layout="packed", per_residue=True, layers=tuple(layers),
                           pooling=("mean", "bos"), tokens_per_batch=tokens_per_batch)
    assert embedder.batch_layout == "packed" and embedder.attention_path == "packed-sdpa-per-sequence"
    assert embedder.stats["batches"] > (1 if tokens_per_batch == 300 else 0)
    assert embedder.stats["computed_tokens"] == embedder.stats["real_tokens"]  # no padding computed
    model, alphabet = fair_esm_reference(tiny_model_path)
    for index, (_, seq) in enumerate(records):
        want = fair_esm_forward(model, alphabet, seq, layers)
        bos = fair_esm_bos(model, alphabet, seq, layers)
        for layer in layers:
            np.testing.assert_allclose(got[index].per_residue[layer], want[layer], atol=ATOL, rtol=0)
            np.testing.assert_allclose(got[index].mean[layer], want[layer].mean(0), atol=ATOL, rtol=0)
            np.testing.assert_allclose(got[index].bos[layer], bos[layer], atol=ATOL, rtol=0)


def test_packed_chunked_long_records_equal_the_padded_layout(tiny_model_path):
    loaded = load_model(str(tiny_model_path))
    records = random_sequences(4, (900, 2600), seed=22)
    _, packed = _embed(loaded, records, batch_layout="packed", per_residue=True)
    _, padded = _embed(loaded, records, batch_layout="padded", per_residue=True)
    last = loaded.num_layers
    for index in padded:
        assert packed[index].long_handling == padded[index].long_handling
        assert packed[index].windows == padded[index].windows
        np.testing.assert_allclose(packed[index].per_residue[last], padded[index].per_residue[last], atol=ATOL, rtol=0)
        np.testing.assert_allclose(packed[index].mean[last], padded[index].mean[last], atol=ATOL, rtol=0)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_runs_packed_close_to_its_padded_twin(tiny_model_path, policy):
    """Same numerics, no padding: equal to rounding of the policy's compute dtype."""
    loaded = load_model(str(tiny_model_path))
    records = random_sequences(6, (10, 90), seed=23)
    _, packed = _embed(loaded, records, precision=policy, batch_layout="packed", per_residue=True)
    _, padded = _embed(loaded, records, precision=policy, batch_layout="padded", per_residue=True)
    tolerance = ATOL if policy == "fp32" else 0.05
    last = loaded.num_layers
    for index in padded:
        assert packed[index].precision_used == padded[index].precision_used
        assert np.isfinite(packed[index].per_residue[last]).all()
        scale = np.abs(padded[index].per_residue[last]).max()
        assert np.abs(packed[index].per_residue[last] - padded[index].per_residue[last]).max() <= tolerance * max(scale, 1)


def test_a_record_packed_alone_equals_it_packed_in_a_batch(tiny_model_path):
    """Batch invariance of the packed layout in fp32 on the CPU (attention per sequence)."""
    loaded = load_model(str(tiny_model_path))
    records = random_sequences(8, (20, 200), seed=24)
    _, together = _embed(loaded, records, batch_layout="packed", per_residue=True)
    last = loaded.num_layers
    for index, record in enumerate(records[:3]):
        _, alone = _embed(loaded, [record], batch_layout="packed", per_residue=True)
        np.testing.assert_allclose(alone[0].per_residue[last], together[index].per_residue[last], atol=1e-6, rtol=0)


def test_overflow_fallback_under_the_packed_layout_is_exact_fp32(overflow_model, overflow_records):
    loaded = load_model(str(overflow_model))
    embedder, got = _embed(loaded, overflow_records, precision="fp16", batch_layout="packed", per_residue=True)
    _, reference = _embed(loaded, overflow_records, precision="fp32", batch_layout="padded", per_residue=True)
    fell = [i for i, record in got.items() if record.precision_used == "fp32"]
    assert fell and embedder.stats["fallback"] == len(fell)
    last = loaded.num_layers
    for index in fell:
        assert got[index].fallback_reason
        np.testing.assert_allclose(got[index].per_residue[last], reference[index].per_residue[last], atol=ATOL, rtol=0)


# -- the CUDA branch, with a CPU stand-in for the varlen kernel ---------------------------------


@pytest.fixture
def varlen_here(monkeypatch):
    """Pretend the varlen kernel runs here for 16-bit inputs; record its calls and answer with
    the per-sequence stand-in, computed from what the kernel receives (int32 offsets)."""
    calls: list[dict] = []

    def varlen_attention(q, k, v, cu_seqlens, max_len):
        assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1  # flash's contract: the last dim only
        assert cu_seqlens.dtype == torch.int32
        calls.append({"dtype": q.dtype, "tokens": q.shape[0], "max_len": max_len,
                      "offsets": cu_seqlens.tolist()})
        return per_sequence_attention(q, k, v, cu_seqlens.tolist())

    monkeypatch.setattr(cuda, "varlen_available", lambda device, dtype: dtype in cuda.VARLEN_DTYPES)
    monkeypatch.setattr(cuda, "varlen_attention", varlen_attention)
    return calls


def test_auto_layout_packs_where_the_varlen_kernel_runs(tiny_model_path, varlen_here):
    loaded = load_model(str(tiny_model_path))
    records = random_sequences(5, (10, 70), seed=25)
    embedder, got = _embed(loaded, records, precision="bf16-mixed", attention_inputs="compute", per_residue=True)
    assert embedder.batch_layout == "packed" and embedder.attention_path == "packed-varlen-flash"
    assert embedder.attention_inputs == "bfloat16"
    assert varlen_here and {c["dtype"] for c in varlen_here} == {torch.bfloat16}
    first = varlen_here[0]
    assert first["tokens"] == first["offsets"][-1] and first["max_len"] == max(np.diff(first["offsets"]))
    _, per_sequence = _embed(loaded, records, precision="bf16-mixed", attention_inputs="compute",
                             batch_layout="padded", per_residue=True)
    last = loaded.num_layers
    for index in got:
        np.testing.assert_allclose(got[index].mean[last], per_sequence[index].mean[last], atol=0.02, rtol=0)


@pytest.mark.parametrize(("policy", "inputs", "layout"), [
    ("fp32", "auto", "padded"),  # flash takes 16-bit inputs only
    ("bf16-mixed", "fp32", "padded"),  # fp32 attention inputs asked for
    ("bf16-mixed", "compute", "packed"),
    ("fp16", "auto", "packed"),
    ("amp-bf16", "auto", "packed"),
])
def test_auto_layout_follows_the_attention_dtype(tiny_model_path, varlen_here, policy, inputs, layout):
    loaded = load_model(str(tiny_model_path))
    embedder = embedder_for(loaded, EmbedOptions(precision=policy), CPU, attention_inputs=inputs)
    assert embedder.batch_layout == layout
    explicit = embedder_for(loaded, EmbedOptions(precision=policy), CPU, attention_inputs=inputs, attention="math")
    assert explicit.batch_layout == "padded" and explicit.attention_path == "padded-math"


def test_attention_inputs_per_device_and_policy():
    cuda_device = torch.device("cuda")
    assert resolve_attention_inputs("auto", cuda_device) == "compute"
    assert resolve_attention_inputs("auto", CPU) == "fp32"
    assert resolve_attention_inputs("fp32", cuda_device) == "fp32"
    expected = {  # (policy, resolved inputs) -> q/k/v dtype at the kernel
        ("fp32", "compute"): torch.float32, ("fp16", "fp32"): torch.float16, ("bf16", "fp32"): torch.bfloat16,
        ("amp-bf16", "fp32"): torch.bfloat16, ("bf16-mixed", "fp32"): torch.float32,
        ("bf16-mixed", "compute"): torch.bfloat16, ("fp16-mixed", "compute"): torch.float16,
    }
    for (policy, inputs), dtype in expected.items():
        assert attention_dtype(POLICIES[policy], inputs) == dtype, (policy, inputs)


def test_compute_attention_inputs_stay_close_to_fp32_on_the_cpu(tiny_model_path):
    loaded = load_model(str(tiny_model_path))
    records = random_sequences(4, (30, 200), seed=26)
    _, reference = _embed(loaded, records)
    last = loaded.num_layers
    for inputs in ("fp32", "compute"):
        embedder, got = _embed(loaded, records, precision="bf16-mixed", attention_inputs=inputs)
        assert embedder.attention_inputs == ("float32" if inputs == "fp32" else "bfloat16")
        for index in got:
            a, b = got[index].mean[last], reference[index].mean[last]
            assert float(a @ b / np.linalg.norm(a) / np.linalg.norm(b)) > 0.999


def test_packed_needs_sdpa_and_a_runner_that_packs():
    with pytest.raises(EmbedpipeError, match="^EMBEDPIPE_ENGINE: batch_layout=packed attends with sdpa"):
        engine_override.parse("batch_layout=packed,attention=math")
    with pytest.raises(EmbedpipeError, match="^EMBEDPIPE_ENGINE: attention_inputs must be one of auto, fp32, compute"):
        engine_override.parse("attention_inputs=fp8")


def test_host_copies_and_busy_time_on_the_cpu(tiny_model_path):
    tensor = torch.arange(6.0)
    assert cuda.HostCopy(tensor).wait() is not None and torch.equal(cuda.HostCopy(tensor).wait(), tensor)
    assert cuda.to_device(tensor, CPU) is tensor or torch.equal(cuda.to_device(tensor, CPU), tensor)
    loaded = load_model(str(tiny_model_path))
    embedder, _ = _embed(loaded, random_sequences(3, (10, 40), seed=27))
    assert embedder.busy_seconds > 0


def test_varlen_runs_only_on_ampere_or_newer_with_16_bit_inputs_and_flash(monkeypatch):
    gpu = torch.device("cuda")
    assert not cuda.varlen_available(CPU, torch.bfloat16)
    assert not cuda.varlen_available(gpu, torch.float32)  # decided before asking the device
    capability = {"value": (8, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability["value"])
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
    assert cuda.varlen_available(gpu, torch.bfloat16) and cuda.varlen_available(gpu, torch.float16)
    capability["value"] = (7, 5)  # Turing: no flash
    assert not cuda.varlen_available(gpu, torch.float16)
    capability["value"] = (9, 0)
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: False)
    assert not cuda.varlen_available(gpu, torch.float16)
