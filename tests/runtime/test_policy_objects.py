"""Policies as objects (issue 21): each owns its capability check, its weight preparation and
its linear; the names are defined once (options.POLICY_KINDS)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from embedpipe.core import options
from embedpipe.core.errors import EmbedpipeError
from embedpipe.runtime.cpu_features import CpuFeatures
from embedpipe.runtime.precision import POLICIES, get_policy

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
AVX2 = CpuFeatures(frozenset({"avx", "avx2", "fma"}))
SAPPHIRE = CpuFeatures(frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8", "avx512_fp16"}))
GRAVITON3 = CpuFeatures(frozenset({"fp", "asimd", "fphp", "asimdhp", "bf16", "i8mm", "asimddp"}))


def test_the_names_are_defined_once_and_the_objects_are_built_from_them() -> None:
    assert tuple(POLICIES) == options.POLICY_NAMES == tuple(options.POLICY_KINDS)
    for name, (kind, low) in options.POLICY_KINDS.items():
        policy = POLICIES[name]
        assert policy.compute_dtype == getattr(torch, low)
        assert policy.fp32_islands is (kind in ("mixed", "int8"))
        assert (policy.weight_dtype == torch.float32) is (kind in ("autocast", "int8") or low == "float32")


@pytest.fixture
def gpu(monkeypatch):
    def make(capability: tuple[int, int], name: str) -> None:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: name)
    return make


@pytest.mark.parametrize(("capability", "name", "refused"), [
    ((9, 0), "NVIDIA H100", set()),
    ((8, 0), "NVIDIA A100", set()),
    ((7, 0), "Tesla V100", {"bf16", "amp-bf16", "bf16-mixed"}),
    ((5, 2), "Tesla M40", {"bf16", "amp-bf16", "bf16-mixed", "fp16", "amp-fp16", "fp16-mixed"}),
])
def test_cuda_capability_per_policy(gpu, capability, name, refused) -> None:
    gpu(capability, name)
    for policy in POLICIES.values():
        if policy.name in refused:
            with pytest.raises(EmbedpipeError, match=f"{policy.name}.*{name}.*{capability[0]}\\.{capability[1]}"):
                policy.check_device(CUDA)
        elif policy.name != "int8-mixed":
            assert policy.check_device(CUDA) == []


@pytest.mark.parametrize(("cpu", "warned"), [
    (AVX2, {"fp16", "amp-fp16", "fp16-mixed", "bf16", "amp-bf16", "bf16-mixed"}),
    # native fp16 there, but measured no faster than fp32; int8-mixed not faster than bf16-mixed
    (SAPPHIRE, {"fp16", "amp-fp16", "fp16-mixed", "int8-mixed"}),
    (CpuFeatures(frozenset({"avx2", "avx512f", "avx512_bf16"})), {"fp16", "amp-fp16", "fp16-mixed", "int8-mixed"}),
    (GRAVITON3, set()),
])
def test_cpu_warnings_follow_the_native_16_bit_flags_and_the_advice_table(cpu, warned) -> None:
    for policy in POLICIES.values():
        notes = policy.check_device(CPU, cpu)
        assert bool(notes) is (policy.name in warned), policy.name
        for note in notes:
            assert policy.name in note and "\n" not in note


def test_weight_preparation_keeps_the_islands_fp32_only_under_mixed_policies() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    islands = {id(p) for p in model[1].parameters()}
    for policy in POLICIES.values():
        copy = policy.cast_copy(model, CPU, islands)
        assert copy[0].weight.dtype == policy.weight_dtype
        assert copy[1].weight.dtype == (torch.float32 if policy.fp32_islands else policy.weight_dtype)
        torch.testing.assert_close(copy[0].weight.double(), model[0].weight.double(), rtol=1e-2, atol=1e-2)
        assert model[0].weight.dtype == torch.float32  # the source stays fp32
        named = policy.cast_weights({"q": model[0].weight, "ln": model[1].weight}, CPU, lambda n: n == "ln")
        assert named["ln"].dtype == copy[1].weight.dtype and named["q"].dtype == policy.weight_dtype


@pytest.mark.parametrize("name", ["fp32", "bf16", "amp-bf16", "bf16-mixed", "fp16-mixed"])
def test_each_policy_runs_a_linear_its_way(name) -> None:
    policy = get_policy(name)
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(5, 8, generator=g), torch.randn(6, 8, generator=g), torch.randn(6, generator=g)
    weight, bias = w.to(policy.weight_dtype), b.to(policy.weight_dtype)
    with policy.context(CPU):
        got = policy.linear(x.to(policy.stream_dtype), weight, bias, gelu=True)
    # independent: the matmul in the compute dtype from the same rounded inputs
    want = F.gelu(F.linear(x.to(policy.compute_dtype).double(), w.to(policy.compute_dtype).double(),
                           b.to(policy.compute_dtype).double()))
    assert got.dtype == policy.compute_dtype
    tol = 1e-5 if policy.is_reference else 3e-2
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
