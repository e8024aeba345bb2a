"""``--compile``: the compiled elementwise pieces (embedpipe/runtime/fused.py) against fair-esm's
own forward, ``auto``'s decision, the provenance and the identity (docs/precision.md, "Compiled
elementwise work"). Few tests: every inductor compile takes seconds to tens of seconds here,
so the module compiles once per policy into one inductor cache that later compiles reuse."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from embedpipe.core.options import FASTA_LIMITS
from embedpipe.embed import run
from embedpipe.embed.engine import EmbedOptions
from embedpipe.embed.identity import describe_difference
from embedpipe.runtime import fused
from helpers.embed_helpers import (
    bitwise_differences,
    embed_and_read,
    embed_store,
    fair_esm_forward,
    random_sequences,
    stored_values,
    write_fasta,
)

#: compiled fp32 against fair-esm's fp32 forward: the eager forward's own tolerance there
#: (tests/embed/test_embed.py); the compiled norms and rotation only reorder fp32 sums
FP32_ATOL = 1e-5
#: bf16-mixed, compiled or eager, against fair-esm's fp32 forward on this random 64-dim model:
#: bf16 matmuls (8 significant bits) through two layers
BF16_ATOL = 0.05
RECORDS = random_sequences(7, (5, 80), seed=2)


@pytest.fixture(scope="module")
def setup(tmp_path_factory, model_factory):
    path = model_factory(layers=2, dim=64, heads=4, seed=3)
    return path, tmp_path_factory.mktemp("compile"), str(tmp_path_factory.mktemp("inductor"))


def test_compiled_fp32_equals_fair_esm_forward_and_is_recorded(setup, fair_esm_reference):
    path, tmp, cache = setup
    on = embed_and_read(tmp, path, RECORDS, name="fp32-on", per_residue=True, compile="on", compile_cache=cache,
                        tokens_per_batch=200)
    off = embed_and_read(tmp, path, RECORDS, name="fp32-off", per_residue=True, compile="off", tokens_per_batch=200)
    model, alphabet = fair_esm_reference(path)
    for rid, seq in RECORDS:
        ref = fair_esm_forward(model, alphabet, seq, [2])[2]
        np.testing.assert_allclose(on["per_residue"][2][rid], ref, atol=FP32_ATOL, rtol=0)
    assert on["attrs"]["compiled"] == True  # noqa: E712  (numpy bool)
    assert on["attrs"]["compile_reason"] == "--compile on"
    assert on["attrs"]["compile_s"] > 0
    assert off["attrs"]["compiled"] == False and off["attrs"]["compile_s"] == 0  # noqa: E712
    assert any(p.is_file() for p in Path(cache).rglob("*")), "the inductor cache stayed empty"
    why = describe_difference(str(off["attrs"]["embed_identity"]), str(on["attrs"]["embed_identity"]))
    assert why is not None and "compiled elementwise work" in why


def test_compiled_bf16_mixed_is_as_close_to_fair_esm_as_eager_and_batch_invariant(setup, fair_esm_reference):
    path, tmp, cache = setup
    options = dict(precision="bf16-mixed", per_residue=True, compile_cache=cache)
    on = embed_and_read(tmp, path, RECORDS, name="bf16-on", compile="on", tokens_per_batch=200, **options)
    off = embed_and_read(tmp, path, RECORDS, name="bf16-off", compile="off", tokens_per_batch=200, **options)
    model, alphabet = fair_esm_reference(path)
    for rid, seq in RECORDS:
        ref = fair_esm_forward(model, alphabet, seq, [2])[2]
        eager_error = float(np.abs(off["per_residue"][2][rid] - ref).max())
        compiled_error = float(np.abs(on["per_residue"][2][rid] - ref).max())
        assert compiled_error <= BF16_ATOL and eager_error <= BF16_ATOL, (rid, compiled_error, eager_error)
    # batch invariance holds compiled too: other batch-mates and batch sizes, the same bits
    small = stored_values(embed_store(tmp, path, RECORDS, "bf16-on-small", compile="on", tokens_per_batch=90,
                                      **options))
    alone = stored_values(embed_store(tmp, path, RECORDS[3:4], "bf16-on-alone", compile="on", **options))
    reference = stored_values(tmp / "bf16-on.h5")
    assert bitwise_differences(reference, small) == []
    assert bitwise_differences(reference, alone) == []


def test_auto_compiles_only_a_job_big_enough(setup, monkeypatch):
    path, tmp, cache = setup
    tiny = embed_and_read(tmp, path, RECORDS, name="auto-tiny", precision="bf16-mixed", compile_cache=cache)
    assert tiny["attrs"]["compiled"] == False  # noqa: E712
    residues = sum(len(s) for _, s in RECORDS)
    # no policy is measured faster compiled on a quiet CPU (docs/benchmarks.md), so auto stays eager
    assert tiny["attrs"]["compile_reason"].startswith("auto: bf16-mixed was not measured faster compiled")
    monkeypatch.setattr(fused, "AUTO_POLICIES", ("bf16-mixed",))  # a CPU class that gained
    too_small = embed_and_read(tmp, path, RECORDS, name="auto-small", precision="bf16-mixed", compile_cache=cache)
    assert too_small["attrs"]["compiled"] == False  # noqa: E712
    assert too_small["attrs"]["compile_reason"].startswith(f"auto: {residues} residues, below")
    monkeypatch.setattr(fused, "COLD_BREAK_EVEN", 10)  # forced low: this job now repays it
    forced = embed_and_read(tmp, path, RECORDS, name="auto-forced", precision="bf16-mixed", compile_cache=cache)
    why = forced["attrs"]["compile_reason"]
    assert why.startswith(f"auto: {residues} residues, at least")
    # compiled where the policy has a compiled path on this CPU (prepacked fp32-stream layers);
    # where it has none (bf16 not native: nothing prepacked) the store says so and is eager
    assert forced["attrs"]["compiled"] == ("has no compiled path" not in why)
    # never on CUDA unless asked, and not for the policy compiling did not speed up
    assert fused.decide_compile("auto", "bf16-mixed", "cuda", 10**9)[0] is False
    assert fused.decide_compile("auto", "int8-mixed", "cpu", 10**9)[0] is False
    assert fused.decide_compile("on", "int8-mixed", "cuda", 1)[0] is True


def test_auto_reads_the_group_s_residues_only_for_a_policy_it_may_compile(tmp_path, monkeypatch):
    shards = [write_fasta(tmp_path / f"s{i}.fasta", RECORDS[i::2]) for i in range(2)]
    options = EmbedOptions(precision="bf16-mixed", compile="auto")
    assert run._job_residues(shards, options, FASTA_LIMITS) == 0  # no policy listed: no shard read
    monkeypatch.setattr(fused, "AUTO_POLICIES", ("bf16-mixed",))
    assert run._job_residues(shards, options, FASTA_LIMITS) == sum(len(s) for _, s in RECORDS)
    assert run._job_residues(shards, EmbedOptions(precision="bf16-mixed", compile="on"), FASTA_LIMITS) == 0
