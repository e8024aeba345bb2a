"""Crafted reuse indexes (issue 30, round 4): every field is checked against the real datasets
before use, so a bad index is one line naming the file and the field, never a traceback or
an allocation sized by what it declares (a fence of 2^36 entries tried to allocate 2 TiB);
and a property that mutates indexes at random: a run either equals the un-mutated run or
fails in one line, in bounded memory."""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import h5py
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import embedpipe.store.reuse_index as reuse_index
from embedpipe.core.errors import EmbedpipeError
from embedpipe.core.options import EmbedOptions
from embedpipe.extraction.run import embed_fasta
from helpers.embed_helpers import random_sequences, read_store, write_fasta
from helpers.processes import run_measured

OPTIONS = EmbedOptions(per_residue=True, device="cpu", layers=(0, -1), storage_dtype="float16")
RECORDS = random_sequences(12, (8, 40), seed=11)
AGAIN = "; build the index again (embedpipe reuse-index)"
#: peak RSS a CLI run may reach on a crafted index (a plain all-reused run: ~280 MiB, python and torch)
RSS_LIMIT = 512 << 20


@pytest.fixture(scope="module")
def source(tmp_path_factory, tiny_model_path):
    """A store of RECORDS, its index in blocks of 4 (3 blocks), and the un-mutated reuse run."""
    tmp = tmp_path_factory.mktemp("reuse-hostile")
    fasta = write_fasta(tmp / "r.fasta", RECORDS)
    store = tmp / "src.h5"
    embed_fasta(fasta, model=str(tiny_model_path), out=store, options=OPTIONS, quiet=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(reuse_index, "BLOCK", 4)
        reuse_index.build_index(store, tmp / "src.idx.h5")
    base = _reuse(tmp / "src.idx.h5", fasta, tiny_model_path, tmp / "base.h5")
    return {"tmp": tmp, "fasta": fasta, "store": store, "index": tmp / "src.idx.h5", "base": read_store(base),
            "base_path": base, "model": tiny_model_path}


def _reuse(index: Path, fasta: Path, model: Path, out: Path) -> Path:
    embed_fasta(fasta, model=str(model), out=out, options=OPTIONS, quiet=True, reuse=[index])
    return out


def _crafted(source, tmp: Path, edit) -> Path:
    index = tmp / "crafted.idx.h5"
    shutil.copy(source["index"], index)
    with h5py.File(index, "a") as f:
        edit(f)
    return index


def assert_refused(source, tmp: Path, edit, field: str) -> None:
    """embed --reuse on the crafted index fails with exactly ``{index}: reuse index {field}...``."""
    index = _crafted(source, tmp, edit)
    with pytest.raises(EmbedpipeError) as info:
        _reuse(index, source["fasta"], source["model"], tmp / "out.h5")
    assert str(info.value) == f"{index}: reuse index {field}{AGAIN}"
    assert not (tmp / "out.h5").exists()


def _replace(f: h5py.File, name: str, data=None, **kwargs) -> None:
    del f[name]
    f.create_dataset(name, data=data, **kwargs)


def test_rows_out_of_range(source, tmp_path):
    def edit(f):
        f["rows"][0] = 10**6
    n = len(RECORDS)
    assert_refused(source, tmp_path, edit,
             f"dataset rows points to row 1000000, outside 0..{n - 1} (the {n} records of {source['store']})")


def test_negative_rows(source, tmp_path):
    def edit(f):
        f["rows"][5] = -7
    assert_refused(source, tmp_path, edit, "dataset rows row 5 is -7, negative")


@pytest.mark.parametrize(("value", "shown"), [(0, "0"), (-3, "-3"), (2**40, str(2**40)), ("4", "'4'"), (4.5, "4.5")])
def test_block_not_a_usable_integer(source, tmp_path, value, shown):
    def edit(f):
        f.attrs["block"] = value
    assert_refused(source, tmp_path, edit, f"attribute block is {shown}, not an integer in 1..65536")


def test_block_that_does_not_match_the_fence(source, tmp_path):
    def edit(f):
        f.attrs["block"] = 1
    assert_refused(source, tmp_path, edit, "dataset fence has 3 keys, expected 12 (one per 1-entry block of 12 keys)")


@pytest.mark.parametrize("name", ["keys", "rows", "fence"])
def test_missing_dataset(source, tmp_path, name):
    assert_refused(source, tmp_path, lambda f: f.__delitem__(name), f"dataset {name} is missing")


@pytest.mark.parametrize(("name", "data", "shown"), [
    ("rows", np.zeros(12, dtype=np.float64), "shape (12,) and dtype float64, expected 1-D integers"),
    ("rows", np.zeros((12, 2), dtype=np.int64), "shape (12, 2) and dtype int64, expected 1-D integers"),
    ("keys", np.zeros(12, dtype="S8"), "shape (12,) and dtype |S8, expected 1-D 32-byte keys (S32)"),
    ("fence", np.zeros(3, dtype=np.int64), "shape (3,) and dtype int64, expected 1-D 32-byte keys (S32)"),
])
def test_wrong_dtype_or_shape(source, tmp_path, name, data, shown):
    assert_refused(source, tmp_path, lambda f: _replace(f, name, data), f"dataset {name} has {shown}")


def test_rows_shorter_than_keys(source, tmp_path):
    assert_refused(source, tmp_path, lambda f: _replace(f, "rows", np.arange(5)), "dataset rows has 5 entries, dataset keys 12")


def test_missing_store_path_and_huge_chunks(source, tmp_path):
    assert_refused(source, tmp_path, lambda f: f.attrs.__delitem__("store_path"), "attribute store_path is missing")
    rows = np.arange(12)

    def chunked(f):
        del f["rows"]
        f.create_dataset("rows", data=rows, maxshape=(None,), chunks=(1 << 20,), compression="gzip")
    assert_refused(source, tmp_path, chunked, "dataset rows has chunks of 1048576 entries, more than 4 MiB")


def test_entries_disagree(source, tmp_path):
    def edit(f):
        f.attrs["entries"] = 13
    assert_refused(source, tmp_path, edit, "attribute entries is 13, dataset keys holds 12")


@pytest.mark.parametrize(("value", "shown"), [("{not json", "'{not json'"), ("[1, 2]", "'[1, 2]'"),
                                              (np.arange(3), "[0, 1, 2]")])
def test_bad_identity(source, tmp_path, value, shown):
    def edit(f):
        f.attrs["embed_identity"] = value
    kind = "not text" if isinstance(value, np.ndarray) else "not a JSON object"
    assert_refused(source, tmp_path, edit, f"attribute embed_identity is {shown}, {kind}")


def test_bad_num_layers(source, tmp_path):
    def edit(f):
        f.attrs["model_num_layers"] = "two"
    assert_refused(source, tmp_path, edit, "attribute model_num_layers is 'two', not a positive integer")


def test_unsorted_fence_and_block_not_at_its_fence(source, tmp_path):
    def swap(f):
        fence = f["fence"][()]
        f["fence"][:] = fence[::-1]
    assert_refused(source, tmp_path, swap, "dataset fence is not sorted (entry 1 is not above entry 0)")

    def shift(f):
        fence = f["fence"][()]
        fence[1] = f["keys"][5]  # still sorted, but block 1 starts at key 4
        f["fence"][:] = fence
    assert_refused(source, tmp_path, shift, "dataset keys row 4 is not fence entry 1")


def test_fence_declaring_2_36_entries_is_refused_unallocated(source, tmp_path):
    """Both ways a file can declare it: contiguous (no bytes written) and chunked, compressed."""
    n = 2**36
    for kwargs, field in (({}, f"dataset fence declares shape ({n},) ({n * 32} bytes) but the file holds "),
                          ({"chunks": (1 << 16,), "compression": "gzip"},
                           f"dataset fence has {n} keys, expected 3 (one per 4-entry block of 12 keys)")):
        index = _crafted(source, tmp_path, lambda f, kw=kwargs: _replace(f, "fence", None, shape=(n,), dtype="S32", **kw))
        with pytest.raises(EmbedpipeError) as info:
            reuse_index.ReuseIndex(index)
        message = str(info.value)
        assert message.startswith(f"{index}: reuse index {field}") and message.endswith(AGAIN), message
        assert "\n" not in message


def _run_measured(args: list[str], timeout: float = 300) -> tuple[int, str, int]:
    """(exit code, stderr, peak RSS in bytes) of one child (helpers.processes.run_measured)."""
    rc, _out, err, peak = run_measured(args, timeout)
    return rc, err, peak


def _cli_embed(index: Path, source, out: Path) -> tuple[int, str, int]:
    return _run_measured([sys.executable, "-m", "embedpipe.cli", "embed", str(source["fasta"]), "--model",
                          str(source["model"]), "--out", str(out), "--device", "cpu", "--layers", "0,-1",
                          "--per-residue", "--storage-dtype", "float16", "--reuse", str(index), "-q"])


@pytest.mark.parametrize("kwargs", [{}, {"chunks": (1 << 16,), "compression": "gzip"}], ids=["contiguous", "gzip"])
def test_cli_on_the_2_36_fence_is_one_line_in_bounded_memory(source, tmp_path, kwargs):
    index = _crafted(source, tmp_path, lambda f: _replace(f, "fence", None, shape=(2**36,), dtype="S32", **kwargs))
    rc, stderr, rss = _cli_embed(index, source, tmp_path / "out.h5")
    assert rc == 1
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"embedpipe: error: {index}: reuse index dataset fence "), stderr
    assert rss < RSS_LIMIT, f"peak RSS {rss >> 20} MiB"
    assert not (tmp_path / "out.h5").exists()


# ---------------------------------------------------------------------------------------------
# the property

ATTRS = ["block", "entries", "store_path", "store_uuid", "embed_identity", "model_sha256", "model_num_layers",
         "format", "format_version"]
DATASETS = ["keys", "rows", "fence"]
DTYPES = ["int8", "int64", "uint64", "float32", "S32", "S8", "bool"]

values = st.one_of(
    st.integers(-2**62, 2**62), st.sampled_from([0, 1, -1, 4, 12, 2**36]),
    st.text(st.characters(blacklist_characters="\0"), max_size=12),  # h5py writes no NUL in text
    st.floats(allow_nan=True), st.binary(min_size=1, max_size=12).map(np.bytes_),
    st.sampled_from(['{"a": 1}', "[]", "null", "{", "2"]),
    st.lists(st.integers(-5, 5), min_size=1, max_size=4).map(np.array))


@st.composite
def mutations(draw):
    """One mutation: (kind, target, payload)."""
    kind = draw(st.sampled_from(["attr", "del_attr", "dataset", "del_dataset", "element", "huge", "same"]))
    if kind == "same":  # the same values, written otherwise: harmless
        return kind, draw(st.sampled_from(ATTRS + DATASETS)), draw(st.sampled_from([None, 2, 5, 1024]))
    if kind in ("attr", "del_attr"):
        return kind, draw(st.sampled_from(ATTRS)), draw(values)
    name = draw(st.sampled_from(DATASETS))
    if kind == "dataset":
        shape = draw(st.sampled_from([(0,), (3,), (12,), (12, 2), (5,)]))
        seed = draw(st.integers(0, 2**16))
        return kind, name, (shape, draw(st.sampled_from(DTYPES)), seed)
    if kind == "element":
        return kind, name, (draw(st.integers(0, 11)), draw(st.integers(-2**40, 2**40)), draw(st.binary(min_size=32, max_size=32)))
    return kind, name, draw(st.sampled_from([2**20, 2**36, 2**40]))


def _random_data(shape, dtype, seed):
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(*shape, 32), dtype=np.uint8)
    if dtype.startswith("S"):
        return np.array([bytes(r[: int(dtype[1:])]) for r in raw.reshape(-1, 32)], dtype=dtype).reshape(shape)
    return rng.integers(-50, 50, size=shape).astype(dtype)


def _rewritten(f: h5py.File, target: str, chunk: int | None) -> None:
    """``target``'s value written anew: an attribute as fixed-length bytes (or a numpy scalar),
    a dataset with other chunks, compressed (or contiguous)."""
    if target in ATTRS:
        if target in f.attrs:
            value = f.attrs[target]
            f.attrs[target] = np.bytes_(value.encode()) if isinstance(value, str) else np.asarray(value)
        return
    if isinstance(f.get(target), h5py.Dataset) and f[target].ndim == 1:
        if f[target].shape[0] > 1 << 20:  # a "huge" mutation before: rewriting it would allocate what it declares
            return
        data = f[target][()]
        del f[target]
        layout = {"chunks": (min(chunk, len(data)),), "compression": "gzip"} if chunk and len(data) else {}
        f.create_dataset(target, data=data, **layout)


def _mutate(f: h5py.File, mutation) -> None:
    kind, target, payload = mutation
    if kind == "attr":
        f.attrs[target] = payload
    elif kind == "del_attr":
        f.attrs.pop(target, None)
    elif kind == "same":
        _rewritten(f, target, payload)
    elif kind == "del_dataset":
        f.pop(target, None)
    elif kind == "dataset":
        f.pop(target, None)
        f.create_dataset(target, data=_random_data(*payload))
    elif kind == "huge":
        f.pop(target, None)
        f.create_dataset(target, shape=(payload,), dtype="S32" if target != "rows" else "<i8", chunks=(1024,),
                         compression="gzip")
    else:
        at, number, key = payload
        ds = f.get(target)
        if isinstance(ds, h5py.Dataset) and ds.ndim == 1 and at < ds.shape[0] and ds.dtype.kind in "iuS":
            ds[at] = np.array(number).astype(ds.dtype) if ds.dtype.kind in "iu" else key


def _reused_from(path: Path) -> dict[str, str]:
    with h5py.File(path, "r") as f:
        return {i.decode(): u.decode() for i, u in zip(f["ids"][()], f["reused_from"][()])}


def _assert_equal_to_base(out: Path, base: dict, base_path: Path) -> None:
    """Each record copied as in the un-mutated run (bit for bit, from the same store), or, where
    a key was altered within its block's order (an absent sequence, as far as anything short
    of reading the store's sequences can tell), computed: a fresh embed's numbers."""
    got, copied, expected = read_store(out), _reused_from(out), _reused_from(base_path)
    assert got["ids"] == base["ids"]
    for rid in base["ids"]:
        assert copied[rid] in (expected[rid], "")
        for k in base["mean"]:
            for kind in ("mean", "per_residue"):
                a, b = got[kind][k][rid], base[kind][k][rid]
                if copied[rid]:
                    assert np.array_equal(a, b)
                else:
                    np.testing.assert_allclose(a.astype(np.float32), b.astype(np.float32), atol=2e-3, rtol=0)
    assert int(got["attrs"]["reused_count"]) == sum(1 for u in copied.values() if u)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(changes=st.lists(mutations(), min_size=1, max_size=3))
def test_mutated_index_equals_the_unmutated_run_or_fails_in_one_line(source, changes):
    with tempfile.TemporaryDirectory(dir=source["tmp"]) as tmp:
        index = _crafted(source, Path(tmp), lambda f: [_mutate(f, m) for m in changes])
        out = Path(tmp) / "out.h5"
        try:
            _reuse(index, source["fasta"], source["model"], out)
        except EmbedpipeError as exc:
            message = str(exc)
            assert message and "\n" not in message, message
            assert not out.exists()
            event("refused")
            return
        event("ran")
        _assert_equal_to_base(out, source["base"], source["base_path"])


@pytest.mark.parametrize("mutation", [
    ("huge", "keys", 2**40), ("dataset", "rows", ((12,), "float32", 3)), ("attr", "block", 0),
    ("attr", "embed_identity", "{"), ("element", "rows", (2, 99, b"\0" * 32))])
def test_mutated_index_through_the_cli_is_one_line(source, tmp_path, mutation):
    index = _crafted(source, tmp_path, lambda f: _mutate(f, mutation))
    rc, stderr, rss = _cli_embed(index, source, tmp_path / "out.h5")
    assert rc == 1 and len(stderr.strip().splitlines()) == 1, stderr
    assert stderr.startswith(f"embedpipe: error: {index}: reuse index "), stderr
    assert "Traceback" not in stderr and rss < RSS_LIMIT
