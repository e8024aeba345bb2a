"""Property test (issue 19, D): a small store with one of its offsets, index rows,
``block_rows``, declared shapes or ``dim`` mutated. Every read returns the right data or raises
one embedpipe error line, within a fixed memory bound; ``validate`` passes only a store whose
reads are all right."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import h5py
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_store import synthetic, write_store

from embedpipe.core.errors import EmbedpipeError
from embedpipe.store import open_store, validate_store

N = 12
#: every read of the 12-record store together stays far below this (the crafted shapes
#: declare up to 128 GiB)
MEMORY_BOUND = 32 << 20


class Base(tuple):
    """(store file bytes, records by ID), with a short repr for hypothesis' reports."""

    def __repr__(self) -> str:
        return f"<store of {N} records>"


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Base:
    records, rows = synthetic(N, truncate_every=5)
    path = write_store(tmp_path_factory.mktemp("base") / "s.h5", records, rows)
    return Base((path.read_bytes(), {r.id: r for r in records}))


VALUES = st.sampled_from([-(10**10), -5, -1, 0, 1, 2, 3, 7, 11, 12, 13, 40, 10**10, 2**31, 2**62])


def _replace_shape(f: h5py.File, name: str, shape: tuple[int, int]) -> None:
    """``name`` declared as ``shape``; the overlapping part of the old data kept."""
    old, attrs = f[name][...], dict(f[name].attrs)
    del f[name]
    ds = f.create_dataset(name, shape=shape, dtype=old.dtype, chunks=(1, max(1, min(shape[1], 1024))),
                          maxshape=(None, shape[1]), fletcher32=True)
    a, b = min(shape[0], old.shape[0]), min(shape[1], old.shape[1])
    if a and b:
        ds[:a, :b] = old[:a, :b]
    for k, v in attrs.items():
        ds.attrs[k] = v


MUTATIONS = st.one_of(
    st.tuples(st.just("offsets"), st.sampled_from(["per_residue/offsets", "sequence/offsets"]),
              st.integers(0, N), VALUES),
    st.tuples(st.just("index_row"), st.integers(0, N - 1), VALUES),
    st.tuples(st.just("index_swap"), st.integers(0, N - 1), st.integers(0, N - 1)),
    st.tuples(st.just("block_rows"), VALUES),
    st.tuples(st.just("shape"), st.sampled_from(["mean/layer_2", "mean/layer_0", "per_residue/layer_2"]),
              st.sampled_from([0, 1, N - 1, N, N + 1, 2**20]), st.sampled_from([1, 3, 4, 5, 2**31])),
    st.tuples(st.just("dim"), VALUES),
)


def mutate(path: Path, mutation: tuple) -> None:
    kind, *args = mutation
    with h5py.File(path, "r+") as f:
        if kind == "offsets":
            name, row, value = args
            f[name][row] = value
        elif kind == "index_row":
            f["id_index/rows"][args[0]] = args[1]
        elif kind == "index_swap":
            rows = f["id_index/rows"][:]
            rows[[args[0], args[1]]] = rows[[args[1], args[0]]]
            f["id_index/rows"][:] = rows
        elif kind == "block_rows":
            f["id_index"].attrs["block_rows"] = np.int64(args[0])
        elif kind == "shape":
            name, rows, cols = args
            if name.startswith("per_residue"):
                rows = {N: int(f["per_residue/offsets"][-1])}.get(rows, rows)
            _replace_shape(f, name, (rows, cols))
        else:
            f.attrs["dim"] = np.int64(args[0])


def _reads(path: Path, truth: dict) -> list[str]:
    """Read everything; return the records read right. A wrong value fails the test; an
    embedpipe error must be one line."""
    right = []
    try:
        with open_store(path) as store:
            for rid, rec in truth.items():
                got = store[rid]
                assert got["sequence"] == rec.sequence
                for k in (0, 2):
                    np.testing.assert_array_equal(store.mean_vector(rid, k), rec.mean[k])
                    np.testing.assert_array_equal(store.per_residue(rid, k), rec.per_residue[k])
                    np.testing.assert_array_equal(got["mean"][k], rec.mean[k])
                np.testing.assert_array_equal(store.mean_rows(slice(0, N), 2)[store.index(rid)], rec.mean[2])
                vecs, off = store.per_residue_rows(slice(0, N), 0)
                i = store.index(rid)
                np.testing.assert_array_equal(vecs[off[i]:off[i + 1]], rec.per_residue[0])
                assert rid in store.ids
                right.append(rid)
    except EmbedpipeError as exc:
        assert "\n" not in str(exc) and str(exc), repr(exc)
    return right


@settings(max_examples=60, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutation=MUTATIONS)
def test_mutated_store_reads_right_or_fails_in_one_line(base, tmp_path, mutation):
    data, truth = base
    path = tmp_path / "m.h5"
    path.write_bytes(data)
    mutate(path, mutation)
    tracemalloc.start()
    try:
        right = _reads(path, truth)
        problems = validate_store(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < MEMORY_BOUND, (mutation, peak)
    assert all("\n" not in p for p in problems)
    if not problems:  # validate passes only a store whose every read is right
        assert len(right) == N, (mutation, right)
