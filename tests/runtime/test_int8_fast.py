"""int8-mixed's fast quantize (issue 23): the rounding trick against ``torch.round`` and its
fallback, the in-place rescale/GELU against float64 with the same scales, and the 7-bit
weights where oneDNN's int8 kernels saturate (AVX2 without VNNI, emulated in a child process)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from embedpipe.runtime import int8_kernels, int8_linear
from embedpipe.runtime.int8_linear import Int8Linear, quantize_per_token

ROOT = Path(__file__).resolve().parents[2]


def _float64_reference(x: torch.Tensor, layer: Int8Linear) -> torch.Tensor:
    """``y`` from float64 quantization of ``x`` with absmax/127 per token and the layer's integers."""
    x64 = x.double()
    sx = x64.abs().amax(1, keepdim=True) / 127
    xq = torch.round(x64 / sx.clamp_min(1e-300))
    return (xq @ layer.qweight.double().t()) * sx * layer.weight_scale.double() + layer.bias.double()


def test_the_rounding_add_equals_round_ties_and_signs_included(monkeypatch) -> None:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(300, 64, generator=g) * torch.logspace(-3, 3, 300)[:, None]
    x[7, :4] = torch.tensor([2.5, -2.5, 0.5, -127.0])  # ties and the range's end, before scaling
    x[8] = 0.0
    scaled = x * (127.0 / torch.maximum(x.abs().amax(1, keepdim=True), torch.tensor(1e-30)))
    want = torch.round(scaled.double()).to(torch.int8)
    want_u8 = (torch.round(scaled.double()) + 128).to(torch.uint8)  # oneDNN's input: u8, zero point 128
    for zero_point, wanted in ((0, want), (128, want_u8)):
        assert int8_linear._rounder_works(zero_point)
        assert torch.equal(int8_linear._round_into(scaled.clone(), torch.empty_like(wanted), zero_point), wanted)
        q, s = quantize_per_token(x, zero_point)
        assert torch.equal(q, wanted) and torch.equal(s, x.abs().amax(1, keepdim=True) / 127)
    monkeypatch.setattr(int8_linear, "_rounder_works", lambda zero_point=0: False)  # the plain passes
    for zero_point, wanted in ((0, want), (128, want_u8)):
        assert torch.equal(int8_linear._round_into(scaled.clone(), torch.empty_like(wanted), zero_point), wanted)


def test_in_place_rescale_and_gelu_match_float64_with_the_same_scales() -> None:
    g = torch.Generator().manual_seed(6)
    x = torch.randn(3, 41, 96, generator=g) * 4
    layer = Int8Linear(torch.randn(200, 96, generator=g) * 0.1, torch.randn(200, generator=g))
    exact = _float64_reference(x.view(-1, 96), layer).view(3, 41, 200)
    torch.testing.assert_close(layer(x).double(), exact, rtol=1e-5, atol=1e-5 * float(exact.abs().max()))
    torch.testing.assert_close(layer(x, gelu=True).double(), F.gelu(exact), rtol=1e-5, atol=1e-4)
    assert x.abs().amax() > 1  # the input was not overwritten by the in-place passes


CHILD = textwrap.dedent("""
    import torch
    from embedpipe.runtime import int8_kernels
    from embedpipe.runtime.int8_linear import Int8Linear
    g = torch.Generator().manual_seed(7)
    w, b, x = torch.randn(64, 96, generator=g), torch.randn(64, generator=g), torch.randn(50, 96, generator=g)
    choice = int8_kernels.choose_weight_range(96)
    layer = Int8Linear(w, b, kernels=choice)
    x64 = x.double(); sx = x64.abs().amax(1, keepdim=True) / 127
    sw = w.double().abs().amax(1) / layer.weight_qmax
    wq = torch.round(w.double() / sw[:, None])
    assert torch.equal(layer.qweight.double(), wq)
    want = (torch.round(x64 / sx) @ wq.t()) * sx * sw + b.double()
    torch.testing.assert_close(layer(x).double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    from embedpipe.runtime.precision import get_policy
    assert get_policy("int8-mixed").for_width(96).provenance()["quantization_weight_range"] == choice.weight_range
    assert layer.weight_qmax == choice.qmax and choice.used == {layer.engine: 1}
    print(torch.backends.cpu.get_cpu_capability(), layer.engine, layer.weight_qmax)
""")


@pytest.mark.parametrize("caps", [{}, {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}])
def test_the_layer_runs_at_the_range_recorded_and_is_exact_whatever_the_kernels(caps) -> None:
    """Exactness against float64 with the weight range the run records, on this CPU's own kernels
    and with oneDNN and ATen held to AVX2 (whose int16 pair sums saturate at 8 bits: a correctness
    case, not a speed one; which range a CPU gets is measured, never asserted here)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), **caps)
    if caps and platform.machine().lower() not in ("x86_64", "amd64"):
        env = dict(os.environ, PYTHONPATH=str(ROOT))  # ISA caps are x86's: this CPU's own kernels again
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    _, engine, qmax = done.stdout.split()
    assert engine in int8_kernels.ENGINES and float(qmax) in int8_kernels.WEIGHT_RANGES


def test_the_store_records_the_weight_range_of_this_cpu() -> None:
    from embedpipe.runtime.precision import get_policy

    policy = get_policy("int8-mixed").for_width(64)
    layer = Int8Linear(torch.randn(64, 64), None, kernels=policy.kernels)
    assert layer.weight_qmax == policy.kernels.qmax
    assert policy.provenance()["quantization_weight_range"] == int8_kernels.range_name(layer.weight_qmax)
    assert policy.runner_provenance({})["quantization_engines"] == f"{layer.engine}: 1 layers"


VERBOSE_CHILD = textwrap.dedent("""
    import torch
    from embedpipe.runtime.int8_linear import Int8Linear
    g = torch.Generator().manual_seed(8)
    layer = Int8Linear(torch.randn(256, 192, generator=g), torch.randn(256, generator=g), engine="onednn")
    print("ENGINE", layer.engine)
    layer(torch.randn(300, 192, generator=g))
""")


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86 ISA caps")
@pytest.mark.parametrize("isa", ["AVX2", "AVX512_CORE_VNNI", None])
def test_the_int8_matmul_runs_a_jit_kernel_not_onednns_reference(isa) -> None:
    """With s8 activations oneDNN had no kernel on AVX512-VNNI CPUs without AMX (Cascade/Ice
    Lake) and ran its scalar reference one (ref_int8); u8 activations get the VNNI kernel.
    A cap above this CPU's ISA is this CPU's own ISA."""
    env = dict(os.environ, ONEDNN_VERBOSE="1", PYTHONPATH=str(ROOT))
    env.pop("ONEDNN_MAX_CPU_ISA", None)
    if isa:
        env["ONEDNN_MAX_CPU_ISA"] = isa
    done = subprocess.run([sys.executable, "-c", VERBOSE_CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "ENGINE onednn" in done.stdout  # asked for by name: oneDNN's kernel is what is checked
    kernels = [line.split(",")[6] for line in (done.stdout + done.stderr).splitlines()
               if line.startswith("onednn_verbose") and ",exec," in line and ",matmul," in line]
    assert kernels, done.stdout[-2000:]
    assert not [k for k in kernels if k.startswith("ref")], kernels


def test_the_quantize_chunks_grow_with_the_threads_and_change_no_integer() -> None:
    """1 MiB of rows per intra-op thread (fewer parallel regions beside a neighbour:
    docs/benchmarks.md, "CPU contention"); each row is quantized on its own, so the integers,
    the scales and the layer's output are the same bytes at any chunk size."""
    saved = torch.get_num_threads()
    x = torch.randn(3000, 1920, generator=torch.Generator().manual_seed(4))
    layer = Int8Linear(torch.randn(480, 1920, generator=torch.Generator().manual_seed(5)), torch.randn(480))
    got = {}
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            got[threads] = (int8_linear.row_chunks(*x.shape).step, *quantize_per_token(x, layer.zero_point), layer(x))
    finally:
        torch.set_num_threads(saved)
    assert (got[1][0], got[2][0]) == (int8_linear.CHUNK_BYTES // (4 * 1920), 2 * int8_linear.CHUNK_BYTES // (4 * 1920))
    for a, b in zip(got[1][1:], got[2][1:]):
        assert torch.equal(a, b)
    exact = F.linear(x.double(), layer.qweight.double() * layer.weight_scale.double()[:, None], layer.bias.double())
    assert float((got[1][3].double() - exact).norm() / exact.norm()) < 1e-2  # int8 activations' rounding only
