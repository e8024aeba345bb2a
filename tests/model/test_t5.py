"""The T5 encoder family (ProtT5, Ankh) in the model layer: tokens, fp32 forward, overflow.

The independent computation is transformers' own tokenizer and ``T5EncoderModel`` on the
same directory, read as ProtTrans' ``prott5_embedder.py`` reads it (marker ``peer``).
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from embedpipe.cli import app
from embedpipe.core.errors import ModelError
from embedpipe.model import describe, load_model
from embedpipe.model.families import T5_LAYOUT
from embedpipe.model.layout import ESM2_LAYOUT
from embedpipe.model.random_hf import make_hf_test_model
from embedpipe.runtime.precision import POLICIES, forward_context
from helpers.embed_helpers import overflowing_prot_t5

HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
CPU = torch.device("cpu")
FP16_MAX = float(torch.finfo(torch.float16).max)
SEQS = ["MKTAYIAKQRQISFVKSHFSRQ", "ACDEFGHIKLMNPQRSTVWY", "UZOBXMK", "GAVLI" * 7, "W"]


@pytest.fixture(scope="module", params=["prot-t5", "ankh"])
def t5_dir(request, tmp_path_factory) -> Path:
    return make_hf_test_model(tmp_path_factory.mktemp("t5") / request.param, family=request.param,
                              layers=3, dim=32, heads=4, seed=5)


def run(model, policy: str, seqs: list[str], layers: list[int]):
    runner = model.prepare(POLICIES[policy], CPU)
    with forward_context(POLICIES[policy], CPU):
        return runner(model.tokenize(seqs), layers)


def hf_inputs(tokenizer, family: str, seqs: list[str]) -> dict:
    """The recipes: ProtTrans' (rare residues to X, space-separated) and Ankh's (characters)."""
    if family == "prot-t5":
        spaced = [" ".join(re.sub(r"[UZOB]", "X", s)) for s in seqs]
        return tokenizer(spaced, add_special_tokens=True, padding="longest", return_tensors="pt")
    return tokenizer([list(s) for s in seqs], add_special_tokens=True, padding="longest",
                     is_split_into_words=True, return_tensors="pt")


def test_the_layouts_are_declared() -> None:
    assert (ESM2_LAYOUT.bos, ESM2_LAYOUT.eos, ESM2_LAYOUT.window, ESM2_LAYOUT.extra_tokens) == (True, True, 1022, 2)
    assert (T5_LAYOUT.bos, T5_LAYOUT.eos, T5_LAYOUT.window, T5_LAYOUT.extra_tokens) == (False, True, None, 1)


@pytest.mark.peer
@pytest.mark.skipif(not HAVE_TRANSFORMERS, reason="transformers is not installed")
def test_token_ids_equal_transformers_tokenizer(t5_dir: Path) -> None:
    from transformers import AutoTokenizer

    model = load_model(str(t5_dir))
    want = hf_inputs(AutoTokenizer.from_pretrained(str(t5_dir)), model.family, SEQS)["input_ids"]
    got = model.tokenize(SEQS)
    assert torch.equal(got, want)
    assert (got[:, 0] != model.eos_id).all() and got[1, len(SEQS[1])] == model.eos_id  # no BOS, one EOS


@pytest.mark.peer
@pytest.mark.skipif(not HAVE_TRANSFORMERS, reason="transformers is not installed")
def test_fp32_hidden_states_equal_transformers_every_layer(t5_dir: Path) -> None:
    from transformers import AutoTokenizer, T5EncoderModel

    model = load_model(str(t5_dir))
    layers = list(range(model.num_layers + 1))
    ours = run(model, "fp32", SEQS, layers)
    hf = T5EncoderModel.from_pretrained(str(t5_dir), dtype=torch.float32).eval()
    inputs = hf_inputs(AutoTokenizer.from_pretrained(str(t5_dir)), model.family, SEQS)
    with torch.no_grad():
        theirs = hf(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                    output_hidden_states=True).hidden_states
    assert len(theirs) == len(layers)
    for layer in layers:
        for row, seq in enumerate(SEQS):
            n = len(seq) + 1  # residues and </s>
            want, got = theirs[layer][row, :n], ours.hidden[layer][row, :n]
            rel = float((got - want).abs().max() / want.abs().max())
            assert rel <= 1e-5, (layer, row, rel)


def overflowing(directory: Path, scale: float, out: Path) -> Path:
    """A copy of ``directory`` whose last feed-forward output is scaled by ``scale``."""
    import shutil

    from safetensors.torch import load_file, save_file
    shutil.copytree(directory, out)
    state = load_file(str(out / "model.safetensors"))
    last = json.loads((out / "config.json").read_text())["num_layers"] - 1
    state[f"encoder.block.{last}.layer.1.DenseReluDense.wo.weight"] *= scale
    save_file(state, str(out / "model.safetensors"))
    return out


def overflowed(out) -> np.ndarray:
    return (~torch.isfinite(out.max_abs) | (out.max_abs > FP16_MAX)).numpy()


@pytest.mark.peer
@pytest.mark.skipif(not HAVE_TRANSFORMERS, reason="transformers is not installed")
def test_fp16_overflow_surfaces_where_transformers_clamps_it(t5_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer, T5EncoderModel

    big = overflowing(t5_dir, 1e5, tmp_path / "big")
    model = load_model(str(big))
    layers = [model.num_layers]
    reference = run(model, "fp32", SEQS, layers)
    assert torch.isfinite(reference.max_abs).all() and (reference.max_abs > FP16_MAX).all()  # past fp16's range
    for policy in ("fp16", "fp16-mixed", "amp-fp16"):
        assert overflowed(run(model, policy, SEQS, layers)).all(), policy
    hf = T5EncoderModel.from_pretrained(str(big), dtype=torch.float16).eval()
    inputs = hf_inputs(AutoTokenizer.from_pretrained(str(big)), model.family, SEQS)
    with torch.no_grad():
        clamped = hf(**inputs).last_hidden_state
    for row, seq in enumerate(SEQS):  # transformers' clamp hides it: finite vectors for every record
        assert torch.isfinite(clamped[row, : len(seq) + 1]).all(), row


def test_overflow_of_a_record_does_not_depend_on_its_batch_mates(tmp_path: Path) -> None:
    """'C' embeds at 7e4 (inf once cast to fp16): exactly the records with C overflow, alone or batched."""
    directory = overflowing_prot_t5(tmp_path / "c")
    model = load_model(str(directory))
    seqs = ["MKTAYIAK", "MKCAYIAKQRQ", "GAVLIGAVLIGAVLIW", "CC", "PQRST"]
    for policy in ("fp16", "fp16-mixed"):
        batched = overflowed(run(model, policy, seqs, [model.num_layers]))
        alone = np.array([overflowed(run(model, policy, [s], [model.num_layers]))[0] for s in seqs])
        assert batched.tolist() == alone.tolist() == ["C" in s for s in seqs], policy


@pytest.mark.parametrize("policy", ["bf16", "bf16-mixed", "amp-bf16", "fp16-mixed"])
def test_low_precision_policies_stay_close_to_fp32(policy: str, tmp_path: Path) -> None:
    directory = make_hf_test_model(tmp_path / "m", family="ankh", layers=2, dim=32, heads=4, seed=3)
    model = load_model(str(directory))
    want = run(model, "fp32", SEQS, [model.num_layers]).hidden[model.num_layers]
    got = run(model, policy, SEQS, [model.num_layers]).hidden[model.num_layers].float()
    for row, seq in enumerate(SEQS):
        a, b = want[row, : len(seq)].mean(0), got[row, : len(seq)].mean(0)
        assert float(torch.nn.functional.cosine_similarity(a, b, dim=0)) > 0.99
    islands = model.prepare(POLICIES["bf16-mixed"], CPU).w
    assert islands["0.ln0"].dtype == islands["relative_bias"].dtype == torch.float32
    assert islands["0.q"].dtype == torch.bfloat16
    assert model.weights["0.q"].dtype == torch.float32  # the fp32 model stays usable as the fallback


def test_make_test_model_cli_writes_an_untrained_directory(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["make-test-model", str(tmp_path / "pt5"), "--family", "prot-t5",
                                      "--layers", "1", "--dim", "16", "--heads", "2", "--seed", "4"])
    assert result.exit_code == 0, result.output
    assert {p.name for p in (tmp_path / "pt5").iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json"}
    facts = describe(str(tmp_path / "pt5"))
    assert (facts.family, facts.trained, facts.num_layers, facts.embed_dim) == ("prot-t5", False, 1, 16)
    loaded = load_model(str(tmp_path / "pt5"))
    assert (loaded.trained, loaded.family, loaded.provenance["model_format"]) == (False, "prot-t5", "huggingface-t5")
    again = CliRunner().invoke(app, ["make-test-model", str(tmp_path / "pt5"), "--family", "prot-t5"])
    assert again.exit_code == 1 and "not an empty directory" in again.stderr


def test_refusals_are_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"model_type": "bert"}))
    result = CliRunner().invoke(app, ["model-info", str(bert)])
    assert result.exit_code == 1 and "model_type 'bert' is not supported" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(ModelError, match=r"not in the local hub cache .*hf download ElnaggarLab/ankh-base"):
        load_model("ElnaggarLab/ankh-base")
    assert describe("ElnaggarLab/ankh-base").family == "ankh"  # known without the files


def test_without_the_hf_extra_a_directory_is_refused_naming_it(tmp_path: Path, monkeypatch) -> None:
    directory = make_hf_test_model(tmp_path / "m", family="ankh", layers=1, dim=16, heads=2)
    for name in ("safetensors", "safetensors.torch"):
        monkeypatch.setitem(sys.modules, name, None)  # import now raises ImportError
    with pytest.raises(ModelError, match=r"needs the Python package 'safetensors.torch'.*pip install 'embedpipe\[hf\]'"):
        load_model(str(directory))


def test_a_hub_name_loads_from_the_hub_cache(tmp_path: Path, monkeypatch) -> None:
    snapshot = tmp_path / "hub" / "models--ElnaggarLab--ankh-base" / "snapshots" / "abc123"
    snapshot.parent.mkdir(parents=True)
    make_hf_test_model(snapshot, family="ankh", layers=1, dim=16, heads=2)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    model = load_model("ElnaggarLab/ankh-base")
    assert (model.name, model.source, model.family) == ("ElnaggarLab/ankh-base", str(snapshot), "ankh")
