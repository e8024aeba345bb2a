"""Issue 30 (integrity round 4), store side: crafted stores give one embedpipe error line or
one validate problem, never a traceback: count attributes against the rows (``merged_rows``
of 10^12 on 20 records), JSON attributes nested 100,000 deep, bytes that are not UTF-8."""

from __future__ import annotations

import subprocess
from pathlib import Path

import h5py
import numpy as np
import pytest
from test_store import synthetic, write_store

from embedpipe.core.errors import StoreError
from embedpipe.store import merge_stores, open_store, store_info, validate_store
from helpers.processes import run_cli
from helpers.stores import edit_store, set_row

DEEP = "[" * 100_000 + "]" * 100_000


@pytest.fixture
def store(tmp_path: Path) -> Path:
    records, rows = synthetic(20)
    return write_store(tmp_path / "s.h5", records, rows)





def one_line(result: subprocess.CompletedProcess) -> str:
    """The one ``embedpipe: error:`` line of a failed command (no traceback)."""
    assert result.returncode != 0, result.stdout
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("embedpipe: ")]
    assert len(lines) == 1, result.stderr
    return lines[0]


# ----------------------------------------------------------------------------- the quoting helper


def test_quote_shortens_long_values_and_keeps_short_ones():
    from embedpipe.core.errors import quote

    assert quote("P12345") == "'P12345'"
    assert quote("a\nb") == "'a\\nb'"
    assert quote("x" * 200_000) == repr("x" * 80) + "... (200000 chars)"


# ----------------------------------------------------------------------------- 2: count attributes


def test_validate_refuses_merged_rows_of_1e12(results, tmp_path):
    root, paths, records, manifest = results
    out = root / "embeddings.h5"
    merge_stores(paths, out=out, manifest=manifest)
    assert validate_store(out) == []

    def huge(f):
        rows = f.attrs["merged_rows"].copy()
        rows[-1] = 10**12
        f.attrs["merged_rows"] = rows
    edit_store(out, huge)
    problems = validate_store(out)
    assert "root attribute merged_rows runs from 0 to 1000000000000, expected 0 to 15 (the store's records) " \
           "without decreasing" in problems, problems


def test_validate_refuses_merged_rows_of_the_wrong_length_and_counts_that_disagree(results):
    root, paths, records, manifest = results
    out = root / "embeddings.h5"
    merge_stores(paths, out=out, manifest=manifest)

    def crafted(f):
        f.attrs["merged_rows"] = np.array([0, 15], dtype=np.int64)
        f.attrs["alias_count"] = np.int64(10**12)
        f.attrs["skipped_count"] = np.int64(0)
        f.attrs["reused_count"] = np.int64(-1)
    edit_store(out, crafted)
    problems = validate_store(out)
    assert "root attribute merged_rows has 2 value(s) of type int64, expected 4 integers (one start per " \
           "merged_from source, then N)" in problems, problems
    assert "root attribute alias_count is 1000000000000, but dataset aliases/id holds 2 rows" in problems
    assert "root attribute skipped_count is 0, but dataset skipped/id holds 2 rows" in problems
    assert "root attribute reused_count is -1, outside 0..15 (the store's records)" in problems


def test_fallback_count_past_the_records_is_a_problem(store):
    edit_store(store, lambda f: f.attrs.__setitem__("fallback_count", np.int64(10**12)))
    assert validate_store(store) == ["root attribute fallback_count is 1000000000000, outside 0..20 (the store's "
                                     "records)"]


# ----------------------------------------------------------------------------- 3: nested JSON


def test_json_depth_ignores_brackets_inside_strings():
    from embedpipe.core.jsonbounds import MAX_JSON_DEPTH, json_depth
    from embedpipe.store.attrjson import load_json_attr

    assert json_depth('{"a": [1, {"b": "[[[[["}]}') == 3
    assert json_depth('["' + "[" * 1000 + '"]') == 1
    assert json_depth(DEEP) == 100_000
    assert load_json_attr('{"a": [1, 2]}', "config") == {"a": [1, 2]}
    with pytest.raises(StoreError, match=rf"^f\.h5: root attribute 'config' is JSON nested 100000 levels deep, "
                                         rf"more than {MAX_JSON_DEPTH}: refusing to parse it$"):
        load_json_attr(DEEP, "config", "f.h5")


def test_config_nested_100000_deep_is_one_line_everywhere(store, tmp_path):
    edit_store(store, lambda f: f.attrs.__setitem__("config", DEEP))
    want = (f"{store}: root attribute 'config' is JSON nested 100000 levels deep, more than 64: "
            "refusing to parse it")
    with pytest.raises(StoreError) as info:
        open_store(store)
    assert str(info.value) == want
    with pytest.raises(StoreError) as info:
        store_info(store)
    assert str(info.value) == want
    assert validate_store(store) == [want.removeprefix(f"{store}: ")]
    assert one_line(run_cli("info", str(store))) == f"embedpipe: error: {want}"
    assert one_line(run_cli("export", str(store), "--format", "npy", "--out", str(tmp_path / "x.npy"))).endswith(
        "root attribute 'config' is JSON nested 100000 levels deep, more than 64: refusing to parse it")
    assert not list(tmp_path.glob("x*"))


def test_merged_sources_nested_deep_is_one_line_at_open(results):
    root, paths, records, manifest = results
    out = root / "embeddings.h5"
    merge_stores(paths, out=out, manifest=manifest)
    edit_store(out, lambda f: f.attrs.__setitem__("merged_sources", DEEP))
    with pytest.raises(StoreError, match=r"embeddings\.h5: root attribute 'merged_sources' is JSON nested 100000 "
                                         r"levels deep"):
        open_store(out)
    assert any("'merged_sources' is JSON nested 100000 levels deep" in p for p in validate_store(out))


# ----------------------------------------------------------------------------- 4: not UTF-8


def test_an_id_that_is_not_utf8_names_the_dataset_and_row(store, tmp_path):
    edit_store(store, lambda f: set_row(f, "ids", 3, b"s0\xffr3"))
    want = "dataset ids row 3: b's0\\xffr3' is not valid UTF-8 (byte 0xff at position 2)"
    assert want in validate_store(store)
    with open_store(store) as st:
        with pytest.raises(StoreError) as info:
            list(st.ids)
        assert str(info.value) == f"{store}: {want}"
        with pytest.raises(StoreError, match=r"dataset ids row 3: b's0\\xffr3' is not valid UTF-8"):
            st.records()
    for fmt in ("npy", "h5-per-id", "parquet"):
        line = one_line(run_cli("export", str(store), "--format", fmt, "--out", str(tmp_path / f"x-{fmt}")))
        # and the ID index, which holds the ID as written (export checks it as validate does)
        assert line == (f"embedpipe: error: {store}: {want} (and 1 more problem(s)): export refuses a store embedpipe "
                        f"validate rejects; run embedpipe validate {store}"), line
    assert not list(tmp_path.glob("x-*")) and not list(tmp_path.glob(".x-*"))


def test_a_string_column_that_is_not_utf8_is_a_validate_problem_and_one_line_in_info(store, tmp_path):
    edit_store(store, lambda f: set_row(f, "precision_used", 2, b"fp\xff"))
    want = "dataset precision_used row 2: b'fp\\xff' is not valid UTF-8 (byte 0xff at position 2)"
    assert validate_store(store) == [want]
    with pytest.raises(StoreError) as info:
        store_info(store)
    assert str(info.value) == f"{store}: {want}"
    assert one_line(run_cli("info", str(store))) == f"embedpipe: error: {store}: {want}"
    with open_store(store) as st, pytest.raises(StoreError, match=r"dataset precision_used row 2: b'fp\\xff'"):
        st[st.ids[2]]


def test_a_sequence_that_is_not_utf8_names_the_row(store, tmp_path):
    def crafted(f):
        start = int(f["sequence/offsets"][5])
        f["sequence/data"][start] = 0xFF
    edit_store(store, crafted)
    assert any(p.startswith("dataset sequence row 5: b'\\xff") and "is not valid UTF-8" in p
               for p in validate_store(store)), validate_store(store)
    line = one_line(run_cli("export", str(store), "--format", "parquet", "--out", str(tmp_path / "x.parquet")))
    assert f"{store}: dataset sequence row 5: b'\\xff" in line and "is not valid UTF-8" in line


def test_merge_names_the_shard_whose_id_is_not_utf8(store, tmp_path):
    edit_store(store, lambda f: set_row(f, "ids", 3, b"s0\xffr3"))
    with pytest.raises(StoreError) as info:
        merge_stores([store], out=tmp_path / "m.h5")
    assert str(info.value) == f"{store}: dataset ids row 3: b's0\\xffr3' is not valid UTF-8 (byte 0xff at position 2)"
    assert not (tmp_path / "m.h5").exists()


def test_an_id_past_the_first_block_is_named_by_its_own_row(store, monkeypatch):
    """validate reads IDs in blocks of ID_ROWS; the line named the row within the block."""
    import embedpipe.store.id_checks as id_checks

    monkeypatch.setattr(id_checks, "ID_ROWS", 4)
    edit_store(store, lambda f: set_row(f, "ids", 14, b"s\nx"))
    assert any(p.startswith("dataset ids: id 's\\nx' (row 14) holds the control character \\n")
               for p in validate_store(store)), validate_store(store)


@pytest.mark.parametrize("fixed", [False, True])
def test_a_root_attribute_that_is_not_utf8_is_one_line(store, tmp_path, fixed):
    """h5py hands a variable-length attribute over with lone surrogates ('esm\\udcff'): info
    printed it (a traceback under a UTF-8 locale) and parquet's metadata could not encode it."""
    def crafted(f):
        del f.attrs["model_name"]
        dtype = h5py.string_dtype("utf-8", 4) if fixed else h5py.string_dtype("utf-8")
        f.attrs.create("model_name", np.array(b"esm\xff", dtype="S4" if fixed else object), dtype=dtype)
    edit_store(store, crafted)
    want = f"{store}: root attribute 'model_name': b'esm\\xff' is not valid UTF-8"
    with pytest.raises(StoreError) as info:
        open_store(store)
    assert str(info.value) == want
    assert validate_store(store) == [want.removeprefix(f"{store}: ")]
    assert one_line(run_cli("info", str(store))) == f"embedpipe: error: {want}"
    assert one_line(run_cli("export", str(store), "--format", "parquet", "--out", str(tmp_path / "x.parquet"))) == \
        f"embedpipe: error: {want}"


def test_validate_reports_a_refused_attribute_and_still_checks_the_rest(store):
    def crafted(f):
        f.attrs["config"] = DEEP
        f["mean/layer_2"][5, 1] = np.nan
    edit_store(store, crafted)
    problems = validate_store(store)
    assert problems[::2] == [
        "root attribute 'config' is JSON nested 100000 levels deep, more than 64: refusing to parse it",
        "dataset mean/layer_2: 1 row(s) with non-finite values (first at row 5)",
    ]
    # the edit in place, named by the row digest (tests/store/test_row_digest.py)
    assert len(problems) == 3 and problems[1].startswith("record 's0r5' (row 5): dataset mean/layer_2 holds other bytes")
