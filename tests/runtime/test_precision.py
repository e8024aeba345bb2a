"""Precision policies, per-record fp32 fallback and precision provenance (issue 4)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from embedpipe.core.errors import EmbedpipeError
from embedpipe.core.options import EmbedOptions
from embedpipe.extraction.engine import Engine
from embedpipe.model import load_model
from embedpipe.runtime import precision
from embedpipe.runtime.cpu_features import CpuFeatures
from embedpipe.runtime.precision import POLICIES, check_policy_on_device, get_policy
from helpers.embed_helpers import embed_and_read, fair_esm_forward, random_sequences, read_store, write_fasta
from helpers.engine import embedder_for
from helpers.stores import cosine

LOW_POLICIES = [p for p in POLICIES if p != "fp32"]



@pytest.mark.parametrize("attention", ["sdpa", "fair-esm"])
def test_fp16_overflow_falls_back_exactly_for_records_with_the_token(tmp_path, overflow_model, overflow_records,
                                                                     fair_esm_reference, attention):
    store = embed_and_read(tmp_path, overflow_model, overflow_records, "fp16", precision="fp16", per_residue=True,
                   layers=(0, -1), attention=attention)
    model, alphabet = fair_esm_reference(overflow_model)
    used = store["fields"]["precision_used"]
    reasons = store["fields"]["fallback_reason"]
    for rid, seq in overflow_records:
        if "C" in seq:
            assert used[rid] == "fp32" and reasons[rid] == "nonfinite", (rid, used[rid], reasons[rid])
            ref = fair_esm_forward(model, alphabet, seq, [0, 2])
            for layer in (0, 2):
                np.testing.assert_allclose(store["per_residue"][layer][rid], ref[layer], atol=1e-5, rtol=0)
                # layer 0 holds the 61,600-sized 'C' row: fp32 summation order alone moves the mean by ~4e-4
                np.testing.assert_allclose(store["mean"][layer][rid], ref[layer].mean(0), atol=1e-5, rtol=1e-6)
            assert not np.isfinite(store["fields"]["max_abs_activation"][rid])  # seen in the fp16 pass
        else:
            assert used[rid] == "fp16" and reasons[rid] == "", rid
    assert store["attrs"]["fallback_count"] == 4
    assert json.loads(store["attrs"]["fallback_reasons"]) == {"nonfinite": 4}


@pytest.mark.parametrize("policy", list(POLICIES))
def test_nothing_non_finite_is_stored_under_any_policy(tmp_path, overflow_model, overflow_records, policy):
    store = embed_and_read(tmp_path, overflow_model, overflow_records, policy, precision=policy, per_residue=True,
                   layers=(0, 1, 2), storage_dtype="float16" if policy == "bf16" else "float32")
    for layer in (0, 1, 2):
        for rid, _ in overflow_records:
            assert np.isfinite(store["mean"][layer][rid]).all()
            assert np.isfinite(store["per_residue"][layer][rid]).all()
    used = set(store["fields"]["precision_used"].values())
    assert used <= {policy, "fp32"}
    assert store["attrs"]["precision_policy"] == policy


def test_overflow_margin_falls_back_before_the_dtype_limit(tmp_path, overflow_model, overflow_records):
    """amp-fp16 keeps the 61,600-sized activations finite, but within 50% of fp16's max."""
    plain = embed_and_read(tmp_path, overflow_model, overflow_records, "amp", precision="amp-fp16")
    assert set(plain["fields"]["precision_used"].values()) == {"amp-fp16"}
    margin = embed_and_read(tmp_path, overflow_model, overflow_records, "amp-margin", precision="amp-fp16", overflow_margin=0.5)
    for rid, seq in overflow_records:
        expected = ("fp32", "overflow-margin") if "C" in seq else ("amp-fp16", "")
        assert (margin["fields"]["precision_used"][rid], margin["fields"]["fallback_reason"][rid]) == expected
        if "C" in seq:
            assert margin["fields"]["max_abs_activation"][rid] > 0.5 * 65504


def test_fp32_values_that_do_not_fit_float16_storage_fail_naming_the_record(tmp_path, model_factory):
    path = model_factory(layers=2, dim=32, heads=4, seed=22, token_row_overrides={"W": 9e4})
    records = [("fine", "ACDEFGHIK"), ("bigW", "ACDWEFG")]
    with pytest.raises(EmbedpipeError, match="record 'bigW'.*storage-dtype float16"):
        embed_and_read(tmp_path, path, records, "f16store", precision="fp32", layers=(0,), storage_dtype="float16")
    assert not (tmp_path / "f16store.h5").exists()


def test_every_policy_is_finite_recorded_and_close_to_fp32(tmp_path, model_factory):
    path = model_factory(layers=3, dim=64, heads=4, seed=5)
    records = random_sequences(8, (30, 300), seed=10)
    ref = embed_and_read(tmp_path, path, records, "ref", precision="fp32")
    figures = {}
    for policy in LOW_POLICIES:
        store = embed_and_read(tmp_path, path, records, policy, precision=policy)
        assert store["attrs"]["precision_policy"] == policy
        assert store["attrs"]["compute_dtype"] == precision.dtype_name(POLICIES[policy].compute_dtype)
        cosines = [cosine(store["mean"][3][r], ref["mean"][3][r]) for r, _ in records]
        max_abs = max(float(np.abs(store["mean"][3][r] - ref["mean"][3][r]).max()) for r, _ in records)
        figures[policy] = (min(cosines), max_abs)
        assert set(store["fields"]["precision_used"].values()) == {policy}
    report = ", ".join(f"{p}: min cos {c:.6f} max|d| {m:.2e}" for p, (c, m) in figures.items())
    for cos, max_abs in figures.values():
        assert cos > 0.999 and max_abs < 0.1, report


def test_mixed_policies_are_closer_to_fp32_than_plain_casts_on_long_sequences(model_factory):
    """700-1022 residues: fp32 rotary tables, attention and norms beat the plain cast."""
    loaded = load_model(str(model_factory(layers=4, dim=64, heads=4, seed=3)))
    records = random_sequences(4, (700, 1022), seed=9)
    last = loaded.num_layers

    def run(policy):
        embedder = embedder_for(loaded, EmbedOptions(precision=policy, per_residue=True), torch.device("cpu"))
        return dict(embedder.embed(records))

    ref = run("fp32")

    def error(policy):
        out = run(policy)
        return float(np.mean([
            np.linalg.norm(out[i].per_residue[last] - ref[i].per_residue[last]) / np.linalg.norm(ref[i].per_residue[last])
            for i in range(len(records))
        ]))

    errors = {p: error(p) for p in ("fp16", "fp16-mixed", "bf16", "bf16-mixed")}
    message = "mean per-residue relative L2 error to fp32: " + ", ".join(f"{p}={e:.3e}" for p, e in errors.items())
    assert errors["fp16-mixed"] < 0.85 * errors["fp16"], message
    assert errors["bf16-mixed"] < 0.85 * errors["bf16"], message


def test_low_precision_then_fp32_in_one_process_equals_a_fresh_process(tmp_path, tiny_model_path):
    records = random_sequences(6, (10, 200), seed=11)
    for policy in ("fp16", "bf16-mixed"):
        embed_and_read(tmp_path, tiny_model_path, records, f"warm-{policy}", precision=policy, attention="fair-esm"
               if policy == "fp16" else "sdpa")
    same_process = embed_and_read(tmp_path, tiny_model_path, records, "after", precision="fp32", attention="fair-esm",
                          per_residue=True)
    fasta = tmp_path / "after.fasta"
    fresh_out = tmp_path / "fresh.h5"
    subprocess.run([sys.executable, "-m", "embedpipe.cli", "embed", str(fasta), "--model", str(tiny_model_path),
                    "--out", str(fresh_out), "--per-residue", "--quiet"], check=True,
                   env=os.environ | {"EMBEDPIPE_ENGINE": "attention=fair-esm"})
    fresh = read_store(fresh_out)
    for rid, _ in records:
        np.testing.assert_allclose(same_process["per_residue"][2][rid], fresh["per_residue"][2][rid], atol=1e-6, rtol=0)


def test_rotary_cache_from_one_dtype_never_leaks_into_another(tiny_model_path):
    """fair-esm rebuilds its cos/sin cache on length or device change only, not dtype."""
    loaded = load_model(str(tiny_model_path))
    records = random_sequences(3, (40, 40), seed=12)
    fp32 = embedder_for(loaded, EmbedOptions(), torch.device("cpu"), attention="fair-esm")
    before = dict(fp32.embed(records))
    low = embedder_for(loaded, EmbedOptions(precision="fp16"), torch.device("cpu"), attention="fair-esm")
    dict(low.embed(records))
    rot = low.runner(get_policy("fp16")).model.layers[0].self_attn.rot_emb
    assert rot._cos_cached.dtype == torch.float16
    again = dict(embedder_for(loaded, EmbedOptions(), torch.device("cpu"), attention="fair-esm").embed(records))
    assert loaded.model.layers[0].self_attn.rot_emb._cos_cached.dtype == torch.float32
    for i in before:
        np.testing.assert_array_equal(before[i].mean[2], again[i].mean[2])


def test_device_checks(monkeypatch):
    avx512_bf16 = CpuFeatures(frozenset({"avx2", "avx512f", "avx512_bf16"}))  # native bf16, emulated fp16
    notes = check_policy_on_device(get_policy("fp16-mixed"), torch.device("cpu"), avx512_bf16)
    assert notes and "bf16-mixed" in notes[0]
    assert check_policy_on_device(get_policy("bf16"), torch.device("cpu"), avx512_bf16) == []
    # What current torch answers on a V100: bf16 "supported" (emulated), compute capability 7.0.
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (7, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "Tesla V100")
    for name in ("bf16", "bf16-mixed", "amp-bf16"):
        with pytest.raises(EmbedpipeError, match=f"{name}.*Tesla V100.*7\\.0.*pre-Ampere"):
            check_policy_on_device(get_policy(name), torch.device("cuda"))
    assert check_policy_on_device(get_policy("fp16-mixed"), torch.device("cuda")) == []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "NVIDIA A100")
    assert check_policy_on_device(get_policy("bf16-mixed"), torch.device("cuda")) == []
    with pytest.raises(EmbedpipeError, match="unknown precision policy 'half'"):
        get_policy("half")


def test_mixed_policy_refuses_fair_esm_attention(tiny_model_path):
    with pytest.raises(EmbedpipeError, match="^EMBEDPIPE_ENGINE attention=fair-esm: --precision bf16-mixed keeps fp32 islands"):
        embedder_for(load_model(str(tiny_model_path)), EmbedOptions(precision="bf16-mixed"), torch.device("cpu"),
                     attention="fair-esm")


def test_fp32_policy_pins_true_fp32_matmuls_and_restores_settings(tiny_model_path, monkeypatch):
    """No TF32 for fp32 work; the process-wide flags are set once per worker run (not per
    batch) and restored after it."""
    from embedpipe.runtime.precision import forward_context, true_fp32_matmuls

    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")
    try:
        with true_fp32_matmuls(), forward_context(get_policy("fp32"), torch.device("cpu")):
            assert torch.get_float32_matmul_precision() == "highest"
            assert torch.backends.cuda.matmul.allow_tf32 is False
        assert torch.get_float32_matmul_precision() == "medium"
        with forward_context(get_policy("bf16-mixed"), torch.device("cpu")):
            assert torch.get_float32_matmul_precision() == "medium"

        seen: list[str] = []
        real_forward = Engine._launch

        def forward(self, *args):
            seen.append(torch.get_float32_matmul_precision())
            return real_forward(self, *args)

        settings: list[str] = []
        real_set = torch.set_float32_matmul_precision
        monkeypatch.setattr(Engine, "_launch", forward)
        monkeypatch.setattr(torch, "set_float32_matmul_precision", lambda p: (settings.append(p), real_set(p))[1])
        records = random_sequences(6, (20, 60), seed=1)
        embedder = embedder_for(load_model(str(tiny_model_path)), EmbedOptions(tokens_per_batch=64), torch.device("cpu"))
        dict(embedder.embed(records))
        assert len(seen) > 1 and set(seen) == {"highest"}
        assert settings == ["highest", "medium"]
        assert torch.get_float32_matmul_precision() == "medium"
    finally:
        torch.set_float32_matmul_precision(before)


def test_fused_qkv_weights_follow_each_policys_dtype(tiny_model_path):
    """The fused q/k/v GEMM must use the policy's weights, never a stale fp32 copy."""
    loaded = load_model(str(tiny_model_path))
    records = random_sequences(2, (20, 30), seed=13)
    for name in ("fp32", "bf16-mixed", "fp16", "fp32"):
        embedder = embedder_for(loaded, EmbedOptions(precision=name), torch.device("cpu"))
        dict(embedder.embed(records))
        for layer in embedder.runner(get_policy(name)).model.layers:
            attn = layer.self_attn
            weight, bias = attn._embedpipe_qkv
            assert weight.dtype == POLICIES[name].weight_dtype
            assert attn.k_proj.weight.data_ptr() == weight[attn.k_proj.weight.shape[0]].data_ptr()
            torch.testing.assert_close(weight[: weight.shape[0] // 3], attn.q_proj.weight, rtol=0, atol=0)


def test_prepared_copies_hold_each_policys_dtypes_and_leave_the_source_alone(tiny_model_path):
    from embedpipe.model.esm2 import prepare_model

    loaded = load_model(str(tiny_model_path))
    source = {k: v.clone() for k, v in loaded.model.state_dict().items()}
    mixed = prepare_model(loaded.model, get_policy("bf16-mixed"), torch.device("cpu"))
    plain = prepare_model(loaded.model, get_policy("fp16"), torch.device("cpu"))
    rot_mixed = mixed.layers[0].self_attn.rot_emb.inv_freq
    assert rot_mixed.dtype == torch.float32  # fp32 rotary frequencies: the tables are really fp32
    torch.testing.assert_close(rot_mixed, loaded.model.layers[0].self_attn.rot_emb.inv_freq, rtol=0, atol=0)
    assert mixed.layers[0].self_attn_layer_norm.weight.dtype == torch.float32
    assert mixed.layers[0].fc1.weight.dtype == torch.bfloat16
    assert plain.layers[0].self_attn.rot_emb.inv_freq.dtype == torch.float16  # a plain cast casts all
    assert plain.layers[0].self_attn_layer_norm.weight.dtype == torch.float16
    assert mixed.lm_head.weight is mixed.embed_tokens.weight  # ties survive the copy
    for key, value in loaded.model.state_dict().items():
        assert value.dtype == torch.float32
        torch.testing.assert_close(value, source[key], rtol=0, atol=0)


def test_rotary_tables_are_bounded_and_prefixes_are_exact():
    from embedpipe.model.esm2_forward import RotaryTables

    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    tables = RotaryTables()
    for dtype in (torch.float32, torch.bfloat16):
        long_cos, long_sin = tables.get(inv_freq.to(dtype), 900, dtype)
        for length in (3, 77, 512):
            fresh_cos, fresh_sin = RotaryTables().get(inv_freq.to(dtype), length, dtype)
            cos, sin = tables.get(inv_freq.to(dtype), length, dtype)
            torch.testing.assert_close(cos, fresh_cos, rtol=0, atol=0)
            torch.testing.assert_close(sin, fresh_sin, rtol=0, atol=0)
            assert cos.shape == (length, 2, 1, 8) and long_cos.shape[0] == 900
    assert len(tables._cache) == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rotation_equals_fair_esms_rotary_embedding(dtype):
    """q (scaled first, as fair-esm does) and k rotated together into a wider buffer."""
    from esm.rotary_embedding import RotaryEmbedding

    from embedpipe.model.esm2_forward import RotaryTables, rotate_into

    head_dim, heads, length, scale = 16, 3, 41, 16 ** -0.5
    rot = RotaryEmbedding(dim=head_dim).to(dtype)
    generator = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, length, heads, head_dim, generator=generator).to(dtype) for _ in range(2))
    # fair-esm: q_proj(x) * scaling, then rot_emb on (batch * heads, T, head_dim)
    flat = lambda t: t.transpose(1, 2).reshape(2 * heads, length, head_dim)  # noqa: E731
    want_q, want_k = rot(flat(q * scale), flat(k))

    table_dtype = rot.inv_freq.dtype
    cos, sin = RotaryTables().get(rot.inv_freq, length, table_dtype, scale)
    out = torch.empty((2, 2, heads, length, head_dim), dtype=torch.float32)
    rotate_into(torch.stack((q, k), 2), cos, sin, out=out.permute(1, 3, 0, 2, 4))
    tolerance = {torch.float32: 1e-6, torch.bfloat16: 3e-2, torch.float16: 4e-3}[dtype]
    torch.testing.assert_close(out[0].reshape(2 * heads, length, head_dim), want_q.float(), rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(out[1].reshape(2 * heads, length, head_dim), want_k.float(), rtol=tolerance, atol=tolerance)


def test_pair_order_rotation_equals_fair_esms_rotary_embedding():
    """Interleaved q/k rows + one complex multiply == fair-esm's rotation, once the order is undone."""
    from esm.rotary_embedding import RotaryEmbedding

    from embedpipe.model.esm2_forward import RotaryTables, interleave_rotary_rows, rotate_pairs_

    heads, head_dim, length, dim, scale = 3, 8, 29, 24, 8 ** -0.5
    generator = torch.Generator().manual_seed(7)
    weight, bias = torch.randn(3 * dim, dim, generator=generator), torch.randn(3 * dim, generator=generator)
    x = torch.randn(2, length, dim, generator=generator)
    rot = RotaryEmbedding(dim=head_dim)

    qkv = torch.nn.functional.linear(x, weight, bias).view(2, length, 3, heads, head_dim)
    flat = lambda t: t.transpose(1, 2).reshape(2 * heads, length, head_dim)  # noqa: E731
    want_q, want_k = rot(flat(qkv[:, :, 0] * scale), flat(qkv[:, :, 1]))

    paired_w, paired_b = interleave_rotary_rows(weight, bias, heads, head_dim)
    paired = torch.nn.functional.linear(x, paired_w, paired_b).view(2, length, 3, heads, head_dim)
    torch.testing.assert_close(paired[:, :, 2], qkv[:, :, 2], rtol=0, atol=0)  # v untouched
    qk = paired[:, :, :2].clone()
    rotate_pairs_(qk, RotaryTables().complex(rot.inv_freq, length, scale))
    half = head_dim // 2
    undo = torch.cat((torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)))  # pair order -> halves
    assert undo.tolist()[:half] == [0, 2, 4, 6]
    torch.testing.assert_close(flat(qk[:, :, 0][..., undo]), want_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(flat(qk[:, :, 1][..., undo]), want_k, rtol=1e-6, atol=1e-6)
    # attention scores do not see the order: q.k per head is the same
    q_halves, k_halves = qk[:, :, 0][..., undo], qk[:, :, 1][..., undo]
    torch.testing.assert_close(torch.einsum("bthd,bshd->bhts", qk[:, :, 0], qk[:, :, 1]),
                               torch.einsum("bthd,bshd->bhts", q_halves, k_halves), rtol=1e-5, atol=1e-5)


def test_masked_max_abs_sees_negatives_and_nonfinite_and_skips_padding():
    from embedpipe.model.base import masked_max_abs

    x = torch.zeros(3, 4, 5, dtype=torch.float16)
    x[0, 1, 2] = -7.0
    x[1, 3, 0] = 60000.0  # padding: ignored
    x[1, 0, 4] = 2.0
    x[2, 2, 1] = float("nan")
    keep = torch.ones(3, 4, dtype=torch.bool)
    keep[1, 3] = False
    got = masked_max_abs(x, keep)
    assert got.dtype == torch.float32
    assert got[0].item() == 7.0 and got[1].item() == 2.0 and torch.isnan(got[2])
    x[2, 2, 1] = float("-inf")
    assert masked_max_abs(x, keep)[2].item() == float("inf")


@pytest.mark.parametrize("policy", ["amp-bf16", "amp-fp16"])
def test_pooling_sums_stay_fp32_under_autocast(tiny_model_path, policy):
    """Autocast would run the pooling einsum in 16 bits: each mean must be the fp32 mean of its rows."""
    loaded = load_model(str(tiny_model_path))
    records = random_sequences(3, (900, 1000), seed=31)
    embedder = embedder_for(loaded, EmbedOptions(precision=policy, per_residue=True, layers=(0, -1)), torch.device("cpu"))
    out = dict(embedder.embed(records))
    for index in range(len(records)):
        assert out[index].precision_used == policy
        for layer in embedder.layers:
            rows = out[index].per_residue[layer]
            assert rows.dtype == np.float32
            expected = rows.astype(np.float64).mean(0)
            np.testing.assert_allclose(out[index].mean[layer], expected, rtol=1e-5,
                                       atol=1e-6 * float(np.abs(expected).max()))


def _fallback_embedder(loaded, fallback_device: str, monkeypatch, prepared_on: list):
    """An fp16 embedder whose main model runs on the CPU while its main device reads as a GPU on
    which preparing the fp32 model runs out of memory (the CPU stand-in for a full 80 GB GPU)."""
    from embedpipe.model import esm2 as esm2_module

    real = esm2_module.prepare_model

    def prepare(model, policy, device, **kw):
        prepared_on.append((policy.name, str(device), kw.get("private", False)))
        if policy.name == "fp32" and device.type == "cuda":
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected while moving the fp32 model)")
        return real(model, policy, device, **kw)

    monkeypatch.setattr(esm2_module, "prepare_model", prepare)
    embedder = embedder_for(loaded, EmbedOptions(precision="fp16", per_residue=True, layers=(0, -1)),
                            torch.device("cpu"), fallback_device=fallback_device)
    embedder.runner(embedder.policy)  # the fp16 model: prepared on the CPU
    embedder.device = torch.device("cuda", 0)  # ...while the job's device reads as the GPU
    return embedder


def test_fp32_fallback_that_does_not_fit_the_gpu_runs_on_the_cpu(overflow_model, overflow_records, monkeypatch):
    loaded = load_model(str(overflow_model))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    prepared_on: list = []
    embedder = _fallback_embedder(loaded, "auto", monkeypatch, prepared_on)
    out = dict(embedder.embed(overflow_records))
    # the fp32 model was tried on the GPU, then used where it was loaded, on the CPU
    assert prepared_on == [("fp16", "cpu", False), ("fp32", "cuda:0", False), ("fp32", "cpu", False)]
    assert embedder.fallback_device == "cpu" and embedder.stats["fallback_moved_to_cpu"] == 1
    assert next(loaded.model.parameters()).device.type == "cpu"
    fp32 = embedder_for(loaded, EmbedOptions(per_residue=True, layers=(0, -1)), torch.device("cpu"))
    reference = dict(fp32.embed(overflow_records))
    fell = [i for i, (_, seq) in enumerate(overflow_records) if "C" in seq]
    assert fell and embedder.stats["fallback"] == len(fell)
    for index in fell:
        assert out[index].precision_used == "fp32"
        for layer in embedder.layers:
            np.testing.assert_allclose(out[index].mean[layer], reference[index].mean[layer], rtol=1e-6, atol=1e-6)
            np.testing.assert_allclose(out[index].per_residue[layer], reference[index].per_residue[layer], rtol=1e-6, atol=1e-6)


def test_fp32_fallback_that_does_not_fit_says_so_under_same(overflow_model, overflow_records, monkeypatch):
    loaded = load_model(str(overflow_model))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    embedder = _fallback_embedder(loaded, "same", monkeypatch, [])
    with pytest.raises(EmbedpipeError, match=r"fp32 fallback model .* does not fit in memory on cuda:0 .*a GPU with more memory"):
        list(embedder.embed(overflow_records))


def test_a_fallback_forward_out_of_memory_still_names_the_record(overflow_model, overflow_records, monkeypatch):
    loaded = load_model(str(overflow_model))
    real = Engine._launch

    def fp32_oom(self, policy, batch, recs):
        if policy.name == "fp32":
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected in the forward)")
        return real(self, policy, batch, recs)

    monkeypatch.setattr(Engine, "_launch", fp32_oom)
    embedder = embedder_for(loaded, EmbedOptions(precision="fp16"), torch.device("cpu"), fallback_device="cpu")
    with pytest.raises(EmbedpipeError, match=r"record 'cys\d'.*does not fit in memory on cpu even alone"):
        list(embedder.embed(overflow_records))


def test_fallback_device_is_recorded_in_the_store(tmp_path, overflow_model, overflow_records):
    store = embed_and_read(tmp_path, overflow_model, overflow_records, "cpufb", precision="fp16", fallback_device="cpu")
    assert store["attrs"]["fallback_device"] == "cpu" and store["attrs"]["fallback_count"] == 4
    assert "fallback_device" not in json.loads(store["attrs"]["config"])  # not an option: derived, or overridden
    plain = embed_and_read(tmp_path, overflow_model, overflow_records, "nofb", precision="fp32")
    assert plain["attrs"]["fallback_device"] == "none"
    with pytest.raises(EmbedpipeError, match="^EMBEDPIPE_ENGINE: fallback_device must be one of auto, same, cpu, not 'gpu'$"):
        embed_and_read(tmp_path, overflow_model, overflow_records, "gpufb", precision="fp16", fallback_device="gpu")
    from typer.testing import CliRunner

    from embedpipe.cli import app

    fasta = write_fasta(tmp_path / "cli.fasta", overflow_records)
    result = CliRunner().invoke(app, ["embed", str(fasta), "--model", str(overflow_model), "--out", str(tmp_path / "cli.h5"),
                                      "--precision", "fp16", "-q"], env={"EMBEDPIPE_ENGINE": "fallback_device=cpu"})
    assert result.exit_code == 0, result.output
    assert read_store(tmp_path / "cli.h5")["attrs"]["fallback_device"] == "cpu"
