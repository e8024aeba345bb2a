"""Store format v1: writer (atomic, any row order, storage dtypes), info, validate, old files."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import h5py
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from embedpipe.core.errors import StoreError
from embedpipe.store import (
    FORMAT,
    FORMAT_VERSION,
    EmbeddedRecord,
    StoreWriter,
    render_info,
    store_info,
    validate_store,
)
from helpers.embed_helpers import flip_byte_in_chunk
from helpers.stores import ATTRS, as_format2, write_store

DATA = Path(__file__).resolve().parents[1] / "data"
ARCHIVED_V1 = DATA / "store-v1-example.h5"
AMINO = "ACDEFGHIKLMNPQRSTVWY"


# --------------------------------------------------------------------------- synthetic records


def synthetic(n: int, *, dim: int = 4, layers=(0, 2), seed: int = 0, per_residue: bool = True,
              truncate_every: int = 0, legacy_means: bool = False) -> tuple[list[EmbeddedRecord], list[int] | None]:
    """Deterministic records built from arithmetic only (stable across numpy versions).

    With per-residue rows, each mean is their fp32 mean, as the worker computes it;
    ``legacy_means`` gives the unrelated means the archived v1 example was written with."""
    records, rows = [], []
    for i in range(n):
        length = 2 + (i * 7 + seed) % 9
        seq = "".join(AMINO[(i + j + seed) % 20] for j in range(length))
        truncated = bool(truncate_every) and i % truncate_every == truncate_every - 1
        emb = length - 1 if truncated else length
        base = np.arange(dim, dtype=np.float64)
        mean = {k: np.sin(base * (i + 1) + k + seed).astype(np.float32) for k in layers}
        pr = None
        if per_residue:
            grid = np.arange(emb, dtype=np.float64)[:, None] * dim + base[None, :]
            pr = {k: np.cos(grid * 0.37 + i + 10 * k + seed).astype(np.float32) for k in layers}
            if not legacy_means:
                mean = {k: pr[k].sum(axis=0, dtype=np.float32) / np.float32(emb) for k in layers}
        fallback = i % 4 == 3
        records.append(
            EmbeddedRecord(
                id=f"s{seed}r{i}",
                sequence=seq,
                precision_used="fp32" if fallback else "fp16-mixed",
                fallback_reason="nonfinite" if fallback else "",
                mean=mean,
                per_residue=pr,
                max_abs_activation=float(i) * 1.5,
                long_handling="truncated" if truncated else "none",
                embedded_length=emb,
                windows=1,
            )
        )
        rows.append(emb)
    return records, (rows if per_residue else None)


@pytest.fixture
def good_store(tmp_path: Path) -> tuple[Path, list[EmbeddedRecord]]:
    records, rows = synthetic(12, truncate_every=5)
    return write_store(tmp_path / "good.h5", records, rows), records


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


# --------------------------------------------------------------------------- writing / round trip


def test_round_trip_float32_any_order(good_store):
    path, records = good_store
    with h5py.File(path, "r") as f:
        assert f.attrs["format"] == FORMAT and f.attrs["format_version"] == FORMAT_VERSION
        assert bool(f.attrs["complete"]) is True
        assert list(f.attrs["layers"]) == [0, 2]
        assert f.attrs["storage_dtype"] == "float32"
        assert json.loads(f.attrs["config"]) == ATTRS["config"]
        assert f.attrs["created_utc"].endswith("Z")
        assert int(f.attrs["fallback_count"]) == 3
        ids = [x.decode() for x in f["ids"][:]]
        assert ids == [r.id for r in records]
        offsets = f["per_residue/offsets"][:]
        assert offsets[0] == 0 and offsets.dtype == np.int64
        seq_offsets, seq_data = f["sequence/offsets"][:], f["sequence/data"]  # ragged since format 2
        for i, r in enumerate(records):
            assert seq_data[seq_offsets[i] : seq_offsets[i + 1]].tobytes().decode() == r.sequence
            assert f["length"][i] == len(r.sequence)
            assert f["embedded_length"][i] == r.embedded_length
            assert f["precision_used"][i].decode() == r.precision_used
            assert f["fallback_reason"][i].decode() == r.fallback_reason
            assert f["long_handling"][i].decode() == r.long_handling
            assert f["max_abs_activation"][i] == np.float32(r.max_abs_activation)
            for k in (0, 2):
                np.testing.assert_array_equal(f[f"mean/layer_{k}"][i], r.mean[k])
                np.testing.assert_array_equal(f[f"per_residue/layer_{k}"][offsets[i] : offsets[i + 1]], r.per_residue[k])
    assert validate_store(path) == []


def test_every_dataset_chunked_checksummed_and_tagged(good_store):
    path, _ = good_store
    seen = []

    def visit(name, obj):
        assert "encoding-type" in obj.attrs and "encoding-version" in obj.attrs, name
        if isinstance(obj, h5py.Dataset):
            seen.append(name)
            assert obj.chunks is not None and obj.fletcher32, name
            if obj.dtype.kind == "S":  # strings: fixed-length UTF-8
                assert h5py.check_string_dtype(obj.dtype).encoding == "utf-8"

    with h5py.File(path, "r") as f:
        assert f.attrs["encoding-type"] == FORMAT
        f.visititems(visit)
    assert {"ids", "sequence/data", "sequence/offsets", "id_index/keys", "mean/layer_0", "per_residue/offsets",
            "per_residue/layer_2", "windows"} <= set(seen)


def test_float16_storage_rounds_like_numpy(tmp_path):
    records, rows = synthetic(7)
    path = write_store(tmp_path / "h.h5", records, rows, storage_dtype="float16")
    with h5py.File(path, "r") as f:
        assert f["mean/layer_2"].dtype == np.float16
        offsets = f["per_residue/offsets"][:]
        for i, r in enumerate(records):
            np.testing.assert_array_equal(f["mean/layer_2"][i], r.mean[2].astype(np.float16))
            np.testing.assert_allclose(f["mean/layer_2"][i], r.mean[2], rtol=1e-3, atol=1e-3)
            np.testing.assert_array_equal(
                f["per_residue/layer_0"][offsets[i] : offsets[i + 1]], r.per_residue[0].astype(np.float16)
            )
    assert validate_store(path) == []


def test_per_residue_off_and_unicode_ids(tmp_path):
    records, rows = synthetic(3, per_residue=False)
    records[1].id = "sp|Q9Ü|β-chain"
    path = write_store(tmp_path / "p.h5", records, rows)
    with h5py.File(path, "r") as f:
        assert "per_residue" not in f
        assert bool(f.attrs["per_residue"]) is False
        assert f["ids"][1].decode("utf-8") == "sp|Q9Ü|β-chain"
    assert validate_store(path) == []


def test_float16_overflow_refused_names_record_and_layer(tmp_path):
    records, rows = synthetic(3)
    records[1].mean[2] = records[1].mean[2].copy()
    records[1].mean[2][0] = 70000.0  # finite in float32, inf in float16
    with pytest.raises(StoreError, match=r"s0r1.*layer 2.*overflow.*float16"):
        write_store(tmp_path / "o.h5", records, rows, storage_dtype="float16")
    assert not (tmp_path / "o.h5").exists() and leftovers(tmp_path) == []


def test_non_finite_refused(tmp_path):
    records, rows = synthetic(3)
    records[2].per_residue[0] = records[2].per_residue[0].copy()
    records[2].per_residue[0][0, 1] = np.nan
    with pytest.raises(StoreError, match=r"s0r2.*layer 0 per-residue.*non-finite"):
        write_store(tmp_path / "n.h5", records, rows)
    assert not (tmp_path / "n.h5").exists() and leftovers(tmp_path) == []


def test_exception_inside_with_leaves_nothing(tmp_path):
    records, rows = synthetic(4)
    with pytest.raises(RuntimeError, match="boom"):
        with StoreWriter(tmp_path / "x.h5", ids=[r.id for r in records], sequences=[r.sequence for r in records],
                         residue_rows=rows, layers=[0, 2], dim=4, storage_dtype="float32", attrs=ATTRS) as w:
            w.write(0, records[0])
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_at_the_rename_is_atomic_h5_s_one_line(tmp_path, monkeypatch):
    """StoreWriter writes through store/h5write.py's H5Target, the primitive atomic_h5 uses: a
    failure where the finished file is renamed into place is one line naming the store, and
    leaves neither the store nor its temporary (issue 31)."""
    import errno

    from embedpipe.core.errors import EmbedpipeError
    from embedpipe.store import h5write

    seen: list[Path] = []

    def full(tmp: Path, path: Path) -> None:
        seen.append(tmp)
        assert tmp.exists() and h5py.is_hdf5(tmp) and not path.exists()  # written in full, under its temp name
        raise h5write.write_error(path, OSError(errno.ENOSPC, "No space left on device"), tmp, known=True)

    monkeypatch.setattr(h5write, "commit", full)
    records, rows = synthetic(3)
    out = tmp_path / "x.h5"
    with pytest.raises(EmbedpipeError, match=rf"^cannot write {out}: No space left on device$"):
        write_store(out, records, rows)
    assert len(seen) == 1 and seen[0].name.startswith(".x.h5.") and list(tmp_path.iterdir()) == []


def test_missing_index_refused_at_finalize(tmp_path):
    records, rows = synthetic(5)
    with pytest.raises(StoreError, match=r"first missing id 's0r3'"):
        with StoreWriter(tmp_path / "m.h5", ids=[r.id for r in records], sequences=[r.sequence for r in records],
                         residue_rows=rows, layers=[0, 2], dim=4, storage_dtype="float32", attrs=ATTRS) as w:
            for i in (4, 0, 2, 1):
                w.write(i, records[i])
    assert list(tmp_path.iterdir()) == []


def test_writer_rejects_bad_rows(tmp_path):
    records, rows = synthetic(3)
    with StoreWriter(tmp_path / "b.h5", ids=[r.id for r in records], sequences=[r.sequence for r in records],
                     residue_rows=rows, layers=[0, 2], dim=4, storage_dtype="float32", attrs=ATTRS) as w:
        with pytest.raises(StoreError, match="index 1 is record 's0r1'"):
            w.write(1, records[0])
        with pytest.raises(StoreError, match="out of range"):
            w.write(3, records[0])
        bad = EmbeddedRecord(**{**records[0].__dict__, "mean": {0: np.zeros(5, np.float32), 2: np.zeros(4, np.float32)}})
        with pytest.raises(StoreError, match=r"shape \(5,\)"):
            w.write(0, bad)
        w.write(0, records[0])
        with pytest.raises(StoreError, match="written twice"):
            w.write(0, records[0])
        w.write(1, records[1])
        w.write(2, records[2])
    assert validate_store(tmp_path / "b.h5") == []


def test_writer_owned_attributes_refused(tmp_path):
    with pytest.raises(StoreError, match="complete"):
        StoreWriter(tmp_path / "a.h5", ids=["a"], sequences=["AC"], residue_rows=None, layers=[1], dim=2,
                    storage_dtype="float32", attrs={"complete": True})
    with pytest.raises(StoreError, match="storage_dtype"):
        StoreWriter(tmp_path / "a.h5", ids=["a"], sequences=["AC"], residue_rows=None, layers=[1], dim=2,
                    storage_dtype="float32", attrs={"storage_dtype": "float16"})
    with pytest.raises(StoreError, match="duplicate record id"):
        StoreWriter(tmp_path / "a.h5", ids=["a", "a"], sequences=["AC", "AC"], residue_rows=None, layers=[1],
                    dim=2, storage_dtype="float32", attrs={})
    assert list(tmp_path.iterdir()) == []


def test_attribute_types_round_trip(tmp_path):
    class Version(str):  # like torch.__version__ (TorchVersion), which h5py refuses as is
        pass

    attrs = {**ATTRS, "torch_version": Version("2.4.0"), "island_dtype": None, "counts": {"a": 1},
             "names": ["x", "y"], "sizes": (1, 2), "ratio": 0.5, "config": '{"k": 1}'}
    records, rows = synthetic(2)
    path = write_store(tmp_path / "a.h5", records, rows, attrs=attrs)
    info = store_info(path)["provenance"]
    assert info["torch_version"] == "2.4.0" and info["island_dtype"] is None and info["counts"] == {"a": 1}
    assert info["names"] == ["x", "y"] and info["sizes"] == [1, 2] and info["ratio"] == 0.5
    assert info["config"] == {"k": 1}  # a JSON string is stored as is and parsed on reading


KILL_SCRIPT = textwrap.dedent(
    """
    import os, sys
    sys.path[:0] = [{tests!r}, {helpers!r}]
    from test_store import synthetic, ATTRS
    from embedpipe.store import StoreWriter
    records, rows = synthetic(6)
    w = StoreWriter({out!r}, ids=[r.id for r in records], sequences=[r.sequence for r in records],
                    residue_rows=rows, layers=[0, 2], dim=4, storage_dtype="float32", attrs=ATTRS)
    for i in range(3):
        w.write(i, records[i])
    w._file.flush()
    os._exit(9)  # killed mid-write: no finalize, no cleanup
    """
)


def test_killed_writer_leaves_only_temp_file(tmp_path):
    out = tmp_path / "k.h5"
    script = KILL_SCRIPT.format(tests=str(Path(__file__).parent), helpers=str(Path(__file__).resolve().parents[1]),
                                out=str(out))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert proc.returncode == 9, proc.stderr
    assert not out.exists()
    temps = leftovers(tmp_path)
    assert len(temps) == 1 and temps[0].startswith(".k.h5.")
    # the leftover is recognisably incomplete
    problems = validate_store(tmp_path / temps[0])
    assert any("incomplete" in p for p in problems), problems


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 20), seed=st.integers(0, 1000), dtype=st.sampled_from(["float32", "float16"]))
def test_round_trip_property(tmp_path_factory, n, seed, dtype):
    directory = tmp_path_factory.mktemp("prop")
    records, rows = synthetic(n, seed=seed % 7, truncate_every=3)
    path = write_store(directory / "p.h5", records, rows, storage_dtype=dtype, shuffle_seed=seed)
    with h5py.File(path, "r") as f:
        offsets = f["per_residue/offsets"][:]
        assert offsets[-1] == sum(rows)
        for i, r in enumerate(records):
            np.testing.assert_array_equal(f["mean/layer_0"][i], r.mean[0].astype(dtype))
            np.testing.assert_array_equal(f["per_residue/layer_2"][offsets[i] : offsets[i + 1]], r.per_residue[2].astype(dtype))
    assert validate_store(path) == []


def test_empty_store(tmp_path):
    path = write_store(tmp_path / "e.h5", [], [], layers=(0, 2), dim=4)
    assert validate_store(path) == []
    assert store_info(path)["counts"]["records"] == 0


# --------------------------------------------------------------------------- validate


def test_validate_truncated_file(good_store, tmp_path):
    path, _ = good_store
    cut = tmp_path / "cut.h5"
    data = path.read_bytes()
    cut.write_bytes(data[: len(data) // 2])
    problems = validate_store(cut)
    assert problems and all(isinstance(p, str) for p in problems)
    assert "truncated" in problems[0] or "read error" in " ".join(problems)


@pytest.mark.parametrize("dataset", ["mean/layer_2", "per_residue/layer_0", "ids", "per_residue/offsets"])
def test_validate_bit_flip(good_store, dataset):
    path, _ = good_store
    flip_byte_in_chunk(path, dataset)
    problems = validate_store(path)
    assert any("checksum" in p and dataset in p for p in problems), problems


def test_validate_non_finite(good_store):
    path, _ = good_store
    with h5py.File(path, "r+") as f:  # HDF5 recomputes the checksum: only finiteness catches it
        f["per_residue/layer_2"][5, 1] = np.inf
    problems = validate_store(path)
    assert any("non-finite" in p and "per_residue/layer_2" in p for p in problems), problems


def test_validate_incomplete_and_inconsistent(good_store):
    path, _ = good_store
    with h5py.File(path, "r+") as f:
        del f.attrs["complete"]
        off = f["per_residue/offsets"][:]
        off[3] += 1
        f["per_residue/offsets"][:] = off
    problems = validate_store(path)
    assert any("incomplete" in p for p in problems)
    assert any("per-residue rows but embedded_length" in p for p in problems), problems


def test_validate_layers_mismatch_and_duplicate_ids(good_store):
    path, _ = good_store
    with h5py.File(path, "r+") as f:
        f.attrs["layers"] = np.array([0, 1], dtype=np.int64)
        ids = f["ids"][:]
        ids[1] = ids[0]
        f["ids"][:] = ids
    problems = validate_store(path)
    assert any("layers attribute" in p for p in problems)
    assert any("not unique" in p for p in problems)


def test_validate_not_hdf5_missing_and_directory(tmp_path):
    junk = tmp_path / "junk.h5"
    junk.write_text("not a store\n")
    assert "not a readable HDF5 file" in validate_store(junk)[0]
    assert validate_store(tmp_path / "nope.h5") == ["no such file"]
    assert "directory" in validate_store(tmp_path)[0]
    with h5py.File(tmp_path / "other.h5", "w") as f:
        f["x"] = 1
    assert "not an embedpipe store" in validate_store(tmp_path / "other.h5")[0]


def test_newer_format_version_refused(good_store):
    path, _ = good_store
    with h5py.File(path, "r+") as f:
        f.attrs["format_version"] = FORMAT_VERSION + 1
    newer = FORMAT_VERSION + 1
    assert validate_store(path) == [f"written by a newer embedpipe (format {newer}); upgrade embedpipe to read it"]
    with pytest.raises(StoreError, match=rf"newer embedpipe \(format {newer}\)"):
        store_info(path)


# --------------------------------------------------------------------------- info


def test_store_info_and_render(good_store):
    path, records = good_store
    info = store_info(path)
    assert info["counts"]["records"] == 12
    assert info["counts"]["residues"] == sum(len(r.sequence) for r in records)
    assert info["counts"]["per_residue_rows"] == sum(r.embedded_length for r in records)
    assert info["precision_used"] == {"fp16-mixed": 9, "fp32": 3}
    assert info["fallback"] == {"count": 3, "rate": 0.25, "by_reason": {"nonfinite": 3}}
    assert info["long_handling"] == {"none": 10, "truncated": 2}
    assert info["max_abs_activation"]["max"] == pytest.approx(16.5)
    assert info["provenance"]["config"] == ATTRS["config"]
    assert info["provenance"]["model_trained"] is False
    assert info["file_size"] == path.stat().st_size
    assert info["datasets"]["mean/layer_2"]["shape"] == [12, 4]
    json.dumps(info)  # JSON-friendly
    text = render_info(info)
    assert "fallback    3 (25.00%): nonfinite 3" in text
    assert "UNTRAINED" in text and "truncated 2" in text


def test_cli_validate_and_info(good_store, tmp_path):
    from typer.testing import CliRunner

    from embedpipe.cli import app

    path, _ = good_store
    runner = CliRunner()
    res = runner.invoke(app, ["validate", str(path)])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["info", str(path), "--json"])
    assert res.exit_code == 0 and json.loads(res.stdout)["counts"]["records"] == 12
    flip_byte_in_chunk(path, "mean/layer_0")
    res = runner.invoke(app, ["validate", str(path)])
    assert res.exit_code == 1 and "checksum" in res.output
    res = runner.invoke(app, ["info", str(tmp_path / "missing.h5")])
    assert res.exit_code == 1 and "no such file" in res.output


# --------------------------------------------------------------------------- identity and mean check


def test_every_store_gets_a_fresh_store_uuid_the_caller_cannot_set(tmp_path):
    records, rows = synthetic(3)
    a = write_store(tmp_path / "a.h5", records, rows)
    b = write_store(tmp_path / "b.h5", records, rows)
    with h5py.File(a, "r") as fa, h5py.File(b, "r") as fb:
        ua, ub = fa.attrs["store_uuid"], fb.attrs["store_uuid"]
    assert len(ua) == 32 and int(ua, 16) >= 0 and ua != ub
    with pytest.raises(StoreError, match="store_uuid"):
        write_store(tmp_path / "c.h5", records, rows, attrs={**ATTRS, "store_uuid": "0" * 32})


def _edit_mean(path: Path, row: int, layer: int, element: int, delta: float) -> None:
    """Overwrite one pooled value through h5py (the chunk's fletcher32 is recomputed)."""
    with h5py.File(path, "r+") as f:
        ds = f[f"mean/layer_{layer}"]
        vec = ds[row]
        vec[element] = vec[element] + np.asarray(delta, dtype=vec.dtype)
        ds[row] = vec


@pytest.mark.parametrize("dtype, rel", [("float32", 1e-4), ("float16", 1e-2)])
def test_validate_names_a_record_whose_mean_is_not_the_mean_of_its_rows(tmp_path, dtype, rel):
    records, rows = synthetic(12, dim=6, truncate_every=5)  # rows 4 and 9 are truncated
    path = write_store(tmp_path / f"{dtype}.h5", records, rows, dim=6, storage_dtype=dtype)
    assert validate_store(path) == []  # fp32 means of the rows, cast like the worker does
    r = records[4]
    scale = float(np.abs(r.per_residue[2]).mean(axis=0)[1])
    _edit_mean(path, 4, 2, 1, rel * scale)  # far below a policy or model change, above rounding
    problems = validate_store(path)
    # the edit also changes the record's bytes: its row digest says so too (tests/store/test_row_digest.py)
    assert len(problems) == 2 and "dataset mean/layer_2 holds other bytes than were written" in problems[0], problems
    assert problems[1].startswith(f"record {r.id!r} (row 4) layer 2: stored mean differs from the mean of its "
                                  f"{r.embedded_length} per-residue rows")
    assert f"for {dtype}" in problems[1]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@settings(max_examples=60, deadline=None)
@given(length=st.integers(1, 400), log_scale=st.floats(-3, 3), seed=st.integers(0, 2**32 - 1))
def test_mean_tolerance_covers_the_workers_rounding(dtype, length, log_scale, seed):
    """The bound holds for fp32 sums cast to the storage dtype against individually cast rows."""
    from embedpipe.store.meancheck import mean_tolerance

    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((length, 16)) * 10.0**log_scale + rng.standard_normal(16) * 10.0**log_scale)
    x = x.astype(np.float32)
    stored_mean = (x.sum(axis=0, dtype=np.float32) / np.float32(length)).astype(dtype).astype(np.float64)
    rows = x.astype(dtype).astype(np.float64)
    tol = mean_tolerance(stored_mean[None], np.abs(rows).mean(axis=0)[None], np.array([float(length)]), np.dtype(dtype))
    assert (np.abs(stored_mean - rows.mean(axis=0)) <= tol[0]).all()


def test_mean_check_is_the_same_for_any_block_split(tmp_path):
    """validate streams per-residue rows in blocks; records spanning blocks are carried over."""
    from embedpipe.store.meancheck import MeanCheck

    records, rows = synthetic(15, dim=5, truncate_every=4)
    path = write_store(tmp_path / "s.h5", records, rows, dim=5)
    _edit_mean(path, 9, 0, 3, 0.05)
    _edit_mean(path, 13, 0, 0, -0.05)
    results = set()
    with h5py.File(path, "r") as f:
        offsets = f["per_residue/offsets"][:]
        ids = [r.id for r in records]
        data = f["per_residue/layer_0"][:]
        for size in (1, 2, 3, 5, 8, 13, len(data)):
            check = MeanCheck(f["mean/layer_0"], offsets, ids, 0)
            for start in range(0, len(data), size):
                check.feed(slice(start, min(start + size, len(data))), data[start : start + size])
            results.add(check.problem())
    assert len(results) == 1
    (problem,) = results
    assert problem.startswith(f"record {records[9].id!r} (row 9) layer 0:") and "2 record(s)" in problem


def test_mean_check_skips_single_run_stores_from_before_store_uuid(tmp_path):
    """Documented choice: a store without store_uuid that is not merged was written by one run
    in one atomic step (it cannot mix runs) before the check existed; the archived v1 example
    holds synthetic means unrelated to its rows and must keep validating."""
    records, rows = synthetic(6)
    path = write_store(tmp_path / "old.h5", records, rows)
    _edit_mean(path, 1, 2, 0, 0.5)
    assert any("record 's0r1'" in p for p in validate_store(path))
    with h5py.File(path, "r+") as f:
        del f.attrs["store_uuid"]
        as_format2(f)
        del f["row_digest"]  # nor row digests: they came later still
    assert validate_store(path) == []


@pytest.mark.parametrize("precision, storage, long_sequences", [
    ("fp32", "float16", "chunk"), ("fp16", "float16", "truncate"), ("bf16-mixed", "float32", "chunk"),
    ("fp32", "float32", "full"),
])
def test_real_stores_pass_the_mean_check(tmp_path, tiny_model_path, precision, storage, long_sequences):
    from embedpipe.extraction.run import EmbedOptions, embed_fasta
    from helpers.embed_helpers import random_sequences, write_fasta

    records = random_sequences(6, (5, 300), seed=3) + random_sequences(1, [1400], seed=4)
    fasta = write_fasta(tmp_path / "in.fasta", [(f"r{i}", s) for i, (_, s) in enumerate(records)])
    out = tmp_path / "s.h5"
    embed_fasta(fasta, model=str(tiny_model_path), out=out, quiet=True, options=EmbedOptions(
        precision=precision, storage_dtype=storage, long_sequences=long_sequences, layers=(0, 1, 2),
        per_residue=True))
    assert validate_store(out) == []
    _edit_mean(out, 6, 1, 0, 0.05)
    assert any(p.startswith("record 'r6' (row 6) layer 1: stored mean differs") for p in validate_store(out))


# --------------------------------------------------------------------------- archived v1 file


def make_archived_example(path: Path) -> Path:
    """How tests/data/store-v1-example.h5 was made (kept to compare values, never to rewrite it)."""
    records, rows = synthetic(5, dim=3, layers=(1, 2), seed=3, truncate_every=4, legacy_means=True)
    attrs = {**ATTRS, "created_utc": "2026-01-01T00:00:00Z", "embedpipe_version": "0.1.0"}
    return write_store(path, records, rows, layers=(1, 2), dim=3, storage_dtype="float16", attrs=attrs)


def test_archived_v1_store_still_reads(tmp_path):
    """Old stores must keep reading: never regenerate this file when the format changes."""
    assert ARCHIVED_V1.exists(), "tests/data/store-v1-example.h5 is missing"
    assert ARCHIVED_V1.stat().st_size < 64 * 1024
    work = tmp_path / ARCHIVED_V1.name
    shutil.copy(ARCHIVED_V1, work)  # validate/read a copy: the archived bytes stay untouched
    assert validate_store(work) == []
    import embedpipe

    records, _ = synthetic(5, dim=3, layers=(1, 2), seed=3, truncate_every=4, legacy_means=True)
    with embedpipe.open_store(work) as store:
        assert store.provenance["format_version"] == 1
        assert store.provenance["created_utc"] == "2026-01-01T00:00:00Z"
        assert store.ids == [r.id for r in records] and store.layers == [1, 2]
        means = store.mean(1).compute()
        for i, r in enumerate(records):
            np.testing.assert_array_equal(means[i], r.mean[1].astype(np.float16))
            np.testing.assert_array_equal(store.per_residue(r.id, 2), r.per_residue[2].astype(np.float16))
            assert store[r.id]["long_handling"] == r.long_handling
