"""ProstT5: a T5 encoder whose direction prefix (``<AA2fold>``, ``<fold2AA>``) is chosen by the
record's case, through the T5 path (model layer, embed, shard, the fp32 fallback).

The independent computation is transformers' own tokenizer and ``T5EncoderModel`` on the
same directory, read as ProstT5's model card reads it: rare residues to X in upper case,
space-separated residues after the prefix, the per-residue rows ``[1 : n + 1]`` (the prefix
and ``</s>`` dropped), and their mean.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_t5 import overflowing, run
from test_t5_pipeline import close, embed
from transformers import AutoTokenizer, T5EncoderModel
from typer.testing import CliRunner

from embedpipe.cli import app
from embedpipe.core.errors import InputError, ModelError
from embedpipe.core.options import FastaLimits
from embedpipe.inputs.fasta import read_sequences
from embedpipe.inputs.residue_rules import MIXED_CASE, check_sequence
from embedpipe.model import describe, load_model
from embedpipe.model.families import PROSTT5
from embedpipe.model.random_hf import make_hf_test_model
from helpers.embed_helpers import plain_sequences, reuse_twins, unmarked_family, write_fasta

#: amino acids (upper case, rare residues included) and 3Di (lower case)
PROSTT5_LAYOUT = PROSTT5.layout  # its direction prefix in BOS's place, case kept
SEQS = ["MKTAYIAKQRQISFVKSHFSRQ", "dvvcvvpddpvrvvvd", "UZOBXMK", "acdefghiklmnpqrstvwy", "W", "w"]


@pytest.fixture(scope="module")
def prost(tmp_path_factory) -> Path:
    return make_hf_test_model(tmp_path_factory.mktemp("prostt5") / "p", family="prostt5", layers=3, dim=32,
                              heads=4, seed=7)


def card_inputs(tokenizer, seqs: list[str]) -> dict:
    """ProstT5's model card: X for rare residues, spaces, the prefix by case, </s> appended."""
    spaced = [" ".join(re.sub(r"[UZOB]", "X", s)) for s in seqs]
    prefixed = [("<AA2fold>" if s.isupper() else "<fold2AA>") + " " + s for s in spaced]
    return tokenizer(prefixed, add_special_tokens=True, padding="longest", return_tensors="pt")


def reference(directory: Path, seqs: list[str]) -> tuple[torch.Tensor, ...]:
    model = T5EncoderModel.from_pretrained(str(directory), dtype=torch.float32).eval()
    inputs = card_inputs(AutoTokenizer.from_pretrained(str(directory)), seqs)
    with torch.no_grad():
        return model(**inputs, output_hidden_states=True).hidden_states


def test_the_family_is_recognised_and_declares_its_layout(prost: Path) -> None:
    facts = describe(str(prost))
    assert (facts.family, facts.token_layout) == ("prostt5", PROSTT5_LAYOUT)
    assert (PROSTT5_LAYOUT.first_residue, PROSTT5_LAYOUT.extra_tokens, PROSTT5_LAYOUT.keeps_case) == (1, 2, True)
    model = load_model(str(prost))
    assert (model.family, model.token_layout, model.batch_layouts) == ("prostt5", PROSTT5_LAYOUT, ("padded",))
    for name in ("Rostlab/ProstT5", "Rostlab/ProstT5_fp16"):  # known before they are cached
        assert (describe(name).family, describe(name).token_layout) == ("prostt5", PROSTT5_LAYOUT)
    assert unmarked_family(prost) == "prostt5"  # without make-test-model's family: the vocabulary's prefixes say it


def test_token_ids_equal_the_model_cards_tokenizer_call(prost: Path) -> None:
    model = load_model(str(prost))
    want = card_inputs(AutoTokenizer.from_pretrained(str(prost)), SEQS)["input_ids"]
    got = model.tokenize(SEQS)
    assert torch.equal(got, want)
    aa2fold, fold2aa = model.prefix_ids
    assert got[:, 0].tolist() == [aa2fold, fold2aa, aa2fold, fold2aa, aa2fold, fold2aa]


def test_fp32_hidden_states_equal_transformers_at_every_stored_layer(prost: Path) -> None:
    model = load_model(str(prost))
    layers = list(range(model.num_layers + 1))
    ours = run(model, "fp32", SEQS, layers)
    theirs = reference(prost, SEQS)
    assert len(theirs) == len(layers)
    for layer in layers:
        for row, seq in enumerate(SEQS):
            n = len(seq) + 2  # prefix, residues, </s>
            want, got = theirs[layer][row, :n], ours.hidden[layer][row, :n]
            rel = float((got - want).abs().max() / want.abs().max())
            assert rel <= 1e-5, (layer, row, rel)


def test_case_is_kept_for_prostt5_only_and_mixed_case_is_invalid() -> None:
    assert check_sequence(b"MKtA") == (b"MKTA", ("uppercased",), None, -1)  # every other family: as before
    assert check_sequence(b"acdj", keep_case=True) == (b"acdx", ("J-to-X",), None, -1)
    assert check_sequence(b"MKTA*", keep_case=True) == (b"MKTA", ("stop-stripped",), None, -1)
    assert check_sequence(b"MKtA", keep_case=True) == (b"MKtA", (), MIXED_CASE, 2)
    assert check_sequence(b"acDc", keep_case=True)[2:] == (MIXED_CASE, 2)


def test_a_mixed_case_record_is_refused_in_one_line_naming_it(prost: Path, tmp_path: Path) -> None:
    fasta = write_fasta(tmp_path / "in.fasta", [("aa", "MKTAYIAK"), ("both", "MKTAyiak")])
    with pytest.raises(InputError, match=r"in.fasta:4: record 'both': 'y' at column 5 \(residue 5\).*all one case"):
        list(read_sequences(fasta, FastaLimits(keep_case=True)))
    result = CliRunner().invoke(app, ["embed", str(fasta), "--model", str(prost), "--out", str(tmp_path / "o.h5"),
                                      "--device", "cpu", "--quiet"])
    assert result.exit_code == 1 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "record 'both'" in result.stderr and not (tmp_path / "o.h5").exists()


def test_stores_hold_the_residue_rows_only_and_the_case_kept(prost: Path, tmp_path: Path) -> None:
    """Per-residue rows and the mean equal transformers' rows 1..n (prefix and </s> dropped) at
    every layer; BOS pooling stores the prefix's row; the case is the stored sequence's."""
    records = [(f"r{i}", s) for i, s in enumerate(SEQS)] + [("upper", "ACDW"), ("lower", "acdw")]
    store = embed(prost, tmp_path, records, "s", per_residue=True, layers=(0, 1, 2, 3), pooling=("mean", "bos"))
    assert (store["attrs"]["model_family"], store["attrs"]["batch_layout"]) == ("prostt5", "padded")
    assert "<AA2fold>" in store["attrs"]["direction_prefixes"]
    theirs = reference(prost, [s for _, s in records])
    with h5py.File(tmp_path / "s.h5", "r") as f:
        bos = {layer: f["bos"][f"layer_{layer}"][()] for layer in range(4)}
        sequences = plain_sequences(f)
    assert sequences[-2:] == ["ACDW", "acdw"]
    for row, (rid, seq) in enumerate(records):
        for layer in range(4):
            want = theirs[layer][row, 1 : len(seq) + 1].numpy()
            close(store["per_residue"][layer][rid], want)
            close(store["mean"][layer][rid], want.mean(0))
            close(bos[layer][store["ids"].index(rid)], theirs[layer][row, 0].numpy())
    assert not np.allclose(store["mean"][3]["upper"], store["mean"][3]["lower"])  # the other direction


def test_a_sequence_in_the_other_case_is_another_sequence_to_reuse(prost: Path, tmp_path: Path) -> None:
    """The sequence's sha256 is the case-kept one: a 3Di record is not copied from its upper-case twin."""
    reused, earlier, store = reuse_twins(tmp_path, prost, ("upper", "ACDW"), "acdw")
    assert reused == 1  # "again" only
    assert np.array_equal(store["mean"][3]["again"], earlier["mean"][3]["upper"])


def test_shard_with_the_model_keeps_case_and_records_mixed_case_as_skipped(prost: Path, tmp_path: Path) -> None:
    fasta = write_fasta(tmp_path / "in.fasta", [("aa", "ACDW"), ("tdi", "acdw"), ("both", "ACdw"), ("dup", "ACDW")])
    result = CliRunner().invoke(app, ["shard", str(fasta), "--out", str(tmp_path / "shards"), "--model", str(prost),
                                      "--on-invalid", "skip", "-q"])
    assert result.exit_code == 0, result.output
    shards = "".join(p.read_text() for p in sorted((tmp_path / "shards").glob("shard-*.fasta")))
    assert sorted(line for line in shards.split() if not line.startswith(">")) == ["ACDW", "acdw"]  # 3Di != AA
    manifest = (tmp_path / "shards" / "manifest.tsv").read_text()
    assert "skipped:mixed-case" in manifest
    plain = CliRunner().invoke(app, ["shard", str(fasta), "--out", str(tmp_path / "esm"), "--on-invalid", "skip", "-q"])
    assert plain.exit_code == 0  # without --model: ESM-2's rules, everything upper-cased
    assert "mixed-case" not in (tmp_path / "esm" / "manifest.tsv").read_text()


def test_an_overflowing_record_falls_back_to_fp32(prost: Path, tmp_path: Path) -> None:
    big = overflowing(prost, 1e5, tmp_path / "big")
    records = [("aa", "MKTAYIAKQRQ"), ("tdi", "dvvcvvpddpv")]
    want = embed(big, tmp_path, records, "fp32", per_residue=True)
    store = embed(big, tmp_path, records, "fp16", per_residue=True, precision="fp16")
    assert int(store["attrs"]["fallback_count"]) == len(records)
    theirs = reference(big, [s for _, s in records])
    for row, (rid, seq) in enumerate(records):
        assert (store["fields"]["precision_used"][rid], store["fields"]["fallback_reason"][rid]) == ("fp32", "nonfinite")
        close(store["mean"][3][rid], want["mean"][3][rid])
        close(store["mean"][3][rid], theirs[3][row, 1 : len(seq) + 1].numpy().mean(0))


def test_hostile_tokenizers_and_configs_are_refused_in_one_line(prost: Path, tmp_path: Path) -> None:
    small = tmp_path / "small-embedding"  # the prefixes' ids beyond the embedding's rows
    shutil.copytree(prost, small)
    state = load_file(str(small / "model.safetensors"))
    rows = load_model(str(prost)).prefix_ids[0]
    state["shared.weight"] = state["shared.weight"][:rows].clone()
    config = json.loads((small / "config.json").read_text()) | {"vocab_size": rows}
    save_file(state, str(small / "model.safetensors"))
    (small / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError, match=r"the tokenizer's ids reach \d+, the embedding has \d+ rows") as info:
        load_model(str(small))
    assert "\n" not in str(info.value)
    one = tmp_path / "one-prefix"  # marked ProstT5, but its tokenizer lacks <fold2AA>
    shutil.copytree(prost, one)
    tokenizer = json.loads((one / "tokenizer.json").read_text())
    tokenizer["added_tokens"] = [t for t in tokenizer["added_tokens"] if t["content"] != "<fold2AA>"]
    (one / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ModelError, match=r"a ProstT5 tokenizer needs <AA2fold> and <fold2AA>; it lacks <fold2AA>"):
        load_model(str(one))
    merged = tmp_path / "no-3di-piece"  # a 3Di state without its own piece: refused, not read as <unk>
    shutil.copytree(prost, merged)
    tokenizer = json.loads((merged / "tokenizer.json").read_text())
    tokenizer["model"]["vocab"] = [p for p in tokenizer["model"]["vocab"] if p[0] != "▁w"]
    (merged / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ModelError, match=r"one piece per 3Di state; it lacks ▁w$"):
        load_model(str(merged))


def test_make_test_model_cli_writes_a_prostt5_directory(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["make-test-model", str(tmp_path / "p"), "--family", "prostt5",
                                      "--layers", "1", "--dim", "16", "--heads", "2"])
    assert result.exit_code == 0, result.output
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "p"))
    assert {"<AA2fold>", "<fold2AA>", "▁a", "▁A"} <= set(tokenizer.get_vocab())
    assert (describe(str(tmp_path / "p")).family, describe(str(tmp_path / "p")).trained) == ("prostt5", False)


def test_the_workflow_shards_with_the_model_so_that_case_is_kept(prost: Path, tmp_path: Path) -> None:
    """ProstT5 counts 2 special tokens per record, as ESM-2, but its case is input: the shard
    rule passes --model (a dry run prints the command)."""
    import yaml

    from helpers.workflow_helpers import snakemake

    write_fasta(tmp_path / "in.fasta", [("aa", "ACDW"), ("tdi", "acdw")])
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"input": "in.fasta", "outdir": "out", "model": str(prost), "device": "cpu"}))
    printed = snakemake(tmp_path, "--dry-run", "--printshellcmds", configfile=config).stdout
    shard = [line for line in printed.splitlines() if "embedpipe shard" in line]
    assert len(shard) == 1 and f"--model {prost}" in shard[0], shard


def test_only_the_record_whose_own_tokens_overflow_falls_back(prost: Path, tmp_path: Path) -> None:
    """The 3Di state 'c' embeds at 7e4 (inf in fp16): the lower-case records holding a 'c' fall
    back alone, the amino-acid record with a 'C' (another token) and the other 3Di record do not."""
    planted = tmp_path / "planted"
    shutil.copytree(prost, planted)
    state = load_file(str(planted / "model.safetensors"))
    vocab = json.loads((planted / "tokenizer.json").read_text())["model"]["vocab"]
    state["shared.weight"][[p for p, _ in vocab].index("▁c")] = 7e4
    save_file(state, str(planted / "model.safetensors"))
    records = [("aa", "MKCAYIAKQ"), ("tdi_c", "dvvcvvpdd"), ("tdi", "dvvvvpddw"), ("tdi_cc", "cc")]
    reference = embed(planted, tmp_path, records, "fp32")
    store = embed(planted, tmp_path, records, "fp16", precision="fp16")
    assert {rid: store["fields"]["fallback_reason"][rid] for rid, _ in records} == {
        "aa": "", "tdi_c": "nonfinite", "tdi": "", "tdi_cc": "nonfinite"}
    for rid in ("tdi_c", "tdi_cc"):
        close(store["mean"][3][rid], reference["mean"][3][rid])
