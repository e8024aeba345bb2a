"""The fp32 embedding worker against fair-esm's own forward pass (issue 3)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from embedpipe.cli import app
from embedpipe.core.errors import EmbedpipeError
from embedpipe.core.options import EmbedOptions
from embedpipe.extraction.engine import Engine
from embedpipe.extraction.planning import plan_record
from embedpipe.extraction.run import embed_fasta
from embedpipe.model import load_model
from embedpipe.model.families import ESM2
from embedpipe.model.layers import resolve_layers
from helpers.embed_helpers import embed_and_read, fair_esm_forward, random_sequences, write_fasta
from helpers.engine import embedder_for

ATOL = 1e-5


@pytest.mark.parametrize("shape", [(2, 32, 4), (3, 48, 6)])
@pytest.mark.parametrize("attention", ["sdpa", "math", "fair-esm"])
def test_fp32_equals_fair_esm_forward_record_by_record(tmp_path, model_factory, fair_esm_reference, shape, attention):
    layers, dim, heads = shape
    path = model_factory(layers=layers, dim=dim, heads=heads, seed=layers)
    records = random_sequences(9, (5, 90), seed=1)
    store = embed_and_read(tmp_path, path, records, per_residue=True, layers=(0, 1, -1),
                   tokens_per_batch=300, attention=attention)
    model, alphabet = fair_esm_reference(path)
    wanted = [0, 1, layers]
    assert sorted(store["mean"]) == wanted
    assert store["ids"] == [r for r, _ in records]
    for rid, seq in records:
        ref = fair_esm_forward(model, alphabet, seq, wanted)
        for layer in wanted:
            per_res = store["per_residue"][layer][rid]
            assert per_res.shape == (len(seq), dim)
            np.testing.assert_allclose(per_res, ref[layer], atol=ATOL, rtol=0)
            np.testing.assert_allclose(store["mean"][layer][rid], ref[layer].mean(0), atol=ATOL, rtol=0)
        assert store["fields"]["precision_used"][rid] == "fp32"
        assert store["fields"]["fallback_reason"][rid] == ""
    assert store["attrs"]["model_trained"] == False  # noqa: E712  (numpy bool)
    assert store["attrs"]["precision_policy"] == "fp32"


def test_values_do_not_depend_on_batch_composition(tmp_path, tiny_model_path):
    records = random_sequences(12, (3, 120), seed=2)
    one = embed_and_read(tmp_path, tiny_model_path, records, name="a", per_residue=True, tokens_per_batch=130)
    many = embed_and_read(tmp_path, tiny_model_path, records, name="b", per_residue=True, tokens_per_batch=100_000)
    layer = max(one["mean"])
    for rid, _ in records:
        np.testing.assert_allclose(one["mean"][layer][rid], many["mean"][layer][rid], atol=ATOL, rtol=0)
        np.testing.assert_allclose(one["per_residue"][layer][rid], many["per_residue"][layer][rid], atol=ATOL, rtol=0)


def test_long_sequences_chunked_windows_match_fair_esm_per_window(tmp_path, tiny_model_path, fair_esm_reference):
    records = random_sequences(2, [2500, 40], seed=3)
    store = embed_and_read(tmp_path, tiny_model_path, records, per_residue=True)
    model, alphabet = fair_esm_reference(tiny_model_path)
    layer = max(store["mean"])
    rid, seq = records[0]
    pieces, how = plan_record(0, len(seq), "chunk", window=ESM2.window)
    assert how == "chunked" and len(pieces) >= 3
    assert all(p.residues <= ESM2.window for p in pieces)
    stitched = store["per_residue"][layer][rid]
    assert stitched.shape[0] == len(seq)
    assert store["fields"]["long_handling"][rid] == "chunked"
    assert store["fields"]["windows"][rid] == len(pieces)
    assert store["fields"]["long_handling"][records[1][0]] == "none"
    for piece in pieces:
        ref = fair_esm_forward(model, alphabet, seq[piece.start : piece.end], [layer])[layer]
        lo, hi = piece.keep_start - piece.start, piece.keep_end - piece.start
        np.testing.assert_allclose(stitched[piece.keep_start : piece.keep_end], ref[lo:hi], atol=ATOL, rtol=0)
    np.testing.assert_allclose(store["mean"][layer][rid], stitched.mean(0), atol=ATOL, rtol=0)


def test_chunk_plan_covers_every_residue_once():
    for length in (1023, 1500, 2044, 3000, 10_000):
        pieces, _ = plan_record(0, length, "chunk", window=ESM2.window)
        covered = np.zeros(length, dtype=int)
        for p in pieces:
            assert 0 <= p.start <= p.keep_start < p.keep_end <= p.end <= length
            assert p.residues <= ESM2.window
            covered[p.keep_start : p.keep_end] += 1
        assert (covered == 1).all(), length


def test_truncate_and_error_modes(tmp_path, tiny_model_path, fair_esm_reference):
    records = random_sequences(2, [1100, 30], seed=4)
    store = embed_and_read(tmp_path, tiny_model_path, records, per_residue=True, long_sequences="truncate")
    rid, seq = records[0]
    layer = max(store["mean"])
    assert store["fields"]["long_handling"][rid] == "truncated"
    assert store["fields"]["embedded_length"][rid] == ESM2.window
    assert store["fields"]["length"][rid] == 1100
    model, alphabet = fair_esm_reference(tiny_model_path)
    ref = fair_esm_forward(model, alphabet, seq[:ESM2.window], [layer])[layer]
    np.testing.assert_allclose(store["per_residue"][layer][rid], ref, atol=ATOL, rtol=0)
    with pytest.raises(EmbedpipeError, match="rec000.*1100 residues"):
        embed_and_read(tmp_path, tiny_model_path, records, name="err", long_sequences="error")
    assert not (tmp_path / "err.h5").exists()


def test_layer_resolution():
    assert resolve_layers([-1], 6) == [6]
    assert resolve_layers([0, -1, 6, 3], 6) == [0, 3, 6]
    assert resolve_layers([-7], 6) == [0]
    with pytest.raises(EmbedpipeError, match="layer 7 does not exist"):
        resolve_layers([7], 6)
    with pytest.raises(EmbedpipeError, match="layer -8"):
        resolve_layers([-8], 6)


def test_cuda_oom_splits_batch_and_names_unfittable_record(tmp_path, tiny_model_path, fair_esm_reference, monkeypatch):
    """Inject CUDA out-of-memory on the CPU: batches over 2 pieces fail, then a named record fails alone."""
    loaded = load_model(str(tiny_model_path))
    records = random_sequences(8, (10, 40), seed=5)
    embedder = embedder_for(loaded, EmbedOptions(tokens_per_batch=10_000), torch.device("cpu"))
    real = Engine._launch
    calls = []

    def flaky(self, policy, batch, recs):
        calls.append(len(batch))
        if len(batch) > 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected)")
        return real(self, policy, batch, recs)

    monkeypatch.setattr(Engine, "_launch", flaky)
    results = dict(embedder.embed(records))
    assert sorted(results) == list(range(8))
    assert calls == [8, 4, 2, 2, 4, 2, 2]  # 8 fails, halves fail, quarters succeed
    assert embedder.stats["oom_splits"] == 3
    model, alphabet = fair_esm_reference(tiny_model_path)
    layer = loaded.num_layers
    for index, (_, seq) in enumerate(records):
        ref = fair_esm_forward(model, alphabet, seq, [layer])[layer].mean(0)
        np.testing.assert_allclose(results[index].mean[layer], ref, atol=ATOL, rtol=0)

    def always(self, policy, batch, recs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected)")

    monkeypatch.setattr(Engine, "_launch", always)
    with pytest.raises(EmbedpipeError, match=r"record 'rec00\d'.*does not fit"):
        list(embedder_for(loaded, EmbedOptions(), torch.device("cpu")).embed(records))


def test_failed_run_leaves_no_store(tmp_path, tiny_model_path, monkeypatch):
    records = random_sequences(6, (10, 40), seed=6)
    fasta = write_fasta(tmp_path / "in.fasta", records)
    out = tmp_path / "store.h5"
    seen = []

    def boom(self, policy, batch, recs):
        seen.append(1)
        if len(seen) == 2:
            raise RuntimeError("simulated crash mid-run")
        return real(self, policy, batch, recs)

    real = Engine._launch
    monkeypatch.setattr(Engine, "_launch", boom)
    with pytest.raises(RuntimeError, match="simulated crash"):
        embed_fasta(fasta, model=str(tiny_model_path), out=out,
                    options=EmbedOptions(tokens_per_batch=60), quiet=True)
    assert not out.exists()
    assert list(tmp_path.glob("*.tmp")) == [] and list(tmp_path.glob(".store.h5*")) == []


def test_cli_embed_info_validate(tmp_path, tiny_model_path):
    records = random_sequences(5, (10, 60), seed=7)
    fasta = write_fasta(tmp_path / "in.fasta", records)
    out = tmp_path / "s.h5"
    runner = CliRunner()
    result = runner.invoke(app, ["embed", str(fasta), "--model", str(tiny_model_path), "--out", str(out),
                                 "--layers", "0", "--layers", "-1", "--per-residue"])
    assert result.exit_code == 0, result.output
    assert "embedded 5 records" in result.output
    assert "tokens per batch 4096 (auto)" in result.output  # the default, auto, on the CPU
    result = runner.invoke(app, ["validate", str(out)])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["info", str(out), "--json"])
    assert result.exit_code == 0, result.output
    assert '"precision_policy": "fp32"' in result.output
    assert '"tokens_per_batch": 4096,' in result.output and '"batch_layout": "padded"' in result.output
    result = runner.invoke(app, ["info", str(out)])
    assert "batches     4096 tokens (auto), padded;" in result.output
    given = runner.invoke(app, ["embed", str(fasta), "--model", str(tiny_model_path), "--out", str(tmp_path / "g.h5"),
                                "--tokens-per-batch", "300"],
                          env={"EMBEDPIPE_ENGINE": "batch_layout=padded,attention_inputs=fp32"})
    assert given.exit_code == 0, given.output
    assert "tokens per batch 300\n" in given.output + "\n" and "(auto)" not in given.output
    bad = runner.invoke(app, ["embed", str(fasta), "--model", str(tiny_model_path), "--out", str(out),
                              "--precision", "fp8"])
    assert bad.exit_code != 0 and "unknown precision policy 'fp8'" in bad.output


def test_oom_retry_runs_after_the_failed_attempt_is_freed(tiny_model_path, monkeypatch):
    """The traceback of a CUDA OOM holds the failed forward's tensors: halves must not run under it."""
    import gc
    import weakref

    loaded = load_model(str(tiny_model_path))
    records = random_sequences(4, (10, 20), seed=14)
    embedder = embedder_for(loaded, EmbedOptions(tokens_per_batch=10_000), torch.device("cpu"))
    real = Engine._launch
    failed: list = []
    alive_during_retry: list[bool] = []

    def flaky(self, policy, batch, recs):
        if failed:
            alive_during_retry.append(failed[-1]() is not None)
        if len(batch) > 1:
            activations = torch.ones(1000, 1000)  # stands in for the failed forward's memory
            failed.append(weakref.ref(activations))
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected)")
        return real(self, policy, batch, recs)

    monkeypatch.setattr(Engine, "_launch", flaky)
    gc.disable()  # prove it is freed by leaving the except block, not by a later collection
    try:
        assert len(dict(embedder.embed(records))) == 4
    finally:
        gc.enable()
    assert alive_during_retry and not any(alive_during_retry)


def test_unwritable_output_fails_in_one_line_before_any_work(tmp_path, tiny_model_path, monkeypatch):
    records = random_sequences(3, (10, 20), seed=15)
    fasta = write_fasta(tmp_path / "in.fasta", records)
    (tmp_path / "adir.h5").mkdir()
    monkeypatch.setattr(Engine, "_launch", lambda *a: pytest.fail("computed before checking the output"))
    result = CliRunner().invoke(app, ["embed", str(fasta), "--model", str(tiny_model_path), "--out", str(tmp_path / "adir.h5")])
    assert result.exit_code == 1
    assert "is a directory" in result.output and "Traceback" not in result.output
    result = CliRunner().invoke(app, ["merge", str(tmp_path / "x.h5"), "--out", str(tmp_path / "adir.h5")])
    assert result.exit_code == 1 and "Traceback" not in result.output


def test_long_sequences_full_embeds_whole_sequences_like_fair_esm(tmp_path, tiny_model_path, fair_esm_reference):
    records = random_sequences(2, [1300, 50], seed=16)
    store = embed_and_read(tmp_path, tiny_model_path, records, per_residue=True, long_sequences="full")
    model, alphabet = fair_esm_reference(tiny_model_path)
    layer = max(store["mean"])
    rid, seq = records[0]
    assert store["fields"]["long_handling"][rid] == "full" and store["fields"]["windows"][rid] == 1
    ref = fair_esm_forward(model, alphabet, seq, [layer])[layer]
    np.testing.assert_allclose(store["per_residue"][layer][rid], ref, atol=ATOL, rtol=0)
    np.testing.assert_allclose(store["mean"][layer][rid], ref.mean(0), atol=ATOL, rtol=0)


@pytest.mark.parametrize("tokens_per_batch, resolved", [("auto", 4096), (300, 300)])
def test_the_store_records_the_batches_it_was_made_with(tmp_path, tiny_model_path, tokens_per_batch, resolved):
    """``config`` keeps the option as given; root attributes hold the resolved budget, layout,
    attention path and q/k/v dtype (docs/store-format.md, "Root attributes")."""
    import json

    records = random_sequences(6, (10, 60), seed=17)
    store = embed_and_read(tmp_path, tiny_model_path, records, tokens_per_batch=tokens_per_batch)
    attrs = store["attrs"]
    assert json.loads(attrs["config"])["tokens_per_batch"] == tokens_per_batch
    assert int(attrs["tokens_per_batch"]) == resolved
    embedder = embedder_for(load_model(str(tiny_model_path)), EmbedOptions(tokens_per_batch=tokens_per_batch),
                        torch.device("cpu"))
    assert embedder.tokens_per_batch == resolved
    assert attrs["batch_layout"] == embedder.batch_layout == "padded"  # auto: padded off CUDA
    assert attrs["attention_path"] == embedder.attention_path
    assert attrs["attention_inputs"] == embedder.attention_inputs == "float32"  # fp32, and auto off CUDA
