"""Issue 30, items 6 and the friction item: a crafted model config is refused in one line naming
the file and the field before anything is sized by it, through one bounds module
(embedpipe/model/config_bounds.py) for fair-esm checkpoints and Hugging Face config.json
(ESM-2 and T5) alike; a pickle refusal names a Hugging Face weights file as one.

Independent computations: the field values themselves (the messages quote them), and for a
valid unusual T5 bucket setting transformers' own ``T5EncoderModel`` on the same directory."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from embedpipe.cli import app
from embedpipe.core.errors import ModelError
from embedpipe.model import hf_checkpoint, inspect, load_model
from embedpipe.model.checkpoint import load_checkpoint_safely
from embedpipe.model.random_hf import make_hf_test_model
from embedpipe.runtime.precision import POLICIES

HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
MISSING = object()


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {family: make_hf_test_model(root / family, family=family, layers=2, dim=32, heads=4, seed=3)
            for family in ("hf-esm", "prot-t5", "ankh")}


def _edited(source: Path, tmp_path: Path, **fields) -> Path:
    """A copy of ``source`` whose config.json has ``fields`` set (MISSING: removed)."""
    out = tmp_path / "edited"
    shutil.copytree(source, out)
    config = json.loads((out / "config.json").read_text())
    for key, value in fields.items():
        if value is MISSING:
            config.pop(key, None)
        else:
            config[key] = value
    (out / "config.json").write_text(json.dumps(config))  # NaN/Infinity as Python's json writes them
    return out


def assert_refused(directory: Path, monkeypatch, pattern: str) -> str:
    """The one-line refusal of ``directory`` by load_model and by model-info, before any weight is read."""
    def no_weights(files):
        raise AssertionError("weights were read before the config was checked")

    monkeypatch.setattr(hf_checkpoint, "read_state_dict", no_weights)
    expected = "^" + re.escape(str(directory / "config.json")) + ": " + pattern + "$"
    with pytest.raises(ModelError, match=expected) as info:
        load_model(str(directory))
    with pytest.raises(ModelError, match=expected):
        inspect(str(directory))  # model-info and the workflow's mem_mb
    message = str(info.value)
    assert "\n" not in message
    return message


ESM_CASES = [
    ("num_hidden_layers", 10_000_000, r"num_hidden_layers must be a positive integer no larger than 1024, got 10000000"),
    ("num_hidden_layers", -2, r"num_hidden_layers must be a positive integer no larger than 1024, got -2"),
    ("num_hidden_layers", 0, r"num_hidden_layers must be a positive integer no larger than 1024, got 0"),
    ("num_hidden_layers", 2.5, r"num_hidden_layers must be a positive integer, got 2\.5"),
    ("num_hidden_layers", "2", r"num_hidden_layers must be a positive integer, got '2'"),
    ("num_hidden_layers", True, r"num_hidden_layers must be a positive integer, got True"),
    ("num_hidden_layers", MISSING, r"num_hidden_layers is missing \(a positive integer, at most 1024\)"),
    ("hidden_size", 10**12, r"hidden_size must be a positive integer no larger than 65536, got 1000000000000"),
    ("hidden_size", 30, r"hidden_size 30 is not divisible by num_attention_heads 4"),
    ("num_attention_heads", 5, r"hidden_size 32 is not divisible by num_attention_heads 5"),
    ("num_attention_heads", 10**6, r"num_attention_heads must be a positive integer no larger than 1024, got 1000000"),
    ("intermediate_size", 10**9, r"intermediate_size must be a positive integer no larger than 262144, got 1000000000"),
    ("intermediate_size", 0, r"intermediate_size must be a positive integer no larger than 262144, got 0"),
    ("vocab_size", 10**9, r"vocab_size must be a positive integer no larger than 1048576, got 1000000000"),
    ("vocab_size", MISSING, r"vocab_size is missing \(a positive integer, at most 1048576\)"),
    ("max_position_embeddings", 10**10,
     r"max_position_embeddings must be a positive integer no larger than 1048576, got 10000000000"),
    ("max_position_embeddings", -1, r"max_position_embeddings must be a positive integer no larger than 1048576, got -1"),
    ("layer_norm_eps", math.nan, r"layer_norm_eps must be a finite number in \(0, 0\.01\], got nan"),
    ("layer_norm_eps", math.inf, r"layer_norm_eps must be a finite number in \(0, 0\.01\], got inf"),
    ("layer_norm_eps", 0, r"layer_norm_eps must be a finite number in \(0, 0\.01\], got 0"),
    ("layer_norm_eps", 5.0, r"layer_norm_eps must be a finite number in \(0, 0\.01\], got 5\.0"),
    ("layer_norm_eps", "tiny", r"layer_norm_eps must be a finite number in \(0, 0\.01\], got 'tiny'"),
    ("position_embedding_type", "sinusoidal", (r"position_embedding_type 'sinusoidal' is not one of absolute, "
                                               r"relative_key, relative_key_query, rotary \(ESM-2's is 'rotary'\)")),
]


@pytest.mark.parametrize(("field", "value", "pattern"), ESM_CASES, ids=lambda v: str(v)[:20])
def test_a_crafted_esm_config_is_refused_in_one_line(dirs, tmp_path, monkeypatch, field, value, pattern) -> None:
    assert_refused(_edited(dirs["hf-esm"], tmp_path, **{field: value}), monkeypatch, pattern)


def test_token_dropout_must_be_a_bool(dirs, tmp_path) -> None:
    directory = _edited(dirs["hf-esm"], tmp_path, token_dropout="false")  # bool("false") was True
    with pytest.raises(ModelError, match=r"config\.json: token_dropout must be true or false, got 'false'$"):
        load_model(str(directory))


T5_CASES = [
    ("num_layers", 10_000_000, r"num_layers must be a positive integer no larger than 1024, got 10000000"),
    ("num_layers", 1.5, r"num_layers must be a positive integer, got 1\.5"),
    ("num_layers", MISSING, r"num_layers is missing \(a positive integer, at most 1024\)"),
    ("d_model", 12.7, r"d_model must be a positive integer, got 12\.7"),  # int() once made it 12
    ("d_model", 10**7, r"d_model must be a positive integer no larger than 65536, got 10000000"),
    ("d_kv", 0, r"d_kv must be a positive integer no larger than 65536, got 0"),
    ("num_heads", -4, r"num_heads must be a positive integer no larger than 1024, got -4"),
    ("d_ff", 10**9, r"d_ff must be a positive integer no larger than 262144, got 1000000000"),
    ("d_ff", "64", r"d_ff must be a positive integer, got '64'"),
    ("vocab_size", 0, r"vocab_size must be a positive integer no larger than 1048576, got 0"),
    ("relative_attention_num_buckets", 10**8,
     r"relative_attention_num_buckets must be an integer from 4 no larger than 4096, got 100000000"),
    ("relative_attention_num_buckets", 2, r"relative_attention_num_buckets must be an integer from 4 no larger than 4096, got 2"),
    ("relative_attention_max_distance", 8, (r"relative_attention_max_distance 8 must be larger than "
                                            r"relative_attention_num_buckets // 4 = 8, where T5's logarithmic buckets start")),
    ("relative_attention_max_distance", -1,
     r"relative_attention_max_distance must be a positive integer no larger than 1048576, got -1"),
    ("layer_norm_epsilon", math.nan, r"layer_norm_epsilon must be a finite number in \(0, 0\.01\], got nan"),
    ("layer_norm_epsilon", -1e-6, r"layer_norm_epsilon must be a finite number in \(0, 0\.01\], got -1e-06"),
    ("layer_norm_epsilon", math.inf, r"layer_norm_epsilon must be a finite number in \(0, 0\.01\], got inf"),
]


@pytest.mark.parametrize("family", ["prot-t5", "ankh"])
@pytest.mark.parametrize(("field", "value", "pattern"), T5_CASES, ids=lambda v: str(v)[:20])
def test_a_crafted_t5_config_is_refused_in_one_line(dirs, tmp_path, monkeypatch, family, field, value, pattern) -> None:
    assert_refused(_edited(dirs[family], tmp_path, **{field: value}), monkeypatch, pattern)


def test_num_heads_times_d_kv_is_bounded(dirs, tmp_path, monkeypatch) -> None:
    assert_refused(_edited(dirs["prot-t5"], tmp_path, num_heads=1024, d_kv=65536), monkeypatch,
             r"num_heads x d_kv = 1024 x 65536 is wider than 65536")


def test_the_cli_prints_one_line_for_a_huge_depth(dirs, tmp_path) -> None:
    directory = _edited(dirs["hf-esm"], tmp_path, num_hidden_layers=10_000_000)
    for command in (["model-info", str(directory)], ["model-info", "--json", str(directory)]):
        result = CliRunner().invoke(app, command)
        assert result.exit_code == 1
        assert result.stderr.strip().splitlines() == [
            (f"embedpipe: error: {directory / 'config.json'}: num_hidden_layers must be a positive integer "
             f"no larger than 1024, got 10000000")]


@pytest.mark.parametrize(("key", "value", "pattern"), [
    ("encoder_layers", 10_000_000, "encoder_layers must be a positive integer no larger than 1024, got 10000000"),
    ("encoder_embed_dim", 32.0, "encoder_embed_dim must be a positive integer, got 32.0"),
    ("encoder_embed_dim", 10**9, "encoder_embed_dim must be a positive integer no larger than 65536, got 1000000000"),
    ("encoder_attention_heads", 3, "encoder_embed_dim 32 is not divisible by encoder_attention_heads 3"),
    ("encoder_attention_heads", 0, "encoder_attention_heads must be a positive integer no larger than 1024, got 0"),
])
def test_the_pt_path_uses_the_same_bounds(tiny_model_path, tmp_path, key, value, pattern) -> None:
    data = load_checkpoint_safely(tiny_model_path)
    setattr(data["cfg"]["model"], key, value)
    path = tmp_path / "edited.pt"
    torch.save(data, path)
    expected = rf"^{re.escape(str(path))}: {re.escape(pattern)}$"
    with pytest.raises(ModelError, match=expected):
        load_model(str(path))
    with pytest.raises(ModelError, match=expected):
        inspect(str(path))


@pytest.mark.peer
@pytest.mark.skipif(not HAVE_TRANSFORMERS, reason="transformers is not installed")
@pytest.mark.parametrize(("buckets", "distance"), [(32, 9), (8, 3), (64, 40)])
def test_unusual_valid_buckets_equal_transformers(dirs, tmp_path, buckets, distance) -> None:
    """Just above the exact range, few buckets, many buckets: every layer as transformers computes it."""
    from safetensors.torch import load_file, save_file
    from transformers import T5EncoderModel

    directory = _edited(dirs["prot-t5"], tmp_path, relative_attention_num_buckets=buckets,
                        relative_attention_max_distance=distance)
    weights = load_file(str(directory / "model.safetensors"))
    name = "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    weights[name] = torch.randn(buckets, weights[name].shape[1], generator=torch.Generator().manual_seed(1))
    save_file(weights, str(directory / "model.safetensors"))
    model = load_model(str(directory))
    tokens = torch.randint(3, 20, (2, 90), generator=torch.Generator().manual_seed(2))
    ours = model.prepare(POLICIES["fp32"], torch.device("cpu"))(tokens, list(range(model.num_layers + 1)))
    hf = T5EncoderModel.from_pretrained(str(directory), dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(input_ids=tokens, output_hidden_states=True).hidden_states
    for layer, want in enumerate(theirs):
        rel = float((ours.hidden[layer] - want).abs().max() / want.abs().max())
        assert rel <= 1e-5, (layer, rel)


class _Payload:
    """A pickled object the weights-only allowlist refuses (its class is a global)."""


def test_a_pickled_hf_weights_file_is_named_as_one(dirs, tmp_path) -> None:
    directory = tmp_path / "pickled"
    shutil.copytree(dirs["hf-esm"], directory)
    (directory / "model.safetensors").unlink()
    weights = directory / "pytorch_model.bin"
    torch.save({"x": _Payload()}, weights)
    with pytest.raises(ModelError) as info:
        load_model(str(directory))
    message = str(info.value)
    assert message.startswith(f"refusing to load {weights}: its pickle references ")
    assert "_Payload" in message and "(a Hugging Face weights file holds only tensors)" in message
    assert "fair-esm" not in message and "\n" not in message
