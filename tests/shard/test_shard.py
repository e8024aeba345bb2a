"""embedpipe.shard.passes: dedupe, length sort, token-budget shards, manifest (issue 2, sections 4-7)."""

from __future__ import annotations

import csv
import dataclasses
import functools
import gzip
import hashlib
import io
import json
import os
import random
import re
import signal
import subprocess
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from embedpipe.core.errors import EmbedpipeError, InputError, StoreError
from embedpipe.inputs.fasta import iter_fasta, read_sequences
from embedpipe.shard.manifest import DIALECT, MANIFEST_COLUMNS, iter_manifest, quote, quote_all
from embedpipe.shard.passes import ShardSummary, plan_shards, shard_fasta
from helpers.shard_helpers import manifest, write

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "swissprot100.fasta"


def shards_json(out: Path) -> dict:
    return json.loads((out / "shards.json").read_text())


def shard_records(out: Path) -> list[list[tuple[str, str]]]:
    meta = shards_json(out)
    return [list(read_sequences(out / s["path"])) for s in meta["shards"]]


def sha(seq: str) -> str:
    return hashlib.sha256(seq.encode()).hexdigest()


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def check_invariants(out: Path, summary: ShardSummary, budget: int) -> None:
    """The shard contract, checked from the files alone."""
    rows = manifest(out)
    meta = shards_json(out)
    shards = shard_records(out)
    assert meta["format"] == "embedpipe.shards" and meta["version"] == 1
    assert meta["tokens_per_shard"] == budget
    assert len(rows) == summary.records == meta["counts"]["records"]
    # shards partition the unique sequences; every ok row is in its shard, under its ID
    in_shards = {ident: (k, seq) for k, recs in enumerate(shards) for ident, seq in recs}
    assert sum(len(recs) for recs in shards) == len(in_shards) == summary.unique
    seqs = [seq for _, seq in in_shards.values()]
    assert len(set(seqs)) == len(seqs)
    ok = {r["id"]: r for r in rows if r["status"] == "ok"}
    assert set(ok) == set(in_shards)
    for ident, row in ok.items():
        k, seq = in_shards[ident]
        assert int(row["shard"]) == k
        assert row["sequence_sha256"] == sha(seq)
        assert int(row["length"]) == len(seq)
    for row in rows:
        if row["status"] == "duplicate":
            kept = ok[row["duplicate_of"]]
            assert row["shard"] == kept["shard"]
            assert row["sequence_sha256"] == kept["sequence_sha256"]
            assert row["length"] == kept["length"]
        elif row["status"].startswith("skipped:"):
            assert row["shard"] == "" and row["sequence_sha256"] == ""
        else:
            assert row["status"] == "ok" and row["duplicate_of"] == ""
    # budgets, ordering inside and across shards, and shards.json figures
    previous_max = 0
    for k, (recs, info) in enumerate(zip(shards, meta["shards"])):
        lengths = [len(seq) for _, seq in recs]
        tokens = sum(lengths) + 2 * len(lengths)
        assert recs, "no empty shards"
        assert lengths == sorted(lengths)
        assert tokens <= budget or len(recs) == 1
        assert lengths[0] >= previous_max
        previous_max = lengths[-1]
        assert info == {
            "index": k,
            "path": f"shard-{k:05d}.fasta",
            "records": len(recs),
            "residues": sum(lengths),
            "tokens": tokens,
            "min_length": lengths[0],
            "max_length": lengths[-1],
        }
    assert sorted(p.name for p in out.glob("shard-*.fasta")) == [s["path"] for s in meta["shards"]]
    assert summary.n_shards == len(shards)
    assert leftovers(out) == []


# ------------------------------------------------------------------------------- example


def test_example_swissprot100(tmp_path: Path) -> None:
    out = tmp_path / "shards"
    summary = shard_fasta([EXAMPLE], out=out, tokens_per_shard=5000, quiet=True)
    assert summary.records == 100
    assert summary.input_residues == 37_225
    assert summary.unique + summary.duplicates == 100
    assert summary.skipped == {}
    rows = manifest(out)
    assert len(rows) == 100
    assert sum(int(r["length"]) for r in rows) == 37_225
    assert [r["source"] for r in rows[:2]] == [f"{EXAMPLE}:1", f"{EXAMPLE}:10"]
    assert rows[0]["id"] == "sp|P15455|CRU4_ARATH"
    check_invariants(out, summary, 5000)
    assert summary.residues == sum(s["residues"] for s in shards_json(out)["shards"])
    assert shards_json(out)["counts"]["records"] == 100


def test_manifest_columns_and_input_order(tmp_path: Path) -> None:
    src = write(tmp_path / "in.fa", ">Z\nMKVL\n>A\nWW\n>M\nmkvl*\n>B\nAC1\n")
    out = tmp_path / "out"
    summary = shard_fasta([src], out=out, tokens_per_shard=100, on_invalid="skip", quiet=True)
    header = (out / "manifest.tsv").read_text().splitlines()[0].split("\t")
    assert tuple(header) == MANIFEST_COLUMNS
    rows = manifest(out)
    assert [r["id"] for r in rows] == ["Z", "A", "M", "B"]
    assert [r["source"] for r in rows] == [f"{src}:{n}" for n in (1, 3, 5, 7)]
    assert [r["status"] for r in rows] == ["ok", "ok", "duplicate", "skipped:invalid-character"]
    assert rows[2]["duplicate_of"] == "Z"
    assert rows[2]["normalised"] == "uppercased,stop-stripped"
    assert rows[0]["sequence_sha256"] == sha("MKVL") == rows[2]["sequence_sha256"]
    assert summary.normalised == {"uppercased": 1, "stop-stripped": 1, "J-to-X": 0}
    assert summary.normalised_records == 1
    check_invariants(out, summary, 100)


def test_shard_fasta_headers_are_ids_only_and_one_line(tmp_path: Path) -> None:
    src = write(tmp_path / "in.fa", ">P1 long description here\nMKV\nLLA\n")
    out = tmp_path / "out"
    shard_fasta([src], out=out, tokens_per_shard=100, quiet=True)
    assert (out / "shard-00000.fasta").read_text() == ">P1\nMKVLLA\n"


# --------------------------------------------------------------------------------- dedupe


def test_dedupe_by_normalised_content(tmp_path: Path) -> None:
    a = write(tmp_path / "a.fa", ">P1\nMKJL\n>P2\nWWW\n")
    b = write(tmp_path / "b.fa", ">P3\nmkxl*\n>P4\nMKXL\n>P5\nWWW\n")
    out = tmp_path / "out"
    summary = shard_fasta([a, b], out=out, tokens_per_shard=100, quiet=True)
    rows = {r["id"]: r for r in manifest(out)}
    assert summary.unique == 2 and summary.duplicates == 3
    assert [rows[i]["status"] for i in ("P1", "P2", "P3", "P4", "P5")] == ["ok", "ok"] + ["duplicate"] * 3
    assert [rows[i]["duplicate_of"] for i in ("P3", "P4", "P5")] == ["P1", "P1", "P2"]
    assert shard_records(out) == [[("P2", "WWW"), ("P1", "MKXL")]]
    check_invariants(out, summary, 100)


# --------------------------------------------------------------------------- shard planning


def test_plan_shards_greedy_budget() -> None:
    assert plan_shards([], 10) == [0]
    assert plan_shards([3, 3, 3], 10) == [0, 2, 3]  # 5 + 5 = 10 fits, a third would not
    assert plan_shards([1, 1, 20, 30], 10) == [0, 2, 3, 4]  # oversize records alone
    assert plan_shards([8], 10) == [0, 1]
    assert plan_shards([9], 10) == [0, 1]  # 11 tokens > budget, still one shard


def test_oversize_sequence_gets_its_own_shard(tmp_path: Path) -> None:
    src = write(tmp_path / "in.fa", ">L\n" + "A" * 50 + "\n>S1\nMK\n>S2\nMKV\n>XL\n" + "W" * 80 + "\n")
    out = tmp_path / "out"
    summary = shard_fasta([src], out=out, tokens_per_shard=20, quiet=True)
    assert [[i for i, _ in recs] for recs in shard_records(out)] == [["S1", "S2"], ["L"], ["XL"]]
    check_invariants(out, summary, 20)


def test_equal_lengths_keep_input_order(tmp_path: Path) -> None:
    src = write(tmp_path / "in.fa", ">C\nMKV\n>A\nWWW\n>B\nAAA\n")
    out = tmp_path / "out"
    shard_fasta([src], out=out, tokens_per_shard=100, quiet=True)
    assert [i for i, _ in shard_records(out)[0]] == ["C", "A", "B"]


def test_gzip_and_several_inputs(tmp_path: Path) -> None:
    a = tmp_path / "a.faa.gz"
    a.write_bytes(gzip.compress(b">A1\nMKV\n>A2\nMKVLL\n"))
    b = write(tmp_path / "b.faa", ">B1\nMK\n")
    out = tmp_path / "out"
    summary = shard_fasta([a, b], out=out, tokens_per_shard=6, quiet=True)
    rows = manifest(out)
    assert [(r["id"], r["source"]) for r in rows] == [("A1", f"{a}:1"), ("A2", f"{a}:3"), ("B1", f"{b}:1")]
    assert summary.inputs == [str(a), str(b)]
    check_invariants(out, summary, 6)


# ------------------------------------------------------------------------- invalid records


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (">P1\nMK*V\n", "internal-stop"),
        (">P1\nMK-V\n", "alignment-gap"),
        (">P1\nMK.V\n", "alignment-gap"),
        (">P1\nMK1V\n", "invalid-character"),
        (">P1\n\n", "empty-sequence"),
    ],
)
def test_invalid_record_stops_the_run_and_leaves_nothing(tmp_path: Path, body: str, reason: str) -> None:
    src = write(tmp_path / "in.fa", ">OK\nMKV\n" + body.replace("P1", "P1 desc"))
    out = tmp_path / "out"
    with pytest.raises(InputError) as err:
        shard_fasta([src], out=out, tokens_per_shard=100, quiet=True)
    assert str(err.value).startswith(f"{src}:")
    assert "record 'P1'" in str(err.value)
    assert not out.exists()
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (">P1\nMK*V\n", "internal-stop"),
        (">P1\nMK-V\n", "alignment-gap"),
        (">P1\nMK1V\n", "invalid-character"),
        (">P1\n>P2\nMK\n", "empty-sequence"),
    ],
)
def test_on_invalid_skip_records_reason(tmp_path: Path, body: str, reason: str) -> None:
    src = write(tmp_path / "in.fa", ">OK\nMKV\n" + body)
    out = tmp_path / "out"
    summary = shard_fasta([src], out=out, tokens_per_shard=100, on_invalid="skip", quiet=True)
    rows = {r["id"]: r for r in manifest(out)}
    assert rows["P1"]["status"] == f"skipped:{reason}"
    assert rows["P1"]["shard"] == ""
    assert summary.skipped == {reason: 1}
    assert shards_json(out)["counts"]["skipped_by_reason"] == {reason: 1}
    assert f"{reason}" in summary.render()
    check_invariants(out, summary, 100)


def test_everything_skipped_gives_zero_shards(tmp_path: Path) -> None:
    src = write(tmp_path / "in.fa", ">P1\nM-K\n>P2\n*\n")
    out = tmp_path / "out"
    summary = shard_fasta([src], out=out, tokens_per_shard=100, on_invalid="skip", quiet=True)
    assert summary.n_shards == 0 and summary.unique == 0 and summary.records == 2
    assert shards_json(out)["shards"] == []
    assert len(manifest(out)) == 2
    check_invariants(out, summary, 100)


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ("junk\n>P1\nMK\n", r":1: text before the first '>' header"),
        (">P1\nMK\n>\nMK\n", r":3: empty header"),
        (">P1\nMK\n>P1\nWW\n", r"duplicate ID 'P1'"),
    ],
)
def test_structural_errors_fail_even_with_skip(tmp_path: Path, body: str, match: str) -> None:
    src = write(tmp_path / "in.fa", body)
    out = tmp_path / "out"
    with pytest.raises(InputError, match=match):
        shard_fasta([src], out=out, tokens_per_shard=100, on_invalid="skip", quiet=True)
    assert not out.exists() and leftovers(tmp_path) == []


def test_bad_arguments(tmp_path: Path) -> None:
    src = write(tmp_path / "in.fa", ">P1\nMK\n")
    with pytest.raises(InputError, match="--on-invalid must be one of error, skip"):
        shard_fasta([src], out=tmp_path / "o", tokens_per_shard=10, on_invalid="ignore")
    with pytest.raises(InputError, match="--tokens-per-shard"):
        shard_fasta([src], out=tmp_path / "o", tokens_per_shard=0)
    with pytest.raises(InputError, match="no input"):
        shard_fasta([], out=tmp_path / "o", tokens_per_shard=10)
    with pytest.raises(InputError, match=r"missing\.fa: no such file"):
        shard_fasta([src, tmp_path / "missing.fa"], out=tmp_path / "o", tokens_per_shard=10)
    with pytest.raises(InputError, match="not a directory"):
        shard_fasta([src], out=src, tokens_per_shard=10)
    with pytest.raises(InputError, match="no FASTA records"):
        shard_fasta([write(tmp_path / "empty.fa", "")], out=tmp_path / "o", tokens_per_shard=10)
    assert not (tmp_path / "o").exists() and leftovers(tmp_path) == []


# ---------------------------------------------------------------------- replacing a run


def test_rerun_replaces_shards_and_removes_stale_ones(tmp_path: Path) -> None:
    src = write(tmp_path / "in.fa", "".join(f">P{i}\n{'A' * (i + 1)}\n" for i in range(10)))
    out = tmp_path / "out"
    first = shard_fasta([src], out=out, tokens_per_shard=10, quiet=True)
    assert first.n_shards > 3
    (out / "notes.txt").write_text("mine")
    second = shard_fasta([src], out=out, tokens_per_shard=1000, quiet=True)
    assert second.n_shards == 1
    assert sorted(p.name for p in out.iterdir()) == ["manifest.tsv", "notes.txt", "shard-00000.fasta", "shards.json"]
    check_invariants(out, second, 1000)
    assert leftovers(tmp_path) == []


def test_failed_rerun_keeps_previous_run(tmp_path: Path) -> None:
    src = write(tmp_path / "in.fa", ">P1\nMK\n>P2\nMKV\n")
    out = tmp_path / "out"
    shard_fasta([src], out=out, tokens_per_shard=5, quiet=True)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    bad = write(tmp_path / "bad.fa", ">P1\nMK\n>P2\nM1\n")
    with pytest.raises(InputError):
        shard_fasta([bad], out=out, tokens_per_shard=1000, quiet=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert leftovers(tmp_path) == []


def test_new_output_directory_gets_normal_permissions(tmp_path: Path) -> None:
    src = write(tmp_path / "in.fa", ">P1\nMK\n")
    out = tmp_path / "deep" / "out"
    shard_fasta([src], out=out, tokens_per_shard=5, quiet=True)
    assert out.stat().st_mode & 0o777 == (tmp_path / "deep").stat().st_mode & 0o777


# --------------------------------------------------------------------------------- summary


def test_summary_is_data_and_renders_one_screen(tmp_path: Path) -> None:
    src = write(tmp_path / "in.fa", ">A\nmkv\n>B\nMKV\n>C\nM-V\n>D\nMJ*\n")
    summary = shard_fasta([src], out=tmp_path / "out", tokens_per_shard=100, on_invalid="skip", quiet=True)
    assert (summary.records, summary.unique, summary.duplicates) == (4, 2, 1)
    assert summary.skipped == {"alignment-gap": 1}
    assert summary.normalised == {"uppercased": 1, "stop-stripped": 1, "J-to-X": 1}
    assert (summary.residues, summary.tokens, summary.n_shards) == (5, 9, 1)
    text = summary.render()
    assert len(text.splitlines()) <= 24
    for needle in ("4 records", "unique", "duplicates", "skipped", "alignment-gap", "uppercased", "J-to-X", "shards", "residues"):
        assert needle in text
    assert dataclasses.asdict(summary)["records"] == 4


# ------------------------------------------------------------------- property-based check

residues = st.text(alphabet="ACDEFGHIKLMNPQRSTVWYacdexj", min_size=0, max_size=25)
record = st.one_of(
    residues.map(lambda s: s + "*" if len(s) % 3 == 0 else s),  # sometimes a trailing stop
    st.sampled_from(["MK-V", "AC1", "A*C"]),  # invalid
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seqs=st.lists(st.one_of(record, st.sampled_from(["MKV", "mkv", "WW", "MKV*"])), min_size=1, max_size=30),
    budget=st.integers(min_value=1, max_value=60),
    files=st.integers(min_value=1, max_value=3),
)
def test_property_every_record_once_shards_partition_and_order(
    tmp_path_factory: pytest.TempPathFactory, seqs: list[str], budget: int, files: int
) -> None:
    tmp = tmp_path_factory.mktemp("prop")
    paths = []
    for f in range(files):
        part = [(i, s) for i, s in enumerate(seqs) if i % files == f]
        paths.append(write(tmp / f"in{f}.fa", "".join(f">R{i} d\n{s[:7]}\n{s[7:]}\n" for i, s in part)))
    order = [f"R{i}" for f in range(files) for i in range(len(seqs)) if i % files == f]
    out = tmp / "out"
    summary = shard_fasta(paths, out=out, tokens_per_shard=budget, on_invalid="skip", quiet=True)
    rows = manifest(out)
    # every input record appears exactly once, in input order
    assert [r["id"] for r in rows] == order
    assert summary.records == len(seqs) == summary.unique + summary.duplicates + summary.n_skipped
    # the unique sequences are exactly the distinct normalised valid ones
    normalised = {r["sequence_sha256"] for r in rows if not r["status"].startswith("skipped")}
    assert len(normalised) == summary.unique
    check_invariants(out, summary, budget)



# --------------------------------------------------------------- issue 11: nothing lost

CR_ONLY = b">x\rMKVLAA\r>y\rMSTNPK\r>z\rMAAAA\r"
LONE_CR = b">a\nMKVLAA\r>b\nMSTNPK\n>c\nMAAAA\n"


@pytest.mark.parametrize("block_size", [1, 2, 3, 5, None])
@pytest.mark.parametrize("on_invalid", ["skip", "error"])
def test_cr_line_endings_keep_every_header(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, block_size: int | None, on_invalid: str
) -> None:
    if block_size is not None:
        import embedpipe.shard.index

        monkeypatch.setattr(embedpipe.shard.index, "iter_fasta", functools.partial(iter_fasta, block_size=block_size))
    good = write(tmp_path / "good.fa", ">g1\nMKVLLA\n")
    cr3 = tmp_path / "cr3.fa"
    cr3.write_bytes(CR_ONLY)
    mixed = tmp_path / "mixed.fa"
    mixed.write_bytes(LONE_CR)
    out = tmp_path / "o"
    summary = shard_fasta([good, cr3, mixed], out=out, tokens_per_shard=100, on_invalid=on_invalid, quiet=True)
    rows = manifest(out)
    assert [(r["id"], r["source"], r["status"]) for r in rows] == [
        ("g1", f"{good}:1", "ok"),
        ("x", f"{cr3}:1", "ok"),
        ("y", f"{cr3}:3", "ok"),
        ("z", f"{cr3}:5", "ok"),
        ("a", f"{mixed}:1", "duplicate"),
        ("b", f"{mixed}:3", "duplicate"),
        ("c", f"{mixed}:5", "duplicate"),
    ]
    assert [r["sequence_sha256"] for r in rows[4:]] == [sha("MKVLAA"), sha("MSTNPK"), sha("MAAAA")]
    assert shards_json(out)["counts"]["records"] == 7 == summary.records
    check_invariants(out, summary, 100)


def test_input_inside_out_is_refused_before_anything_changes(tmp_path: Path) -> None:
    src = write(tmp_path / "in.fa", "".join(f">P{i}\n{'A' * (i + 1)}\n" for i in range(6)))
    out = tmp_path / "out"
    shard_fasta([src], out=out, tokens_per_shard=6, quiet=True)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    inside = out / "shard-00003.fasta"
    with pytest.raises(InputError, match=rf"^{inside}: lies inside --out {out}, which shard replaces"):
        shard_fasta([inside], out=out, tokens_per_shard=1000, quiet=True)
    # through a symlink to the output directory, and with --out itself a symlink
    link = tmp_path / "link"
    link.symlink_to(out)
    with pytest.raises(InputError, match="lies inside --out"):
        shard_fasta([link / "shard-00003.fasta"], out=out, tokens_per_shard=1000, quiet=True)
    with pytest.raises(InputError, match="lies inside --out"):
        shard_fasta([src, inside], out=link, tokens_per_shard=1000, quiet=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert leftovers(tmp_path) == []


def test_same_file_given_twice_is_named(tmp_path: Path) -> None:
    src = write(tmp_path / "in.fa", ">P1\nMK\n")
    with pytest.raises(InputError, match=rf"^{src}: was given twice; give each input file once$"):
        shard_fasta([src, src], out=tmp_path / "o", tokens_per_shard=10)
    alias = tmp_path / "alias.fa"
    alias.symlink_to(src)
    with pytest.raises(InputError, match=rf"^{alias}: was given twice \(as {src} and {alias}\)"):
        shard_fasta([src, alias], out=tmp_path / "o", tokens_per_shard=10)
    assert not (tmp_path / "o").exists()


def test_fifo_input_says_shard_needs_a_regular_file(tmp_path: Path) -> None:
    fifo = tmp_path / "in.fifo"
    os.mkfifo(fifo)
    with pytest.raises(InputError, match=rf"^{fifo}: is a pipe \(FIFO\); shard needs a regular file"):
        shard_fasta([fifo], out=tmp_path / "o", tokens_per_shard=10)
    assert not (tmp_path / "o").exists()


def test_non_utf8_input_path_is_written_escaped(tmp_path: Path) -> None:
    src = write(tmp_path / os.fsdecode(b"bad\xffname.fa"), ">P1\nMK\n")
    out = tmp_path / "out"
    summary = shard_fasta([src], out=out, tokens_per_shard=10, quiet=True)
    assert manifest(out)[0]["source"] == f"{tmp_path}/bad\\xffname.fa:1"
    assert shards_json(out)["inputs"] == [f"{tmp_path}/bad\\xffname.fa"]
    summary.render().encode("utf-8")


# ---------------------------------------------------------------- manifest.tsv escaping

ODD_NAMES = ["tab\there.fa", "new\nline.fa", 'quo"te.fa', "back\\slash.fa", "cr\rhere.fa", '"lead.fa', "plain.fa"]


def test_manifest_round_trip_with_odd_paths_and_ids(tmp_path: Path) -> None:
    paths = []
    for k, name in enumerate(ODD_NAMES):
        d = tmp_path / f"d{k}"
        d.mkdir()
        paths.append(write(d / name, f'>id{k}"q\\x desc\nMK{"A" * k}\n>dup{k}\nMK{"A" * k}\n'))
    out = tmp_path / "out"
    shard_fasta(paths, out=out, tokens_per_shard=100, quiet=True)
    want = []
    for k, path in enumerate(paths):
        seq = "MK" + "A" * k
        want.append([f'id{k}"q\\x', f"{path}:1", str(len(seq)), sha(seq), "0", "ok", "", ""])
        want.append([f"dup{k}", f"{path}:3", str(len(seq)), sha(seq), "0", "duplicate", f'id{k}"q\\x', ""])
    with open(out / "manifest.tsv", encoding="utf-8", newline="") as fh:
        text = fh.read()
    # the bytes are what Python's csv writer makes of these cells when it also quotes a lone CR
    # (3.11's writer quotes only the line terminator's characters; no cell here holds CRLF)
    expected = io.StringIO()
    csv.writer(expected, **{**DIALECT, "lineterminator": "\r\n"}).writerows([list(MANIFEST_COLUMNS), *want])
    assert text == expected.getvalue().replace("\r\n", "\n")
    # and three readers agree: csv, embedpipe.shard.manifest, pandas
    assert [list(r.values()) for r in manifest(out)] == want
    assert [list(r.values()) for _, r in iter_manifest(out / "manifest.tsv")] == want
    pandas = pytest.importorskip("pandas")
    frame = pandas.read_csv(out / "manifest.tsv", sep="\t", dtype=str, keep_default_na=False)
    assert list(frame.columns) == list(MANIFEST_COLUMNS)
    assert frame.values.tolist() == want


@given(cell=st.text(alphabet=st.sampled_from(list('ab \t\n\r"\\,\'x')), max_size=12))
def test_quote_round_trips_and_matches_the_csv_writer(cell: str) -> None:
    line = f"x\t{quote(cell)}\ty\n"
    assert list(csv.reader(io.StringIO(line, newline=""), **DIALECT)) == [["x", cell, "y"]]
    expected = io.StringIO()
    csv.writer(expected, **DIALECT).writerow(["x", cell, "y"])
    if "\r" not in cell:  # Python 3.11's writer leaves a lone CR bare, which its reader then splits at
        assert line == expected.getvalue()
    assert quote_all(["x", cell]) == ["x", quote(cell)]


def test_manifest_reader_names_bad_lines(tmp_path: Path) -> None:
    path = tmp_path / "m.tsv"
    path.write_text("id\tstatus\tsequence_sha256\tshard\na\tok\tff\t0\nb\tok\tff\n")
    with pytest.raises(StoreError, match=rf"^manifest {path} line 3: 3 fields, header has 4$"):
        list(iter_manifest(path))
    path.write_text('id\tstatus\tsequence_sha256\tshard\n"a\nb"\tok\tff\t0\n\nc\tok\tff\n')
    with pytest.raises(StoreError, match=rf"^manifest {path} line 5: 3 fields"):
        list(iter_manifest(path))
    path.write_bytes(b"id\tstatus\tsequence_sha256\tshard\na\tok\tff\t0\n\xfe\tok\tff\t0\n")
    with pytest.raises(StoreError, match=rf"^manifest {path} line 3: not UTF-8 text \(byte 0xfe at column 1\)$"):
        list(iter_manifest(path))
    path.write_text("")
    with pytest.raises(StoreError, match="empty"):
        list(iter_manifest(path))


# ------------------------------------------------------------ spool cleanup, full disk


def test_sigterm_removes_the_spool_and_restores_the_handler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import embedpipe.shard.passes

    src = write(tmp_path / "in.fa", ">P1\nMK\n")
    seen: list[Path] = []

    def killed(paths: list[Path], tmp: Path, *args: object) -> None:
        (tmp / ".spool").write_bytes(b"x" * 1000)
        seen.append(tmp)
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):  # the handler runs at the next bytecode boundary
            pass
        raise AssertionError("SIGTERM did not stop the run")

    monkeypatch.setattr(embedpipe.shard.passes, "_run", killed)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as exc:
        shard_fasta([src], out=tmp_path / "out", tokens_per_shard=10, quiet=True)
    assert exc.value.code == 128 + signal.SIGTERM
    assert seen and not seen[0].exists()
    assert leftovers(tmp_path) == [] and not (tmp_path / "out").exists()
    assert signal.getsignal(signal.SIGTERM) == before


def test_stale_spools_of_dead_processes_are_removed(tmp_path: Path) -> None:
    import embedpipe.shard.output

    dead = subprocess.run(["true"], check=True)  # noqa: S603, S607
    proc = subprocess.Popen(["true"])  # noqa: S603, S607
    proc.wait()
    dead_pid, live_pid = proc.pid, os.getppid()
    del dead
    host = embedpipe.shard.output.host_tag()
    stale = [f".out.tmp-{dead_pid}-{host}-0a1b2c3d", f".out.tmp-{dead_pid}-deadbeef"]  # new and old names
    kept = [
        f".out.tmp-{live_pid}-{host}-0a1b2c3d",  # a live run
        f".out.tmp-{dead_pid}-{'0' * 8 if host != '0' * 8 else '1' * 8}-0a1b2c3d",  # another host's
        f".other.tmp-{dead_pid}-{host}-0a1b2c3d",  # another output directory's
    ]
    for name in stale + kept:
        (tmp_path / name).mkdir()
        (tmp_path / name / ".spool").write_bytes(b"x")
    src = write(tmp_path / "in.fa", ">P1\nMK\n")
    shard_fasta([src], out=tmp_path / "out", tokens_per_shard=10, quiet=True)
    assert leftovers(tmp_path) == sorted(kept)


def _mount_tmpfs(where: Path, size: str) -> bool:
    where.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],  # noqa: S603, S607
                          capture_output=True, check=False)
    return proc.returncode == 0


@pytest.mark.parametrize("size", ["64k", "1m"])
def test_full_disk_names_the_path_and_leaves_nothing(tmp_path: Path, size: str) -> None:
    small = tmp_path / "small"
    if not _mount_tmpfs(small, size):
        pytest.skip("cannot mount a tmpfs here (needs root); the full-disk path is not exercised")
    try:
        rng = random.Random(0)
        body = "".join(f">P{i}\n{''.join(rng.choice('ACDEFGHIKLMNPQRSTVWY') for _ in range(300))}\n" for i in range(4000))
        src = write(tmp_path / "in.fa", body)
        out = small / "out"
        with pytest.raises(EmbedpipeError) as err:
            shard_fasta([src], out=out, tokens_per_shard=50_000, quiet=True)
        message = str(err.value)
        # named by the output it becomes, with the hidden work directory it was written in
        assert message.startswith(f"cannot write {out} (") and message.endswith("): No space left on device")
        assert f" in the work directory {small}/.out.tmp-" in message
        assert "\n" not in message
        assert list(small.iterdir()) == []
    finally:
        subprocess.run(["umount", str(small)], check=False)  # noqa: S603, S607


def test_summary_counts_end_in_one_column(tmp_path: Path) -> None:
    src = tmp_path / "in.fa"
    src.write_text(">a\nMKV\n>b\nMK-V\n>c\nMK1V\n>d\nmkv\n>e\nMKV*A\n")
    text = shard_fasta([src], out=tmp_path / "out", tokens_per_shard=100, on_invalid="skip", quiet=True).render()
    rows = [line for line in text.splitlines()[1:] if line.startswith("  ")]
    ends = {re.match(r"\s+\S+(?: \S+)?\s+[\d,]+", line).end() for line in rows}
    assert len(ends) == 1, text
    assert "invalid-character" in text and "internal-stop" in text
