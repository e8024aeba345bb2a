"""Sequences held in memory (the Python API's input) are held to the FASTA path's rules: for
each raw sequence, ``check_records`` gives the sequence ``read_sequences`` gives for the same
record in a file, or refuses it with the same reason."""

from __future__ import annotations

import re

import pytest

from embedpipe.core.errors import InputError
from embedpipe.core.options import FastaLimits
from embedpipe.inputs.fasta import read_sequences
from embedpipe.inputs.memory import check_records

RAW = ["MKVL", "mkvl", "MKVL*", "MKJL", "mk vl", "MK*VL", "MK-VL", "MK.VL", "MK1VL", "MKÄVL", "*", "UOBZX",
       "M" * 41]


def _fasta_outcome(tmp_path, raw: str, limits: FastaLimits) -> str:
    path = tmp_path / "one.fasta"
    path.write_text(f">rec\n{raw}\n", encoding="utf-8")
    try:
        return next(iter(read_sequences(path, limits)))[1]
    except InputError as error:  # the reason, after the file:line and record
        return "error: " + str(error).split("'rec'", 1)[1]


def _memory_outcome(raw: str, limits: FastaLimits) -> str:
    try:
        return check_records([("rec", raw)], limits)[0][1]
    except InputError as error:
        return "error: " + str(error).split("'rec'", 1)[1]


@pytest.mark.parametrize("raw", RAW)
def test_a_sequence_in_memory_fares_as_in_a_fasta(raw, tmp_path):
    limits = FastaLimits(max_length=40)
    # a file's over-long record is stopped while it streams ("N read so far"), a held one once whole
    counted = re.compile(r"\d+ read so far|it has \d+")
    assert counted.sub("N", _memory_outcome(raw, limits)) == counted.sub("N", _fasta_outcome(tmp_path, raw, limits))


def test_the_input_forms_give_the_same_records():
    pairs = [("a", "MKV"), ("b", "acd")]
    assert check_records(pairs) == check_records(dict(pairs)) == [("a", "MKV"), ("b", "ACD")]
    assert check_records(["MKV", "acd"]) == [("0", "MKV"), ("1", "ACD")]
    with pytest.raises(InputError, match=r"sequences:2: 3 is neither a sequence nor an \(id, sequence\) pair"):
        check_records(["MKV", 3])  # type: ignore[list-item]


FAMILY_RAW = ["MdEv", "MDEV", "MdE", "M#K#", "mkvl", "MKvl", "acdj", "MK*"]


@pytest.mark.parametrize("keep_case,per_residue", [(True, 1), (True, 2)], ids=["prostt5", "saprot"])
@pytest.mark.parametrize("raw", FAMILY_RAW)
def test_a_held_sequence_is_read_by_the_family_rules_as_in_a_fasta(raw, keep_case, per_residue, tmp_path):
    """The family's rules travel in the limits (case kept, pairs): a held record fares as in a file."""
    limits = FastaLimits(max_length=40, keep_case=keep_case, chars_per_residue=per_residue)
    assert _memory_outcome(raw, limits) == _fasta_outcome(tmp_path, raw, limits)


def test_a_saprot_record_is_bounded_in_residues_not_characters(tmp_path):
    limits = FastaLimits(max_length=3, keep_case=True, chars_per_residue=2)
    assert _memory_outcome("MdEvVp", limits) == "MdEvVp"  # 3 residues, 6 characters
    assert "it has 4" in _memory_outcome("MdEvVpQp", limits)


@pytest.mark.parametrize("given,words", [
    ({"MKV", "ACD"}, "a set has no order"), (frozenset({"MKV"}), "a frozenset has no order"),
    (None, "not NoneType"), (5, "not int")])
def test_unordered_or_non_iterable_input_is_one_input_error(given, words):
    with pytest.raises(InputError, match=words):
        check_records(given)
