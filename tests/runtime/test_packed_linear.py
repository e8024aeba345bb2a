"""embedpipe.runtime.packed_linear: oneDNN-prepacked projections equal F.linear; anything odd falls back."""

from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F

from embedpipe.core.host_memory import keep_freed_memory
from embedpipe.model.esm2 import prepare_model
from embedpipe.model.esm2_forward import EsmForward
from embedpipe.runtime import packed_linear
from embedpipe.runtime.packed_linear import pack_linear
from embedpipe.runtime.precision import forward_context, get_policy

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
# oneDNN packs bf16 weights only on CPUs with AVX512-BF16-class instructions (or AVX-NE-CONVERT);
# elsewhere pack_linear must fall back to F.linear, and the tests check that instead.
BF16_PACKS = torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _packs(dtype: torch.dtype) -> bool:
    return dtype != torch.bfloat16 or BF16_PACKS


def _weights(dtype: torch.dtype, out_features: int = 48, in_features: int = 40):
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
    bias = torch.randn(out_features, generator=generator).to(dtype)
    return weight, bias


def _packed(dtype: torch.dtype):
    """(weight, bias, packed projection); None where this CPU cannot run oneDNN ``dtype``,
    after checking that ``pack_linear`` then says so (F.linear serves)."""
    weight, bias = _weights(dtype)
    packed = pack_linear(weight, bias)
    if not _packs(dtype):
        assert packed is None
        return None
    assert packed is not None
    return weight, bias, packed


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_projection_equals_f_linear(dtype):
    if (made := _packed(dtype)) is None:
        return
    weight, bias, packed = made
    x = torch.randn(3, 17, 40, generator=torch.Generator().manual_seed(2)).to(dtype)
    want = F.linear(x.double(), weight.double(), bias.double())
    got = packed(x)
    assert got.dtype == dtype and got.shape == (3, 17, 48)
    # as close to the exact product as F.linear itself
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), want, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=tolerance, atol=tolerance)


@needs_onednn
def test_strided_input_is_read_correctly():
    weight, bias = _weights(torch.float32)
    packed = pack_linear(weight, bias)
    wide = torch.randn(5, 9, 2, 40, generator=torch.Generator().manual_seed(3))
    view = wide[:, :, 0]  # not contiguous: oneDNN would misread it as dense
    torch.testing.assert_close(packed(view), F.linear(view, weight, bias), rtol=1e-5, atol=1e-5)


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_gelu_is_exact_gelu_of_the_fp32_product(dtype):
    if (made := _packed(dtype)) is None:
        return
    weight, bias, packed = made
    x = torch.randn(64, 40, generator=torch.Generator().manual_seed(4)).to(dtype)
    exact = F.gelu(F.linear(x.double(), weight.double(), bias.double()))
    fused = packed(x, gelu=True).double()
    unfused = F.gelu(F.linear(x, weight, bias)).double()
    if dtype == torch.float32:
        torch.testing.assert_close(fused, exact, rtol=1e-5, atol=1e-5)
    else:  # one rounding (epilogue on the fp32 accumulator) instead of two: at least as close
        assert (fused - exact).abs().mean() <= (unfused - exact).abs().mean()
        torch.testing.assert_close(fused, exact, rtol=1e-2, atol=1e-2)


def test_unsupported_dtypes_and_broken_ops_fall_back(monkeypatch):
    assert pack_linear(*_weights(torch.float16)) is None  # fp16 stays on F.linear
    on_meta = torch.empty(4, 3, device="meta"), torch.empty(4, device="meta")
    assert pack_linear(*on_meta) is None  # only CPU weights are packed (CUDA keeps F.linear)
    weight, bias = _weights(torch.float32)
    assert pack_linear(weight, bias.double()) is None

    class WrongAnswers(packed_linear.PackedLinear):
        def __call__(self, x, gelu=False):
            return super().__call__(x, gelu) + 1.0

    monkeypatch.setattr(packed_linear, "PackedLinear", WrongAnswers)
    assert pack_linear(weight, bias) is None  # the probe catches a mismatch

    def missing(*args, **kwargs):
        raise RuntimeError("no such op")

    monkeypatch.setattr(packed_linear, "PackedLinear", missing)
    assert pack_linear(weight, bias) is None


@needs_onednn
@pytest.mark.parametrize("precision, expected", [("fp32", True), ("bf16-mixed", True), ("bf16", True),
                                                 ("amp-bf16", False), ("fp16", False)])
def test_forward_prepacks_where_it_can_and_matches_unpacked(tiny_model_path, precision, expected):
    from embedpipe.model import load_model

    loaded = load_model(str(tiny_model_path))
    policy = get_policy(precision)
    model = prepare_model(loaded.model, policy, torch.device("cpu"))
    packed, plain = EsmForward(model, policy), EsmForward(model, policy, prepack=False)
    assert packed.prepacked is (expected and _packs(policy.weight_dtype))
    assert not plain.prepacked
    tokens = torch.randint(4, 24, (3, 40), generator=torch.Generator().manual_seed(5))
    tokens[:, 0], tokens[:, -1] = 0, 2
    tokens[2, 30:] = 1  # padding
    with forward_context(policy, torch.device("cpu")):  # amp runs under autocast
        a, b = packed(tokens, [1, 2]), plain(tokens, [1, 2])
    tolerance = 1e-5 if precision == "fp32" else 5e-2
    for layer in (1, 2):
        torch.testing.assert_close(a.hidden[layer].float(), b.hidden[layer].float(), rtol=tolerance, atol=tolerance)


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_keep_freed_memory_applies_on_glibc():
    assert keep_freed_memory() is True
    assert keep_freed_memory() is True  # idempotent


# --------------------------------------------------------------------- batch invariance (issue 32)

def _row_count_dependent(weight: torch.Tensor, calls: list[int]):
    """A linear whose rounding follows its row count, as a GEMM whose kernel or blocking
    changes with M does: each output is nudged by a last-bit amount that depends on how many
    rows the call had. ``calls`` records each call's row count."""
    def linear(x: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        y = F.linear(x, weight)
        return y + y * (x.shape[0] % 5) * 2.0 ** -22
    return linear


def test_row_tiles_make_a_row_count_dependent_linear_batch_invariant():
    weight, _ = _weights(torch.float32)
    x = torch.randn(700, weight.shape[1], generator=torch.Generator().manual_seed(2))
    calls: list[int] = []
    linear = _row_count_dependent(weight, calls)
    tile = packed_linear.tile_rows(torch.device("cpu"))
    reference = packed_linear.row_tiled(linear, x[:5])  # 5 rows: one padded tile
    for n in (1, 5, tile - 1, tile, tile + 1, 700):
        got = packed_linear.row_tiled(linear, x[:n])
        assert got.shape == (n, weight.shape[0])
        assert torch.equal(got[:min(n, 5)], reference[:min(n, 5)]), n
        # every call is one whole tile, and the rows are the plain linear's up to the planted nudge
        torch.testing.assert_close(got, F.linear(x[:n], weight), rtol=1e-5, atol=1e-5)
    assert set(calls) == {tile}
    # (B, T, K) inputs keep their leading shape
    assert packed_linear.row_tiled(linear, x[:600].view(4, 150, -1)).shape == (4, 150, weight.shape[0])
    # untiled, the same rows round differently with the batch's size: what the tiles take away
    assert not torch.equal(linear(x[:5]), linear(x[:6])[:5])


def test_every_float_policy_runs_its_linear_layers_in_whole_tiles():
    """fp32 (F.linear and prepacked) and bf16-mixed: each matmul a policy's linear runs gets
    exactly one tile of rows, whatever the batch's row count."""
    weight, bias = _weights(torch.float32)
    tile = packed_linear.tile_rows(torch.device("cpu"))
    seen: list[int] = []
    for name in ("fp32", "bf16-mixed"):
        policy = get_policy(name)
        w, b = weight.to(policy.weight_dtype), bias.to(policy.weight_dtype)
        packed = policy.pack(w, b) if policy.packs(True) else None
        seen.clear()
        real = packed if packed is not None else (lambda rows, gelu=False, w=w, b=b: F.linear(rows, w, b))
        counted = lambda rows, gelu=False, real=real: (seen.append(rows.shape[0]), real(rows, gelu=gelu))[1]  # noqa: E731
        with forward_context(policy, torch.device("cpu")):
            for n in (3, 300):
                x = torch.randn(n, weight.shape[1], generator=torch.Generator().manual_seed(n))
                out = policy.linear(x, w, b, counted)
                assert out.shape == (n, weight.shape[0])
                torch.testing.assert_close(out.float(), F.linear(x, weight, bias), rtol=0.05, atol=0.3)
        assert seen and set(seen) == {tile}, name


def test_int8_rows_need_no_tile_they_are_the_same_in_any_row_count():
    """int8-mixed's linear runs untiled: a row's per-token scale is its own, the int32 sums are
    exact in any blocking and the rescale is per element, so each row's output is bit for bit
    the same alone, in 2, 3 (oneDNN's small-M paths), 127, 129 or 1000 rows, at any offset."""
    weight, bias = _weights(torch.float32)
    policy = get_policy("int8-mixed")
    packed = policy.pack(weight, bias)
    x = torch.randn(1000, weight.shape[1], generator=torch.Generator().manual_seed(8)) * 3
    with forward_context(policy, torch.device("cpu")):
        whole = policy.linear(x, weight, bias, packed)
        for lo, hi in ((0, 1), (5, 7), (10, 13), (0, 127), (300, 429), (999, 1000), (1, 1000)):
            assert torch.equal(policy.linear(x[lo:hi], weight, bias, packed), whole[lo:hi]), (lo, hi)
    coarse = 127 / packed.weight_qmax  # 7-bit weights (where only 7-bit kernels are exact) round twice as coarsely
    torch.testing.assert_close(whole, F.linear(x, weight, bias), rtol=0.05 * coarse, atol=0.3 * 3 * coarse)
