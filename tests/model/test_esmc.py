"""ESM C (``model_type: esmc``, issue 33): embedpipe's own forward against transformers' ``EsmcModel``.

Independent computation: transformers' ``EsmcModel`` (eager attention, fp32) on the same
directory, every layer's hidden states (``output_hidden_states``: the embedding, each block,
the final norm's output last), and its tokenizer for the token ids.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from embedpipe.core.errors import ModelError
from embedpipe.model import describe, load_model
from embedpipe.model.random_hf import make_hf_test_model
from embedpipe.model.registry import model_identity
from embedpipe.runtime.int8_kernels import QMAX, range_name
from embedpipe.runtime.packed import PackedTokens
from embedpipe.runtime.precision import get_policy
from helpers.stores import cosine

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.peer

SEQS = ["MKTAYIAKQRQISFVKSHFSRQ", "ACDEFGHIKLMNPQRSTVWYXBUZO", "MK", "W"]
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def esmc_dir(tmp_path_factory) -> Path:
    return make_hf_test_model(tmp_path_factory.mktemp("esmc") / "m", family="esmc", layers=3, dim=64, heads=4, seed=1)


def reference(directory: Path, tokens: torch.Tensor) -> list[torch.Tensor]:
    """transformers' fp32 hidden states of every layer, (B, T, D) each, for padded ``tokens``."""
    model = transformers.EsmcModel.from_pretrained(str(directory), attn_implementation="eager",
                                                   dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(input_ids=tokens, attention_mask=tokens.ne(1).long(), output_hidden_states=True)
    assert torch.equal(out.hidden_states[-1], out.last_hidden_state)  # the last layer is the final norm's output
    return list(out.hidden_states)


def ours(directory: Path, policy: str = "fp32", packed: bool = False, seqs: list[str] = SEQS):
    model = load_model(str(directory))
    tokens = model.tokenize(seqs)
    runner = model.prepare(get_policy(policy), CPU)
    layers = list(range(model.num_layers + 1))
    with torch.inference_mode():
        if not packed:
            return model, tokens, runner(tokens, layers)
        return model, tokens, runner.packed(PackedTokens.from_padded(tokens, [len(s) + 2 for s in seqs]), layers)


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def residue_means(hidden: torch.Tensor, seqs: list[str], packed: bool) -> list[torch.Tensor]:
    """Means over each record's residue rows (``<cls>`` and ``<eos>`` excluded)."""
    if packed:
        starts = np.cumsum([0] + [len(s) + 2 for s in seqs])
        return [hidden[start + 1 : start + 1 + len(s)].float().mean(0) for start, s in zip(starts, seqs)]
    return [hidden[i, 1 : 1 + len(s)].float().mean(0) for i, s in enumerate(seqs)]


def test_token_ids_equal_transformers_tokenizer(esmc_dir: Path) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(esmc_dir))
    model = load_model(str(esmc_dir))
    want = tokenizer(SEQS, padding=True, return_tensors="pt")["input_ids"]
    assert torch.equal(model.tokenize(SEQS), want)
    assert (model.family, model.token_layout.bos, model.token_layout.eos, model.trained) == ("esmc", True, True, False)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_fp32_every_layer_and_residue_means_equal_transformers(esmc_dir: Path, packed: bool) -> None:
    model, tokens, out = ours(esmc_dir, packed=packed)
    want = reference(esmc_dir, tokens)
    assert len(want) == model.num_layers + 1 == len(out.hidden)
    keep = tokens.ne(1)
    for layer, expected in enumerate(want):
        got = out.hidden[layer] if packed else out.hidden[layer][keep]
        assert rel(got, expected[keep]) <= 1e-5, layer
        for a, b in zip(residue_means(out.hidden[layer], SEQS, packed), residue_means(expected, SEQS, False)):
            assert rel(a, b) <= 1e-5, layer


def test_packed_and_padded_batches_agree(esmc_dir: Path) -> None:
    _, tokens, padded = ours(esmc_dir)
    _, _, packed = ours(esmc_dir, packed=True)
    keep = tokens.ne(1)
    for layer in padded.hidden:
        assert rel(packed.hidden[layer], padded.hidden[layer][keep]) <= 1e-6
    torch.testing.assert_close(packed.max_abs, padded.max_abs, rtol=1e-6, atol=0)


@pytest.mark.parametrize("policy", ["bf16-mixed", "int8-mixed"])
def test_mixed_policies_stay_within_cosine_0999_of_fp32_every_layer(esmc_dir: Path, policy: str) -> None:
    """0.999 every layer; int8-mixed with 7-bit weights (this CPU's only exact int8 kernels are
    7-bit, as on AVX2 without VNNI: half the weight resolution, recorded in the store) 0.998."""
    model, _, fp32 = ours(esmc_dir)
    _, _, low = ours(esmc_dir, policy)
    bar = 0.999
    if policy == "int8-mixed":
        weights = get_policy(policy).for_width(model.embed_dim).provenance()["quantization_weight_range"]
        bar = 0.999 if weights == range_name(QMAX) else 0.998
    for layer in fp32.hidden:
        for a, b in zip(residue_means(low.hidden[layer], SEQS, False), residue_means(fp32.hidden[layer], SEQS, False)):
            assert cosine(a.numpy(), b.numpy()) >= bar, (policy, layer, bar)
    assert model.weights["0.qkv"].dtype == torch.float32  # the fp32 model stays the fallback's


@pytest.mark.parametrize("head", [False, True], ids=["EsmcModel", "EsmcForMaskedLM"])
def test_a_directory_saved_by_transformers_loads_and_matches(tmp_path: Path, head: bool) -> None:
    """transformers' own save_pretrained (sharded: an index and two files), no tokenizer."""
    config = transformers.EsmcConfig(hidden_size=48, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
                                     rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    torch.manual_seed(3)
    cls = transformers.EsmcForMaskedLM if head else transformers.EsmcModel
    cls(config).save_pretrained(str(tmp_path / "saved"), max_shard_size="60KB")
    assert (tmp_path / "saved" / "model.safetensors.index.json").is_file()
    if head:  # the encoder alone, for the reference
        transformers.EsmcForMaskedLM.from_pretrained(str(tmp_path / "saved")).esmc.save_pretrained(str(tmp_path / "enc"))
    model, tokens, out = ours(tmp_path / "saved")
    want = reference(tmp_path / ("enc" if head else "saved"), tokens)
    keep = tokens.ne(1)
    for layer, expected in enumerate(want):
        assert rel(out.hidden[layer][keep], expected[keep]) <= 1e-5, layer
    assert model.trained and describe(str(tmp_path / "saved")).num_layers == 2


def _hub_snapshot(tmp_path: Path, directory: Path, name: str = "biohub/ESMC-300M") -> Path:
    repo = tmp_path / "hub" / ("models--" + name.replace("/", "--"))
    shutil.copytree(directory, repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    return repo / "snapshots" / "abc123"


def test_a_hub_name_resolves_through_the_offline_cache(esmc_dir: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    uncached = describe("biohub/ESMC-600M")
    assert (uncached.family, uncached.kind, uncached.trained_window, uncached.token_layout.window) == (
        "esmc", "name", 2046, 2046)
    with pytest.raises(ModelError) as refused:
        load_model("biohub/ESMC-600M")
    assert "'biohub/ESMC-600M' is not in the local hub cache" in str(refused.value)
    assert "hf download biohub/ESMC-600M" in str(refused.value) and "\n" not in str(refused.value)
    snapshot = _hub_snapshot(tmp_path, esmc_dir)
    model, tokens, out = ours(Path(snapshot))
    named = load_model("biohub/ESMC-300M")
    assert (named.name, named.source, named.family, named.sha256) == ("biohub/ESMC-300M", str(snapshot), "esmc",
                                                                      model.sha256)
    runner = named.prepare(get_policy("fp32"), CPU)
    with torch.inference_mode():
        again = runner(named.tokenize(SEQS), [named.num_layers])
    want = reference(esmc_dir, tokens)[-1]
    assert rel(again.hidden[named.num_layers][tokens.ne(1)], want[tokens.ne(1)]) <= 1e-5
    identity = model_identity("biohub/ESMC-300M")
    assert identity is not None and identity.packs and identity.family == "esmc v1"
    from embedpipe.core.checksums import file_sha256

    assert identity.sha256 == file_sha256(snapshot / "model.safetensors")
    assert identity.files == {n: file_sha256(snapshot / n) for n in ("config.json", "tokenizer.json")}


def _edited(directory: Path, out: Path, **config) -> Path:
    shutil.copytree(directory, out)
    data = json.loads((out / "config.json").read_text()) | config
    (out / "config.json").write_text(json.dumps(data))
    return out


@pytest.mark.parametrize(("change", "message"), [
    ({"attention_bias": True}, "not an ESM C that embedpipe can run (attention_bias or mlp_bias is set)"),
    ({"num_key_value_heads": 2}, "not an ESM C that embedpipe can run (num_key_value_heads differs"),
    ({"hidden_act": "gelu"}, "not an ESM C that embedpipe can run (hidden_act is not silu)"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "(rope_type is not 'default')"),
    ({"num_hidden_layers": 4}, "does not match an ESM C with 4 layers: missing layers.3.input_layernorm.weight"),
    ({"intermediate_size": 100}, "weight for 0.gate_up has shape (256, 64), config says (200, 64)"),
    ({"num_hidden_layers": 10**7}, "num_hidden_layers must be a positive integer no larger than 1024"),
])
def test_refusals_are_one_line(esmc_dir: Path, tmp_path: Path, change: dict, message: str) -> None:
    with pytest.raises(ModelError) as refused:
        load_model(str(_edited(esmc_dir, tmp_path / "bad", **change)))
    assert message in str(refused.value) and "\n" not in str(refused.value), str(refused.value)


def test_a_tokenizer_with_other_ids_is_refused(esmc_dir: Path, tmp_path: Path) -> None:
    bad = _edited(esmc_dir, tmp_path / "tok")
    data = json.loads((bad / "tokenizer.json").read_text())
    data["model"]["vocab"]["A"], data["model"]["vocab"]["L"] = 4, 5
    (bad / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(ModelError, match=r"tokenizer.json: not ESM C's vocabulary \('L' is not token 4\)"):
        load_model(str(bad))


@pytest.mark.parametrize(("field", "value", "pattern"), [
    ("num_hidden_layers", 10_000_000, r"num_hidden_layers must be a positive integer no larger than 1024, got 10000000"),
    ("hidden_size", 30, r"hidden_size 30 is not divisible by num_attention_heads 4"),
    ("intermediate_size", "64", r"intermediate_size must be a positive integer, got '64'"),
    ("vocab_size", 10, r"vocab_size must be an integer from 33 no larger than 1048576, got 10"),
    ("max_position_embeddings", 2, r"max_position_embeddings must be an integer from 3 no larger than 1048576, got 2"),
    ("rope_parameters", {"rope_type": "default", "rope_theta": float("nan")},
     r"not an ESM C that embedpipe can run \(rope_theta nan is not a number above 1\)"),
], ids=lambda v: str(v)[:20])
def test_a_crafted_config_is_refused_before_any_weight_is_read(esmc_dir, tmp_path, monkeypatch, field, value,
                                                                pattern) -> None:
    from test_hf_config_limits import assert_refused

    assert_refused(_edited(esmc_dir, tmp_path / "crafted", **{field: value}), monkeypatch, pattern)


def test_there_is_no_fair_esm_forward_for_esmc(esmc_dir: Path) -> None:
    with pytest.raises(ModelError, match=r"^EMBEDPIPE_ENGINE attention=fair-esm: the esmc family runs sdpa or math$"):
        load_model(str(esmc_dir)).prepare(get_policy("fp32"), CPU, "fair-esm")


def test_the_math_attention_equals_sdpa(esmc_dir: Path) -> None:
    model = load_model(str(esmc_dir))
    tokens = model.tokenize(SEQS)
    layers = [model.num_layers]
    with torch.inference_mode():
        sdpa = model.prepare(get_policy("fp32"), CPU, "sdpa")(tokens, layers).hidden[layers[0]]
        math = model.prepare(get_policy("fp32"), CPU, "math")(tokens, layers).hidden[layers[0]]
    keep = tokens.ne(1)
    assert rel(math[keep], sdpa[keep]) <= 1e-5


def test_an_esm_plusplus_directory_loads_and_equals_transformers_esmc(tmp_path: Path) -> None:
    """ESM++ (model_type ESMplusplus): transformers' EsmcModel weights under ESM++'s names (its
    modeling file: ``embed``, ``transformer.blocks.{i}.attn.layernorm_qkv.{0,1}``, ``q_ln``/``k_ln``,
    ``out_proj``, ``ffn.{0,1,3}`` with gate before up, ``transformer.norm``), config.json with only
    the width, heads, layers and vocabulary; the SwiGLU width follows ESM C's 8/3 rule."""
    from safetensors.torch import save_file

    config = transformers.EsmcConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256)
    torch.manual_seed(4)
    transformers.EsmcModel(config).save_pretrained(str(tmp_path / "esmc"))
    state = transformers.EsmcModel.from_pretrained(str(tmp_path / "esmc")).state_dict()
    plus = {"embed.weight": state["embed_tokens.weight"], "transformer.norm.weight": state["norm.weight"]}
    for i in range(2):
        a, b = f"layers.{i}.", f"transformer.blocks.{i}."
        plus |= {b + "attn.layernorm_qkv.0.weight": state[a + "input_layernorm.weight"],
                 b + "attn.layernorm_qkv.0.bias": state[a + "input_layernorm.bias"],
                 b + "attn.layernorm_qkv.1.weight": torch.cat([state[a + f"self_attn.{n}_proj.weight"] for n in "qkv"]),
                 b + "attn.q_ln.weight": state[a + "self_attn.q_norm.weight"],
                 b + "attn.k_ln.weight": state[a + "self_attn.k_norm.weight"],
                 b + "attn.out_proj.weight": state[a + "self_attn.o_proj.weight"],
                 b + "ffn.0.weight": state[a + "post_attention_layernorm.weight"],
                 b + "ffn.0.bias": state[a + "post_attention_layernorm.bias"],
                 b + "ffn.1.weight": torch.cat([state[a + "mlp.gate_proj.weight"], state[a + "mlp.up_proj.weight"]]),
                 b + "ffn.3.weight": state[a + "mlp.down_proj.weight"]}
    plus["sequence_head.0.weight"] = torch.zeros(64, 64)  # ESMplusplusForMaskedLM's head: dropped
    directory = tmp_path / "plus"
    directory.mkdir()
    save_file({k: v.contiguous() for k, v in plus.items()}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps({
        "model_type": "ESMplusplus", "architectures": ["ESMplusplusForMaskedLM"], "vocab_size": 64,
        "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2}))
    model, tokens, out = ours(directory)
    assert (model.family, model.shape.ffn, describe(str(directory)).family) == ("esmc", 256, "esmc")
    want = reference(tmp_path / "esmc", tokens)
    keep = tokens.ne(1)
    for layer, expected in enumerate(want):
        assert rel(out.hidden[layer][keep], expected[keep]) <= 1e-5, layer
    assert describe("Synthyra/ESMplusplus_small").family == "esmc"
    from test_capabilities import assert_declared_as_loaded

    assert_declared_as_loaded(str(directory))  # ESM++'s spec declares what its loaded model answers
