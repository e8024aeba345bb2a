"""int8-mixed (issue 23): the int8 linear against float64 with the same scales, the policy
end to end against fp32, the fp32 fallback on a planted non-finite, the CPU advice, the
refusal off the CPU, and the provenance it records."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from embedpipe.core.errors import EmbedpipeError
from embedpipe.model.esm2_forward import EsmForward
from embedpipe.runtime import advice
from embedpipe.runtime.advice import cpu_note, fastest_policy
from embedpipe.runtime.cpu_features import CpuFeatures
from embedpipe.runtime.engine_override import EngineChoice
from embedpipe.runtime.int8_kernels import ENGINES
from embedpipe.runtime.int8_linear import Int8Linear, quantize_per_token
from embedpipe.runtime.precision import get_policy
from helpers.embed_helpers import embed_and_read, random_sequences
from helpers.int8_engines import assert_engine, engine_here
from helpers.stores import cosine

INT8 = get_policy("int8-mixed")
#: the stated tolerance (docs/precision.md): pooled cosine to fp32 on random-weight models, every layer
POOLED_COSINE = 0.99


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor,
               qmax: float = 127) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float64: absmax/127 scales per token and absmax/``qmax`` per output channel (the layer's
    weight range: 127, or 63 where only 7-bit kernels are exact here), the rounded int values, y."""
    x64, w64 = x.double(), w.double()
    sx = x64.abs().amax(1, keepdim=True) / 127
    sw = w64.abs().amax(1) / qmax
    xq, wq = torch.round(x64 / sx.clamp_min(1e-300)), torch.round(w64 / sw[:, None])
    return xq, wq, (xq @ wq.t()) * sx * sw + b.double()


@pytest.mark.parametrize("engine", ENGINES)
def test_int8_linear_equals_float64_with_the_same_scales(engine) -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(37, 96, generator=g) * torch.logspace(-2, 2, 37)[:, None]  # tokens of very different size
    w, b = torch.randn(64, 96, generator=g) * 0.05, torch.randn(64, generator=g)
    engine = engine_here(engine)
    layer = Int8Linear(w, b, engine=engine)  # at the widest range this engine is exact at on this CPU
    assert_engine(layer, engine)
    assert layer.weight_qmax in (127, 63)
    xq_ref, wq_ref, y_ref = _reference(x, w, b, layer.weight_qmax)
    xq, sx = quantize_per_token(x)
    torch.testing.assert_close(sx.double(), x.double().abs().amax(1, keepdim=True) / 127, rtol=1e-6, atol=0)
    assert (xq.double() - xq_ref).abs().max() <= 1 and (xq.double() != xq_ref).float().mean() < 1e-3  # ties only
    assert torch.equal(layer.qweight.double(), wq_ref)
    # the exact int32 sums from the layer's own integers, rescaled in float64: only fp32 rounding differs
    exact = (xq.double() @ layer.qweight.double().t()) * sx.double() * layer.weight_scale.double() + b.double()
    y = layer(x.view(1, 37, 96)).view(37, 64)
    torch.testing.assert_close(y.double(), exact, rtol=1e-5, atol=1e-5 * float(exact.abs().max()))
    torch.testing.assert_close(layer(x, gelu=True).double(), F.gelu(exact), rtol=1e-5, atol=1e-4)
    assert F.cosine_similarity(y.double(), y_ref, dim=1).min() > 0.9999


def test_int8_linear_keeps_zero_rows_and_propagates_non_finite_rows() -> None:
    g = torch.Generator().manual_seed(4)
    w, b = torch.randn(8, 16, generator=g), torch.randn(8, generator=g)
    x = torch.randn(4, 16, generator=g)
    x[1] = 0.0  # padding
    x[2, 3] = float("nan")
    y = Int8Linear(w, b)(x)
    assert torch.equal(y[1], b)
    assert torch.isnan(y[2]).all() and torch.isfinite(y[[0, 1, 3]]).all()



def test_int8_mixed_matches_fp32_on_every_layer_and_records_its_scheme(tmp_path, model_factory) -> None:
    path = model_factory(layers=3, dim=64, heads=4, seed=5)
    records = random_sequences(8, (30, 300), seed=10)
    layers = (0, 1, 2, 3)
    ref = embed_and_read(tmp_path, path, records, "ref", precision="fp32", layers=layers, per_residue=True)
    got = embed_and_read(tmp_path, path, records, "int8", precision="int8-mixed", layers=layers, per_residue=True)
    for layer in layers:
        worst = min(cosine(got["mean"][layer][r], ref["mean"][layer][r]) for r, _ in records)
        assert worst >= POOLED_COSINE, (layer, worst)
        rows = got["per_residue"][layer]["rec000"], ref["per_residue"][layer]["rec000"]
        assert rows[0].shape == rows[1].shape
    assert 0 < max(float(np.abs(got["mean"][3][r] - ref["mean"][3][r]).max()) for r, _ in records)  # really int8
    attrs = got["attrs"]
    assert (attrs["precision_policy"], attrs["weight_dtype"], attrs["compute_dtype"], attrs["island_dtype"]) == (
        "int8-mixed", "float32", "int8", "float32")
    assert "per output channel" in attrs["quantization_scheme"] and "per token" in attrs["quantization_scheme"]
    assert "no smoothing" in attrs["quantization_scales"]
    assert "quantization_scheme" not in ref["attrs"]
    assert set(got["fields"]["precision_used"].values()) == {"int8-mixed"}


def test_a_planted_non_finite_falls_back_to_fp32_for_that_record_only(tmp_path, model_factory, monkeypatch) -> None:
    path = model_factory(layers=2, dim=32, heads=4, seed=6)
    records = random_sequences(6, (20, 60), seed=3, alphabet=np.array(list("ADEFGHIKLMNPQRSTVWY")))
    records[2] = ("planted", records[2][1][:5] + "C" + records[2][1][5:])
    ref = embed_and_read(tmp_path, path, records, "ref", precision="fp32", layers=(0, 2), per_residue=True)
    original = EsmForward._own_forward

    def planted(self, batch, layers):
        out = original(self, batch, layers)
        if self.policy.name == INT8.name:  # NaN in every stored layer of the batch rows holding a C
            hit = (batch.tokens == 23).any(-1)  # 'C' in ESM-2's alphabet
            for layer in out.hidden:
                out.hidden[layer][hit] = float("nan")
        return out

    monkeypatch.setattr(EsmForward, "_own_forward", planted)
    got = embed_and_read(tmp_path, path, records, "int8", precision="int8-mixed", layers=(0, 2), per_residue=True)
    for rid, _ in records:
        want = ("fp32", "nonfinite") if rid == "planted" else ("int8-mixed", "")
        assert (got["fields"]["precision_used"][rid], got["fields"]["fallback_reason"][rid]) == want
    for layer in (0, 2):  # re-run alone in fp32: the fp32 store's values, up to the batch's summation order
        np.testing.assert_allclose(got["mean"][layer]["planted"], ref["mean"][layer]["planted"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got["per_residue"][layer]["planted"], ref["per_residue"][layer]["planted"],
                                   rtol=1e-5, atol=1e-5)
    assert json.loads(got["attrs"]["fallback_reasons"]) == {"nonfinite": 1}


def test_int8_mixed_is_refused_off_the_cpu_in_one_line() -> None:
    for device in ("cuda", "mps"):
        with pytest.raises(EmbedpipeError, match=r"^precision 'int8-mixed' runs on the CPU only[^\n]*$"):
            INT8.check_device(torch.device(device))
    assert INT8.check_device(torch.device("cpu"), CpuFeatures(frozenset({"avx2"}))) == []
    assert EngineChoice(attention="fair-esm").refusal("int8-mixed") == (
        "EMBEDPIPE_ENGINE attention=fair-esm: --precision int8-mixed keeps fp32 islands inside the layers, which "
        "fair-esm's own forward cannot do")
    assert EngineChoice(attention="math").refusal("int8-mixed") is None


@pytest.mark.parametrize(("flags", "dtype", "best"), [
    ({"avx", "avx2", "fma"}, torch.bfloat16, "int8-mixed"),  # EPYC Rome/Milan (measured on a real Zen 3)
    ({"avx", "avx2", "fma"}, torch.float16, "int8-mixed"),
    ({"avx2", "avx512f", "avx512_vnni"}, torch.bfloat16, "fp32"),  # Cascade/Ice Lake: emulated only, no advice
    ({"avx2", "avx512f", "avx512_bf16", "avx512_vnni"}, torch.float16, "bf16-mixed"),  # Cooper Lake, Zen 4/5
    ({"avx2", "avx512_bf16", "amx_bf16", "amx_int8"}, torch.bfloat16, None),  # Sapphire Rapids: native
    ({"asimd", "fphp", "asimdhp", "bf16"}, torch.float16, None),  # Graviton 3: native
    ({"asimd", "asimddp"}, torch.float16, "fp32"),  # ARM without fp16 arithmetic
])
def test_the_advice_names_the_fastest_policy_for_the_cpu(flags, dtype, best) -> None:
    cpu = CpuFeatures(frozenset(flags))
    note = cpu_note("x16", dtype, cpu)
    if best is None:
        assert note == ""
        return
    row = advice.ADVICE[cpu.cpu_class]
    assert fastest_policy(cpu)[0] == best and "\n" not in note
    assert advice.MEASURE in note  # every warning points at the measurement on the node
    if row.trusted:  # a row measured on a real CPU of the class names its policy and factor
        assert f"the policy advised on this CPU class ({cpu.cpu_class}) is {best}" in note
        assert f"{row.factor:.2f}x" in note
    else:  # emulated or never measured: no policy recommended
        assert f"is not known from a real measurement ({row.basis})" in note
