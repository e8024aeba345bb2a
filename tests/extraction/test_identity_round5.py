"""Integrity round 5: the identity holds the platform that decides the numbers (CPU class, GPU
model, torch and oneDNN: resume re-embeds and ``--reuse`` refuses another platform unless
``--accept-platform-mix``; a merged store of several says which records came from where), and
it compares what was resolved and ran, not how it was requested (an ``EMBEDPIPE_ENGINE``
override that resolves as the derived choice); an all-reused store keeps
this run's request, not its source's (embedpipe/extraction/identity.py, resolved.py, reuse.py)."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import pytest
from typer.testing import CliRunner

import embedpipe.extraction.resolved as resolved_module
from embedpipe.cli import app
from embedpipe.core.errors import EmbedpipeError
from embedpipe.core.options import EmbedOptions
from embedpipe.extraction.run import embed_fasta, embed_shards
from embedpipe.store.info import render_info, store_info
from embedpipe.store.merge import merge_stores
from embedpipe.store.validate import validate_store
from helpers.embed_helpers import random_sequences, write_fasta
from helpers.engine import engine_override
from helpers.stores import rewrite_attr_digests

RECORDS = random_sequences(4, (8, 24), seed=5)
REUSABLE = "only a store embedded with the same model and options can be reused"
WORDS = ("the platform (CPU instruction-set class or GPU model, torch and oneDNN versions decide the numbers; "
         "--accept-platform-mix to accept it)")


def _on(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """This process described as platform ``name`` (what embedpipe.runtime.platform would say elsewhere)."""
    monkeypatch.setattr(resolved_module, "describe_platform", lambda device: name)


def _platform(store: Path) -> tuple[str, str]:
    with h5py.File(store, "r") as f:
        return str(f.attrs["platform"]), json.loads(f.attrs["embed_identity"])["platform"]


def test_another_platform_is_embedded_again_and_refused_by_reuse(tmp_path, tiny_model_path, monkeypatch, capsys):
    shard, out = write_fasta(tmp_path / "shard-0.fasta", RECORDS), tmp_path / "stores"
    store = out / "shard-0.h5"
    _on(monkeypatch, "cpu avx2 (torch AVX2), torch 2.13.0, onednn 3.12.0")
    embed_shards([shard], model=str(tiny_model_path), out_dir=out, options=EmbedOptions(device="cpu"), quiet=True)
    assert _platform(store) == ("cpu avx2 (torch AVX2), torch 2.13.0, onednn 3.12.0",) * 2
    _on(monkeypatch, "cpu amx (torch AVX512), torch 2.13.0, onednn 3.12.0")
    with pytest.raises(EmbedpipeError) as refused:
        embed_fasta(write_fasta(tmp_path / "again.fasta", RECORDS), model=str(tiny_model_path),
                    out=tmp_path / "again.h5", options=EmbedOptions(device="cpu"), quiet=True, reuse=[store])
    assert str(refused.value) == (f"--reuse {store}: embedded with {WORDS} 'cpu avx2 (torch AVX2), torch 2.13.0, "
                                  f"onednn 3.12.0', this run 'cpu amx (torch AVX512), torch 2.13.0, onednn 3.12.0'; "
                                  f"{REUSABLE}")
    capsys.readouterr()
    again = embed_shards([shard], model=str(tiny_model_path), out_dir=out, options=EmbedOptions(device="cpu"))
    assert len(again.embedded) == 1 and again.kept == []
    assert (f"{store}: embedded with {WORDS} 'cpu avx2 (torch AVX2), torch 2.13.0, onednn 3.12.0', this run "
            "'cpu amx (torch AVX512), torch 2.13.0, onednn 3.12.0'; embedding it again") in capsys.readouterr().err
    assert _platform(store) == ("cpu amx (torch AVX512), torch 2.13.0, onednn 3.12.0",) * 2


def test_accept_platform_mix_keeps_and_reuses_and_still_records(tmp_path, tiny_model_path, monkeypatch):
    shard, out = write_fasta(tmp_path / "shard-0.fasta", RECORDS), tmp_path / "stores"
    store = out / "shard-0.h5"
    mix = EmbedOptions(device="cpu", accept_platform_mix=True)
    _on(monkeypatch, "platform A")
    embed_shards([shard], model=str(tiny_model_path), out_dir=out, options=EmbedOptions(device="cpu"), quiet=True)
    _on(monkeypatch, "platform B")
    again = embed_shards([shard], model=str(tiny_model_path), out_dir=out, options=mix, quiet=True)
    assert again.kept == [store] and again.embedded == []
    copied = embed_fasta(write_fasta(tmp_path / "again.fasta", RECORDS), model=str(tiny_model_path),
                         out=tmp_path / "again.h5", options=mix, quiet=True, reuse=[store])
    assert copied.reused == len(RECORDS)
    # the copies' numbers came from platform A: the store says so; its identity names this run's
    assert _platform(tmp_path / "again.h5") == ("platform A", "platform B")


def test_a_merged_store_of_two_platforms_says_which_records_came_from_where(tmp_path, tiny_model_path, monkeypatch):
    out = tmp_path / "stores"
    shards = [write_fasta(tmp_path / f"shard-{k}.fasta", RECORDS[2 * k: 2 * k + 2]) for k in range(2)]
    for shard, name in zip(shards, ("platform A", "platform B")):
        _on(monkeypatch, name)
        embed_shards([shard], model=str(tiny_model_path), out_dir=out, quiet=True,
                     options=EmbedOptions(device="cpu", accept_platform_mix=True))
    merged = tmp_path / "merged.h5"
    merge_stores([out / "shard-0.h5", out / "shard-1.h5"], out=merged)
    info = store_info(merged)
    assert [(p["platform"], p["records"], p["rows"]) for p in info["platforms"]] == [
        ("platform A", 2, [[0, 2]]), ("platform B", 2, [[2, 4]])]
    lines = render_info(info).splitlines()
    assert "  platform    platform A: 2 records, rows 0-1 (stores/shard-0.h5)" in lines
    assert "  platform    platform B: 2 records, rows 2-3 (stores/shard-1.h5)" in lines
    said = CliRunner().invoke(app, ["validate", str(merged)])
    assert said.exit_code == 0, said.output
    assert f"{merged}: records computed on platform B: 2 records, rows 2-3 (stores/shard-1.h5)" in said.output
    with h5py.File(merged, "r") as f:
        assert json.loads(f.attrs["embed_identity"])["platform"] == "mixed: platform A; platform B"
    again = write_fasta(tmp_path / "again.fasta", RECORDS)
    mixed = f"embedded with .* 'mixed: platform A; platform B', this run 'platform B'; {REUSABLE}"
    with pytest.raises(EmbedpipeError, match=mixed):
        embed_fasta(again, model=str(tiny_model_path), out=tmp_path / "again.h5", options=EmbedOptions(device="cpu"),
                    quiet=True, reuse=[merged])
    copied = embed_fasta(again, model=str(tiny_model_path), out=tmp_path / "again.h5", quiet=True, reuse=[merged],
                         options=EmbedOptions(device="cpu", accept_platform_mix=True))
    assert copied.reused == len(RECORDS)


@pytest.mark.parametrize("asked", [{"batch_layout": "padded"}, {"attention_inputs": "fp32"}],
                         ids=["batch_layout", "attention_inputs"])
def test_an_override_that_resolves_as_derived_keeps_the_stores(tmp_path, tiny_model_path, asked):
    """On the CPU the run derives padded batches and fp32 q/k/v for fp32: an ``EMBEDPIPE_ENGINE``
    override asking for the same gives the same numbers, and keeps the stores."""
    shard, out = write_fasta(tmp_path / "shard-0.fasta", RECORDS), tmp_path / "stores"
    embed_shards([shard], model=str(tiny_model_path), out_dir=out, options=EmbedOptions(device="cpu"), quiet=True)
    with h5py.File(out / "shard-0.h5", "r") as f:
        ran = {"batch_layout": "padded", "attention_inputs": "float32"}
        assert {k: str(f.attrs[k]) for k in ran} == ran  # what was derived: what is asked below
    with engine_override(**asked):
        again = embed_shards([shard], model=str(tiny_model_path), out_dir=out, quiet=True,
                             options=EmbedOptions(device="cpu"))
    assert again.kept == [out / "shard-0.h5"] and again.embedded == []


def test_a_store_recording_the_removed_options_still_validates_merges_and_is_kept(tmp_path, tiny_model_path):
    """A store an embedpipe with ``--compile``, ``--attention``, ``--batch-layout``,
    ``--attention-inputs``, ``--fallback-device`` and ``--compile-cache`` wrote (their values in
    ``config``, the ``compiled`` attributes at the root) validates, merges and is kept by a rerun:
    readers ignore them, and its identity (eager, sdpa) is this embedpipe's."""
    shard, out = write_fasta(tmp_path / "shard-0.fasta", RECORDS), tmp_path / "stores"
    embed_shards([shard], model=str(tiny_model_path), out_dir=out, options=EmbedOptions(device="cpu"), quiet=True)
    store = out / "shard-0.h5"
    older = {"attention": "sdpa", "batch_layout": "auto", "attention_inputs": "auto", "fallback_device": "auto",
             "compile": "auto", "compile_cache": None}
    with h5py.File(store, "r+") as f:
        config = json.loads(f.attrs["config"])
        assert not set(older) & set(config)  # this embedpipe records none of them
        f.attrs["config"] = json.dumps(config | older, sort_keys=True)
        f.attrs["compiled"], f.attrs["compile_reason"], f.attrs["compile_s"] = False, "auto: eager", 0.0
        rewrite_attr_digests(f)  # as the store would have recorded them
    assert validate_store(store) == []
    merge_stores([store], out=tmp_path / "merged.h5")
    assert validate_store(tmp_path / "merged.h5") == []
    again = embed_shards([shard], model=str(tiny_model_path), out_dir=out, quiet=True, options=EmbedOptions(device="cpu"))
    assert again.kept == [store] and again.embedded == []


def test_an_all_reused_store_keeps_this_runs_request_not_its_sources(tmp_path, tiny_model_path):
    source = tmp_path / "source.h5"
    embed_fasta(write_fasta(tmp_path / "source.fasta", RECORDS), model=str(tiny_model_path), out=source, quiet=True,
                options=EmbedOptions(device="cpu", precision="auto"))
    with h5py.File(source, "r") as f:
        assert f.attrs["precision_requested"] == "auto"  # the source asked for auto
        policy = str(f.attrs["precision_policy"])
    copied = embed_fasta(write_fasta(tmp_path / "again.fasta", RECORDS), model=str(tiny_model_path),
                         out=tmp_path / "again.h5", quiet=True, reuse=[source],
                         options=EmbedOptions(device="cpu", precision=policy))  # this run asks for the policy itself
    assert copied.reused == len(RECORDS)
    with h5py.File(tmp_path / "again.h5", "r") as f:
        assert "precision_requested" not in f.attrs and "precision_reason" not in f.attrs
        assert f.attrs["precision_policy"] == policy
