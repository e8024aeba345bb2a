"""Issue 30, build item 1: one identity of everything that decides the numbers, compared by
resuming (a store with another identity is embedded again, saying why) and by ``--reuse`` (a
source with another identity is refused naming the first difference in user words):
a Hugging Face model's config.json and tokenizer, the family's forward version, int8-mixed's
weight range (7-bit on AVX2 without VNNI), the precision policy named before its resolved
fields, and ``--pooling`` canonical (embedpipe/extraction/identity.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import h5py
import pytest

from embedpipe.core.checksums import file_sha256
from embedpipe.core.errors import EmbedpipeError
from embedpipe.core.options import EmbedOptions
from embedpipe.extraction.identity import IDENTITY_VERSION, describe_difference
from embedpipe.extraction.run import embed_fasta, embed_shards
from embedpipe.model import esm2_spec
from embedpipe.model.random_hf import make_hf_test_model
from helpers.embed_helpers import embed_store, random_sequences, write_fasta

ROOT = Path(__file__).resolve().parents[2]
REUSABLE = "only a store embedded with the same model and options can be reused"
RECORDS = random_sequences(4, (8, 24), seed=11)


@pytest.fixture(scope="module")
def t5_model(tmp_path_factory) -> Path:
    return make_hf_test_model(tmp_path_factory.mktemp("t5") / "prot-t5", family="prot-t5", layers=1, dim=16, heads=2)


def _edit_config(model: Path) -> str:
    """layer_norm_epsilon 1e-6 -> 0.01 (the largest the bounds allow: the vectors move; the weights stay)."""
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"layer_norm_epsilon": 0.01}, indent=2))
    return "config.json"


def _swap_tokens(model: Path) -> str:
    """Two residues' tokens swapped in tokenizer.json (▁A and ▁C: their ids trade places)."""
    data = json.loads((model / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    a, c = (next(i for i, (piece, _) in enumerate(vocab) if piece == p) for p in ("▁A", "▁C"))
    vocab[a][0], vocab[c][0] = vocab[c][0], vocab[a][0]
    (model / "tokenizer.json").write_text(json.dumps(data))
    return "tokenizer.json"


def _files_changed(name: str, before: str, after: str) -> str:
    return (f"embedded with the model's {name} sha256 {before[:16]}..., this run {after[:16]}... "
            "(the weights are the same; the file changes the numbers)")


@pytest.mark.parametrize("edit", [_edit_config, _swap_tokens], ids=["config.json", "tokenizer.json"])
def test_reuse_refuses_a_store_of_the_same_weights_with_another_config_or_tokenizer(tmp_path, t5_model, edit):
    model = Path(shutil.copytree(t5_model, tmp_path / "model"))
    earlier = embed_store(tmp_path, model, RECORDS, "earlier", device="cpu")
    name = edit(model)
    before = json.loads(h5py.File(earlier, "r").attrs["embed_identity"])["model_files"][name]
    fasta = write_fasta(tmp_path / "again.fasta", RECORDS)
    with pytest.raises(EmbedpipeError) as refused:
        embed_fasta(fasta, model=str(model), out=tmp_path / "again.h5", options=EmbedOptions(device="cpu"),
                    quiet=True, reuse=[earlier])
    assert str(refused.value) == f"--reuse {earlier}: {_files_changed(name, before, file_sha256(model / name))}; {REUSABLE}"
    assert not (tmp_path / "again.h5").exists()


@pytest.mark.parametrize("edit", [_edit_config, _swap_tokens], ids=["config.json", "tokenizer.json"])
def test_resume_embeds_again_when_the_config_or_tokenizer_changed(tmp_path, t5_model, edit, capsys):
    model = Path(shutil.copytree(t5_model, tmp_path / "model"))
    shard, out = write_fasta(tmp_path / "shard-0.fasta", RECORDS), tmp_path / "stores"
    embed_shards([shard], model=str(model), out_dir=out, options=EmbedOptions(device="cpu"), quiet=True)
    with h5py.File(out / "shard-0.h5", "r") as f:
        old_mean = f["mean/layer_1"][()]
    name = edit(model)
    capsys.readouterr()
    again = embed_shards([shard], model=str(model), out_dir=out, options=EmbedOptions(device="cpu"))
    assert again.kept == [] and len(again.embedded) == 1
    said = [line for line in capsys.readouterr().err.splitlines() if "embedding it again" in line]
    assert len(said) == 1 and said[0].startswith(f"{out / 'shard-0.h5'}: embedded with the model's {name} sha256 ")
    with h5py.File(out / "shard-0.h5", "r") as f:
        assert json.loads(f.attrs["embed_identity"])["model_files"][name] == file_sha256(model / name)
        assert abs(f["mean/layer_1"][()] - old_mean).max() > 1e-3  # the file changed the numbers indeed


def test_a_new_family_version_recomputes_and_is_refused_by_reuse(tmp_path, tiny_model_path, monkeypatch, capsys):
    shard, out = write_fasta(tmp_path / "shard-0.fasta", RECORDS), tmp_path / "stores"
    embed_shards([shard], model=str(tiny_model_path), out_dir=out, options=EmbedOptions(device="cpu"), quiet=True)
    monkeypatch.setattr(esm2_spec, "FAMILY_VERSION", esm2_spec.FAMILY_VERSION + 1)
    new = f"esm2 v{esm2_spec.FAMILY_VERSION}"
    fasta = write_fasta(tmp_path / "again.fasta", RECORDS)
    with pytest.raises(EmbedpipeError) as refused:
        embed_fasta(fasta, model=str(tiny_model_path), out=tmp_path / "again.h5", options=EmbedOptions(device="cpu"),
                    quiet=True, reuse=[out / "shard-0.h5"])
    old = f"esm2 v{esm2_spec.FAMILY_VERSION - 1}"
    assert str(refused.value) == (f"--reuse {out / 'shard-0.h5'}: embedded with the model family and its forward "
                                  f"version {old!r}, this run {new!r}; {REUSABLE}")
    capsys.readouterr()
    again = embed_shards([shard], model=str(tiny_model_path), out_dir=out, options=EmbedOptions(device="cpu"))
    assert len(again.embedded) == 1
    assert (f"{out / 'shard-0.h5'}: embedded with the model family and its forward version {old!r}, this run "
            f"{new!r}; embedding it again") in capsys.readouterr().err.splitlines()


def test_bf16_against_an_fp32_store_names_the_precision_policy(tmp_path, tiny_model_path):
    earlier = embed_store(tmp_path, tiny_model_path, RECORDS, "earlier", device="cpu")
    fasta = write_fasta(tmp_path / "again.fasta", RECORDS)
    with pytest.raises(EmbedpipeError) as refused:
        embed_fasta(fasta, model=str(tiny_model_path), out=tmp_path / "again.h5",
                    options=EmbedOptions(device="cpu", precision="bf16"), quiet=True, reuse=[earlier])
    assert str(refused.value) == f"--reuse {earlier}: embedded with the precision policy 'fp32', this run 'bf16'; {REUSABLE}"


def test_a_resolved_field_is_named_only_alone_and_explained():
    base = {"identity_version": IDENTITY_VERSION, "precision": "fp32", "model_sha256": "a" * 64,
            "computed_as": {"device_type": "cpu", "batch_layout": "padded", "attention_inputs": "float32"}}
    other = base | {"computed_as": base["computed_as"] | {"attention_inputs": "bfloat16"}}
    assert describe_difference(json.dumps(base), json.dumps(other)) == (
        "embedded with the dtype of q/k/v at attention (resolved from the precision policy and the device) "
        "'float32', this run 'bfloat16'")
    assert describe_difference(json.dumps(other | {"precision": "bf16"}), json.dumps(base)) == (
        "embedded with the precision policy 'bf16', this run 'fp32'")
    assert describe_difference(json.dumps(base), json.dumps(base)) is None
    files = other | {"precision": "bf16", "model_files": {"config.json": "b" * 64}}
    assert describe_difference(json.dumps(files), json.dumps(base | {"model_files": {"config.json": "c" * 64}})) == (
        f"embedded with the model's config.json sha256 {'b' * 16}..., this run {'c' * 16}... (the weights are the "
        "same; the file changes the numbers)")  # the model before the options


def test_pooling_bos_and_mean_plus_bos_are_one_identity(tmp_path, tiny_model_path):
    both = EmbedOptions(device="cpu", pooling=("mean", "bos"))
    earlier = embed_store(tmp_path, tiny_model_path, RECORDS, "earlier", device="cpu", pooling=("mean", "bos"))
    fasta = write_fasta(tmp_path / "again.fasta", RECORDS)
    summary = embed_fasta(fasta, model=str(tiny_model_path), out=tmp_path / "again.h5", quiet=True,
                          options=EmbedOptions(device="cpu", pooling=("bos",)), reuse=[earlier])
    assert summary.reused == len(RECORDS)
    shard, out = write_fasta(tmp_path / "shard-0.fasta", RECORDS), tmp_path / "stores"
    embed_shards([shard], model=str(tiny_model_path), out_dir=out, options=both, quiet=True)
    again = embed_shards([shard], model=str(tiny_model_path), out_dir=out, quiet=True,
                         options=EmbedOptions(device="cpu", pooling=("bos", "mean", "bos")))
    assert again.embedded == [] and again.kept == [out / "shard-0.h5"]


def test_a_store_of_the_other_int8_weight_range_is_neither_reused_nor_kept(tmp_path, tiny_model_path, capsys):
    """The weight range is measured on the CPU (runtime/int8_kernels.py) and decides the numbers:
    a store recorded with the other range (as another node's run would be) is refused by
    --reuse and embedded again by a resume, on any CPU class."""
    shard, out = write_fasta(tmp_path / "shard-0.fasta", RECORDS), tmp_path / "stores"
    options = EmbedOptions(device="cpu", precision="int8-mixed")
    embed_shards([shard], model=str(tiny_model_path), out_dir=out, options=options, quiet=True)
    store = out / "shard-0.h5"
    with h5py.File(store, "r+") as f:
        ours = str(f.attrs["quantization_weight_range"])
        assert json.loads(f.attrs["embed_identity"])["int8_weight_range"] == ours  # recorded as used
        other = "+-63 (7-bit)" if ours == "+-127 (8-bit)" else "+-127 (8-bit)"
        identity = json.loads(f.attrs["embed_identity"]) | {"int8_weight_range": other}
        f.attrs["embed_identity"] = json.dumps(identity, sort_keys=True)
        f.attrs["quantization_weight_range"] = other
    with pytest.raises(EmbedpipeError) as refused:
        embed_fasta(write_fasta(tmp_path / "again.fasta", RECORDS), model=str(tiny_model_path),
                    out=tmp_path / "again.h5", options=options, quiet=True, reuse=[store])
    assert str(refused.value) == (f"--reuse {store}: embedded with the int8 weight range (resolved on the CPU by the "
                                  f"int8 kernels) {other!r}, this run {ours!r}; {REUSABLE}")
    capsys.readouterr()
    again = embed_shards([shard], model=str(tiny_model_path), out_dir=out, options=options)
    assert len(again.embedded) == 1 and again.kept == []
    assert (f"{store}: embedded with the int8 weight range (resolved on the CPU by the int8 kernels) {other!r}, this "
            f"run {ours!r}; embedding it again") in capsys.readouterr().err.splitlines()
    with h5py.File(store, "r") as f:
        assert f.attrs["quantization_weight_range"] == ours
        assert json.loads(f.attrs["embed_identity"])["int8_weight_range"] == ours


def test_reuse_refuses_a_store_of_an_older_identity_saying_so(tmp_path, tiny_model_path):
    earlier = embed_store(tmp_path, tiny_model_path, RECORDS, "earlier", device="cpu")
    with h5py.File(earlier, "r+") as f:  # as written before issue 30: no version, no model files or family
        old = json.loads(f.attrs["embed_identity"])
        for key in ("identity_version", "model_files", "model_family"):
            del old[key]
        f.attrs["embed_identity"] = json.dumps(old, sort_keys=True)
    with pytest.raises(EmbedpipeError) as refused:
        embed_fasta(write_fasta(tmp_path / "again.fasta", RECORDS), model=str(tiny_model_path),
                    out=tmp_path / "again.h5", options=EmbedOptions(device="cpu"), quiet=True, reuse=[earlier])
    assert str(refused.value) == (
        f"--reuse {earlier}: written by an older embedpipe whose identity did not cover the model's config.json and "
        f"tokenizer files, the model family's version or the int8 weight range; {REUSABLE}")
