"""Issue 30, item 5: int8-mixed never stores numbers from a zeroed layer. Tiny weights keep
their own per-channel scales (a 1e-30 floor once quantized them to zeros), tiny activations
are lifted by an exact power of two before they are quantized, and a layer whose weights are
below float32's normal range once scaled stays an fp32 island, named in the store's
``quantization_fp32_layers`` (docs/precision.md, "int8-mixed"). The references are float64
(the layer) and fair-esm's own fp32 forward (the model)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from embedpipe.model import load_model
from embedpipe.runtime.int8_kernels import ENGINES
from embedpipe.runtime.int8_linear import Int8Linear
from embedpipe.runtime.precision import get_policy
from helpers.embed_helpers import embed_and_read, fair_esm_forward, random_sequences
from helpers.int8_engines import assert_engine, engine_here

INT8 = get_policy("int8-mixed")
LAYERS = (0, 1, 2, 3)
#: the bar of this issue: pooled cosine to fp32 at every layer
POOLED_COSINE = 0.999


def _layer_data(seed: int = 7) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(24, 96, generator=g), torch.randn(64, 96, generator=g) * 0.05, torch.randn(64, generator=g)


def _cosines(y: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Row cosines, each row first divided by its own largest |value| (``F.cosine_similarity``
    clamps norms at 1e-8, which tiny rows are below)."""
    def unit(t: torch.Tensor) -> torch.Tensor:
        t = t.double()
        return t / t.abs().amax(dim=1, keepdim=True)
    return F.cosine_similarity(unit(y), unit(want), dim=1)


def _bar(layer: Int8Linear) -> float:
    """The cosine to the exact fp32 product int8 reaches on these layers: 0.9999 with 8-bit
    weights, 0.9995 with 7-bit ones (half the weight resolution, where only 7-bit kernels are
    exact); a zeroed layer gives 0 either way."""
    return 0.9999 if layer.weight_qmax == 127 else 0.9995


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("factor", [1e-32, 1e-34])  # below the old 1e-30 floor, scales still normal
def test_tiny_weights_keep_their_own_scales_and_stay_int8(engine, factor) -> None:
    x, w, _ = _layer_data()
    engine = engine_here(engine)
    layer = Int8Linear(w * factor, None, engine=engine)
    want = x.double() @ (w.double() * factor).t()
    assert float(_cosines(layer(x), want).min()) > _bar(layer)  # before: all zeros (cosine 0)
    assert torch.equal(layer.qweight, Int8Linear(w, None, engine=engine).qweight)  # the same integers
    assert_engine(layer, engine)
    assert layer.fp32_reason == ""


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("factor", [1e-33, 1e-40])  # below the old floor; subnormal
def test_tiny_activations_are_lifted_not_zeroed(engine, factor) -> None:
    x, w, b = _layer_data(8)
    x = x * factor
    x[3] = 0.0  # a zero row stays the bias
    layer = Int8Linear(w * 1e30, b * 1e-10, engine=engine_here(engine))  # scaled so the product is not dominated by b
    want = x.double() @ (w.double() * 1e30).t() + b.double() * 1e-10
    y = layer(x)
    rows = [r for r in range(24) if r != 3]
    assert float(_cosines(y[rows], want[rows]).min()) > _bar(layer)  # before: rows of bias only
    assert torch.equal(y[3], (b * 1e-10).float())
    assert torch.isfinite(y).all()


def test_weights_below_the_normal_range_keep_the_layer_fp32() -> None:
    x, w, b = _layer_data(9)
    tiny = w * 1e-40  # subnormal once divided by 127
    layer = Int8Linear(tiny, b)
    assert layer.engine == "fp32"
    assert "64 of 64 output channels have weights too small for int8" in layer.fp32_reason
    torch.testing.assert_close(layer(x, gelu=True), F.gelu(F.linear(x, tiny, b)), rtol=0, atol=0)


def test_one_lost_channel_is_enough_to_keep_the_layer_fp32() -> None:
    _, w, _ = _layer_data(10)
    w[5] *= 1e-42
    assert "1 of 64 output channels" in Int8Linear(w, None).fp32_reason
    assert Int8Linear(w * 0 + w.mean(), None).fp32_reason == ""  # equal weights: exact in int8


def _tiny_v(state) -> None:
    """Layer 1's v rows x1e-32 and its out projection x1e32: the same function in fp32."""
    state["layers.1.self_attn.v_proj.weight"].mul_(1e-32)
    state["layers.1.self_attn.v_proj.bias"].mul_(1e-32)
    state["layers.1.self_attn.out_proj.weight"].mul_(1e32)


def _subnormal_fc1(state) -> None:
    """Layer 1's fc1 weights subnormal, its layer norm x1e37 (net 1e-3; bias and fc2 follow)."""
    state["layers.1.final_layer_norm.weight"].mul_(1e37)
    state["layers.1.final_layer_norm.bias"].mul_(1e37)
    state["layers.1.fc1.weight"].mul_(1e-40)
    state["layers.1.fc1.bias"].mul_(1e-3)
    state["layers.1.fc2.weight"].mul_(1e3)


@pytest.mark.parametrize(("edit", "kept"), [
    (_tiny_v, "none"),
    (_subnormal_fc1, "layers.1.fc1: 256 of 256 output channels have weights too small for int8"),
])
def test_a_crafted_tiny_layer_stays_within_fp32_at_every_layer(tmp_path, model_factory, fair_esm_reference,
                                                                edit, kept) -> None:
    path = model_factory(layers=3, dim=64, heads=4, seed=5, edit=edit)
    records = random_sequences(5, (30, 120), seed=10)
    got = embed_and_read(tmp_path, path, records, "int8", precision="int8-mixed", layers=LAYERS)
    model, alphabet = fair_esm_reference(path)
    for rid, seq in records:
        want = fair_esm_forward(model, alphabet, seq, LAYERS)
        for layer in LAYERS:
            a, b = got["mean"][layer][rid].astype(np.float64), want[layer].mean(0).astype(np.float64)
            cosine = float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))
            assert cosine >= POOLED_COSINE, (rid, layer, cosine)  # today's main: 0.75 (tiny v), 0.986
    assert got["attrs"]["quantization_fp32_layers"].startswith(kept)
    assert set(got["fields"]["fallback_reason"].values()) == {""}  # the layer, not a record fallback


def test_a_normal_model_keeps_every_linear_in_int8(tmp_path, model_factory) -> None:
    path = model_factory(layers=2, dim=32, heads=4, seed=6)
    runner = load_model(str(path)).prepare(INT8, torch.device("cpu"))
    engines = {packed.engine for packed in runner._packed.values()}
    assert len(runner._packed) == 2 * 4 and "fp32" not in engines and runner.fp32_layers == {}
    got = embed_and_read(tmp_path, path, random_sequences(3, (20, 40), seed=1), "int8", precision="int8-mixed")
    assert got["attrs"]["quantization_fp32_layers"] == "none"
    ref = embed_and_read(tmp_path, path, random_sequences(3, (20, 40), seed=1), "fp32", precision="fp32")
    assert "quantization_fp32_layers" not in ref["attrs"]


def test_a_t5_layer_of_subnormal_weights_is_named_and_stays_exact(tmp_path) -> None:
    """T5 (the padded runner): 0.v's weights below the normal range, 0.o scaled back up so far
    that its int8 sums would overflow float32 (today's main: no engine passes its probe, a traceback)."""
    from embedpipe.model.random_hf import make_hf_test_model
    from embedpipe.runtime.precision import POLICIES, forward_context

    model = load_model(str(make_hf_test_model(tmp_path / "m", family="ankh", layers=2, dim=32, heads=4, seed=3)))
    model.weights["0.v"].mul_(1e-40)
    model.weights["0.o"].mul_(1e38)
    tokens = model.tokenize(["MKTAYIAKQRQISFVKSHFSRQ", "ACDEFGHIKLMNPQRSTVWY"])
    cpu = torch.device("cpu")
    outs = {}
    for name in ("fp32", "int8-mixed"):
        runner = model.prepare(POLICIES[name], cpu)
        with forward_context(POLICIES[name], cpu):
            outs[name] = runner(tokens, [1, 2]).hidden
    assert sorted(runner.fp32_layers) == ["0.o", "0.v"]
    assert "32 of 32 output channels have weights too small for int8" in runner.fp32_layers["0.v"]
    assert "32 of 32 output channels have weights too large for int8" in runner.fp32_layers["0.o"]
    for layer in (1, 2):
        got, want = outs["int8-mixed"][layer].mean(1), outs["fp32"][layer].mean(1)
        assert float(_cosines(got, want).min()) >= POOLED_COSINE  # today's main: 0.v zeroed


def test_smoothquant_calibration_keeps_the_crafted_layer_close(tmp_path, model_factory, fair_esm_reference) -> None:
    path = model_factory(layers=3, dim=64, heads=4, seed=5, edit=_subnormal_fc1)
    records = random_sequences(4, (30, 120), seed=11)
    got = embed_and_read(tmp_path, path, records, "sq", precision="int8-mixed", int8_smoothing="smoothquant",
                         layers=LAYERS)
    model, alphabet = fair_esm_reference(path)
    for rid, seq in records:
        want = fair_esm_forward(model, alphabet, seq, LAYERS)
        for layer in LAYERS:
            a, b = got["mean"][layer][rid].astype(np.float64), want[layer].mean(0).astype(np.float64)
            assert float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b))) >= POOLED_COSINE, (rid, layer)
    assert got["attrs"]["quantization_fp32_layers"]  # recorded after calibration ("none" or the layer)
