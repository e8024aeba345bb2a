"""The per-record column registry drives the writer, the reader, merge and validate; readers
check the encoding tags they write (docs/store-format.md, "Datasets", "File level")."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np
import pytest
from test_merge import synthetic, write

import embedpipe
from embedpipe.core.errors import StoreError
from embedpipe.store import EmbeddedRecord, merge_stores, validate_store
from embedpipe.store.columns import COLUMNS, STR, Column

ARCHIVED_V1 = Path(__file__).resolve().parents[1] / "data" / "store-v1-example.h5"


@dataclass
class TimedRecord(EmbeddedRecord):
    """EmbeddedRecord plus two per-record fields, as a later format version might add them."""

    seconds: float = float("nan")
    note: str = "n/a"


@pytest.fixture
def extra_columns(monkeypatch):
    """Register two optional columns (added additively: older stores lack them)."""
    monkeypatch.setitem(COLUMNS, "seconds", Column("seconds", "float32", float("nan"), required_since=None))
    monkeypatch.setitem(COLUMNS, "note", Column("note", STR, "n/a", required_since=None))


def timed(records: list[EmbeddedRecord], base: float) -> list[TimedRecord]:
    return [TimedRecord(**vars(r), seconds=base + i, note=f"run-{base:g}-{i}") for i, r in enumerate(records)]


def test_an_added_column_is_written_read_merged_and_validated(tmp_path, extra_columns):
    a = timed(synthetic("a", 4, start_len=10), 1.0)
    b = timed(synthetic("b", 3, start_len=20, seed=1), 10.0)
    paths = [write(tmp_path / "a.h5", a), write(tmp_path / "b.h5", b)]
    assert [validate_store(p) for p in paths] == [[], []]
    with h5py.File(paths[0]) as f:
        assert f["seconds"].dtype == np.float32 and f["seconds"].fletcher32
        assert f["seconds"].attrs["encoding-type"] == "array" and f["note"].attrs["encoding-type"] == "fixed-utf8-array"
    with embedpipe.open_store(paths[0]) as store:
        assert store["a2"]["seconds"] == 3.0 and store["a2"]["note"] == "run-1-2"
        table = store.records()
        np.testing.assert_array_equal(table["seconds"], [1.0, 2.0, 3.0, 4.0])
        assert list(table["note"]) == [r.note for r in a]
    merged = merge_stores(paths, out=tmp_path / "m.h5").out
    assert validate_store(merged) == []
    with embedpipe.open_store(merged) as store:
        np.testing.assert_array_equal(store.records()["seconds"], [r.seconds for r in a + b])
        assert store["b1"]["note"] == "run-10-1"


def test_stores_without_an_added_column_read_it_as_its_default(tmp_path, monkeypatch):
    old = write(tmp_path / "old.h5", synthetic("o", 3, start_len=10))  # before the columns exist
    monkeypatch.setitem(COLUMNS, "seconds", Column("seconds", "float32", float("nan"), required_since=None))
    monkeypatch.setitem(COLUMNS, "note", Column("note", STR, "n/a", required_since=None))
    archived = tmp_path / "v1.h5"
    shutil.copy(ARCHIVED_V1, archived)
    for path in (old, archived):
        assert validate_store(path) == []
        with embedpipe.open_store(path) as store:
            first = store.ids[0]
            assert np.isnan(store[first]["seconds"]) and store[first]["note"] == "n/a"
            table = store.records()
            assert np.isnan(table["seconds"]).all() and set(table["note"]) == {"n/a"}
    new = write(tmp_path / "new.h5", timed(synthetic("n", 2, start_len=30, seed=2), 5.0))
    merged = merge_stores([old, new], out=tmp_path / "m.h5").out
    assert validate_store(merged) == []
    with embedpipe.open_store(merged) as store:
        table = store.records()
        np.testing.assert_array_equal(table["seconds"], [np.nan] * 3 + [5.0, 6.0])
        assert list(table["note"]) == ["n/a"] * 3 + ["run-5-0", "run-5-1"]


@pytest.mark.parametrize("since, required", [(1, True), (4, False)])
def test_validate_and_merge_require_what_the_stores_version_requires(tmp_path, monkeypatch, since, required):
    """A column required from format 1 must be in a (format 3) store; one required from format 4 need not."""
    store = write(tmp_path / "s.h5", synthetic("s", 3, start_len=10))
    monkeypatch.setitem(COLUMNS, "seconds", Column("seconds", "float32", float("nan"), required_since=since))
    problems = validate_store(store)
    assert problems == (["dataset seconds is missing"] if required else [])
    if required:
        with pytest.raises(StoreError, match="missing dataset"):
            merge_stores([store], out=tmp_path / "m.h5")
    else:
        assert validate_store(merge_stores([store], out=tmp_path / "m.h5").out) == []


def retag(path: Path, name: str, **attrs: str) -> Path:
    with h5py.File(path, "a") as f:
        for key, value in attrs.items():
            f[name].attrs[key.replace("_", "-")] = value
    return path


@pytest.mark.parametrize(
    "name, attrs, message",
    [
        ("mean/layer_2", {"encoding_type": "sparse-array"},
         "dataset mean/layer_2 has encoding-type 'sparse-array', which this embedpipe does not read"),
        ("ids", {"encoding_version": "4"},
         "dataset ids has encoding-version 4: written by a newer embedpipe (format 4); upgrade embedpipe"),
        ("per_residue", {"encoding_type": "csr-layers"}, "group per_residue has encoding-type 'csr-layers'"),
        ("per_residue/offsets", {"encoding_version": "4.0"}, "dataset per_residue/offsets has encoding-version 4"),
        ("/", {"encoding_version": "4"}, "root group has encoding-version 4: written by a newer embedpipe"),
        ("precision_used", {"encoding_type": "array"}, "dataset precision_used has encoding-type 'array'"),
    ],
)
def test_unknown_or_newer_encodings_are_refused(tmp_path, name, attrs, message):
    path = retag(write(tmp_path / "s.h5", synthetic("s", 3, start_len=10)), name, **attrs)
    with pytest.raises(StoreError, match="^" + str(path).replace(".", r"\.") + ": .*"):
        embedpipe.open_store(path)
    with pytest.raises(StoreError) as exc:
        embedpipe.open_store(path)
    assert message in str(exc.value)
    assert any(message in p for p in validate_store(path)), validate_store(path)
    with pytest.raises(StoreError) as exc:
        merge_stores([path], out=tmp_path / "m.h5")
    assert message in str(exc.value)


def test_objects_without_tags_still_read(tmp_path):
    """Tags are checked when present; a store whose tags were stripped reads by name and dtype."""
    path = write(tmp_path / "s.h5", synthetic("s", 3, start_len=10))
    with h5py.File(path, "a") as f:
        for obj in [f, *(f[name] for name in _names(f))]:
            for key in ("encoding-type", "encoding-version"):
                del obj.attrs[key]
    assert validate_store(path) == []
    with embedpipe.open_store(path) as store:
        assert store.ids == ["s0", "s1", "s2"]


def _names(f: h5py.File) -> list[str]:
    names: list[str] = []
    f.visit(names.append)
    return names
