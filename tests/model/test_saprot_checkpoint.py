"""SaProt as SaProt ships it: its token order, and its esm-format ``.pt`` beside the Hugging Face directory.

The facts are transcribed from SaProt's own loader (westlake-repl/SaProt ``utils/esm_loader.py``,
``load_esm_saprot``) and its constants (``utils/constants.py``), and the test models are checked
against them. The independent computations: fair-esm's ``ESM2`` built as ``load_esm_saprot``
builds it (its alphabet constructed here from fair-esm's ``Alphabet``, its weights read from the
``.pt``), fed token ids looked up in that alphabet; and the Hugging Face directory written from
the same weights, whose store must be the ``.pt``'s bit for bit.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import esm
import h5py
import numpy as np
import pytest
import torch
from esm.model.esm2 import ESM2
from test_t5_pipeline import close
from typer.testing import CliRunner

from embedpipe.cli import app
from embedpipe.core.errors import ModelError
from embedpipe.model import inspect, load_model, registry
from embedpipe.model.families import SAPROT
from embedpipe.model.random_checkpoint import save
from helpers.embed_helpers import random_sequences, read_store, structure_aware, write_fasta

# westlake-repl/SaProt utils/constants.py
FOLDSEEK_SEQ_VOCAB = "ACDEFGHIKLMNPQRSTVWY#"
FOLDSEEK_STRUC_VOCAB = "pynwrqhgdlvtmfsaeikc#"
# westlake-repl/SaProt utils/esm_loader.py: the keys load_esm_saprot reads from data["config"]
LAYOUT = SAPROT.layout
CONFIG_KEYS = {"num_layers", "embed_dim", "attention_heads", "token_dropout"}

RECORDS = structure_aware(random_sequences(5, [3, 30, 1, 12, 41], seed=21), seed=22) + [
    ("masked", "M#K#T#"), ("hand", "MdEvVpQp"), ("rare", "XaUcBd#p")]


def load_esm_saprot_alphabet() -> esm.data.Alphabet:
    """The alphabet exactly as westlake-repl/SaProt utils/esm_loader.py's load_esm_saprot builds it."""
    tokens = ["<cls>", "<pad>", "<eos>", "<unk>", "<mask>"]
    for seq_token, struc_token in itertools.product(FOLDSEEK_SEQ_VOCAB, FOLDSEEK_STRUC_VOCAB):
        token = seq_token + struc_token
        tokens.append(token)
    alphabet = esm.data.Alphabet(standard_toks=tokens, prepend_toks=[], append_toks=[], prepend_bos=True,
                                 append_eos=True, use_msa=False)
    alphabet.all_toks = alphabet.all_toks[:-2]
    alphabet.unique_no_split_tokens = alphabet.all_toks
    alphabet.tok_to_idx = {tok: i for i, tok in enumerate(alphabet.all_toks)}
    return alphabet


def load_esm_saprot(path: Path) -> tuple[ESM2, esm.data.Alphabet, list[str], list[str]]:
    """westlake-repl/SaProt utils/esm_loader.py's load_esm_saprot (weights-only here, as this project
    loads every file), returning also its load_weights' missed and unused parameter names."""
    data = torch.load(path, weights_only=True)
    weights, config = data["model"], data["config"]
    alphabet = load_esm_saprot_alphabet()
    model = ESM2(num_layers=config["num_layers"], embed_dim=config["embed_dim"],
                 attention_heads=config["attention_heads"], alphabet=alphabet, token_dropout=config["token_dropout"])
    model_dict = model.state_dict()
    unused = [k for k in weights if k not in model_dict]
    missed = [k for k in model_dict if k not in weights]
    model_dict.update({k: v for k, v in weights.items() if k in model_dict})
    model.load_state_dict(model_dict)
    return model.eval(), alphabet, missed, unused


def fair_esm_ids(alphabet: esm.data.Alphabet, seqs: list[str]) -> torch.Tensor:
    """<cls>, one token a residue (its two characters looked up in ``alphabet``; ``<unk>`` if none),
    <eos>, then <pad>: what SaProt's tokenizer gives a structure-aware sequence."""
    width = max(len(s) // 2 for s in seqs) + 2
    ids = torch.full((len(seqs), width), alphabet.padding_idx, dtype=torch.long)
    for row, seq in enumerate(seqs):
        pairs = [alphabet.get_idx(seq[i : i + 2]) for i in range(0, len(seq), 2)]
        ids[row, : len(pairs) + 2] = torch.tensor([alphabet.cls_idx, *pairs, alphabet.eos_idx])
    return ids


def make(tmp: Path, family: str, name: str, seed: int = 13) -> Path:
    result = CliRunner().invoke(app, ["make-test-model", str(tmp / name), "--family", family, "--layers", "2",
                                      "--dim", "32", "--heads", "4", "--seed", str(seed)])
    assert result.exit_code == 0, result.output
    return tmp / name


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    """SaProt's esm-format .pt and its Hugging Face directory, from the same random weights."""
    tmp = tmp_path_factory.mktemp("saprot-pt")
    return make(tmp, "saprot-pt", "SaProt_test.pt"), make(tmp, "saprot", "SaProt_test")


def test_the_fixtures_are_what_saprots_loader_builds_and_reads(models: tuple[Path, Path]) -> None:
    pt, directory = models
    alphabet = load_esm_saprot_alphabet()
    tokens = alphabet.all_toks
    assert len(tokens) == 446 and len(set(tokens)) == 446
    assert (alphabet.cls_idx, alphabet.padding_idx, alphabet.eos_idx, alphabet.unk_idx, alphabet.mask_idx) == (0, 1, 2, 3, 4)
    assert (tokens[5], tokens[5 + 20], tokens[5 + 21], tokens[-1]) == ("Ap", "A#", "Cp", "##")
    # the directory's vocab.txt lists them in that order (EsmTokenizer: id = line), its config agrees
    assert (directory / "vocab.txt").read_text().splitlines() == tokens
    config = json.loads((directory / "config.json").read_text())
    assert (config["vocab_size"], config["pad_token_id"], config["mask_token_id"]) == (446, 1, 4)
    # the .pt holds exactly what load_esm_saprot reads: its config keys, ESM2's own weight names
    data = torch.load(pt, weights_only=True)
    assert set(data["config"]) == CONFIG_KEYS and set(data) == {"model", "config", "embedpipe"}
    _, _, missed, unused = load_esm_saprot(pt)
    assert (missed, unused) == ([], [])
    assert data["model"]["embed_tokens.weight"].shape == (446, 32)
    # embedpipe's alphabet for both forms is the loader's
    for model in (load_model(str(pt)), load_model(str(directory))):
        ours = model.alphabet
        assert ours.all_toks == tokens and ours.tok_to_idx == alphabet.tok_to_idx
        assert (ours.cls_idx, ours.padding_idx, ours.eos_idx, ours.unk_idx, ours.mask_idx) == (0, 1, 2, 3, 4)
        assert (ours.prepend_bos, ours.append_eos) == (True, True)


def test_the_pt_embeds_as_fair_esms_esm2_built_by_saprots_loader(models: tuple[Path, Path], tmp_path: Path) -> None:
    pt, _ = models
    out = tmp_path / "pt.h5"
    result = CliRunner().invoke(app, ["embed", str(write_fasta(tmp_path / "sa.faa", RECORDS)), "--model", str(pt),
                                      "--out", str(out), "--layers", "0,1,2", "--per-residue", "--device", "cpu",
                                      "--quiet"])
    assert result.exit_code == 0, result.output
    store = read_store(out)
    assert (store["attrs"]["model_family"], store["attrs"]["model_format"]) == ("saprot", "saprot-esm")
    assert (bool(store["attrs"]["model_trained"]), int(store["attrs"]["chars_per_residue"])) == (False, 2)
    model, alphabet, _, _ = load_esm_saprot(pt)
    seqs = [s for _, s in RECORDS]
    with torch.no_grad():
        reps = model(fair_esm_ids(alphabet, seqs), repr_layers=[0, 1, 2])["representations"]
    for row, (rid, seq) in enumerate(RECORDS):
        n = len(seq) // 2
        assert store["fields"]["length"][rid] == n
        for layer in range(3):
            want = reps[layer][row, 1 : n + 1].numpy()
            close(store["per_residue"][layer][rid], want)
            close(store["mean"][layer][rid], want.mean(0))


def datasets(path: Path) -> dict[str, np.ndarray]:
    """Every dataset of a store (vectors, ids, sequences, per-record fields), read with h5py."""
    out: dict[str, np.ndarray] = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: out.__setitem__(name, obj[()]) if isinstance(obj, h5py.Dataset) else None)
    return out


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_the_pt_and_the_directory_of_the_same_weights_give_the_same_store(models: tuple[Path, Path], tmp_path: Path,
                                                                          layout: str) -> None:
    fasta = write_fasta(tmp_path / "sa.faa", RECORDS)
    stores = []
    for n, model in enumerate(models):
        out = tmp_path / f"{n}.h5"
        result = CliRunner().invoke(app, ["embed", str(fasta), "--model", str(model), "--out", str(out), "--layers",
                                          "0,1,2", "--per-residue", "--device", "cpu", "--quiet"],
                                    env={"EMBEDPIPE_ENGINE": f"batch_layout={layout}"})
        assert result.exit_code == 0, result.output
        stores.append(out)
    pt, hf = (datasets(s) for s in stores)
    assert {"mean/layer_2", "per_residue/layer_2", "sequence/data", "precision_used", "length"} <= set(pt)
    assert pt.keys() == hf.keys()
    for name in pt:
        assert pt[name].dtype == hf[name].dtype and np.array_equal(pt[name], hf[name]), name
    with h5py.File(stores[0], "r") as a, h5py.File(stores[1], "r") as b:
        assert (a.attrs["model_format"], b.attrs["model_format"]) == ("saprot-esm", "huggingface-esm")
        ids = [json.loads(x.attrs["embed_identity"])["model_family"] for x in (a, b)]
        assert ids == ["saprot v1", "saprot v1"]


def test_the_pt_is_described_as_saprot_from_its_header(models: tuple[Path, Path], tmp_path: Path) -> None:
    pt, _ = models
    facts = inspect(str(pt))
    model, _, _, _ = load_esm_saprot(pt)
    assert (facts.family, facts.token_layout, facts.packs, facts.trained) == ("saprot", LAYOUT, True, False)
    assert (facts.num_layers, facts.embed_dim, facts.attention_heads) == (2, 32, 4)
    assert facts.parameters == sum(p.numel() for p in model.parameters())
    assert registry.model_identity(str(pt)).family == "saprot v1"
    # without the untrained marker, the file says nothing of itself: real weights
    data = torch.load(pt, weights_only=True)
    del data["embedpipe"]
    save(data, tmp_path / "unmarked.pt")
    assert inspect(str(tmp_path / "unmarked.pt")).trained is True
    assert load_model(str(tmp_path / "unmarked.pt")).trained is True
    # shard counts its residues in pairs, as for the directory
    result = CliRunner().invoke(app, ["shard", str(write_fasta(tmp_path / "s.faa", [("a", "MdEvVpQp")])), "--out",
                                      str(tmp_path / "shards"), "--model", str(pt), "-q"])
    assert result.exit_code == 0, result.output
    rows = (tmp_path / "shards" / "manifest.tsv").read_text().splitlines()[1:]
    assert [row.split("\t")[2] for row in rows] == ["4"]


def _edited(pt: Path, tmp: Path, edit) -> Path:
    data = torch.load(pt, weights_only=True)
    edit(data)
    save(data, tmp / "edited.pt")
    return tmp / "edited.pt"


@pytest.mark.parametrize(("edit", "message"), [
    (lambda d: d.__setitem__("config", [2, 32, 4]), r"not a SaProt checkpoint: 'config' is a list"),
    (lambda d: d["config"].pop("token_dropout"), r"SaProt's config lacks token_dropout"),
    (lambda d: d["config"].__setitem__("num_layers", 10**9), r"num_layers must be a positive integer no larger"),
    (lambda d: d["config"].__setitem__("embed_dim", 30), r"embed_dim"),
    (lambda d: d["config"].__setitem__("token_dropout", "yes"), r"token_dropout must be true or false"),
    (lambda d: d["config"].__setitem__("num_layers", 3), r"num_layers=3, but the state dict holds layers 0..1"),
    (lambda d: d.pop("model"), r"not a SaProt checkpoint: no 'model' state dict"),
    (lambda d: d["model"].update({"embed_tokens.weight": torch.zeros(33, 32), "lm_head.weight": torch.zeros(33, 32)}),
     r"embed_tokens.weight has 33 rows, not SaProt's 446 tokens"),
    (lambda d: d.__setitem__("model", {"encoder." + k: v for k, v in d["model"].items()}), r"embed_tokens.weight"),
    (lambda d: d["model"].__setitem__("extra.weight", torch.zeros(2)), r"unexpected extra.weight"),
    (lambda d: d["model"].pop("layers.1.fc2.weight"), r"missing layers.1.fc2.weight"),
])
def test_a_malformed_pt_is_refused_in_one_line(models: tuple[Path, Path], tmp_path: Path, edit, message: str) -> None:
    path = _edited(models[0], tmp_path, edit)
    with pytest.raises(ModelError, match=message) as caught:
        load_model(str(path))
    assert "\n" not in str(caught.value) and str(path) in str(caught.value)


def test_the_rotary_frequencies_may_be_left_out(models: tuple[Path, Path], tmp_path: Path) -> None:
    """fair-esm's constructor computes ``inv_freq``; a file without it embeds as the full one does."""
    path = _edited(models[0], tmp_path, lambda d: [d["model"].pop(k) for k in list(d["model"]) if "inv_freq" in k])
    seqs = [s for _, s in RECORDS]
    full, bare = load_model(str(models[0])), load_model(str(path))
    with torch.no_grad():
        want = full.model(full.tokenize(seqs), repr_layers=[2])["representations"][2]
        got = bare.model(bare.tokenize(seqs), repr_layers=[2])["representations"][2]
    assert torch.equal(got, want)
