"""An amino-acid FASTA and a 3Di FASTA paired by ID into SaProt's structure-aware FASTA
(``embedpipe join-structure``), checked against sequences written out by hand."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from embedpipe.cli import app
from embedpipe.core.errors import InputError
from embedpipe.model.random_hf import make_hf_test_model
from embedpipe.shard.structure import join_structure
from helpers.embed_helpers import read_store, write_fasta


def test_records_are_paired_by_id_in_the_amino_acid_files_order(tmp_path: Path) -> None:
    amino = write_fasta(tmp_path / "aa.fasta", [("p1", "MEVQ"), ("p2", "acy")])  # lower case read as upper
    three_di = write_fasta(tmp_path / "3di.fasta", [("p2", "PVX"), ("p1", "DVPQ")])  # X: unknown state
    assert join_structure(amino, three_di) == [("p1", "MdEvVpQq"), ("p2", "ApCvY#")]


@pytest.mark.parametrize(("amino", "three_di", "message"), [
    ([("p1", "MEV")], [("p1", "DVPQ")], r"record 'p1': 3 amino acids but 4 3Di states \(.*aa.fasta and .*3di.fasta\)"),
    ([("p1", "MEV"), ("p2", "A")], [("p1", "DVP")], r"record 'p2' of .*aa.fasta has no 3Di record in .*3di.fasta"),
    ([("p1", "MEV")], [("p1", "DVP"), ("p3", "A")], r"record 'p3' of .*3di.fasta has no amino-acid record"),
    ([("p1", "MEV")], [("p1", "DBP")], r"record 'p1': 'B' at residue 2 is not a 3Di state"),
])
def test_records_that_do_not_pair_are_refused_in_one_line(tmp_path: Path, amino, three_di, message: str) -> None:
    with pytest.raises(InputError, match=message) as caught:
        join_structure(write_fasta(tmp_path / "aa.fasta", amino), write_fasta(tmp_path / "3di.fasta", three_di))
    assert "\n" not in str(caught.value)


def test_the_joined_fasta_embeds_as_the_hand_written_one(tmp_path: Path) -> None:
    model = make_hf_test_model(tmp_path / "saprot", family="saprot", layers=2, dim=16, heads=2, seed=3)
    amino = write_fasta(tmp_path / "aa.fasta", [("p1", "MEVQK"), ("p2", "ACY")])
    three_di = write_fasta(tmp_path / "3di.fasta", [("p1", "DVPQA"), ("p2", "PVX")])
    runner = CliRunner()
    joined = runner.invoke(app, ["join-structure", str(amino), str(three_di), "--out", str(tmp_path / "sa.fasta")])
    assert joined.exit_code == 0, joined.output
    assert (tmp_path / "sa.fasta").read_text() == ">p1\nMdEvVpQqKa\n>p2\nApCvY#\n"
    refused = runner.invoke(app, ["join-structure", str(amino), str(three_di), "--out", str(amino)])
    assert refused.exit_code == 1 and f"--out {amino} is the input {amino}" in refused.stderr
    by_hand = write_fasta(tmp_path / "hand.fasta", [("p1", "MdEvVpQqKa"), ("p2", "ApCvY#")])
    stores = []
    for fasta in (tmp_path / "sa.fasta", by_hand):
        out = tmp_path / f"{fasta.stem}.h5"
        result = runner.invoke(app, ["embed", str(fasta), "--model", str(model), "--out", str(out), "--quiet",
                                     "--device", "cpu"])
        assert result.exit_code == 0, result.output
        stores.append(read_store(out))
    for rid in ("p1", "p2"):
        assert (stores[0]["mean"][2][rid] == stores[1]["mean"][2][rid]).all()


def test_a_masked_state_in_the_3di_fasta_is_kept(tmp_path: Path) -> None:
    """SaProt reads ``#`` as a masked 3Di state (its vocabulary pairs every amino acid with
    ``#``: westlake-repl/SaProt utils/foldseek_util.py masks low-pLDDT states as '#'), so a 3Di
    FASTA holding one joins as if it were Foldseek's ``X``."""
    amino = write_fasta(tmp_path / "aa.fasta", [("p1", "MEVQ")])
    three_di = write_fasta(tmp_path / "3di.fasta", [("p1", "d#px")])  # lower case, as SaProt writes 3Di
    by_hand = "M" + "d" + "E" + "#" + "V" + "p" + "Q" + "#"
    assert join_structure(amino, three_di) == [("p1", by_hand)]


@pytest.mark.parametrize("how", ["same path", "symlink", "hard link"])
def test_one_file_given_as_both_inputs_is_refused_and_nothing_written(tmp_path: Path, how: str) -> None:
    amino = write_fasta(tmp_path / "aa.fasta", [("p1", "MEVQ")])  # letters that are 3Di states too
    other = {"same path": lambda: amino, "symlink": lambda: _linked(amino, tmp_path / "l.fasta", os.symlink),
             "hard link": lambda: _linked(amino, tmp_path / "h.fasta", os.link)}[how]()
    result = CliRunner().invoke(app, ["join-structure", str(amino), str(other), "--out", str(tmp_path / "sa.fasta")])
    assert result.exit_code == 1
    assert result.stderr.strip() == f"embedpipe: error: {amino} and {other} are one file; give the amino-acid FASTA " \
                                    "and the 3Di FASTA"
    assert not (tmp_path / "sa.fasta").exists()


def _linked(target: Path, link: Path, make) -> Path:
    make(target, link)
    return link


def test_two_inputs_without_records_are_refused_and_nothing_written(tmp_path: Path) -> None:
    amino, three_di = tmp_path / "aa.fasta", tmp_path / "3di.fasta"
    amino.write_text("")
    three_di.write_text("\n")
    result = CliRunner().invoke(app, ["join-structure", str(amino), str(three_di), "--out", str(tmp_path / "sa.fasta")])
    assert result.exit_code == 1
    assert result.stderr.strip() == f"embedpipe: error: {amino} and {three_di} hold no records; nothing to join"
    assert not (tmp_path / "sa.fasta").exists()
