"""Hugging Face ESM-2 directories (``model_type: esm``) in the ESM-2 runner.

A directory converted from a fair-esm test checkpoint must give the checkpoint's stores
through ``embedpipe embed``; transformers' own ``EsmModel`` on the directory must agree with
fair-esm's forward on the checkpoint (the independent computation, marker ``peer``).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from embedpipe.cli import app
from embedpipe.core.errors import ModelError
from embedpipe.model import describe, load_model
from embedpipe.model.random_hf import make_hf_test_model, write_hf_esm
from helpers.embed_helpers import random_sequences, read_store, write_fasta

HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
RECORDS = random_sequences(7, (5, 60), seed=3)


@pytest.fixture(scope="module")
def converted(tiny_model_path: Path, tmp_path_factory) -> Path:
    """The tiny fair-esm checkpoint as an EsmForMaskedLM directory (weights copied, renamed)."""
    loaded = load_model(str(tiny_model_path))
    return write_hf_esm(tmp_path_factory.mktemp("hf") / "esm2_tiny_hf", loaded.model.state_dict(),
                        layers=loaded.num_layers, dim=loaded.embed_dim, heads=loaded.attention_heads)


def embed_cli(tmp: Path, model: Path, name: str, *extra: str) -> dict:
    fasta = write_fasta(tmp / "in.fasta", RECORDS)
    out = tmp / f"{name}.h5"
    result = CliRunner().invoke(app, ["embed", str(fasta), "--model", str(model), "--out", str(out),
                                      "--layers", "0,1,2", "--per-residue", "--quiet", *extra])
    assert result.exit_code == 0, result.output
    return read_store(out)


def max_diff(a: dict, b: dict) -> float:
    worst = 0.0
    for part in ("mean", "per_residue"):
        assert a[part].keys() == b[part].keys()
        for layer in a[part]:
            for rid in a["ids"]:
                worst = max(worst, float(np.abs(a[part][layer][rid].astype(np.float64)
                                                - b[part][layer][rid].astype(np.float64)).max()))
    return worst


@pytest.mark.parametrize("policy", ["fp32", "bf16-mixed", "fp16"])
def test_a_converted_directory_gives_the_checkpoints_stores(tiny_model_path, converted, tmp_path, policy) -> None:
    want = embed_cli(tmp_path, tiny_model_path, "pt", "--precision", policy)
    got = embed_cli(tmp_path, converted, "hf", "--precision", policy)
    assert got["ids"] == want["ids"]
    assert max_diff(got, want) <= 1e-5
    assert got["fields"]["precision_used"] == want["fields"]["precision_used"]
    assert (got["attrs"]["model_family"], want["attrs"]["model_family"]) == ("esm2", "esm2")
    assert got["attrs"]["model_source"] == str(converted)
    assert got["attrs"]["model_format"] == "huggingface-esm"
    assert not got["attrs"]["model_trained"]  # the directory's config.json carries the untrained marker
    import hashlib
    assert got["attrs"]["model_sha256"] == hashlib.sha256((converted / "model.safetensors").read_bytes()).hexdigest()


def test_the_fallback_works_unchanged(overflow_model, overflow_records, tmp_path) -> None:
    """fp16 overflow ('C' embeds at 7e4) falls back to fp32 for the same records as the .pt."""
    loaded = load_model(str(overflow_model))
    directory = write_hf_esm(tmp_path / "ovf", loaded.model.state_dict(), layers=loaded.num_layers,
                             dim=loaded.embed_dim, heads=loaded.attention_heads)
    fasta = write_fasta(tmp_path / "o.fasta", overflow_records)
    stores = []
    for name, model in (("pt", overflow_model), ("hf", directory)):
        out = tmp_path / f"{name}.h5"
        result = CliRunner().invoke(app, ["embed", str(fasta), "--model", str(model), "--out", str(out),
                                          "--precision", "fp16", "--quiet"])
        assert result.exit_code == 0, result.output
        stores.append(read_store(out))
    used = stores[1]["fields"]["precision_used"]
    assert used == stores[0]["fields"]["precision_used"]
    assert sorted(rid for rid, p in used.items() if p == "fp32") == sorted(r for r, s in overflow_records if "C" in s)
    assert stores[1]["fields"]["fallback_reason"] == stores[0]["fields"]["fallback_reason"]


@pytest.mark.peer
@pytest.mark.skipif(not HAVE_TRANSFORMERS, reason="transformers is not installed")
def test_transformers_on_the_directory_agrees_with_fair_esm(tiny_model_path, converted, fair_esm_reference) -> None:
    from transformers import AutoTokenizer, EsmModel

    ref_model, alphabet = fair_esm_reference(tiny_model_path)
    seqs = [s for _, s in RECORDS]
    _, _, toks = alphabet.get_batch_converter()([(str(i), s) for i, s in enumerate(seqs)])
    hf = EsmModel.from_pretrained(str(converted), add_pooling_layer=False).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(converted))
    ids = tokenizer(seqs, padding="longest", return_tensors="pt")
    assert torch.equal(ids["input_ids"], toks)
    assert torch.equal(load_model(str(converted)).tokenize(seqs), toks)
    with torch.no_grad():
        want = ref_model(toks, repr_layers=[0, 1, 2])["representations"]
        got = hf(**ids, output_hidden_states=True)
    real = toks.ne(alphabet.padding_idx)
    torch.testing.assert_close(got.last_hidden_state[real], want[2][real], rtol=0, atol=1e-5)
    torch.testing.assert_close(got.hidden_states[1][real], want[1][real], rtol=0, atol=1e-5)


@pytest.mark.peer
@pytest.mark.skipif(not HAVE_TRANSFORMERS, reason="transformers is not installed")
def test_an_esm_model_directory_saved_by_transformers_loads_too(tiny_model_path, converted, tmp_path) -> None:
    """EsmModel weights (no ``esm.`` prefix, no LM head), written by transformers itself."""
    from transformers import EsmModel

    plain = tmp_path / "plain"
    EsmModel.from_pretrained(str(converted), add_pooling_layer=False).save_pretrained(str(plain))
    for name in ("vocab.txt", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(converted / name, plain / name)
    assert not any(k.startswith("esm.") for k in json.loads(_safetensors_header(plain / "model.safetensors")))
    want = embed_cli(tmp_path, tiny_model_path, "pt")
    got = embed_cli(tmp_path, plain, "plain")
    assert max_diff(got, want) <= 1e-5


def _safetensors_header(path: Path) -> str:
    raw = path.read_bytes()
    return raw[8 : 8 + int.from_bytes(raw[:8], "little")].decode()


def test_make_test_model_hf_esm_and_refusals(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["make-test-model", str(tmp_path / "e"), "--family", "hf-esm", "--seed", "2"])
    assert result.exit_code == 0, result.output
    facts = describe(str(tmp_path / "e"))
    assert (facts.family, facts.trained, facts.num_layers, facts.trained_window) == ("esm2", False, 2, 1022)
    config = json.loads((tmp_path / "e" / "config.json").read_text())
    config["position_embedding_type"] = "absolute"
    bad = tmp_path / "bad"
    shutil.copytree(tmp_path / "e", bad)
    (bad / "config.json").write_text(json.dumps(config))
    # absolute positions make it an ESM-1b, which needs a position table
    with pytest.raises(ModelError, match=r"max_position_embeddings says embed_positions.weight is \(1026, 32\), found none"):
        load_model(str(bad))
    (bad / "config.json").write_text(json.dumps(config | {"position_embedding_type": "relative_key"}))
    with pytest.raises(ModelError, match="position_embedding_type is neither 'rotary'"):
        load_model(str(bad))
    (bad / "config.json").write_text(json.dumps(config | {"position_embedding_type": "rotary", "num_hidden_layers": 3}))
    with pytest.raises(ModelError, match="weights do not fit the cfg"):
        load_model(str(bad))
    make_hf_test_model(tmp_path / "t", family="hf-esm", layers=1, dim=16, heads=2)
    (tmp_path / "t" / "model.safetensors").unlink()
    with pytest.raises(ModelError, match="holds no weights"):
        load_model(str(tmp_path / "t"))
