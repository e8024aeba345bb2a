"""ESM-1b and ESM-1v: fair-esm checkpoints in the released layout and Hugging Face directories.

The independent computations: fair-esm's own ``ProteinBertModel``, built from the checkpoint
by ``esm.pretrained.load_model_and_alphabet_core`` as fair-esm builds ESM-1b and ESM-1v, and
transformers' ``EsmModel`` (absolute positions, ``emb_layer_norm_before``) on the directory;
each compared with embedpipe's runner at every stored layer, in both batch layouts.
"""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path
from typing import Any

import esm
import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from embedpipe.cli import app
from embedpipe.core.errors import ModelError
from embedpipe.model import describe, inspect, load_model
from embedpipe.model.random_checkpoint import make_test_model
from embedpipe.model.random_hf import write_hf_esm
from embedpipe.model.registry import model_identity
from embedpipe.runtime.packed import PackedTokens
from embedpipe.runtime.precision import POLICIES, forward_context, get_policy
from helpers.embed_helpers import random_sequences, read_store, write_fasta

RECORDS = random_sequences(6, (5, 90), seed=11)
LAYERS = [0, 1, 2]


@pytest.fixture(scope="module")
def esm1b_path(tmp_path_factory) -> Path:
    """A random ESM-1b in the released layout, with its contact-regression companion."""
    return make_test_model(tmp_path_factory.mktemp("esm1b") / "esm1b_t2_32.pt", family="esm1b", layers=2, dim=32,
                           heads=4, seed=5)


@pytest.fixture(scope="module")
def esm1v_path(tmp_path_factory) -> Path:
    """An ESM-1v as fair-esm releases it: ESM-1b's layout, no contact-regression file."""
    return make_test_model(tmp_path_factory.mktemp("esm1v") / "esm1v_t2_32_1.pt", family="esm1b", layers=2,
                           dim=32, heads=4, seed=6, companion=False)


def fair_esm_model(path: Path) -> Any:
    """fair-esm's ProteinBertModel for ``path``, built by fair-esm's own loader core (our own
    test file: loaded with the full unpickler, as fair-esm does)."""
    data = torch.load(str(path), map_location="cpu", weights_only=False)
    companion = Path(str(path.with_suffix("")) + "-contact-regression.pt")
    regression = torch.load(str(companion), weights_only=False) if companion.is_file() else None
    model, _ = esm.pretrained.load_model_and_alphabet_core(path.stem, data, regression)
    assert type(model).__name__ == "ProteinBertModel" and model.model_version == "ESM-1b"
    return model.eval()


def ours(loaded: Any, policy: str, tokens: torch.Tensor, *, packed: bool) -> list[torch.Tensor]:
    """Our runner's hidden states at every layer, real tokens only, (N, D) fp32."""
    runner = loaded.prepare(get_policy(policy), torch.device("cpu"))
    keep = tokens.ne(loaded.alphabet.padding_idx)
    with torch.inference_mode(), forward_context(get_policy(policy), torch.device("cpu")):
        if packed:
            out = runner.packed(PackedTokens.from_padded(tokens, keep.sum(1).tolist()), LAYERS)
            return [out.hidden[k].float() for k in LAYERS]
        out = runner(tokens, LAYERS)
        return [out.hidden[k][keep].float() for k in LAYERS]


@pytest.mark.parametrize("which", ["esm1b", "esm1v"])
@pytest.mark.parametrize("packed", [False, True])
def test_fp32_matches_fair_esm_at_every_layer(which, packed, esm1b_path, esm1v_path) -> None:
    path = esm1b_path if which == "esm1b" else esm1v_path
    loaded = load_model(str(path))
    assert (loaded.family, type(loaded.model).__name__) == ("esm1b", "ProteinBertModel")
    tokens = loaded.tokenize([s for _, s in RECORDS])
    with torch.inference_mode():
        ref = fair_esm_model(path)(tokens, repr_layers=LAYERS)["representations"]
    keep = tokens.ne(loaded.alphabet.padding_idx)
    for layer, got in zip(LAYERS, ours(loaded, "fp32", tokens, packed=packed)):
        want = ref[layer][keep]
        assert float((got - want).abs().max()) <= 2e-5 * max(1.0, float(want.abs().max())), layer


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_stays_close_to_fair_esm(policy, esm1b_path) -> None:
    """Every policy's numbers against fair-esm in fp32: cosine per token above the policy's bar."""
    loaded = load_model(str(esm1b_path))
    tokens = loaded.tokenize([s for _, s in RECORDS])
    with torch.inference_mode():
        ref = fair_esm_model(esm1b_path)(tokens, repr_layers=LAYERS)["representations"]
    keep = tokens.ne(loaded.alphabet.padding_idx)
    bar = 0.9999 if policy == "fp32" else 0.99
    for layer, got in zip(LAYERS, ours(loaded, policy, tokens, packed=False)):
        cos = torch.nn.functional.cosine_similarity(got, ref[layer][keep].float(), dim=-1)
        assert float(cos.min()) > bar, (policy, layer, float(cos.min()))


def test_names_identity_and_facts(esm1b_path, esm1v_path) -> None:
    for name in ("esm1b_t33_650M_UR50S", *(f"esm1v_t33_650M_UR90S_{i}" for i in range(1, 6))):
        facts = describe(name)
        assert (facts.family, facts.kind, facts.num_layers, facts.embed_dim, facts.trained_window) == \
            ("esm1b", "name", 33, 1280, 1022)
    for path in (esm1b_path, esm1v_path):
        identity = model_identity(str(path))
        assert identity is not None
        assert identity.family == "esm1b v1" and identity.packs
        assert identity.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
        facts = inspect(str(path))
        loaded = load_model(str(path))
        assert facts.family == "esm1b" and facts.parameters == sum(p.numel() for p in loaded.model.parameters())


def test_a_name_resolves_through_the_torch_hub_cache(esm1v_path, tmp_path, monkeypatch) -> None:
    """``esm1v_t33_650M_UR90S_1`` from TORCH_HOME, offline; fetch-model finds it there and asks for
    no contact-regression file (ESM-1v has none)."""
    home = tmp_path / "torch"
    cached = home / "hub" / "checkpoints" / "esm1v_t33_650M_UR90S_1.pt"
    cached.parent.mkdir(parents=True)
    cached.write_bytes(esm1v_path.read_bytes())
    monkeypatch.setenv("TORCH_HOME", str(home))
    monkeypatch.setenv("EMBEDPIPE_OFFLINE", "1")
    loaded = load_model("esm1v_t33_650M_UR90S_1")
    assert (loaded.family, loaded.name) == ("esm1b", "esm1v_t33_650M_UR90S_1")
    from embedpipe.model import downloads

    def no_download(url: str, target: Path) -> None:
        raise AssertionError(f"downloaded {url}")

    monkeypatch.setattr(downloads, "_fetch_one", no_download)
    result = CliRunner().invoke(app, ["fetch-model", "esm1v_t33_650M_UR90S_1"])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == str(cached)


def _store(tmp: Path, model: Path | str, name: str, *extra: str) -> dict:
    fasta = write_fasta(tmp / "in.fasta", RECORDS)
    out = tmp / f"{name}.h5"
    result = CliRunner().invoke(app, ["embed", str(fasta), "--model", str(model), "--out", str(out),
                                      "--layers", "0,1,2", "--per-residue", "--pooling", "mean", "--pooling", "bos", "--quiet",
                                      *extra])
    assert result.exit_code == 0, result.output
    return read_store(out)


def test_embed_records_the_family_and_fair_esms_numbers(esm1b_path, tmp_path) -> None:
    got = _store(tmp_path, esm1b_path, "pt")
    assert got["attrs"]["model_family"] == "esm1b"
    assert not got["attrs"]["model_trained"]
    loaded = load_model(str(esm1b_path))
    ref = fair_esm_model(esm1b_path)
    for rid, seq in RECORDS:
        with torch.inference_mode():
            hidden = ref(loaded.tokenize([seq]), repr_layers=LAYERS)["representations"]
        for layer in LAYERS:
            want = hidden[layer][0, 1 : len(seq) + 1].numpy()
            np.testing.assert_allclose(got["per_residue"][layer][rid], want, atol=2e-5, rtol=0)
            np.testing.assert_allclose(got["mean"][layer][rid], want.mean(0), atol=2e-5, rtol=0)


def test_the_fallback_reruns_overflowing_records_in_fp32(model_factory, overflow_records, tmp_path) -> None:
    """fp16 overflow ('C' embeds at 7e4) falls back to fp32 for exactly the records with a C."""
    model = model_factory(layers=2, dim=32, heads=4, seed=21, family="esm1b", token_row_overrides={"C": 7e4})
    fasta = write_fasta(tmp_path / "o.fasta", overflow_records)
    out = tmp_path / "o.h5"
    result = CliRunner().invoke(app, ["embed", str(fasta), "--model", str(model), "--out", str(out),
                                      "--precision", "fp16", "--quiet"])
    assert result.exit_code == 0, result.output
    store = read_store(out)
    assert store["attrs"]["model_family"] == "esm1b"
    used = store["fields"]["precision_used"]
    assert sorted(r for r, p in used.items() if p == "fp32") == sorted(r for r, s in overflow_records if "C" in s)


# --------------------------------------------------------------------------- hostile args


def _rewrite_args(source: Path, out: Path, **changes: object) -> Path:
    data = torch.load(str(source), weights_only=False)
    for key, value in changes.items():
        if value is _DELETE:
            delattr(data["args"], key)
        else:
            setattr(data["args"], key, value)
    torch.save(data, str(out))
    return out


_DELETE = object()


@pytest.mark.parametrize(("changes", "message"), [
    ({"encoder_layers": 10_000_000}, "args.encoder_layers must be a positive integer no larger than 1024"),
    ({"encoder_embed_dim": 12.7}, "args.encoder_embed_dim must be a positive integer, got 12.7"),
    ({"encoder_attention_heads": "4"}, "args.encoder_attention_heads must be a positive integer, got '4'"),
    ({"encoder_attention_heads": 5}, "args.encoder_embed_dim 32 is not divisible by args.encoder_attention_heads 5"),
    ({"encoder_ffn_embed_dim": 100}, "args.encoder_ffn_embed_dim says layers.0.fc1.weight is (100, 32)"),
    ({"max_positions": 1 << 30}, "args.max_positions must be an integer from 3 no larger than"),
    ({"max_positions": 10}, "args.max_positions says embed_positions.weight is (12, 32)"),
    ({"token_dropout": "yes"}, "args.token_dropout must be true or false"),
    ({"encoder_layers": 3}, "encoder_layers=3, but the state dict holds layers 0..1"),
    ({"arch": "protein_bert_base"}, "args.arch is 'protein_bert_base'"),
    ({"encoder_layers": _DELETE}, "args.encoder_layers is missing"),
])
def test_hostile_args_are_one_line(esm1b_path, tmp_path, changes, message) -> None:
    bad = _rewrite_args(esm1b_path, tmp_path / "esm1b_bad.pt", **changes)
    with pytest.raises(ModelError) as info:
        load_model(str(bad))
    assert message in str(info.value) and "\n" not in str(info.value) and str(bad) in str(info.value)
    fasta = write_fasta(tmp_path / "in.fasta", RECORDS[:1])
    result = CliRunner().invoke(app, ["embed", str(fasta), "--model", str(bad), "--out", str(tmp_path / "o.h5"),
                                      "--quiet"])
    assert result.exit_code != 0 and message in result.output
    assert "Traceback" not in result.output


def test_args_that_are_not_a_namespace_are_refused(esm1b_path, tmp_path) -> None:
    data = torch.load(str(esm1b_path), weights_only=False)
    data["args"] = dict(vars(data["args"]))
    bad = tmp_path / "dict_args.pt"
    torch.save(data, str(bad))
    with pytest.raises(ModelError, match="'args' must be an argparse.Namespace"):
        load_model(str(bad))
    assert isinstance(torch.load(str(esm1b_path), weights_only=False)["args"], argparse.Namespace)


def test_make_test_model_family_esm1b_writes_the_released_layout(tmp_path) -> None:
    out = tmp_path / "m.pt"
    result = CliRunner().invoke(app, ["make-test-model", str(out), "--family", "esm1b", "--layers", "1"])
    assert result.exit_code == 0, result.output
    data = torch.load(str(out), weights_only=False)
    assert "cfg" not in data and data["args"].arch == "roberta_large" and data["args"].encoder_layers == 1
    keys = set(data["model"])
    assert "encoder.sentence_encoder.embed_positions.weight" in keys
    assert "encoder.sentence_encoder.emb_layer_norm_before.weight" in keys
    assert "encoder.lm_head.dense.weight" in keys
    fair_esm_model(out)  # fair-esm's own loader takes it


# --------------------------------------------------------------------------- Hugging Face


@pytest.fixture(scope="module")
def hf_esm1b(esm1b_path, tmp_path_factory) -> Path:
    loaded = load_model(str(esm1b_path))
    return write_hf_esm(tmp_path_factory.mktemp("hf1b") / "esm1b_hf", loaded.model.state_dict(), layers=2, dim=32,
                        heads=4, absolute=True)


@pytest.mark.peer
@pytest.mark.parametrize("packed", [False, True])
def test_hf_directory_matches_transformers_esm_model(hf_esm1b, packed) -> None:
    from transformers import EsmModel

    hf = EsmModel.from_pretrained(str(hf_esm1b), add_pooling_layer=False).eval()
    assert hf.config.position_embedding_type == "absolute" and hf.config.emb_layer_norm_before
    loaded = load_model(str(hf_esm1b))
    assert loaded.family == "esm1b" and model_identity(str(hf_esm1b)).family == "esm1b v1"
    tokens = loaded.tokenize([s for _, s in RECORDS])
    keep = tokens.ne(loaded.alphabet.padding_idx)
    with torch.inference_mode():
        states = hf(input_ids=tokens, attention_mask=keep.long(), output_hidden_states=True)
    # transformers' hidden_states: the embeddings, then each layer (the last before the final
    # norm); last_hidden_state: after it, as fair-esm's last layer
    want = [states.hidden_states[0], *states.hidden_states[1:-1], states.last_hidden_state]
    for layer, got in zip(LAYERS, ours(loaded, "fp32", tokens, packed=packed)):
        expected = want[layer][keep]
        assert float((got - expected).abs().max()) <= 2e-5 * max(1.0, float(expected.abs().max())), layer


def test_hf_directory_gives_the_checkpoints_store(esm1b_path, hf_esm1b, tmp_path) -> None:
    want = _store(tmp_path, esm1b_path, "pt", "--precision", "bf16-mixed")
    got = _store(tmp_path, hf_esm1b, "hf", "--precision", "bf16-mixed")
    assert got["attrs"]["model_family"] == want["attrs"]["model_family"] == "esm1b"
    for layer in LAYERS:
        for rid, _ in RECORDS:
            np.testing.assert_allclose(got["per_residue"][layer][rid], want["per_residue"][layer][rid], atol=1e-5)


def test_hf_rotary_with_a_norm_before_is_still_refused(hf_esm1b, tmp_path) -> None:
    import json
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(hf_esm1b, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(config | {"position_embedding_type": "rotary"}))
    with pytest.raises(ModelError, match="emb_layer_norm_before is set with rotary positions"):
        load_model(str(bad))


@pytest.mark.parametrize("field", ["max_position_embeddings", "num_hidden_layers"])
def test_hostile_hf_config_is_one_line(hf_esm1b, tmp_path, field) -> None:
    import json
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(hf_esm1b, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(config | {field: 2 if field == "max_position_embeddings" else 12.5}))
    for call in (describe, load_model):
        with pytest.raises(ModelError) as info:
            call(str(bad))
        assert field in str(info.value) and "config.json" in str(info.value) and "\n" not in str(info.value)
