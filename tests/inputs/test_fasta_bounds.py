"""Hostile FASTA input (issue 30): over-long records and IDs stop while the file streams, at
bounded memory, with one line naming the file, the header's line, the ID and the option to
raise; non-UTF-8 bytes are named by line and column (docs/store-format.md, "Input limits")."""

from __future__ import annotations

import gzip
import os
import subprocess
import sys
import time
import zlib
from pathlib import Path

import psutil
import pytest

from embedpipe.core.errors import InputError
from embedpipe.core.options import FASTA_LIMITS, FastaLimits
from embedpipe.inputs.bounds import text_cap
from embedpipe.inputs.fasta import iter_fasta, read_sequences

ROOT = Path(__file__).resolve().parents[2]


def _records(path: Path, **kwargs) -> list[tuple[str, int]]:
    return [(r.id, r.length) for r in iter_fasta(path, **kwargs)]


def _gzip_bomb(path: Path, residues: int) -> Path:
    """``>a`` then ``residues`` residues in 60-character lines, gzip-compressed as it is made."""
    line = b"A" * 60 + b"\n"
    block = line * (1 << 14)
    comp = zlib.compressobj(9, zlib.DEFLATED, 31)  # 31: the gzip container
    with open(path, "wb") as fh:
        fh.write(comp.compress(b">a huge\n"))
        for _ in range(residues // (60 << 14)):
            fh.write(comp.compress(block))
        fh.write(comp.flush())
    return path


def _peak_rss_and_result(args: list[str], timeout: float = 120) -> tuple[int, subprocess.CompletedProcess]:
    """Run the CLI in a child; its peak RSS (bytes, polled) and its result."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "embedpipe.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    child, peak, deadline = psutil.Process(proc.pid), 0, time.monotonic() + timeout
    while proc.poll() is None:
        try:
            peak = max(peak, child.memory_info().rss)
        except psutil.Error:
            break
        if time.monotonic() > deadline:  # a hang guard only
            proc.kill()
            break
        time.sleep(0.01)
    out, err = proc.communicate()
    return peak, subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_a_gzip_bomb_stops_at_its_first_block_with_one_line(tmp_path: Path) -> None:
    """256 MiB of residues (under 1 MB of gzip): main read it whole (memory of the record,
    twice over); now shard stops after one block, well under the record's size."""
    src = _gzip_bomb(tmp_path / "bomb.fa.gz", 256 << 20)
    assert src.stat().st_size < 2 << 20
    peak, result = _peak_rss_and_result(["shard", str(src), "--out", str(tmp_path / "out"), "-q"])
    assert result.returncode == 1, result.stderr
    assert result.stderr == (
        f"embedpipe: error: {src}:1: record 'a' is longer than --max-record-length (100,000 residues; "
        f"8,251,082 read so far): raise --max-record-length (workflow: max_record_length) if it is a real protein\n"
    )
    assert peak < 250 << 20, peak  # the interpreter, numpy and one 8 MiB block: not 256 MiB
    assert not (tmp_path / "out").exists()


def test_a_record_over_the_limit_names_file_line_and_id(tmp_path: Path) -> None:
    src = tmp_path / "in.fa"
    src.write_text(">ok\nMKV\n>long desc\n" + "MKVL\n" * 6 + ">after\nMK\n")
    with pytest.raises(InputError) as err:
        _records(src, limits=FastaLimits(max_length=23))
    assert str(err.value) == (f"{src}:3: record 'long' is longer than --max-record-length (23 residues; it has 24): "
                              "raise --max-record-length (workflow: max_record_length) if it is a real protein")
    assert _records(src, limits=FastaLimits(max_length=24)) == [("ok", 3), ("long", 24), ("after", 2)]


def test_a_record_over_the_limit_across_blocks_stops_before_its_end(tmp_path: Path) -> None:
    """Read in 64-byte blocks: the check runs on the part read so far, not the whole record."""
    src = tmp_path / "in.fa"
    src.write_text(">r1\n" + "A" * 10_000 + "\n")
    with pytest.raises(InputError, match=rf"^{src}:1: record 'r1' is longer than --max-record-length "
                                         r"\(100 residues; 1\d\d read so far\)"):
        _records(src, limits=FastaLimits(max_length=100), block_size=64)


def test_an_id_over_the_limit_is_refused_with_a_shortened_id(tmp_path: Path) -> None:
    src = tmp_path / "in.fa"
    src.write_text(">P1\nMK\n>" + "x" * 1001 + " desc\nMKV\n")
    with pytest.raises(InputError) as err:
        _records(src)
    assert str(err.value) == (f"{src}:3: ID '{'x' * 40}...' (1,001 characters) is longer than --max-id-length "
                              "(1,000 characters): raise --max-id-length (workflow: max_id_length) if it is real")
    assert _records(src, limits=FastaLimits(max_id_length=1001))[1] == ("x" * 1001, 3)


def test_a_two_mib_id_among_401_records_stops_while_its_header_streams(tmp_path: Path) -> None:
    src = tmp_path / "in.fa"
    body = "".join(f">r{k}\nMKV\n" for k in range(200))
    src.write_text(body + ">" + "y" * (2 << 20) + "\nMKV\n" + body.replace(">r", ">s"))
    with pytest.raises(InputError) as err:
        _records(src, block_size=4096)  # the header is cut off mid-ID by a block end
    assert str(err.value) == (f"{src}:401: ID '{'y' * 40}...' is longer than --max-id-length (1,000 characters): "
                              "raise --max-id-length (workflow: max_id_length) if it is real")


def test_embed_refuses_an_over_long_id_in_one_line_before_loading_the_model(tmp_path: Path) -> None:
    """The model path does not exist: had embed loaded it first, the error would name it."""
    src = tmp_path / "in.fa"
    src.write_text("".join(f">r{k}\nMKV\n" for k in range(400)) + ">" + "z" * (2 << 20) + "\nMKV\n")
    peak, result = _peak_rss_and_result(["embed", str(src), "--model", str(tmp_path / "absent.pt"),
                                         "--out", str(tmp_path / "out.h5"), "-q"])
    assert result.returncode == 1
    assert result.stderr == (f"embedpipe: error: {src}:801: ID '{'z' * 40}...' (2,097,152 characters) is longer "
                             "than --max-id-length (1,000 characters): raise --max-id-length (workflow: "
                             "max_id_length) if it is real\n")
    assert not (tmp_path / "out.h5").exists()


def test_mostly_blank_text_is_bounded_too(tmp_path: Path) -> None:
    limits = FastaLimits(max_length=10, max_id_length=5)
    src = tmp_path / "in.fa"
    src.write_text(">b\nMK\n" + "\n" * (text_cap(limits) + 10) + "V\n")
    with pytest.raises(InputError) as err:
        _records(src, limits=limits, block_size=1 << 16)
    assert str(err.value) == (f"{src}:1: record 'b' spans more than {text_cap(limits):,} bytes of text (header, "
                              "blank lines and spaces included; the bound follows --max-record-length, "
                              "workflow: max_record_length)")


def test_blank_lines_before_the_first_header_are_not_kept(tmp_path: Path) -> None:
    """Many blank lines before the first header: counted (the line numbers stay right), not held."""
    src = tmp_path / "in.fa"
    src.write_bytes(b"\n" * 300_000 + b">a\nMK\n")
    assert [(r.id, r.line) for r in iter_fasta(src, block_size=4096)] == [("a", 300_001)]


def test_the_limits_apply_to_read_sequences_and_refuse_nonsense(tmp_path: Path) -> None:
    src = tmp_path / "in.fa"
    src.write_text(">a\nMKVL\n")
    with pytest.raises(InputError, match=r"^.*:1: record 'a' is longer than --max-record-length \(3 residues"):
        list(read_sequences(src, FastaLimits(max_length=3)))
    with pytest.raises(InputError, match=r"^--max-record-length must be a positive integer, not 0$"):
        FastaLimits(max_length=0).check(InputError)
    assert FASTA_LIMITS == FastaLimits(100_000, 1_000)


def test_a_non_utf8_header_byte_is_named_by_line_and_column(tmp_path: Path) -> None:
    src = tmp_path / "in.fa"
    src.write_bytes(b">P1\nMK\n>P\xff2 desc\nMK\n")
    with pytest.raises(InputError) as err:
        _records(src)
    assert str(err.value) == f"{src}:3: header is not valid UTF-8 text (byte 0xff at column 3)"


def test_a_non_ascii_sequence_byte_is_named_as_a_byte(tmp_path: Path) -> None:
    src = tmp_path / "in.fa.gz"
    src.write_bytes(gzip.compress(b">P1\nMK\nMK\xe9V\n"))
    (rec,) = iter_fasta(src)
    assert rec.error == (f"{src}:3: record 'P1': invalid character (non-ASCII byte 0xe9) at column 3 (residue 5): "
                         "sequences are ASCII letters (a UTF-16 or binary file?)")


def test_shard_takes_the_limits_on_the_command_line(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from embedpipe.cli import app

    src = tmp_path / "in.fa"
    src.write_text(">abcdef\nMKVLA\n")
    result = CliRunner().invoke(app, ["shard", str(src), "--out", str(tmp_path / "o"), "-q", "--max-id-length", "5"])
    assert result.exit_code == 1
    assert "in.fa:1: ID 'abcdef' (6 characters) is longer than --max-id-length (5 characters)" in result.output
    result = CliRunner().invoke(app, ["shard", str(src), "--out", str(tmp_path / "o"), "-q",
                                      "--max-record-length", "5", "--max-id-length", "6"])
    assert result.exit_code == 0, result.output
