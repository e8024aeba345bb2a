"""Issue 19, D and E (store): crafted stores give one embedpipe error line, never wrong data or
a traceback; IDs without control characters; aliases apart from ``store.ids``; a source shard
this user may not read; ``info`` on a merged store whose sources are missing."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import h5py
import numpy as np
import pytest
from test_store import synthetic, write_store

import embedpipe
from embedpipe.core.errors import InputError, StoreError
from embedpipe.inputs.fasta import iter_fasta
from embedpipe.store import merge_stores, open_store, store_info, validate_store

#: the checkout whose embedpipe this test imported: subprocesses use the same code
ROOT = Path(embedpipe.__file__).resolve().parents[1]


@pytest.fixture
def store(tmp_path: Path):
    records, rows = synthetic(12, truncate_every=5)
    return write_store(tmp_path / "s.h5", records, rows), records


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "embedpipe.cli", *args], capture_output=True, text=True,
                          env=env, cwd=cwd)


def one_line_error(result: subprocess.CompletedProcess, *needles: str) -> None:
    assert result.returncode != 0, result.stdout
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("embedpipe: ")]
    assert len(lines) == 1, result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def edit(path: Path, fn) -> None:
    with h5py.File(path, "r+") as f:
        fn(f)


# ------------------------------------------------------------------------------------- D


def test_swapped_index_rows_never_return_another_records_vector(store):
    path, records = store
    def swap(f):
        rows = f["id_index/rows"][:]
        rows[[0, 1]] = rows[[1, 0]]
        f["id_index/rows"][:] = rows
    edit(path, swap)
    with open_store(path) as st, pytest.raises(StoreError, match=r"id_index/rows: id 's0r0' points to row 1"):
        st.mean_vector("s0r0")
    assert any("id_index" in p for p in validate_store(path))


def test_out_of_range_index_row_is_one_line(store):
    path, _ = store
    edit(path, lambda f: f["id_index/rows"].__setitem__(0, 10**6))
    with open_store(path) as st:
        for read in (lambda: st.mean_vector("s0r0"), lambda: st["s0r0"], lambda: "s0r0" in st):
            with pytest.raises(StoreError, match=r"s\.h5: dataset id_index/rows: .* outside"):
                read()


@pytest.mark.parametrize("block", [0, -1])
def test_block_rows_of_zero_or_below_refused_at_open(store, block):
    path, _ = store
    edit(path, lambda f: f["id_index"].attrs.__setitem__("block_rows", np.int64(block)))
    with pytest.raises(StoreError, match=rf"s\.h5: group id_index: attribute block_rows is {block}"):
        open_store(path)
    assert any("block_rows" in p for p in validate_store(path))


def test_negative_per_residue_offset_is_refused(store):
    path, records = store
    edit(path, lambda f: f["per_residue/offsets"].__setitem__(3, -600))
    with open_store(path) as st:
        with pytest.raises(StoreError, match=r"per_residue/offsets row 3 is -600, outside"):
            st.per_residue(records[2].id)
        np.testing.assert_array_equal(st.per_residue(records[5].id, 0), records[5].per_residue[0])


def test_sequence_offsets_past_the_data_refused_by_reader_and_merge(store, tmp_path):
    path, records = store
    def bump(f):
        f["sequence/offsets"][4] = f["sequence/data"].shape[0] + 50
    edit(path, bump)
    with open_store(path) as st, pytest.raises(StoreError, match=r"sequence/offsets row 4 is \d+, outside"):
        st[records[3].id]
    with pytest.raises(StoreError, match=r"s\.h5: .*sequence/offsets"):
        merge_stores([path], out=tmp_path / "m.h5")
    assert not (tmp_path / "m.h5").exists()
    assert any("sequence/offsets" in p for p in validate_store(path))


def _declare_huge_mean(f: h5py.File) -> None:
    old = f["mean/layer_2"]
    attrs = dict(old.attrs)
    del f["mean/layer_2"]
    ds = f.create_dataset("mean/layer_2", shape=(12, 2**31), dtype="f4", chunks=(1, 1 << 16), fletcher32=True)
    for k, v in attrs.items():
        ds.attrs[k] = v


def test_mean_declared_far_larger_than_the_file(store, tmp_path):
    path, _ = store
    edit(path, _declare_huge_mean)
    with pytest.raises(StoreError, match=r"dataset mean/layer_2 declares shape \(12, 2147483648\)"):
        open_store(path)
    problems = validate_store(path)
    assert any("mean/layer_2" in p and "2147483648" in p for p in problems), problems
    with pytest.raises(StoreError, match="mean/layer_2 declares shape"):
        merge_stores([path], out=tmp_path / "m.h5")
    one_line_error(cli("export", str(path), "--format", "npy", "--out", str(tmp_path / "x")), "mean/layer_2")


def test_validate_with_per_residue_offsets_of_1e10(store):
    path, _ = store
    def huge(f):
        off = f["per_residue/offsets"][:]
        f["per_residue/offsets"][1:] = off[1:] + 10**10
    edit(path, huge)
    problems = validate_store(path)
    assert any("per_residue" in p for p in problems), problems
    with pytest.raises(StoreError, match="per_residue/offsets row 12 is 1000000"):
        open_store(path)


# ------------------------------------------------------------------------------------- E


@pytest.mark.parametrize("bad", ["a\nb", "a\rb", "tab\there", "x\x85y", "l\u2028s"])
def test_writer_refuses_ids_with_control_characters(tmp_path, bad):
    records, rows = synthetic(3)
    records[1].id = bad
    with pytest.raises(StoreError, match="control character"):
        write_store(tmp_path / "s.h5", records, rows)
    assert not list(tmp_path.iterdir())


def test_validate_reports_an_id_with_a_newline(store):
    path, records = store
    def crafted(f):
        ids = [r.id.encode() for r in records]
        ids[4] = b"s0\nr4"
        f["ids"][:] = np.array(ids, dtype=f["ids"].dtype)
    edit(path, crafted)
    assert any("control character \\n" in p and "row 4" in p for p in validate_store(path))


def test_shard_refuses_a_header_id_with_a_control_character(tmp_path):
    fa = tmp_path / "in.fa"
    fa.write_bytes(b">ok1\nACDE\n>bad\x01id some text\nACDE\n")
    with pytest.raises(InputError, match=r"in\.fa:3: ID 'bad\\x01id' contains the control character"):
        list(iter_fasta(fa))
    for mode in ("error", "skip"):
        one_line_error(cli("shard", str(fa), "--out", str(tmp_path / f"sh-{mode}"), "--on-invalid", mode),
                       "in.fa:3", "control character")


def test_aliases_are_not_ids_and_resolve_on_their_own(results):
    root, paths, records, manifest = results
    out = root / "embeddings.h5"
    merge_stores(paths, out=out, manifest=manifest)
    with open_store(out) as st:
        assert "dupB2" not in st.ids and "dupB2" not in list(st.ids)
        assert "b2" in st.ids and "nope" not in st.ids
        assert "dupB2" in st  # what store[...] accepts
        assert st.resolve("dupB2") == "b2" and st.aliases["dupB2"] == "b2"
        assert st.index("dupB2") == list(st.ids).index("b2")
        np.testing.assert_array_equal(st.mean_vector("dupB2"), st.mean_vector("b2"))


PERMISSION_CHILD = textwrap.dedent("""
    import os, pwd, sys
    from embedpipe.core.errors import StoreError  # imports first: nobody may not read site-packages
    from embedpipe.store.reader import open_store
    from embedpipe.store.validate import validate_store
    os.setgid(pwd.getpwnam("nobody").pw_gid); os.setuid(pwd.getpwnam("nobody").pw_uid)
    try:
        open_store(sys.argv[1])
    except StoreError as exc:
        print("OPEN", exc)
    for p in validate_store(sys.argv[1]):
        print("VALIDATE", p)
""")


def test_unreadable_source_says_permission_denied(results):
    root, paths, records, manifest = results
    merge_stores(paths, out=root / "embeddings.h5", manifest=manifest)
    if os.geteuid() != 0:
        paths[1].chmod(0)
        with pytest.raises(StoreError, match=r"shard-00001\.h5.*permission denied") as info:
            open_store(root / "embeddings.h5")
        assert "mix runs" not in str(info.value)
        return
    # root reads every file: run the check as nobody, on a copy nobody may traverse to
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "results"
        shutil.copytree(root, copy)
        for p in [Path(tmp), *copy.rglob("*")]:
            p.chmod(0o755 if p.is_dir() else 0o644)
        os.chmod(tmp, 0o755)
        (copy / "stores" / "shard-00001.h5").chmod(0o600)
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        out = subprocess.run([sys.executable, "-c", PERMISSION_CHILD, str(copy / "embeddings.h5")],
                             capture_output=True, text=True, env=env, cwd=tmp)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    opened = [line for line in lines if line.startswith("OPEN")]
    assert len(opened) == 1 and "shard-00001.h5" in opened[0] and "permission denied" in opened[0], lines
    assert "mix runs" not in out.stdout and any("permission denied" in line for line in lines if "VALIDATE" in line)


def test_info_on_a_merged_store_with_a_missing_source_exits_nonzero(results):
    root, paths, records, manifest = results
    out = root / "embeddings.h5"
    merge_stores(paths, out=out, manifest=manifest)
    paths[2].unlink()
    info = store_info(out)
    assert any("shard-00002.h5 is missing" in p for p in info["source_problems"])
    result = cli("info", str(out))
    assert "shard-00002.h5" in result.stdout  # the page says so
    one_line_error(result, "shard-00002.h5", "missing")
    assert cli("info", str(out), "--json").returncode != 0
