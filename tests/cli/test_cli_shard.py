"""`embedpipe shard` on the command line: exit codes, stderr messages, outputs."""

from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from embedpipe.cli import app
from helpers.shard_helpers import manifest as rows
from helpers.shard_helpers import write

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "swissprot100.fasta"
runner = CliRunner()


def shard(*args: str | Path):  # noqa: ANN201 - click Result
    return runner.invoke(app, ["shard", *map(str, args)])


def test_example_end_to_end_with_summary(tmp_path: Path) -> None:
    out = tmp_path / "shards"
    result = shard(EXAMPLE, "--out", out, "--tokens-per-shard", "5000")
    assert result.exit_code == 0, result.stderr
    assert "100 records read from 1 file" in result.stderr
    assert "duplicates" in result.stderr and "shards" in result.stderr
    assert result.stdout == ""
    manifest = rows(out)
    assert len(manifest) == 100
    assert sum(int(r["length"]) for r in manifest) == 37_225
    meta = json.loads((out / "shards.json").read_text())
    assert meta["counts"]["records"] == 100
    assert len(list(out.glob("shard-*.fasta"))) == len(meta["shards"]) > 1


def test_default_budget_is_one_million_tokens(tmp_path: Path) -> None:
    out = tmp_path / "shards"
    result = shard(EXAMPLE, "--out", out, "--quiet")
    assert result.exit_code == 0
    assert result.stderr == ""
    meta = json.loads((out / "shards.json").read_text())
    assert meta["tokens_per_shard"] == 1_000_000 and len(meta["shards"]) == 1


def test_gzip_and_several_inputs(tmp_path: Path) -> None:
    a = tmp_path / "a.fa.gz"
    a.write_bytes(gzip.compress(b">A\nMKV*\n>B\nmkv\n"))
    b = write(tmp_path / "b.fa", ">C\r\nMK J\r\n")
    out = tmp_path / "out"
    result = shard(a, b, "--out", out, "--tokens-per-shard", "5")
    assert result.exit_code == 0, result.stderr
    got = {r["id"]: r for r in rows(out)}
    assert [got[i]["status"] for i in "ABC"] == ["ok", "duplicate", "ok"]
    assert got["C"]["source"] == f"{b}:1"
    # equal lengths keep input order; 3 residues + 2 = 5 tokens fill a shard
    assert (out / "shard-00000.fasta").read_text() == ">A\nMKV\n"
    assert (out / "shard-00001.fasta").read_text() == ">C\nMKX\n"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("hello\n>P1\nMK\n", ":1: text before the first '>' header"),
        (">P1\nMK\n>\nMK\n", ":3: empty header"),
        (">P1\nMK\n>P1\nMKV\n", "duplicate ID 'P1': first seen at {src}:1, again at {src}:3"),
        (">P1\nMK\n>P2\nMK*V\n", ":4: record 'P2': stop codon '*' inside the sequence at column 3"),
        (">P1\nMK\n>P2\nMK-V\n", ":4: record 'P2': gap character '-' at column 3"),
        (">P1\nMK\n>P2\nMK.V\n", ":4: record 'P2': gap character '.' at column 3"),
        (">P1\nMK\n>P2\nMKV\nW2\n", ":5: record 'P2': invalid character '2' at column 2 (residue 5)"),
        (">P1\nMK\n>P2\n", ":3: record 'P2': empty sequence"),
        (">P1\nMK\n>P\x002 d\nMK\n", ":3: header contains a NUL byte"),
        (">P1\rMK\r>P2\rMK-V\r", ":4: record 'P2': gap character '-' at column 3"),
    ],
)
def test_errors_exit_1_with_one_line_and_no_outputs(tmp_path: Path, body: str, message: str) -> None:
    src = write(tmp_path / "in.fa", body)
    out = tmp_path / "out"
    result = shard(src, "--out", out)
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith(f"embedpipe: error: {src}")
    assert message.format(src=src) in lines[0]
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["in.fa"]


def test_on_invalid_skip(tmp_path: Path) -> None:
    src = write(tmp_path / "in.fa", ">P1\nMK\n>P2\nMK-V\n>P3\nA1\n>P4\n>P5\nMKV*K\n")
    out = tmp_path / "out"
    result = shard(src, "--out", out, "--on-invalid", "skip")
    assert result.exit_code == 0, result.stderr
    assert [r["status"] for r in rows(out)] == [
        "ok",
        "skipped:alignment-gap",
        "skipped:invalid-character",
        "skipped:empty-sequence",
        "skipped:internal-stop",
    ]
    assert re.search(r"^  skipped +4$", result.stderr, flags=re.M), result.stderr


def test_bad_on_invalid_value(tmp_path: Path) -> None:
    result = shard(EXAMPLE, "--out", tmp_path / "out", "--on-invalid", "ignore")
    assert result.exit_code == 1
    assert "embedpipe: error: --on-invalid must be one of error, skip" in result.stderr


def test_missing_input(tmp_path: Path) -> None:
    result = shard(tmp_path / "nope.fa", "--out", tmp_path / "out")
    assert result.exit_code == 1
    assert f"embedpipe: error: {tmp_path / 'nope.fa'}: no such file" in result.stderr


def test_tokens_per_shard_must_be_positive(tmp_path: Path) -> None:
    result = shard(EXAMPLE, "--out", tmp_path / "out", "--tokens-per-shard", "0")
    assert result.exit_code != 0


def test_module_entry_point_subprocess(tmp_path: Path) -> None:
    src = write(tmp_path / "in.fa", ">P1\nMK\n>P2\nM#K\n")
    proc = subprocess.run(
        [sys.executable, "-m", "embedpipe.cli", "shard", str(src), "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip() == f"embedpipe: error: {src}:4: record 'P2': invalid character '#' at column 2 (residue 2)"
    assert not (tmp_path / "out").exists()


def test_cr_only_and_bom_files_just_work(tmp_path: Path) -> None:
    cr3 = tmp_path / "cr3.fa"
    cr3.write_bytes(b">x\rMKVLAA\r>y\rMSTNPK\r>z\rMAAAA\r")
    bom = tmp_path / "bom.fa"
    bom.write_bytes(b"\xef\xbb\xbf>b1\r\nMKV\r\n")
    out = tmp_path / "out"
    result = shard(cr3, bom, "--out", out, "--quiet")
    assert result.exit_code == 0, result.stderr
    assert [(r["id"], r["status"]) for r in rows(out)] == [("x", "ok"), ("y", "ok"), ("z", "ok"), ("b1", "ok")]


def test_input_inside_out_exits_1_and_keeps_it(tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert shard(EXAMPLE, "--out", out, "--tokens-per-shard", "5000", "-q").exit_code == 0
    inside = out / "shard-00003.fasta"
    before = inside.read_bytes()
    result = shard(inside, "--out", out, "-q")
    assert result.exit_code == 1
    assert result.stderr.strip() == (
        f"embedpipe: error: {inside}: lies inside --out {out}, which shard replaces; "
        "move the input elsewhere or choose another --out"
    )
    assert inside.read_bytes() == before


def test_non_utf8_input_path_subprocess(tmp_path: Path) -> None:
    name = os.fsdecode(b"bad\xffname.fa")
    write(tmp_path / name, ">P1\nMK\n")
    proc = subprocess.run(
        [sys.executable, "-m", "embedpipe.cli", "shard", name, "--out", "out", "-q"],
        cwd=tmp_path, capture_output=True, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == b""
    assert rows(tmp_path / "out")[0]["source"] == "bad\\xffname.fa:1"
    proc = subprocess.run(
        [sys.executable, "-m", "embedpipe.cli", "shard", name, name, "--out", "out", "-q"],
        cwd=tmp_path, capture_output=True, check=False,
    )
    assert proc.returncode == 1
    assert proc.stderr == b"embedpipe: error: bad\\xffname.fa: was given twice; give each input file once\n"


def test_path_with_newline_stays_one_line_in_messages(tmp_path: Path) -> None:
    src = write(tmp_path / "two\nlines.fa", ">P1\nMK\n>P1\nMK\n")
    result = shard(src, "--out", tmp_path / "out")
    assert result.exit_code == 1
    assert len(result.stderr.strip().splitlines()) == 1
    assert "two\\nlines.fa:3: duplicate ID 'P1'" in result.stderr
