"""The public read API: open_store, Store, dask arrays that survive pickling and forking."""

from __future__ import annotations

import multiprocessing
import pickle

import h5py
import numpy as np
import pytest

import embedpipe
from embedpipe.core.errors import StoreError
from embedpipe.store import EmbeddedRecord, Store, UnknownIdError
from helpers.embed_helpers import flip_byte_in_chunk
from helpers.stores import write_store

AMINO = "ACDEFGHIKLMNPQRSTVWY"


def synthetic(n: int, *, dim: int = 5, layers=(0, 3), seed: int = 0, per_residue: bool = True):
    records, rows = [], []
    for i in range(n):
        length = 3 + (i * 5 + seed) % 11
        seq = "".join(AMINO[(3 * i + j + seed) % 20] for j in range(length))
        emb = length - 2 if i % 6 == 5 else length
        base = np.arange(dim, dtype=np.float64)
        grid = np.arange(emb, dtype=np.float64)[:, None] * dim + base[None, :]
        records.append(
            EmbeddedRecord(
                id=f"id{seed}_{i}",
                sequence=seq,
                precision_used="fp32" if i % 5 == 4 else "bf16",
                fallback_reason="nonfinite" if i % 5 == 4 else "",
                mean={k: (np.sin(base + i * 0.1 + k) * 3).astype(np.float32) for k in layers},
                per_residue={k: np.cos(grid * 0.11 + i + k).astype(np.float32) for k in layers} if per_residue else None,
                max_abs_activation=float(i),
                long_handling="truncated" if emb < length else "none",
                embedded_length=emb,
                windows=1,
            )
        )
        rows.append(emb)
    return records, (rows if per_residue else None)


ATTRS = {"model_name": "m", "model_sha256": "ab" * 32, "precision_policy": "bf16",
         "config": {"storage_dtype": "float32"}}


@pytest.fixture
def store_path(tmp_path):
    records, rows = synthetic(23)
    return write_store(tmp_path / "s.h5", records, rows, attrs=ATTRS), records


def _sum_in_child(arr, queue):  # module level: picklable for multiprocessing
    queue.put(float(arr.sum().compute(scheduler="synchronous")))


def test_open_store_basics(store_path):
    path, records = store_path
    with embedpipe.open_store(path) as store:
        assert isinstance(store, Store)
        assert len(store) == 23 and store.ids == [r.id for r in records]
        assert store.layers == [0, 3] and store.dim == 5 and store.dtype == np.float32
        assert store.provenance["config"] == {"storage_dtype": "float32"}
        assert store.provenance["model_name"] == "m"
        assert store.has_per_residue and store.offsets[-1] == sum(r.embedded_length for r in records)
        assert "id0_4" in store and "nope" not in store
        assert store.index("id0_7") == 7
        assert store.layer(-1) == 3 and store.layer(-2) == 0 and store.layer(0) == 0
        with pytest.raises(StoreError, match=r"layer 2 is not stored.*\[0, 3\]"):
            store.layer(2)
        with pytest.raises(StoreError, match="layer -3"):
            store.mean(-3)
    with pytest.raises(StoreError, match="closed"):
        store.per_residue("id0_1")


def test_mean_dask_equals_written(store_path):
    path, records = store_path
    store = embedpipe.open_store(path)
    for layer in (0, 3):
        arr = store.mean(layer)
        assert arr.shape == (23, 5) and arr.dtype == np.float32
        np.testing.assert_array_equal(arr.compute(), np.stack([r.mean[layer] for r in records]))
    np.testing.assert_array_equal(store.mean().compute(), store.mean(3).compute())
    np.testing.assert_array_equal(store.mean_vector("id0_9", 0), records[9].mean[0])
    store.close()


def test_dask_array_pickles_and_forks(store_path):
    path, records = store_path
    store = embedpipe.open_store(path)
    arr = store.mean(0)
    expected = float(np.stack([r.mean[0] for r in records]).sum())
    store.close()  # the dask graph does not depend on the store's open handle
    clone = pickle.loads(pickle.dumps(arr))
    assert float(clone.sum().compute()) == pytest.approx(expected, rel=1e-6)
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=_sum_in_child, args=(arr, queue))
    proc.start()
    got = queue.get(timeout=60)
    proc.join(timeout=60)
    assert proc.exitcode == 0 and got == pytest.approx(expected, rel=1e-6)
    # and with several threads reading chunks concurrently
    assert float(arr.rechunk((4, 5)).sum().compute(scheduler="threads")) == pytest.approx(expected, rel=1e-6)


def test_store_pickles(store_path):
    path, records = store_path
    with embedpipe.open_store(path) as store:
        clone = pickle.loads(pickle.dumps(store))
    np.testing.assert_array_equal(clone.per_residue("id0_3"), records[3].per_residue[3])
    clone.close()


def test_per_residue_and_getitem(store_path):
    path, records = store_path
    with embedpipe.open_store(path) as store:
        for r in records:
            for k in (0, 3):
                np.testing.assert_array_equal(store.per_residue(r.id, k), r.per_residue[k])
        rec = store["id0_5"]
        assert rec["record_id"] == "id0_5" and rec["alias_of"] is None and rec["row"] == 5
        assert rec["long_handling"] == "truncated" and rec["embedded_length"] == len(records[5].sequence) - 2
        assert rec["sequence"] == records[5].sequence and rec["length"] == len(records[5].sequence)
        np.testing.assert_array_equal(rec["mean"][3], records[5].mean[3])
        whole = store.per_residue_array(0).compute()
        off = store.offsets
        np.testing.assert_array_equal(whole[off[5] : off[6]], records[5].per_residue[0])
        with pytest.raises(UnknownIdError) as err:
            store["missing"]
        assert isinstance(err.value, KeyError) and "missing" in str(err.value)


def test_records_table(store_path):
    path, records = store_path
    with embedpipe.open_store(path) as store:
        table = store.records()
    assert list(table["id"]) == [r.id for r in records]
    assert list(table["precision_used"]) == [r.precision_used for r in records]
    assert list(table["fallback_reason"]) == [r.fallback_reason for r in records]
    np.testing.assert_array_equal(table["embedded_length"], [r.embedded_length for r in records])
    assert "sequence" not in table
    with embedpipe.open_store(path) as store:
        assert list(store.records(sequence=True)["sequence"]) == [r.sequence for r in records]


def test_float16_reads_float16_or_upcast(tmp_path):
    records, rows = synthetic(6)
    path = write_store(tmp_path / "h.h5", records, rows, storage_dtype="float16",
                       attrs={**ATTRS, "config": {"storage_dtype": "float16"}})
    with embedpipe.open_store(path) as store:
        assert store.dtype == np.float16 and store.mean().dtype == np.float16
        up = store.mean(0, dtype=np.float32).compute()
        assert up.dtype == np.float32
        np.testing.assert_array_equal(up, np.stack([r.mean[0] for r in records]).astype(np.float16).astype(np.float32))
        pr = store.per_residue("id0_2", dtype=np.float32)
        assert pr.dtype == np.float32
        np.testing.assert_allclose(pr, records[2].per_residue[3], atol=1e-3)


def test_no_per_residue(tmp_path):
    records, rows = synthetic(4, per_residue=False)
    with embedpipe.open_store(write_store(tmp_path / "n.h5", records, rows, attrs=ATTRS)) as store:
        assert not store.has_per_residue and store.offsets is None
        with pytest.raises(StoreError, match="no per-residue"):
            store.per_residue("id0_1")


def test_refuses_incomplete_newer_and_missing(store_path, tmp_path):
    path, _ = store_path
    with h5py.File(path, "r+") as f:
        del f.attrs["complete"]
    with pytest.raises(StoreError, match="incomplete"):
        embedpipe.open_store(path)
    with h5py.File(path, "r+") as f:
        f.attrs["complete"] = True
        f.attrs["format_version"] = 4
    with pytest.raises(StoreError, match=r"newer embedpipe \(format 4\)"):
        embedpipe.open_store(path)
    with pytest.raises(StoreError, match="no such file"):
        embedpipe.open_store(tmp_path / "absent.h5")


def test_missing_dataset_is_one_line_naming_store_and_dataset(store_path):
    path, records = store_path
    with h5py.File(path, "r+") as f:
        del f["per_residue/layer_0"]
    with embedpipe.open_store(path) as store:
        with pytest.raises(StoreError) as exc:
            store.per_residue(records[1].id, 0)
        assert str(exc.value) == f"{path}: dataset per_residue/layer_0 is missing (run embedpipe validate {path})"
        with pytest.raises(StoreError, match=r"dataset per_residue/layer_0 is missing"):
            store.per_residue_array(0)


@pytest.mark.parametrize("read", ["getitem", "mean_vector", "dask", "records"])
def test_corrupt_chunk_names_store_dataset_and_rows(store_path, read):
    path, records = store_path
    dataset = "precision_used" if read == "records" else "mean/layer_3"
    flip_byte_in_chunk(path, dataset)
    with embedpipe.open_store(path) as store:
        with pytest.raises(StoreError) as exc:
            if read == "getitem":
                store[records[2].id]
            elif read == "mean_vector":
                store.mean_vector(records[2].id, 3)
            elif read == "dask":
                store.mean(3).sum().compute()
            else:
                store.records()
    msg = str(exc.value)
    rows = {"getitem": " row 2", "mean_vector": " row 2", "dask": f" rows 0:{len(records)}", "records": ""}[read]
    assert msg.startswith(f"{path}: cannot read dataset {dataset}{rows}: checksum mismatch or read error ("), msg
    assert "\n" not in msg
