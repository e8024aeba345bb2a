"""embedpipe.inputs.fasta: streaming reader, validation and normalisation (issue 2, section 3 and 4)."""

from __future__ import annotations

import bz2
import gzip
import hashlib
import os
import re
import threading
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from embedpipe.core.errors import InputError
from embedpipe.inputs.fasta import BLOCK_SIZE, FastaRecord, display_path, iter_fasta, read_sequences
from embedpipe.inputs.residue_rules import (
    ALIGNMENT_GAP,
    EMPTY_SEQUENCE,
    INTERNAL_STOP,
    INVALID_CHARACTER,
    J_TO_X,
    STOP_STRIPPED,
    UPPERCASED,
)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "swissprot100.fasta"


def write(path: Path, text: str | bytes) -> Path:
    path.write_bytes(text.encode() if isinstance(text, str) else text)
    return path


def records(path: Path | list[Path], **kwargs: object) -> list[FastaRecord]:
    return list(iter_fasta(path, **kwargs))  # type: ignore[arg-type]


def one(tmp_path: Path, body: str) -> FastaRecord:
    (rec,) = records(write(tmp_path / "in.fa", body))
    return rec


# ------------------------------------------------------------------------------------ reading


def test_basic_records_ids_sources_and_multiline(tmp_path: Path) -> None:
    path = write(tmp_path / "in.fa", ">P1 first protein\nMKV\nLLA\n>sp|P2|X_HUMAN desc OS=Homo\nACDE\n")
    got = records(path)
    assert [r.id for r in got] == ["P1", "sp|P2|X_HUMAN"]
    assert [r.header for r in got] == ["P1 first protein", "sp|P2|X_HUMAN desc OS=Homo"]
    assert [r.sequence for r in got] == ["MKVLLA", "ACDE"]
    assert [r.source for r in got] == [f"{path}:1", f"{path}:4"]
    assert [r.line for r in got] == [1, 4]
    assert all(r.invalid is None and r.normalised == () for r in got)


def test_no_trailing_newline_and_tab_separated_header(tmp_path: Path) -> None:
    got = records(write(tmp_path / "in.fa", ">A\tdesc\nMK\n>B\nWW"))
    assert [(r.id, r.sequence) for r in got] == [("A", "MK"), ("B", "WW")]


def test_leading_blank_lines_are_fine(tmp_path: Path) -> None:
    (rec,) = records(write(tmp_path / "in.fa", "\n  \n\r\n>P1\nMK\n"))
    assert rec.id == "P1" and rec.line == 4


def test_example_file_counts() -> None:
    got = records(EXAMPLE)
    assert len(got) == 100
    assert sum(r.length for r in got) == 37_225


def test_several_inputs_keep_order_and_sources(tmp_path: Path) -> None:
    a = write(tmp_path / "a.fa", ">A1\nMK\n>A2\nMKK\n")
    b = write(tmp_path / "b.fa", ">B1\nW\n")
    got = records([a, b])
    assert [r.id for r in got] == ["A1", "A2", "B1"]
    assert [r.file_index for r in got] == [0, 0, 1]
    assert got[2].source == f"{b}:1"


@pytest.mark.parametrize("name", ["in.fa.gz", "in.fa", "in.txt"])
def test_gzip_detected_by_magic_bytes_not_name(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    path.write_bytes(gzip.compress(b">P1\nMK\nV\n>P2\nAAA\n"))
    assert [(r.id, r.sequence, r.line) for r in records(path)] == [("P1", "MKV", 1), ("P2", "AAA", 4)]


def test_plain_file_named_gz_is_read_as_plain(tmp_path: Path) -> None:
    assert records(write(tmp_path / "in.fa.gz", ">P1\nMK\n"))[0].sequence == "MK"


def test_multi_member_gzip(tmp_path: Path) -> None:
    path = tmp_path / "in.fa.gz"
    path.write_bytes(gzip.compress(b">P1\nMK\n") + gzip.compress(b">P2\nWW\n"))
    assert [r.id for r in records(path)] == ["P1", "P2"]


def test_other_compression_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "in.fa.bz2"
    path.write_bytes(bz2.compress(b">P1\nMK\n"))
    with pytest.raises(InputError, match=r"bzip2-compressed"):
        records(path)


def test_truncated_gzip_is_an_input_error(tmp_path: Path) -> None:
    path = tmp_path / "in.fa.gz"
    path.write_bytes(gzip.compress(b">P1\n" + b"MKV" * 10000)[:-20])
    with pytest.raises(InputError, match="gzip"):
        records(path)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"nope\.fa: no such file"):
        records(tmp_path / "nope.fa")


def test_empty_file_has_no_records(tmp_path: Path) -> None:
    assert records(write(tmp_path / "in.fa", "")) == []
    assert records(write(tmp_path / "blank.fa", "\n\n  \n")) == []


def test_progress_callback_counts_on_disk_bytes(tmp_path: Path) -> None:
    plain = write(tmp_path / "in.fa", ">P1\nMKV\n" * 1 + ">P2\nWW\n")
    packed = tmp_path / "in.fa.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    for path in (plain, packed):
        seen: list[int] = []
        records(path, on_bytes=seen.append, block_size=4)
        assert sum(seen) == path.stat().st_size


def test_streaming_does_not_read_the_whole_file(tmp_path: Path) -> None:
    # Consuming one record of a large file must not require reading all of it.
    path = write(tmp_path / "big.fa", ">P0\nMK\n" + "".join(f">P{i}\n{'A' * 100}\n" for i in range(1, 20000)))
    seen: list[int] = []
    it = iter_fasta(path, on_bytes=seen.append, block_size=4096)
    first = next(it)
    assert first.id == "P0"
    assert sum(seen) <= 4096 < path.stat().st_size
    it.close()  # type: ignore[attr-defined]


# ------------------------------------------------------------------------------ structural errors


def test_text_before_first_header(tmp_path: Path) -> None:
    path = write(tmp_path / "in.fa", "\n# comment\n>P1\nMK\n")
    with pytest.raises(InputError, match=rf"^{path}:2: text before the first '>' header"):
        records(path)


def test_file_without_any_header(tmp_path: Path) -> None:
    path = write(tmp_path / "in.fa", "MKVLLA\nWW\n")
    with pytest.raises(InputError, match=rf"^{path}:1: text before"):
        records(path)


@pytest.mark.parametrize("header", [">", ">   ", ">\t\r"])
def test_empty_header_or_id(tmp_path: Path, header: str) -> None:
    path = write(tmp_path / "in.fa", f">P1\nMK\n{header}\nMK\n")
    with pytest.raises(InputError, match=rf"^{path}:3: empty header"):
        records(path)


def test_header_with_leading_space_takes_first_word(tmp_path: Path) -> None:
    assert one(tmp_path, ">  P1 desc\nMK\n").id == "P1"


def test_header_not_utf8(tmp_path: Path) -> None:
    path = write(tmp_path / "in.fa", b">P1\nMK\n>P\xff2\nMK\n")
    with pytest.raises(InputError, match=rf"^{path}:3: header is not valid UTF-8"):
        records(path)


def test_utf8_header_is_fine(tmp_path: Path) -> None:
    assert one(tmp_path, ">P1 protéine\nMK\n").header == "P1 protéine"


def test_duplicate_id_names_id_and_both_lines(tmp_path: Path) -> None:
    path = write(tmp_path / "in.fa", ">P1\nMK\n>P2\nWW\n>P1 other\nAAA\n")
    with pytest.raises(InputError) as err:
        records(path)
    message = str(err.value)
    assert "duplicate ID 'P1'" in message
    assert f"{path}:1" in message and f"{path}:5" in message


def test_duplicate_id_across_files_same_sequence(tmp_path: Path) -> None:
    a = write(tmp_path / "a.fa", ">X\nMK\n>P1\nMK\n")
    b = write(tmp_path / "b.fa", ">P1\nMK\n")
    with pytest.raises(InputError, match=rf"duplicate ID 'P1': first seen at {a}:3, again at {b}:1"):
        records([a, b])


def test_duplicate_ids_allowed_when_not_checked(tmp_path: Path) -> None:
    path = write(tmp_path / "in.fa", ">P1\nMK\n>P1\nMK\n")
    assert len(records(path, check_duplicate_ids=False)) == 2


# ------------------------------------------------------------------------ validation table


def test_blank_lines_spaces_and_crlf_inside_record(tmp_path: Path) -> None:
    rec = one(tmp_path, ">P1 desc\r\nMK V\r\n\r\n  LL\tA \r\n\n")
    assert rec.sequence == "MKVLLA"
    assert rec.header == "P1 desc"
    assert rec.normalised == () and rec.invalid is None


def test_crlf_line_numbers(tmp_path: Path) -> None:
    got = records(write(tmp_path / "in.fa", ">P1\r\nMK\r\n>P2\r\nWW\r\n"))
    assert [r.line for r in got] == [1, 3]
    assert [r.id for r in got] == ["P1", "P2"]


def test_lowercase_is_uppercased_and_counted(tmp_path: Path) -> None:
    rec = one(tmp_path, ">P1\nmkVl\n")
    assert rec.sequence == "MKVL" and rec.normalised == (UPPERCASED,)


def test_one_trailing_stop_is_stripped_and_counted(tmp_path: Path) -> None:
    rec = one(tmp_path, ">P1\nMKV\nL*\n")
    assert rec.sequence == "MKVL" and rec.normalised == (STOP_STRIPPED,) and rec.invalid is None


def test_two_trailing_stops_are_an_internal_stop(tmp_path: Path) -> None:
    rec = one(tmp_path, ">P1\nMKV**\n")
    assert rec.invalid == INTERNAL_STOP


def test_stop_inside_sequence_is_invalid(tmp_path: Path) -> None:
    path = tmp_path / "in.fa"
    rec = one(tmp_path, ">P1\nMKV\nA*L\n")
    assert rec.invalid == INTERNAL_STOP
    assert rec.error == f"{path}:3: record 'P1': stop codon '*' inside the sequence at column 2 (residue 5)"


def test_ambiguity_and_rare_residues_are_kept(tmp_path: Path) -> None:
    rec = one(tmp_path, ">P1\nUOBZX\n")
    assert rec.sequence == "UOBZX" and rec.normalised == () and rec.invalid is None


def test_j_is_mapped_to_x_and_counted(tmp_path: Path) -> None:
    rec = one(tmp_path, ">P1\nMJKJ\n")
    assert rec.sequence == "MXKX" and rec.normalised == (J_TO_X,)


def test_lowercase_j_counts_both(tmp_path: Path) -> None:
    rec = one(tmp_path, ">P1\nmjk*\n")
    assert rec.sequence == "MXK"
    assert set(rec.normalised) == {UPPERCASED, J_TO_X, STOP_STRIPPED}


@pytest.mark.parametrize("gap", ["-", "."])
def test_gaps_mean_an_alignment(tmp_path: Path, gap: str) -> None:
    path = tmp_path / "in.fa"
    rec = one(tmp_path, f">P1\nMK{gap}V\n")
    assert rec.invalid == ALIGNMENT_GAP
    assert rec.error is not None
    assert rec.error.startswith(f"{path}:2: record 'P1': gap character '{gap}' at column 3")
    assert "alignment" in rec.error


@pytest.mark.parametrize("char", ["1", "#", "@", "é", "\x00", "+"])
def test_digits_and_other_characters_are_invalid(tmp_path: Path, char: str) -> None:
    path = tmp_path / "in.fa"
    rec = one(tmp_path, f">P1\nMKVLL\nAC{char}D\n")
    assert rec.invalid == INVALID_CHARACTER
    assert rec.error is not None
    assert rec.error.startswith(f"{path}:3: record 'P1': invalid character ")
    assert "at column 3 (residue 8)" in rec.error


def test_column_counts_spaces_on_the_line(tmp_path: Path) -> None:
    path = tmp_path / "in.fa"
    rec = one(tmp_path, ">P1\nMK VL1\n")
    assert rec.error == f"{path}:2: record 'P1': invalid character '1' at column 6 (residue 5)"


@pytest.mark.parametrize(
    "body",
    [">P1\n>P2\nMK\n", ">P2\nMK\n>P1\n", ">P2\nMK\n>P1", ">P1\n\n  \n>P2\nMK\n", ">P1\n*\n>P2\nMK\n"],
)
def test_empty_sequence_is_invalid(tmp_path: Path, body: str) -> None:
    path = write(tmp_path / "in.fa", body)
    got = {r.id: r for r in records(path)}
    assert got["P1"].invalid == EMPTY_SEQUENCE
    assert got["P1"].error == f"{path}:{got['P1'].line}: record 'P1': empty sequence"
    assert got["P2"].invalid is None


def test_invalid_records_do_not_stop_iteration(tmp_path: Path) -> None:
    got = records(write(tmp_path / "in.fa", ">A\nMK1\n>B\nMK\n>C\nM-K\n"))
    assert [(r.id, r.invalid) for r in got] == [("A", INVALID_CHARACTER), ("B", None), ("C", ALIGNMENT_GAP)]


# ---------------------------------------------------------------------------- read_sequences


def test_read_sequences_yields_normalised_pairs(tmp_path: Path) -> None:
    path = write(tmp_path / "in.fa", ">P1 d\nmk\nJ*\n>P2\nWW\n")
    assert list(read_sequences(path)) == [("P1", "MKX"), ("P2", "WW")]


def test_read_sequences_raises_on_invalid_record(tmp_path: Path) -> None:
    path = write(tmp_path / "in.fa", ">P1\nMK\n>P2\nMK\nM1\n")
    with pytest.raises(InputError, match=rf"^{path}:5: record 'P2': invalid character '1' at column 2"):
        list(read_sequences(path))


def test_read_sequences_raises_on_duplicate_id(tmp_path: Path) -> None:
    path = write(tmp_path / "in.fa", ">P1\nMK\n>P1\nMK\n")
    with pytest.raises(InputError, match="duplicate ID 'P1'"):
        list(read_sequences(path))


def test_read_sequences_on_example() -> None:
    pairs = list(read_sequences(EXAMPLE))
    assert len(pairs) == 100 and sum(len(s) for _, s in pairs) == 37_225
    assert pairs[0][0] == "sp|P15455|CRU4_ARATH"


# ---------------------------------------------------------------------- block boundaries


def reference_parse(text: str) -> list[tuple[str, str, int]]:
    """A deliberately naive line-by-line parser: (id, sequence-without-whitespace, line).

    Lines end at CRLF, a lone CR or LF; a leading byte-order mark is ignored.
    """
    out: list[tuple[str, str, int]] = []
    for number, raw in enumerate(re.split(r"\r\n|\r|\n", text.removeprefix("\ufeff")), start=1):
        if raw.startswith(">"):
            out.append((raw[1:].split()[0], "", number))
        elif out:
            ident, seq, line = out[-1]
            out[-1] = (ident, seq + "".join(raw.split()), line)
    return out


residue_line = st.text(alphabet="ACDEFGHIKLMNPQRSTVWY \r", min_size=0, max_size=30)
fasta_records = st.lists(
    st.tuples(st.lists(residue_line, min_size=1, max_size=4)),
    min_size=0,
    max_size=12,
)
line_ends = st.sampled_from(["\n", "\r\n", "\r"])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    data=fasta_records,
    block_size=st.integers(min_value=1, max_value=64),
    trailing_newline=st.booleans(),
    gzipped=st.booleans(),
    ends=st.lists(line_ends, min_size=1, max_size=8),
    bom=st.booleans(),
)
def test_block_boundaries_and_line_endings_do_not_matter(
    tmp_path: Path,
    data: list[tuple[list[str]]],
    block_size: int,
    trailing_newline: bool,
    gzipped: bool,
    ends: list[str],
    bom: bool,
) -> None:
    lines: list[str] = []
    for k, (seq_lines,) in enumerate(data):
        lines.append(f">R{k} description {k}")
        lines.extend(seq_lines)
    text = "\ufeff" if bom else ""
    for k, line in enumerate(lines):
        text += line + (ends[k % len(ends)] if k + 1 < len(lines) or trailing_newline else "")
    path = tmp_path / "prop.fa"
    path.write_bytes(gzip.compress(text.encode()) if gzipped else text.encode())
    got = [(r.id, r.sequence, r.line) for r in iter_fasta(path, block_size=block_size)]
    want = reference_parse(text)
    assert got == want
    assert len(got) == len(data)  # every header is one record, whatever the line ends
    for rec in iter_fasta(path, block_size=block_size):
        expected = None if rec.length else EMPTY_SEQUENCE
        assert rec.invalid == expected


def test_record_larger_than_a_block(tmp_path: Path) -> None:
    seq = "ACDEFGHIKLMNPQRSTVWY" * 5000
    path = write(tmp_path / "in.fa", f">BIG\n{seq}\n>S\nMK\n")
    got = records(path, block_size=1000)
    assert [(r.id, r.sequence) for r in got] == [("BIG", seq), ("S", "MK")]
    assert hashlib.sha256(got[0].data).hexdigest() == hashlib.sha256(seq.encode()).hexdigest()


# ------------------------------------------------------------------- line endings (issue 11)

CR_ONLY = b">x\rMKVLAA\r>y\rMSTNPK\r>z\rMAAAA\r"
LONE_CR = b">a\nMKVLAA\r>b\nMSTNPK\n>c\nMAAAA\n"
BLOCK_SIZES = [1, 2, 3, 4, 7, 11, BLOCK_SIZE]


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_cr_only_line_endings_are_read_as_lines(tmp_path: Path, block_size: int) -> None:
    got = records(write(tmp_path / "cr.fa", CR_ONLY), block_size=block_size)
    assert [(r.id, r.sequence, r.line, r.invalid) for r in got] == [
        ("x", "MKVLAA", 1, None),
        ("y", "MSTNPK", 3, None),
        ("z", "MAAAA", 5, None),
    ]


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_lone_cr_inside_an_lf_file_ends_a_line(tmp_path: Path, block_size: int) -> None:
    got = records(write(tmp_path / "mixed.fa", LONE_CR), block_size=block_size)
    assert [(r.id, r.sequence, r.line) for r in got] == [("a", "MKVLAA", 1), ("b", "MSTNPK", 3), ("c", "MAAAA", 5)]


@pytest.mark.parametrize("eol", ["\n", "\r\n", "\r"])
@pytest.mark.parametrize("block_size", [1, 2, 5, BLOCK_SIZE])
def test_error_lines_are_the_same_for_every_line_ending(tmp_path: Path, eol: str, block_size: int) -> None:
    path = write(tmp_path / "in.fa", eol.join([">P1", "MK", "", ">P2", "MKV", "W2", ">P3", "MK", ""]))
    got = records(path, block_size=block_size)
    assert [r.line for r in got] == [1, 4, 7]
    assert got[1].error == f"{path}:6: record 'P2': invalid character '2' at column 2 (residue 5)"
    before = write(tmp_path / "before.fa", eol.join(["", "# note", ">P1", "MK", ""]))
    with pytest.raises(InputError, match=rf"^{before}:2: text before the first '>' header"):
        records(before, block_size=block_size)
    dup = write(tmp_path / "dup.fa", eol.join([">P1", "MK", ">P1", "MK", ""]))
    with pytest.raises(InputError, match=rf"first seen at {dup}:1, again at {dup}:3"):
        records(dup, block_size=block_size)


@pytest.mark.parametrize("block_size", [1, 2, 3, 4, BLOCK_SIZE])
@pytest.mark.parametrize("gzipped", [False, True])
def test_utf8_byte_order_mark_is_stripped(tmp_path: Path, block_size: int, gzipped: bool) -> None:
    body = b"\xef\xbb\xbf>P1 d\r\nMK\r\n>P2\r\nWW\r\n"
    path = tmp_path / "bom.fa"
    path.write_bytes(gzip.compress(body) if gzipped else body)
    got = records(path, block_size=block_size)
    assert [(r.id, r.header, r.sequence, r.line) for r in got] == [("P1", "P1 d", "MK", 1), ("P2", "P2", "WW", 3)]


@pytest.mark.parametrize("body", [b"\xef\xbb\xbf", b"\xef\xbb\xbf\n\n"])
def test_byte_order_mark_alone_is_an_empty_file(tmp_path: Path, body: bytes) -> None:
    assert records(write(tmp_path / "in.fa", body), block_size=1) == []


def test_byte_order_mark_only_at_the_start(tmp_path: Path) -> None:
    path = write(tmp_path / "in.fa", b"\n\xef\xbb\xbf>P1\nMK\n")
    with pytest.raises(InputError, match=rf"^{path}:2: text before the first"):
        records(path)


def test_nul_in_header_is_a_located_error(tmp_path: Path) -> None:
    path = write(tmp_path / "in.fa", b">P1\nMK\n>P\x002 desc\nMK\n")
    with pytest.raises(InputError, match=rf"^{path}:3: header contains a NUL byte"):
        records(path)
    desc = write(tmp_path / "desc.fa", b">P1 a\x00b\nMK\n")
    with pytest.raises(InputError, match=rf"^{desc}:1: header contains a NUL byte"):
        records(desc)


def test_a_pipe_can_be_read_once_in_order(tmp_path: Path) -> None:
    fifo = tmp_path / "in.fifo"
    os.mkfifo(fifo)
    body = gzip.compress(b">P1\nMK\n>P2\nWW\n")

    def feed() -> None:
        with open(fifo, "wb") as fh:  # blocks until the reader opens the pipe
            fh.write(body)

    writer = threading.Thread(target=feed)
    writer.start()
    try:
        assert list(read_sequences(fifo)) == [("P1", "MK"), ("P2", "WW")]
    finally:
        writer.join()


def test_display_path_shows_undecodable_bytes_escaped(tmp_path: Path) -> None:
    raw = os.fsdecode(b"bad\xffname.fa")
    assert display_path(raw) == "bad\\xffname.fa"
    assert display_path(Path("ok/é.fa")) == "ok/é.fa"
    with pytest.raises(InputError) as err:
        records(tmp_path / raw)
    assert str(err.value) == f"{tmp_path}/bad\\xffname.fa: no such file"
    str(err.value).encode("utf-8")  # printable as UTF-8
