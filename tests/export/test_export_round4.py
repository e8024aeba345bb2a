"""Issue 30 (integrity round 4), build item 4: ``embedpipe export`` reads through validate's
checks. Crafted stores (edited with h5py) are refused in one line naming the store, the
row or ID and the check, and no output (nor a temporary) remains: an ID holding a newline gave
an ``ids.txt`` of more lines than rows, duplicate IDs and NaN means were exported, and
``h5-per-id`` crashed on a duplicate ID with a traceback."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from embedpipe.core.errors import StoreError
from embedpipe.core.export_formats import NAMES
from embedpipe.export import export_store
from embedpipe.store import EmbeddedRecord, merge_stores, validate_store
from helpers.processes import run_cli
from helpers.stores import edit_store, set_row, write_store

AMINO = "ACDEFGHIKLMNPQRSTVWY"
OUT = {"npy": "x.npy", "parquet": "x.parquet", "h5-per-id": "x.h5"}


def records(prefix: str, n: int, *, seed: int = 0, dim: int = 4) -> list[EmbeddedRecord]:
    """Records whose means are the fp32 means of their rows (validate checks that)."""
    out = []
    for i in range(n):
        length = 3 + (i * 5 + seed) % 7
        seq = "".join(AMINO[(i * 3 + j * 7 + seed) % 20] for j in range(length))
        grid = np.arange(length, dtype=np.float64)[:, None] * dim + np.arange(dim)[None, :]
        rows = {k: np.cos(grid * 0.05 + i + k + seed).astype(np.float32) for k in (1, 2)}
        out.append(EmbeddedRecord(id=f"{prefix}{i}", sequence=seq, precision_used="fp32", fallback_reason="",
                                  mean={k: rows[k].sum(axis=0, dtype=np.float32) / np.float32(length) for k in rows},
                                  per_residue=rows, max_abs_activation=1.0, embedded_length=length))
    return out


@pytest.fixture
def store(tmp_path: Path) -> Path:
    return write_store(tmp_path / "s.h5", records("r", 20))


@pytest.fixture
def merged(tmp_path: Path) -> Path:
    """A merged store of two shards with two aliases (``dupA1`` of ``a1``, ``dupB0`` of ``b0``)."""
    shards = [records("a", 6), records("b", 5, seed=1)]
    paths = [write_store(tmp_path / "stores" / f"shard-{k}.h5", recs) for k, recs in enumerate(shards)]
    lines = ["id\tsource\tlength\tsequence_sha256\tshard\tstatus\tduplicate_of\tnormalised"]
    for k, recs in enumerate(shards):
        lines += [f"{r.id}\tin.fa:1\t{len(r.sequence)}\t{hashlib.sha256(r.sequence.encode()).hexdigest()}\t{k}\tok\t\t"
                  for r in recs]
    for alias, target, k in (("dupA1", shards[0][1], 0), ("dupB0", shards[1][0], 1)):
        digest = hashlib.sha256(target.sequence.encode()).hexdigest()
        lines.append(f"{alias}\tin.fa:9\t{len(target.sequence)}\t{digest}\t{k}\tduplicate\t{target.id}\t")
    manifest = tmp_path / "manifest.tsv"
    manifest.write_text("\n".join(lines) + "\n")
    out = tmp_path / "embeddings.h5"
    merge_stores(paths, out=out, manifest=manifest)
    assert validate_store(out) == []
    return out





def refused(store: Path, fmt: str, out_dir: Path, *extra: str) -> str:
    """The one error line of ``embedpipe export``; nothing (no output, no temporary) written."""
    result = run_cli("export", str(store), "--format", fmt, "--out", str(out_dir / OUT[fmt]), *extra)
    assert result.returncode != 0, result.stdout
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("embedpipe: ")]
    assert len(lines) == 1, result.stderr
    assert sorted(p.name for p in out_dir.iterdir()) == [], list(out_dir.iterdir())
    return lines[0]


def out_dir(tmp_path: Path, name: str) -> Path:
    d = tmp_path / name
    d.mkdir()
    return d


# ----------------------------------------------------------------------------- IDs


@pytest.mark.parametrize("fmt", NAMES)
@pytest.mark.parametrize("bad, shown, ch", [(b"r\nx", "'r\\nx'", "\\n"), (b"r\rx", "'r\\rx'", "\\r")])
def test_an_id_with_a_line_break_is_refused_before_writing(store, tmp_path, fmt, bad, shown, ch):
    """(IDs here are at most 3 bytes wide: the crafted ID fits the stored width.)"""
    edit_store(store, lambda f: set_row(f, "ids", 3, bad))
    line = refused(store, fmt, out_dir(tmp_path, "o"))
    assert line == (f"embedpipe: error: {store}: dataset ids: id {shown} (row 3) holds the control character {ch}: "
                    "IDs may not contain control characters or line separators (an export's ids.txt would gain "
                    "lines) (and 1 more problem(s)): export refuses a store embedpipe validate rejects; "  # the ID index
                    f"run embedpipe validate {store}")


@pytest.mark.parametrize("fmt", NAMES)
def test_duplicate_ids_are_refused_before_writing(store, tmp_path, fmt):
    edit_store(store, lambda f: set_row(f, "ids", 3, b"r4"))
    line = refused(store, fmt, out_dir(tmp_path, "o"))
    assert line.startswith(f"embedpipe: error: {store}: ids are not unique (1 duplicated, e.g. 'r4' in row 3 and "
                           "row 4)"), line
    assert line.endswith(f"export refuses a store embedpipe validate rejects; run embedpipe validate {store}")


def test_an_alias_that_is_also_a_record_id_is_refused(merged, tmp_path):
    edit_store(merged, lambda f: set_row(f, "aliases/id", 0, b"a2"))
    with pytest.raises(StoreError) as info:
        export_store(merged, fmt="h5-per-id", out=tmp_path / "x.h5", quiet=True)
    assert str(info.value).startswith(f"{merged}: alias id 'a2' is also a record id"), info.value
    assert not list(tmp_path.glob("x*")) and not list(tmp_path.glob(".x*"))


def test_an_alias_id_with_a_newline_is_refused(merged, tmp_path):
    edit_store(merged, lambda f: set_row(f, "aliases/id", 1, b"du\nB0"))
    line = refused(merged, "npy", out_dir(tmp_path, "o"))
    assert f"{merged}: dataset aliases/id: id 'du\\nB0' (row 1) holds the control character \\n" in line, line


def test_a_merged_store_with_clean_ids_still_exports_every_input_id(merged, tmp_path):
    summary = export_store(merged, fmt="npy", out=tmp_path / "x.npy", quiet=True)
    assert (summary.records, summary.aliases) == (11, 2)
    assert len((tmp_path / "x.ids.txt").read_text().splitlines()) == np.load(tmp_path / "x.npy").shape[0] == 13


# ----------------------------------------------------------------------------- values


@pytest.mark.parametrize("fmt", NAMES)
@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_a_non_finite_mean_is_refused_and_no_partial_output_remains(store, tmp_path, fmt, value):
    edit_store(store, lambda f: f["mean/layer_2"].__setitem__((5, 1), value))
    line = refused(store, fmt, out_dir(tmp_path, "o"))
    assert line == (f"embedpipe: error: {store}: dataset mean/layer_2: record 'r5' (row 5) holds non-finite values "
                    f"(1 row(s) of this block): export refuses them; run embedpipe validate {store}")


def test_a_non_finite_per_residue_row_names_the_record(store, tmp_path):
    def crafted(f):
        start = int(f["per_residue/offsets"][7])
        f["per_residue/layer_1"][start + 2, 0] = np.nan
    edit_store(store, crafted)
    line = refused(store, "npy", out_dir(tmp_path, "o"), "--per-residue", "--layer", "1")
    assert line == (f"embedpipe: error: {store}: dataset per_residue/layer_1: record 'r7' (row 7, per-residue row 2) "
                    f"holds non-finite values (1 row(s) of this block): export refuses them; run embedpipe validate "
                    f"{store}")


def test_a_refusal_in_a_later_block_leaves_the_previous_export_untouched(store, tmp_path):
    """Refused while streaming (block 3 of 4): the earlier, complete export stays as it was,
    and no temporary or half-written file remains."""
    export_store(store, fmt="npy", out=tmp_path / "x.npy", quiet=True)
    before = {p.name: p.read_bytes() for p in tmp_path.glob("x*")}
    edit_store(store, lambda f: f["mean/layer_2"].__setitem__((17, 0), np.nan))
    row_bytes = 4 * 4
    with pytest.raises(StoreError, match=r"dataset mean/layer_2: record 'r17' \(row 17\) holds non-finite"):
        export_store(store, fmt="npy", out=tmp_path / "x.npy", quiet=True, block_bytes=5 * row_bytes)
    assert {p.name: p.read_bytes() for p in tmp_path.glob("x*")} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*before, "s.h5"])


@pytest.mark.parametrize("fmt", NAMES)
def test_an_empty_id_is_refused_before_writing(store, tmp_path, fmt):
    edit_store(store, lambda f: set_row(f, "ids", 6, b""))
    line = refused(store, fmt, out_dir(tmp_path, "o"))
    assert line == (f"embedpipe: error: {store}: ids contains an empty id (row 6) (and 1 more problem(s)): export "
                    "refuses a store embedpipe "
                    f"validate rejects; run embedpipe validate {store}")
