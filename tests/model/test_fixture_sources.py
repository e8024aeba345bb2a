"""make-test-model's fixtures against each family's official source (SaProt and ESM C's ``.pth`` have their own).

A fixture stands in for the real checkpoint in every other test, so its token order, weight names and
config fields must be the family's. Each fact below is transcribed from the official file cited beside
it; where that code is installed (fair-esm, transformers) the fixture is also read by it, strictly
(fair-esm's own loader and key checks, transformers' ``from_pretrained`` loading report), so the test
does not rest on the transcription alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

import esm
import pytest
import safetensors.torch as safetensors_torch
import torch
import transformers

from embedpipe.model.esm2 import esm2_alphabet
from embedpipe.model.hf_families import MARKER_KEY
from embedpipe.model.random_checkpoint import make_test_model
from embedpipe.model.random_hf import make_hf_test_model

LAYERS, DIM, HEADS = 2, 32, 4

# facebookresearch/esm esm/constants.py (proteinseq_toks) and esm/data.py (Alphabet.from_architecture,
# "ESM-1b" / "roberta_large": <cls> <pad> <eos> <unk>, the standard tokens, <null_1> up to a multiple
# of 8, <mask>): ESM-2's, ESM-1b's and ESM-1v's 33 tokens in id order.
ESM_TOKENS = ("<cls>", "<pad>", "<eos>", "<unk>", "L", "A", "G", "V", "S", "E", "R", "T", "I", "D", "P", "K",
              "Q", "N", "F", "Y", "M", "H", "W", "C", "X", "B", "U", "Z", "O", ".", "-", "<null_1>", "<mask>")
# facebookresearch/esm esm/pretrained.py (_load_model_and_alphabet_core_v2): the cfg["model"] fields read
ESM2_CFG_FIELDS = ("encoder_layers", "encoder_embed_dim", "encoder_attention_heads", "token_dropout")
# facebookresearch/esm esm/pretrained.py (_load_model_and_alphabet_core_v1 strips "encoder_") and
# esm/model/esm1.py (ProteinBertModel reads args.arch, layers, embed_dim, ffn_embed_dim, attention_heads,
# max_positions): the args fields an ESM-1b / ESM-1v checkpoint needs
ESM1B_ARGS_FIELDS = ("arch", "encoder_layers", "encoder_embed_dim", "encoder_ffn_embed_dim",
                     "encoder_attention_heads", "max_positions")
# facebookresearch/esm esm/pretrained.py (_load_model_and_alphabet_core_v2.upgrade_state_dict)
FAIR_PREFIXES = ("encoder.sentence_encoder.", "encoder.")
# evolutionaryscale/esm esm/utils/constants/esm3.py (SEQUENCE_VOCAB): ESM C's token ids
ESMC_TOKENS = ("<cls>", "<pad>", "<eos>", "<unk>", "L", "A", "G", "V", "S", "E", "R", "T", "I", "D", "P", "K",
               "Q", "N", "F", "Y", "M", "H", "W", "C", "X", "B", "U", "Z", "O", ".", "-", "|", "<mask>")
# huggingface/transformers src/transformers/models/t5/tokenization_t5.py ("<pad>=0, </s>=1, <unk>=2")
T5_SPECIALS = {"<pad>": 0, "</s>": 1, "<unk>": 2}
# mheinzinger/ProstT5 scripts/embed.py: the direction prefix before the space-separated residues
PROSTT5_PREFIXES = ("<AA2fold>", "<fold2AA>")
SEQUENCE = "MKTAYIAKQRQISFVKSHFSRQ"


def _load_pt(path: Path) -> dict[str, Any]:
    # the config is an argparse.Namespace: the one global allowed, nothing else is unpickled
    with torch.serialization.safe_globals([argparse.Namespace]):
        return torch.load(str(path), map_location="cpu", weights_only=True)


def _official_fair_esm(path: Path) -> tuple[Any, Any]:
    """fair-esm's own loader on ``path`` (its name picks ESM-2 or ESM-1; its key checks are the official ones)."""
    with torch.serialization.safe_globals([argparse.Namespace]):
        return esm.pretrained.load_model_and_alphabet_local(str(path))


def _hf_fixture(tmp_path_factory: pytest.TempPathFactory, family: str) -> Path:
    return make_hf_test_model(tmp_path_factory.mktemp(family) / family, family=family, layers=LAYERS, dim=DIM,
                              heads=HEADS, seed=3)


def _config(directory: Path) -> dict[str, Any]:
    return json.loads((directory / "config.json").read_text())


def _assert_config_fields_known(directory: Path, config_class: Any, unread: tuple[str, ...] = ()) -> None:
    """Every field of the fixture's config.json is one the official config class defines (``unread``: the
    ones it does not, which transformers keeps as written), and reads back as written."""
    written = {k: v for k, v in _config(directory).items() if k != MARKER_KEY}
    known = set(config_class().to_dict()) | {f.name for f in dataclasses.fields(config_class)
                                             if dataclasses.is_dataclass(config_class)}
    assert set(written) - known - {"architectures", "model_type"} == set(unread)
    loaded = config_class.from_pretrained(str(directory))
    assert loaded.model_type == written["model_type"]
    for key in set(written) - {"architectures", "model_type", "rope_parameters"}:
        assert getattr(loaded, key) == written[key], key


def _assert_weights_are_the_official_models(directory: Path, model_class: Any) -> Any:
    """transformers' ``model_class`` loads the fixture with nothing missing, unexpected or mismatched, and the
    fixture holds every tensor of its state dict under its name and shape (the tied copies aside)."""
    model, info = model_class.from_pretrained(str(directory), output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}
    fixture = safetensors_torch.load_file(str(directory / "model.safetensors"))
    official = model.state_dict()
    tied = set(getattr(model, "_tied_weights_keys", None) or {})
    # huggingface/transformers src/transformers/models/esm/modeling_esm.py (EsmModel.load_hook): the
    # released ESM-2 directories hold inv_freq per layer, read into the one shared buffer
    renamed = {("esm.rotary_embeddings.inv_freq" if k.endswith(".attention.self.rotary_embeddings.inv_freq") else k): v
               for k, v in fixture.items()}
    assert set(renamed) == set(official) - tied
    assert {k: tuple(v.shape) for k, v in renamed.items()} == {k: tuple(official[k].shape) for k in renamed}
    for key, value in fixture.items():  # the official model holds the fixture's numbers, not its own init
        assert torch.equal(official[key if key in official else "esm.rotary_embeddings.inv_freq"].float(), value), key
    return model


# --------------------------------------------------------------------------- fair-esm .pt


def test_the_esm_token_order_is_fair_esms() -> None:
    for architecture in ("ESM-1b", "roberta_large"):  # ESM-2's loader names the first, ESM-1b's args the second
        assert tuple(esm.data.Alphabet.from_architecture(architecture).all_toks) == ESM_TOKENS
    assert tuple(esm2_alphabet().all_toks) == ESM_TOKENS


def test_the_esm2_pt_fixture_is_what_fair_esms_loader_reads(tmp_path: Path) -> None:
    path = make_test_model(tmp_path / f"esm2_t{LAYERS}_fixture.pt", layers=LAYERS, dim=DIM, heads=HEADS, seed=3)
    data = _load_pt(path)
    cfg = data["cfg"]["model"]
    assert {f: getattr(cfg, f) for f in ESM2_CFG_FIELDS} == {
        "encoder_layers": LAYERS, "encoder_embed_dim": DIM, "encoder_attention_heads": HEADS, "token_dropout": True}
    # the weight names: fair-esm's ESM2 built from that cfg takes the upgraded state dict strictly
    state = {}
    for name, value in {**data["model"], **_load_pt(path.with_name(path.stem + "-contact-regression.pt"))["model"]}.items():
        prefix = next((p for p in FAIR_PREFIXES if name.startswith(p)), "")
        state[name[len(prefix):]] = value
    model = esm.model.esm2.ESM2(num_layers=cfg.encoder_layers, embed_dim=cfg.encoder_embed_dim,
                                attention_heads=cfg.encoder_attention_heads,
                                alphabet=esm.data.Alphabet.from_architecture("ESM-1b"), token_dropout=cfg.token_dropout)
    assert set(state) == set(model.state_dict())
    model.load_state_dict(state, strict=True)
    assert all(k.startswith(FAIR_PREFIXES) for k in data["model"])  # prefixed, as upgrade_state_dict expects
    loaded, alphabet = _official_fair_esm(path)
    assert tuple(alphabet.all_toks) == ESM_TOKENS and loaded.embed_tokens.num_embeddings == len(ESM_TOKENS)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("name, companion", [("esm1b_t2_fixture.pt", True), ("esm1v_t2_fixture_1.pt", False)])
def test_the_esm1b_and_esm1v_pt_fixtures_are_what_fair_esms_loader_reads(tmp_path: Path, name: str,
                                                                           companion: bool) -> None:
    path = make_test_model(tmp_path / name, layers=LAYERS, dim=DIM, heads=HEADS, seed=3, family="esm1b",
                           companion=companion)
    data = _load_pt(path)
    assert "cfg" not in data and data["args"].arch == "roberta_large"
    assert {f: getattr(data["args"], f) for f in ESM1B_ARGS_FIELDS if f not in ("arch", "max_positions")} == {
        "encoder_layers": LAYERS, "encoder_embed_dim": DIM, "encoder_ffn_embed_dim": 4 * DIM,
        "encoder_attention_heads": HEADS}
    # ProteinBertModel sizes its position table by max_positions (fair-esm's strict load below checks the rows)
    assert isinstance(data["args"].max_positions, int)
    # fair-esm: ESM-1v has no contact-regression file (_has_regression_weights), ESM-1b has one; its
    # loader then checks the keys itself (strict with the regression, missing only it without)
    assert path.with_name(path.stem + "-contact-regression.pt").exists() == companion
    loaded, alphabet = _official_fair_esm(path)
    assert type(loaded).__name__ == "ProteinBertModel" and loaded.model_version == "ESM-1b"
    assert loaded.emb_layer_norm_before is not None and tuple(alphabet.all_toks) == ESM_TOKENS
    # the released layout: the LM head under "encoder.", the rest under "encoder.sentence_encoder."
    expected = {("encoder." if k.startswith("lm_head.") else FAIR_PREFIXES[0]) + k for k in loaded.state_dict()
                if not k.startswith("contact_head.")}
    assert set(data["model"]) == expected


# --------------------------------------------------------------------------- Hugging Face ESM


@pytest.mark.parametrize("family", ["hf-esm", "hf-esm1b"])
def test_the_hf_esm_fixtures_are_transformers_esm(tmp_path_factory: pytest.TempPathFactory, family: str) -> None:
    directory = _hf_fixture(tmp_path_factory, family)
    # huggingface/transformers src/transformers/models/esm/tokenization_esm.py: the ids are vocab.txt's lines
    tokenizer = transformers.EsmTokenizer(vocab_file=str(directory / "vocab.txt"))
    assert tokenizer.convert_tokens_to_ids(list(ESM_TOKENS)) == list(range(len(ESM_TOKENS)))
    alphabet = esm.data.Alphabet.from_architecture("ESM-1b")
    _, _, fair_ids = alphabet.get_batch_converter()([("x", SEQUENCE)])
    assert transformers.AutoTokenizer.from_pretrained(str(directory))(SEQUENCE).input_ids == fair_ids[0].tolist()
    # huggingface/transformers src/transformers/models/esm/modeling_esm.py: the activation is its fixed gelu(),
    # EsmConfig has no hidden_act; the fixture's "gelu" is what embedpipe's loader checks
    _assert_config_fields_known(directory, transformers.EsmConfig, unread=("hidden_act",))
    config = _config(directory)
    assert (config["pad_token_id"], config["mask_token_id"], config["vocab_size"]) == (
        alphabet.padding_idx, alphabet.mask_idx, len(alphabet.all_toks))
    # huggingface/transformers src/transformers/models/esm/modeling_esm.py: ESM-1b is the absolute
    # position table (max_position_embeddings rows) with the embeddings' layer norm before the first layer
    assert config["position_embedding_type"] == ("absolute" if family == "hf-esm1b" else "rotary")
    model = _assert_weights_are_the_official_models(directory, transformers.EsmForMaskedLM)
    assert (model.esm.embeddings.layer_norm is not None) == (family == "hf-esm1b")


# --------------------------------------------------------------------------- T5 encoders


@pytest.mark.parametrize("family", ["prot-t5", "prostt5", "ankh"])
def test_the_t5_fixtures_are_transformers_t5_encoders(tmp_path_factory: pytest.TempPathFactory, family: str) -> None:
    directory = _hf_fixture(tmp_path_factory, family)
    # agemagician/Ankh src/ankh/models/ankh_transformers.py, agemagician/ProtTrans Embedding/prott5_embedder.py,
    # mheinzinger/ProstT5 scripts/embed.py: each loads T5EncoderModel.from_pretrained
    _assert_weights_are_the_official_models(directory, transformers.T5EncoderModel)
    # huggingface/transformers src/transformers/models/t5/modeling_t5.py (_shift_right) reads
    # decoder_start_token_id, "usually set to the pad_token_id"; T5Config itself does not define it
    _assert_config_fields_known(directory, transformers.T5Config, unread=("decoder_start_token_id",))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory))
    vocab = tokenizer.get_vocab()
    assert {t: vocab[t] for t in T5_SPECIALS} == T5_SPECIALS
    assert {t: vocab[t] for t in T5_SPECIALS} == {t: transformers.T5Tokenizer().get_vocab()[t] for t in T5_SPECIALS}
    config = _config(directory)
    assert (config["pad_token_id"], config["eos_token_id"], config["decoder_start_token_id"]) == (
        T5_SPECIALS["<pad>"], T5_SPECIALS["</s>"], T5_SPECIALS["<pad>"])
    assert config["vocab_size"] == len(vocab)


@pytest.mark.parametrize("family", ["prot-t5", "prostt5"])
def test_the_prott5_recipes_tokenizer_call_gives_one_token_a_residue(tmp_path_factory: pytest.TempPathFactory,
                                                                      family: str) -> None:
    directory = _hf_fixture(tmp_path_factory, family)
    # agemagician/ProtTrans Embedding/prott5_embedder.py and mheinzinger/ProstT5 scripts/embed.py:
    # T5Tokenizer.from_pretrained(dir, do_lower_case=False) on ' '.join(residues) (ProstT5: prefix + ' ' first)
    tokenizer = transformers.T5Tokenizer.from_pretrained(str(directory), do_lower_case=False)
    vocab = tokenizer.get_vocab()
    residues = [vocab["▁" + r] for r in SEQUENCE]
    assert len(set(residues)) == len(set(SEQUENCE)) and T5_SPECIALS["<unk>"] not in residues
    if family == "prot-t5":
        assert tokenizer(" ".join(SEQUENCE)).input_ids == residues + [T5_SPECIALS["</s>"]]
        return
    for prefix, text in zip(PROSTT5_PREFIXES, (SEQUENCE, SEQUENCE.lower())):
        ids = tokenizer(prefix + " " + " ".join(text)).input_ids
        assert ids == [vocab[prefix]] + [vocab["▁" + r] for r in text] + [T5_SPECIALS["</s>"]]
    assert len({vocab[p] for p in PROSTT5_PREFIXES} | {vocab["▁" + s] for s in SEQUENCE.lower()}) == 2 + len(
        set(SEQUENCE.lower()))


def test_ankhs_tokenizer_call_gives_one_token_a_residue(tmp_path_factory: pytest.TempPathFactory) -> None:
    directory = _hf_fixture(tmp_path_factory, "ankh")
    # agemagician/Ankh src/ankh/extract.py: batch_encode_plus([residues], add_special_tokens=True,
    # is_split_into_words=True), the last token (</s>) dropped, none before the residues (transformers 5
    # spells batch_encode_plus as the tokenizer's call)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory))
    ids = tokenizer([list(SEQUENCE)], add_special_tokens=True, padding=True, is_split_into_words=True).input_ids[0]
    vocab = tokenizer.get_vocab()
    assert ids == [vocab[r] for r in SEQUENCE] + [T5_SPECIALS["</s>"]]
    assert T5_SPECIALS["<unk>"] not in ids and len(set(ids[:-1])) == len(set(SEQUENCE))


# --------------------------------------------------------------------------- ESM C (transformers' layout)


def test_the_esmc_fixture_is_transformers_esmc(tmp_path_factory: pytest.TempPathFactory) -> None:
    from transformers.models.esmc import tokenization_esmc

    directory = _hf_fixture(tmp_path_factory, "esmc")
    # huggingface/transformers src/transformers/models/esmc/tokenization_esmc.py (SEQUENCE_VOCAB), the
    # same ids as evolutionaryscale/esm's
    assert tuple(tokenization_esmc.SEQUENCE_VOCAB) == ESMC_TOKENS
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory))
    assert type(tokenizer).__name__ == "EsmcTokenizer"
    assert tokenizer.convert_tokens_to_ids(list(ESMC_TOKENS)) == list(range(len(ESMC_TOKENS)))
    assert tokenizer(SEQUENCE).input_ids == [0] + [ESMC_TOKENS.index(r) for r in SEQUENCE] + [2]
    _assert_config_fields_known(directory, transformers.EsmcConfig)
    config = _config(directory)
    assert (config["bos_token_id"], config["pad_token_id"], config["eos_token_id"], config["mask_token_id"]) == tuple(
        ESMC_TOKENS.index(t) for t in ("<cls>", "<pad>", "<eos>", "<mask>"))
    _assert_weights_are_the_official_models(directory, transformers.EsmcModel)
