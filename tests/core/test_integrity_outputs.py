"""Issue 19, A: no command's output replaces one of its inputs, another of its outputs, or a
source that a merged store it reads pins; symlinks and hard links are seen through, and the
refusal comes before any work (embedpipe/core/output_guard.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import h5py
import pytest

from embedpipe.core.errors import EmbedpipeError
from embedpipe.core.options import EmbedOptions
from embedpipe.export import export_store
from embedpipe.extraction.run import embed_fasta, embed_shards
from embedpipe.store import merge_stores
from helpers.embed_helpers import random_sequences, write_fasta

OPTIONS = EmbedOptions(device="cpu")


def _fasta(path: Path, seed: int = 0) -> Path:
    return write_fasta(path, [(f"s{seed}-{rid}", seq) for rid, seq in random_sequences(3, (8, 30), seed=seed)])


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = os.environ | {"PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    return subprocess.run([sys.executable, "-m", "embedpipe.cli", *args], capture_output=True, text=True,
                          cwd=cwd, env=env)


def test_embed_out_equal_to_its_fasta_is_refused_in_one_line_and_the_fasta_is_intact(tmp_path, tiny_model_path):
    fasta = _fasta(tmp_path / "x.fasta")
    before = fasta.read_bytes()
    result = _cli("embed", "x.fasta", "--model", str(tiny_model_path), "--out", "x.fasta", "--device", "cpu",
                  "-q", cwd=tmp_path)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert lines[0] == ("embedpipe: error: --out x.fasta is the input x.fasta; embed never writes over its "
                        "inputs: choose another output path")
    assert fasta.read_bytes() == before


@pytest.mark.parametrize("link", ["symlink", "hardlink"])
def test_embed_out_that_links_to_the_fasta_is_refused(tmp_path, tiny_model_path, link):
    fasta = _fasta(tmp_path / "x.fasta")
    out = tmp_path / "out.h5"
    (os.symlink if link == "symlink" else os.link)(fasta, out)
    how = "through a symlink" if link == "symlink" else "a hard link to it"
    with pytest.raises(EmbedpipeError, match=rf"^--out {out} is the input {fasta} \({how}\)"):
        embed_fasta(fasta, model=str(tiny_model_path), out=out, options=OPTIONS, quiet=True)
    assert out.read_bytes() == fasta.read_bytes() and not h5py.is_hdf5(fasta)


def test_embed_out_equal_to_the_model_checkpoint_is_refused(tmp_path, tiny_model_path):
    model = tmp_path / "m.pt"
    model.write_bytes(tiny_model_path.read_bytes())
    with pytest.raises(EmbedpipeError, match=rf"--out {model} is the input {model}"):
        embed_fasta(_fasta(tmp_path / "x.fasta"), model=str(model), out=model, options=OPTIONS, quiet=True)
    assert model.read_bytes() == tiny_model_path.read_bytes()


def test_out_dir_store_that_is_an_input_is_refused(tmp_path, tiny_model_path):
    out_dir = tmp_path / "stores"
    out_dir.mkdir()
    named_like_a_store = _fasta(out_dir / "a.h5")  # a FASTA whose store would be stores/a.h5
    before = named_like_a_store.read_bytes()
    with pytest.raises(EmbedpipeError, match=rf"^store {out_dir}/a.h5 is the input {named_like_a_store}"):
        embed_shards([named_like_a_store], model=str(tiny_model_path), out_dir=out_dir, options=OPTIONS, quiet=True)
    assert named_like_a_store.read_bytes() == before


def test_done_that_is_a_store_of_the_group_or_an_input_is_refused_before_any_work(tmp_path, tiny_model_path):
    shards = [_fasta(tmp_path / f"shard-{k}.fasta", seed=k) for k in range(2)]
    out_dir = tmp_path / "stores"
    with pytest.raises(EmbedpipeError, match=rf"^--done {out_dir}/shard-1.h5 is also store {out_dir}/shard-1.h5"):
        embed_shards(shards, model=str(tiny_model_path), out_dir=out_dir, options=OPTIONS,
                     done=out_dir / "shard-1.h5", quiet=True)
    before = shards[0].read_bytes()
    with pytest.raises(EmbedpipeError, match=rf"^--done {shards[0]} is the input {shards[0]}"):
        embed_shards(shards, model=str(tiny_model_path), out_dir=out_dir, options=OPTIONS, done=shards[0], quiet=True)
    assert shards[0].read_bytes() == before
    assert list(out_dir.glob("*.h5")) == []  # refused before the first shard was embedded


@pytest.mark.parametrize("kind", ["directory", "fifo", "empty shard"])
def test_group_problems_are_found_before_the_first_shard_is_embedded(tmp_path, tiny_model_path, kind):
    shards = [_fasta(tmp_path / f"shard-{k}.fasta", seed=k) for k in range(2)]
    done = tmp_path / "done.json"
    if kind == "directory":
        done.mkdir()
    elif kind == "fifo":
        os.mkfifo(done)
    else:
        shards.append(tmp_path / "shard-9.fasta")
        shards[-1].write_text("")
    out_dir = tmp_path / "stores"
    with pytest.raises(EmbedpipeError, match="is a directory|FIFO|no records to embed"):
        embed_shards(shards, model=str(tiny_model_path), out_dir=out_dir, options=OPTIONS, done=done, quiet=True)
    assert list(out_dir.glob("*.h5")) == []


@pytest.fixture
def merged(tmp_path, tiny_model_path) -> tuple[Path, list[Path]]:
    shards = [_fasta(tmp_path / f"shard-{k:05d}.fasta", seed=k) for k in range(2)]
    out_dir = tmp_path / "stores"
    embed_shards(shards, model=str(tiny_model_path), out_dir=out_dir, options=OPTIONS, quiet=True)
    stores = sorted(out_dir.glob("*.h5"))
    merge_stores(stores, out=tmp_path / "embeddings.h5")
    return tmp_path / "embeddings.h5", stores


def test_export_over_a_source_the_merged_store_pins_is_refused(merged):
    store, sources = merged
    before = sources[1].read_bytes()
    with pytest.raises(EmbedpipeError, match=rf"^--out {sources[1]} is {sources[1]}, a source store that the "
                                             rf"merged store {store} pins"):
        export_store(store, fmt="h5-per-id", out=sources[1], quiet=True)
    assert sources[1].read_bytes() == before


def test_merge_over_a_source_pinned_by_an_input_or_over_its_manifest_is_refused(merged, tmp_path):
    store, sources = merged
    with pytest.raises(EmbedpipeError, match=rf"^--out {sources[0]} is {sources[0]}, a source store"):
        merge_stores([store], out=sources[0])
    manifest = tmp_path / "manifest.tsv"
    manifest.write_text("not yet read\n")
    with pytest.raises(EmbedpipeError, match=rf"^--out {manifest} is the input {manifest}"):
        merge_stores(sources, out=manifest, manifest=manifest)
    assert manifest.read_text() == "not yet read\n"


def _hub_cache(root: Path, name: str, sharded: bool) -> Path:
    """A hub cache as huggingface_hub lays it out: the snapshot's files are symlinks into
    ``blobs/``; ``sharded``: the weights named by an index, one shard not there yet."""
    from embedpipe.model.random_hf import make_hf_test_model

    repo = root / ("models--" + name.replace("/", "--"))
    made = make_hf_test_model(root / "made", family="prot-t5", layers=1, dim=16, heads=2)
    snapshot = repo / "snapshots" / "abc123"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for k, file in enumerate(sorted(made.iterdir())):
        blob = repo / "blobs" / f"blob{k}"
        file.rename(blob)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    if sharded:
        (snapshot / "model.safetensors.index.json").write_text(
            '{"weight_map": {"a": "model.safetensors", "b": "model-00002-of-00002.safetensors"}}')
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    return snapshot


@pytest.mark.parametrize("target", ["snapshot file", "blob", "index-named shard"])
def test_embed_out_over_a_file_of_a_hub_named_model_is_refused(tmp_path, monkeypatch, target):
    """``--model acme/esmc-tiny --out <its snapshot's model.safetensors>`` replaced the weights
    in the hub cache: every file a hub name resolves to is an input."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    snapshot = _hub_cache(tmp_path / "hub", "acme/t5-tiny", sharded=target == "index-named shard")
    weights = (snapshot / "model.safetensors").resolve()
    before = weights.read_bytes()
    out = {"snapshot file": snapshot / "model.safetensors", "blob": weights,
           "index-named shard": snapshot / "model-00002-of-00002.safetensors"}[target]
    fasta = _fasta(tmp_path / "x.fasta")
    with pytest.raises(EmbedpipeError, match=r"--out .* is the input .*; embed never writes over its inputs"):
        embed_fasta(fasta, model="acme/t5-tiny", out=out, options=OPTIONS, quiet=True)
    assert weights.read_bytes() == before and not (snapshot / "model-00002-of-00002.safetensors").exists()
