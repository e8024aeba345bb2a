"""SaProt: an ESM-2 over amino-acid x Foldseek-3Di pair tokens, recognised from its vocabulary,
fed structure-aware sequences (two characters a residue).

The independent computation is transformers' ``EsmTokenizer`` built from the ``vocab.txt``
the test model writes (as SaProt's own repository builds it) and ``EsmModel`` on the same
directory: the store's per-residue rows are its hidden states at tokens ``1..n`` (n residues,
half the characters), the mean their mean.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_saprot_checkpoint import load_esm_saprot_alphabet
from test_t5_pipeline import close, embed
from transformers import EsmModel, EsmTokenizer
from typer.testing import CliRunner

from embedpipe.cli import app
from embedpipe.core.errors import InputError, ModelError
from embedpipe.core.options import FastaLimits
from embedpipe.inputs.fasta import read_sequences
from embedpipe.inputs.residue_rules import ALIGNMENT_GAP, INTERNAL_STOP, NOT_PAIRS, check_sequence
from embedpipe.model import describe, load_model, registry
from embedpipe.model.families import SAPROT
from embedpipe.model.random_hf import make_hf_test_model
from embedpipe.store.validate import validate_store
from helpers.embed_helpers import (
    random_sequences,
    read_store,
    reuse_twins,
    structure_aware,
    unmarked_family,
    write_fasta,
)

#: structure-aware records: amino acids (rare ones too) with 3Di states, '#' masked
LAYOUT = SAPROT.layout  # two characters a residue, case kept
RECORDS = structure_aware(random_sequences(6, [5, 40, 1, 17, 60, 9], seed=5), seed=6) + [
    ("masked", "M#K#T#"), ("hand", "MdEvVpQp")]

FP16_MAX = float(torch.finfo(torch.float16).max)
@pytest.fixture(scope="module")
def saprot(tmp_path_factory) -> Path:
    return make_hf_test_model(tmp_path_factory.mktemp("saprot") / "s", family="saprot", layers=2, dim=32,
                              heads=4, seed=11)


def reference(directory: Path, seqs: list[str]) -> list[torch.Tensor]:
    """transformers' hidden states at every stored layer (the last after the final layer norm)."""
    tokenizer = EsmTokenizer(str(directory / "vocab.txt"))
    model = EsmModel.from_pretrained(str(directory), add_pooling_layer=False).eval()
    with torch.no_grad():
        out = model(**tokenizer(seqs, padding="longest", return_tensors="pt"), output_hidden_states=True)
    return [*out.hidden_states[:-1], out.last_hidden_state]


def test_the_vocabulary_is_saprots_446_tokens_in_its_order(saprot: Path) -> None:
    """vocab.txt as SaProt's own loader orders its alphabet (test_saprot_checkpoint.py transcribes it)."""
    tokens = (saprot / "vocab.txt").read_text().splitlines()
    assert tokens == load_esm_saprot_alphabet().all_toks and len(tokens) == 446
    assert (tokens.index("<mask>"), tokens.index("Ap"), tokens.index("A#"), tokens.index("#p")) == (4, 5, 25, 425)
    config = json.loads((saprot / "config.json").read_text())
    assert (config["vocab_size"], config["mask_token_id"], config["pad_token_id"]) == (446, 4, 1)


def test_the_family_is_recognised_from_its_vocabulary(saprot: Path) -> None:
    facts = describe(str(saprot))
    assert (facts.family, facts.token_layout) == ("saprot", LAYOUT)
    assert (LAYOUT.chars_per_residue, LAYOUT.keeps_case, LAYOUT.extra_tokens) == (2, True, 2)
    model = load_model(str(saprot))
    assert (model.family, model.token_layout, model.batch_layouts) == ("saprot", LAYOUT, ("packed", "padded"))
    assert registry.model_identity(str(saprot)).family == "saprot v1"
    for name in ("westlake-repl/SaProt_650M_AF2", "westlake-repl/SaProt_35M_AF2"):  # before they are cached
        assert (describe(name).family, describe(name).token_layout) == ("saprot", LAYOUT)
    assert unmarked_family(saprot, whole_marker=True) == "saprot"  # no marker at all: the vocabulary says it


def test_saprots_own_vocab_txt_gives_esm_tokenizers_ids(saprot: Path, tmp_path: Path) -> None:
    """A vocab.txt written in SaProt's order (from its loader, not from the test model) is accepted,
    and every token id is EsmTokenizer's over that file."""
    directory = _edited(saprot, tmp_path, {"mask_token_id": 4}, "\n".join(load_esm_saprot_alphabet().all_toks) + "\n")
    seqs = [s for _, s in RECORDS]
    want = EsmTokenizer(str(directory / "vocab.txt"))(seqs, padding="longest", return_tensors="pt")["input_ids"]
    assert torch.equal(load_model(str(directory)).tokenize(seqs), want)
    assert want[RECORDS.index(("hand", "MdEvVpQp")), :6].tolist() == [0, 5 + 10 * 21 + 8, 5 + 3 * 21 + 10,
                                                                       5 + 17 * 21 + 0, 5 + 13 * 21 + 0, 2]


def _shuffled(saprot: Path, tmp_path: Path, seed: int) -> Path:
    """A copy of ``saprot`` whose vocab.txt holds SaProt's tokens in another order (the weights
    as they are: another model, whose ids are its file's), config.json's ids following it."""
    tokens = list(np.random.default_rng(seed).permutation(load_esm_saprot_alphabet().all_toks))
    return _edited(saprot, tmp_path, {"pad_token_id": tokens.index("<pad>"), "mask_token_id": tokens.index("<mask>")},
                   "\n".join(tokens) + "\n")


def test_another_order_of_the_same_tokens_reads_every_id_from_the_file(saprot: Path, tmp_path: Path) -> None:
    directory = _shuffled(saprot, tmp_path, seed=4)
    tokens = (directory / "vocab.txt").read_text().splitlines()
    assert [tokens.index(t) for t in ("<cls>", "<pad>", "<eos>", "<unk>", "<mask>")] != [0, 1, 2, 3, 4]
    seqs = [s for _, s in RECORDS]
    tokenizer = EsmTokenizer(str(directory / "vocab.txt"))
    want = tokenizer(seqs, padding="longest", return_tensors="pt")["input_ids"]
    model = load_model(str(directory))
    assert torch.equal(model.tokenize(seqs), want)
    alphabet = model.alphabet
    assert (alphabet.cls_idx, alphabet.padding_idx, alphabet.eos_idx, alphabet.unk_idx, alphabet.mask_idx) == (
        tokenizer.cls_token_id, tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id,
        tokenizer.mask_token_id)
    store = embed(directory, tmp_path, RECORDS, "shuffled", per_residue=True, layers=(0, 1, 2))
    theirs = reference(directory, seqs)
    for row, (rid, seq) in enumerate(RECORDS):
        n = len(seq) // 2
        for layer in range(3):
            close(store["per_residue"][layer][rid], theirs[layer][row, 1 : n + 1].numpy())


@pytest.mark.parametrize(("vocab", "message"), [
    (lambda t: [x for x in t if x != "Ap"], r"missing 'Ap'$"),
    (lambda t: [x if x != "<mask>" else "<sep>" for x in t], r"missing '<mask>'; extra '<sep>'$"),
    (lambda t: [*t, "Ab"], r"extra 'Ab'$"),
    (lambda t: [*t[:100], "", *t[100:]], r"extra ''$"),
    (lambda t: [*t, "Ap"], r"'Ap' is on lines 6 and 447$"),
    (lambda t: t[:7], r"missing 'An', 'Aw', 'Ar', 'Aq', 'Ah', 'Ag' and 433 more$"),
])
def test_a_vocabulary_that_is_not_saprots_set_is_refused_in_one_line(saprot: Path, tmp_path: Path, vocab,
                                                                     message: str) -> None:
    directory = _edited(saprot, tmp_path, None, "\n".join(vocab(load_esm_saprot_alphabet().all_toks)) + "\n")
    with pytest.raises(ModelError, match=r"vocab.txt: not SaProt's vocabulary \(SaProt's 446 tokens, in any "
                                         r"order\): " + message) as caught:
        load_model(str(directory))
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_the_cli_store_equals_transformers_residue_by_residue(saprot: Path, tmp_path: Path, layout: str) -> None:
    """End to end through ``embedpipe embed``: residues counted as pairs (length, per-residue
    rows, manifest of the store), the structure-aware sequence stored as given."""
    out = tmp_path / "s.h5"
    result = CliRunner().invoke(app, ["embed", str(write_fasta(tmp_path / "sa.faa", RECORDS)), "--model",
                                      str(saprot), "--out", str(out), "--layers", "0,1,2", "--per-residue",
                                      "--device", "cpu", "--quiet"],
                                env={"EMBEDPIPE_ENGINE": f"batch_layout={layout}"})
    assert result.exit_code == 0, result.output
    assert validate_store(out) == []
    store = read_store(out)
    assert (store["attrs"]["model_family"], int(store["attrs"]["chars_per_residue"])) == ("saprot", 2)
    theirs = reference(saprot, [s for _, s in RECORDS])
    for row, (rid, seq) in enumerate(RECORDS):
        n = len(seq) // 2
        assert store["fields"]["length"][rid] == n
        for layer in range(3):
            want = theirs[layer][row, 1 : n + 1].numpy()
            close(store["per_residue"][layer][rid], want)
            close(store["mean"][layer][rid], want.mean(0))


def test_pairs_are_checked_and_case_kept_for_saprot_only() -> None:
    assert check_sequence(b"MdEv", pairs=True) == (b"MdEv", (), None, -1)
    assert check_sequence(b"M#\n#p", pairs=True) == (b"M##p", (), None, -1)
    assert check_sequence(b"MdE", pairs=True)[2:] == (NOT_PAIRS, 2)  # odd length: the last character
    assert check_sequence(b"MDEv", pairs=True)[2:] == (NOT_PAIRS, 1)  # upper case in a 3Di place
    assert check_sequence(b"dMEv", pairs=True)[2:] == (NOT_PAIRS, 0)  # lower case in an amino acid's place
    assert check_sequence(b"MdEb", pairs=True)[2:] == (NOT_PAIRS, 3)  # 'b' is no 3Di state
    assert check_sequence(b"Md-v", pairs=True)[2:] == (ALIGNMENT_GAP, 2)
    assert check_sequence(b"MdEv*", pairs=True) == (b"MdEv", ("stop-stripped",), None, -1)
    assert check_sequence(b"Md*Ev", pairs=True)[2:] == (INTERNAL_STOP, 2)
    assert check_sequence(b"M#E#")[2] is not None  # '#' stays invalid for every other family


@pytest.mark.parametrize(("text", "message"), [
    ("MdEvV", r"sa.faa:4: record 'bad': an odd number of characters \(5\)"),
    ("MdEVVp", r"sa.faa:4: record 'bad': 'V' at column 4 \(character 4\) out of its place"),
])
def test_a_record_that_is_not_pairs_is_refused_in_one_line(saprot: Path, tmp_path: Path, text: str,
                                                           message: str) -> None:
    fasta = write_fasta(tmp_path / "sa.faa", [("ok", "MdEv"), ("bad", text)])
    with pytest.raises(InputError, match=message):
        list(read_sequences(fasta, FastaLimits(keep_case=True, chars_per_residue=2)))
    result = CliRunner().invoke(app, ["embed", str(fasta), "--model", str(saprot), "--out", str(tmp_path / "o.h5"),
                                      "--device", "cpu", "--quiet"])
    assert result.exit_code == 1 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "record 'bad'" in result.stderr and not (tmp_path / "o.h5").exists()


def test_shard_with_the_model_counts_residues_and_skips_what_is_not_pairs(saprot: Path, tmp_path: Path) -> None:
    """The manifest's length, the shard's residues and tokens count pairs; the case is kept."""
    records = [("a", "MdEvVpQp"), ("b", "A#CaYc#pKd"), ("odd", "MdE"), ("dup", "MdEvVpQp")]
    result = CliRunner().invoke(app, ["shard", str(write_fasta(tmp_path / "sa.faa", records)), "--out",
                                      str(tmp_path / "shards"), "--model", str(saprot), "--on-invalid", "skip", "-q"])
    assert result.exit_code == 0, result.output
    rows = [line.split("\t") for line in (tmp_path / "shards" / "manifest.tsv").read_text().splitlines()[1:]]
    assert [(row[0], row[2], row[5]) for row in rows] == [
        ("a", "4", "ok"), ("b", "5", "ok"), ("odd", "1", "skipped:not-pairs"), ("dup", "4", "duplicate")]
    shards = json.loads((tmp_path / "shards" / "shards.json").read_text())["shards"]
    assert [(s["residues"], s["tokens"], s["min_length"], s["max_length"]) for s in shards] == [(9, 13, 4, 5)]
    text = "".join(p.read_text() for p in sorted((tmp_path / "shards").glob("shard-*.fasta")))
    assert sorted(line for line in text.split() if not line.startswith(">")) == ["A#CaYc#pKd", "MdEvVpQp"]


def test_a_structure_change_is_another_sequence_to_reuse(saprot: Path, tmp_path: Path) -> None:
    """The same amino acids with another 3Di string are not copied from the earlier store."""
    reused, earlier, store = reuse_twins(tmp_path, saprot, ("first", "MdEvVp"), "MdEvVq")
    assert reused == 1  # "again" only
    assert np.array_equal(store["mean"][2]["again"], earlier["mean"][2]["first"])
    assert not np.array_equal(store["mean"][2]["other"], store["mean"][2]["again"])


def _edited(saprot: Path, tmp_path: Path, config: dict | None = None, vocab: str | None = None) -> Path:
    copy = tmp_path / "edited"
    shutil.copytree(saprot, copy)
    if config is not None:
        (copy / "config.json").write_text(json.dumps(json.loads((saprot / "config.json").read_text()) | config))
    if vocab is not None:
        (copy / "vocab.txt").write_text(vocab)
    return copy


@pytest.mark.parametrize(("config", "vocab", "message"), [
    ({"vocab_size": 33}, None, r"not a SaProt that fair-esm's ESM2 can run \(vocab_size is not SaProt's 446\)"),
    ({"vocab_size": 10**12}, None, r"vocab_size"),
    # a pair vocabulary with ESM-1b's absolute positions: SaProt's (its vocabulary decides), refused
    ({"position_embedding_type": "absolute", "emb_layer_norm_before": True}, None,
     r"not a SaProt that fair-esm's ESM2 can run \(position_embedding_type is not 'rotary'\)"),
    (None, "<cls>\n<pad>\n<eos>\n<unk>\nAp\nAy\n<mask>\n", r"vocab.txt: not SaProt's vocabulary .*: missing 'An'"),
    ({"pad_token_id": 0}, None, r"not a SaProt that fair-esm's ESM2 can run \(pad_token_id is not vocab.txt's <pad> \(1\)\)"),
])
def test_a_hostile_or_inconsistent_directory_is_refused_in_one_line(saprot: Path, tmp_path: Path, config, vocab,
                                                                    message: str) -> None:
    with pytest.raises(ModelError, match=message) as caught:
        load_model(str(_edited(saprot, tmp_path, config, vocab)))
    assert "\n" not in str(caught.value)


def test_an_overflowing_saprot_falls_back_to_fp32_values(saprot: Path, tmp_path: Path) -> None:
    big = tmp_path / "big"
    shutil.copytree(saprot, big)
    state = load_file(str(big / "model.safetensors"))
    state["esm.encoder.layer.1.output.dense.weight"] *= 1e6  # the last feed-forward's output
    save_file(state, str(big / "model.safetensors"))
    reference_store = embed(big, tmp_path, RECORDS, "fp32", per_residue=True)
    store = embed(big, tmp_path, RECORDS, "fp16", per_residue=True, precision="fp16")
    # fp16 cannot hold a stream past its largest value: exactly those records re-ran in fp32
    overflowing = {rid for rid, _ in RECORDS if reference_store["fields"]["max_abs_activation"][rid] > FP16_MAX}
    assert len(overflowing) >= len(RECORDS) - 2
    assert {rid for rid, _ in RECORDS if store["fields"]["precision_used"][rid] == "fp32"} == overflowing
    assert int(store["attrs"]["fallback_count"]) == len(overflowing)
    for rid in overflowing:
        for layer in store["mean"]:
            close(store["mean"][layer][rid], reference_store["mean"][layer][rid])
            close(store["per_residue"][layer][rid], reference_store["per_residue"][layer][rid])


def test_a_long_record_is_windowed_in_residues_not_characters(saprot: Path, tmp_path: Path) -> None:
    """1100 residues (2200 characters) over SaProt's 1022-residue window: ``truncate`` keeps
    transformers' rows of the first 1022 pairs; ``chunk`` cuts between pairs and keeps every residue."""
    long = structure_aware(random_sequences(1, [1100], seed=8), seed=9)
    rid, seq = long[0]
    truncated = embed(saprot, tmp_path, long, "truncate", per_residue=True, long_sequences="truncate")
    assert (truncated["fields"]["length"][rid], truncated["fields"]["embedded_length"][rid]) == (1100, 1022)
    want = reference(saprot, [seq[: 2 * 1022]])[2][0, 1:1023].numpy()
    close(truncated["per_residue"][2][rid], want)
    chunked = embed(saprot, tmp_path, long, "chunk", per_residue=True, long_sequences="chunk")
    rows = chunked["per_residue"][2][rid]
    assert (rows.shape[0], chunked["fields"]["windows"][rid], chunked["fields"]["embedded_length"][rid]) == (1100, 2, 1100)
    close(rows[:500], want[:500])  # the first window is the truncated one's, its first residues kept


def test_a_stored_sequence_that_is_not_whole_residues_is_refused_and_found(tmp_path: Path) -> None:
    """The writer refuses a structure-aware sequence of odd length; validate finds one in a
    store edited after the fact (7 characters, ``length`` 3: not 3 whole pairs)."""
    from embedpipe.core.errors import StoreError
    from embedpipe.store.writer import StoreWriter

    common = dict(residue_rows=None, layers=[0], dim=4, storage_dtype="float32")
    with pytest.raises(StoreError, match=r"record 'odd': its sequence is not whole residues of 2 characters"):
        StoreWriter(tmp_path / "refused.h5", ids=["odd"], sequences=["MdEvVpQ"], attrs={"chars_per_residue": 2},
                    **common)
    assert not (tmp_path / "refused.h5").exists()
    path = tmp_path / "edited.h5"
    from embedpipe.store.columns import EmbeddedRecord

    with StoreWriter(path, ids=["odd"], sequences=["MdEvVpQ"], attrs={}, **common) as writer:
        writer.write(0, EmbeddedRecord(id="odd", sequence="MdEvVpQ", precision_used="fp32",
                                       mean={0: np.zeros(4, dtype=np.float32)}, embedded_length=3))
    assert validate_store(path) == []  # one character a residue: 7 residues, 3 of them embedded
    with h5py.File(path, "r+") as f:
        f.attrs["chars_per_residue"] = 2
        f["length"][0] = 3
    problems = validate_store(path)
    assert any("sequence/offsets rows 0:2 give record row 0 7 entries, but length says 6" in p for p in problems), problems
