"""int8-mixed smoothing (issue 23, "Outlier smoothing"): the smoothed int8 linear against float64
with the same factors and scales, the SmoothQuant factors on a hand-made example (zero and
non-finite channels included), the calibrating layer, and the shipped calibration set."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from embedpipe.core.errors import EmbedpipeError
from embedpipe.runtime.int8_kernels import ENGINES
from embedpipe.runtime.int8_linear import Int8Linear, quantize_per_token
from embedpipe.runtime.int8_smoothing import SHIPPED, CalibratingLinear, collecting, load_calibration, smoothquant_factors
from helpers.int8_engines import assert_engine, engine_here

ROOT = Path(__file__).resolve().parents[2]


def _outlier_inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (41, 96) with 3 outlier channels (x60), w (64, 96), b (64,)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(41, 96, generator=g)
    x[:, [5, 50, 77]] *= 60.0
    return x, torch.randn(64, 96, generator=g) * 0.05, torch.randn(64, generator=g)


@pytest.mark.parametrize("engine", ENGINES)
def test_smoothed_int8_linear_equals_float64_with_the_same_factors_and_scales(engine) -> None:
    x, w, b = _outlier_inputs(1)
    s = smoothquant_factors(x.abs().amax(0), w.abs().amax(0))
    engine = engine_here(engine)
    layer = Int8Linear(w, b, engine=engine, smoothing=s)
    assert_engine(layer, engine)
    inv = layer.inverse_smoothing.double()
    torch.testing.assert_close(inv, 1 / s.double(), rtol=1e-6, atol=0)
    # float64: x / s per token by absmax / 127, W * s per output channel by absmax / 127
    xs, ws = x.double() * inv, w.double() * s.double()
    sx, sw = xs.abs().amax(1, keepdim=True) / 127, ws.abs().amax(1) / layer.weight_qmax  # 127, or 63 (7-bit kernels)
    xq_ref, wq_ref = torch.round(xs / sx), torch.round(ws / sw[:, None])
    xq, got_sx = quantize_per_token(x, inverse_smoothing=layer.inverse_smoothing)
    torch.testing.assert_close(got_sx.double(), sx, rtol=1e-6, atol=0)
    assert (xq.double() - xq_ref).abs().max() <= 1 and (xq.double() != xq_ref).float().mean() < 1e-3  # ties only
    assert torch.equal(layer.qweight.double(), wq_ref)
    want = (xq_ref @ wq_ref.t()) * sx * sw + b.double()
    y = layer(x.view(1, 41, 96)).view(41, 64)
    assert F.cosine_similarity(y.double(), want, dim=1).min() > 0.9999
    exact = (xq.double() @ layer.qweight.double().t()) * got_sx.double() * layer.weight_scale.double() + b.double()
    torch.testing.assert_close(y.double(), exact, rtol=1e-5, atol=1e-5 * float(exact.abs().max()))
    torch.testing.assert_close(layer(x, gelu=True).double(), F.gelu(exact), rtol=1e-5, atol=1e-4)


def test_smoothing_by_ones_is_no_smoothing_and_smoothing_helps_outlier_channels() -> None:
    x, w, b = _outlier_inputs(2)
    plain = Int8Linear(w, b)
    assert torch.equal(Int8Linear(w, b, smoothing=torch.ones(96))(x), plain(x))  # x * 1 is x: the same bits
    smoothed = Int8Linear(w, b, smoothing=smoothquant_factors(x.abs().amax(0), w.abs().amax(0)))
    exact = x.double() @ w.double().t() + b.double()
    error = {name: float((layer(x).double() - exact).abs().max()) for name, layer in
             (("plain", plain), ("smoothed", smoothed))}
    assert error["smoothed"] < 0.5 * error["plain"], error


def test_smoothquant_factors_by_hand_with_zero_and_non_finite_channels() -> None:
    x_absmax = torch.tensor([4.0, 9.0, 0.0, 1.0, float("inf"), float("nan"), 16.0])
    w_absmax = torch.tensor([1.0, 4.0, 2.0, 0.0, 1.0, 1.0, 0.25])
    # sqrt(ax) / sqrt(aw): 2/1, 3/2, zero activation -> 1, zero weight column -> 1, inf -> 1, NaN -> 1, 4/0.5
    want = torch.tensor([2.0, 1.5, 1.0, 1.0, 1.0, 1.0, 8.0])
    got = smoothquant_factors(x_absmax, w_absmax)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    # alpha 1: all of the activation range moves into the weights; 0: none of it
    torch.testing.assert_close(smoothquant_factors(torch.tensor([4.0]), torch.tensor([3.0]), alpha=1.0), torch.tensor([4.0]))
    torch.testing.assert_close(smoothquant_factors(torch.tensor([4.0]), torch.tensor([2.0]), alpha=0.0), torch.tensor([0.5]))


def test_a_calibrating_layer_is_exact_fp32_then_the_smoothed_int8_layer() -> None:
    x, w, b = _outlier_inputs(3)
    with collecting() as layers:
        layer = CalibratingLinear(w, b)
    assert layers == [layer]
    torch.testing.assert_close(layer(x[:20].view(4, 5, 96), gelu=True), F.gelu(F.linear(x[:20], w, b)).view(4, 5, 64))
    layer(x[20:])
    torch.testing.assert_close(layer.x_absmax, x.abs().amax(0), rtol=0, atol=0)  # both calls' absmax
    want = smoothquant_factors(x.abs().amax(0), w.abs().amax(0))
    layer.finish()
    assert layer.weight is None  # the fp32 reference dropped
    assert torch.equal(layer(x), Int8Linear(w, b, smoothing=want)(x))


def test_a_calibrating_layer_needs_a_calibration() -> None:
    with pytest.raises(RuntimeError, match="outside a calibration"):
        CalibratingLinear(torch.ones(2, 3), None)


def test_the_shipped_set_is_the_first_16_records_of_the_swissprot_example() -> None:
    example = (ROOT / "examples" / "swissprot100.fasta").read_text().split(">")[1:17]
    assert SHIPPED.read_text() == "".join(">" + part for part in example)
    calibration = load_calibration(None)
    assert len(calibration.records) == 16 and calibration.name == "int8_calibration.fasta"
    assert calibration.sha256 == hashlib.sha256(SHIPPED.read_bytes()).hexdigest()
    assert calibration.describe() == (f"SmoothQuant alpha 0.5 per input channel, calibrated in fp32 on "
                                      f"int8_calibration.fasta (16 records, sha256 {calibration.sha256[:16]})")


@pytest.mark.parametrize(("text", "why"), [(None, "no such file"), ("", "no records"), (">a\nAC1D\n", "invalid character")])
def test_a_bad_calibration_file_is_one_line_naming_it(tmp_path, text, why) -> None:
    path = tmp_path / "calib.fasta"
    if text is not None:
        path.write_text(text)
    with pytest.raises(EmbedpipeError) as info:
        load_calibration(path)
    message = str(info.value)
    assert message.startswith("--int8-smoothing smoothquant:FASTA (workflow: int8_calibration)")
    assert str(path) in message and why in message
    assert "\n" not in message
