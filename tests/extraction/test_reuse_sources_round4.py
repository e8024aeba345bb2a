"""`embed --reuse` verifies a source before a row is copied (issue 30, round 4): the index must
belong to the store it names (the store's own uuid, model and identity, not the index's
copies); the rows copied must pass validate's checks (checksums present, finite, the
per-record fields, means against per-residue rows); and a job killed while it indexes a
store leaves no work directory behind for good."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import h5py
import numpy as np
import pytest

from embedpipe.core.atomic import host_tag
from embedpipe.core.errors import EmbedpipeError
from embedpipe.core.options import EmbedOptions
from embedpipe.extraction.run import embed_fasta
from embedpipe.store.reuse_index import build_index
from embedpipe.store.validate import validate_store
from helpers.embed_helpers import random_sequences, read_store, write_fasta
from helpers.stores import restamp_coverage

OPTIONS = EmbedOptions(per_residue=True, device="cpu", layers=(0, -1), storage_dtype="float16")
RECORDS = random_sequences(10, (8, 40), seed=21)


@pytest.fixture(scope="module")
def made(tmp_path_factory, tiny_model_path, model_factory):
    """Stores of RECORDS by two models (A: the tiny model, B: another seed), the FASTA."""
    tmp = tmp_path_factory.mktemp("reuse-sources")
    fasta = write_fasta(tmp / "r.fasta", RECORDS)
    other = model_factory(seed=5)
    for name, model in (("A", tiny_model_path), ("B", other)):
        embed_fasta(fasta, model=str(model), out=tmp / f"{name}.h5", options=OPTIONS, quiet=True)
    return {"tmp": tmp, "fasta": fasta, "A": tmp / "A.h5", "B": tmp / "B.h5", "model": tiny_model_path}


def _embed(made, reuse: Path, out: Path) -> Path:
    embed_fasta(made["fasta"], model=str(made["model"]), out=out, options=OPTIONS, quiet=True, reuse=[reuse])
    return out


# -- 1. the index belongs to its store ---------------------------------------------------------


def test_index_claiming_another_model_is_refused(made, tmp_path):
    """B's index with A's identity and model sha256: main copied B's vectors into an A store."""
    index = tmp_path / "B.idx.h5"
    build_index(made["B"], index)
    with h5py.File(made["A"], "r") as a, h5py.File(index, "a") as f:
        for key in ("embed_identity", "model_sha256"):
            f.attrs[key] = a.attrs[key]
    with pytest.raises(EmbedpipeError) as info:
        _embed(made, index, tmp_path / "out.h5")
    assert str(info.value) == (
        f"--reuse {made['B']}: its reuse index {index} records another model_sha256 than the store itself (the "
        "index was edited, or built from another store); build the index again (embedpipe reuse-index)")
    assert not (tmp_path / "out.h5").exists()


def test_index_claiming_another_identity_is_refused(made, tmp_path):
    """Same model, the store embedded as float32, its index edited to say float16."""
    f32 = tmp_path / "f32.h5"
    embed_fasta(made["fasta"], model=str(made["model"]), out=f32, quiet=True,
                options=EmbedOptions(per_residue=True, device="cpu", layers=(0, -1), storage_dtype="float32"))
    index = tmp_path / "f32.idx.h5"
    build_index(f32, index)
    with h5py.File(index, "a") as f, h5py.File(made["A"], "r") as a:
        f.attrs["embed_identity"] = a.attrs["embed_identity"]
    with pytest.raises(EmbedpipeError) as info:
        _embed(made, index, tmp_path / "out.h5")
    assert str(info.value) == (
        f"--reuse {f32}: its reuse index {index} records another embed_identity than the store itself (the "
        "index was edited, or built from another store); build the index again (embedpipe reuse-index)")


# -- 2. the rows copied pass validate's checks -------------------------------------------------


def _tampered(made, tmp: Path, edit) -> tuple[Path, Path]:
    """A copy of store A edited by ``edit(h5py.File)``, and its index (built after the edit:
    the index belongs to the store, the store's rows are what is wrong)."""
    store = tmp / "T.h5"
    shutil.copy(made["A"], store)
    with h5py.File(store, "a") as f:
        edit(f)
        restamp_coverage(f)  # the record parts and attr_digests too: what the row checks behind them catch
    build_index(store, tmp / "T.idx.h5")
    return store, tmp / "T.idx.h5"


def assert_refused(made, tmp: Path, edit, what: str, *, regex: bool = False) -> None:
    """embed --reuse from the tampered store fails with exactly ``--reuse STORE: WHAT; ...``
    (``what`` a regular expression when ``regex``), and writes nothing."""
    store, index = _tampered(made, tmp, edit)
    with pytest.raises(EmbedpipeError) as info:
        _embed(made, index, tmp / "out.h5")
    head, tail = f"--reuse {store}: ", f"; refusing to copy from it (run embedpipe validate {store})"
    pattern = re.escape(head) + (what if regex else re.escape(what)) + re.escape(tail)
    assert re.fullmatch(pattern, str(info.value)), str(info.value)
    assert not (tmp / "out.h5").exists()


def _rewrite(f: h5py.File, name: str, change, **kwargs) -> None:
    ds = f[name]
    values = change(ds[()])
    if kwargs.get("plain"):  # rewritten without its checksum (and filters)
        del f[name]
        f.create_dataset(name, data=values)
    else:
        ds[...] = values


def test_edited_mean_is_refused(made, tmp_path):
    """The mean of row 3 edited in place (HDF5 recomputes its checksum): main copied it, exit 0,
    and the new store failed validate."""
    def edit(f):
        def bump(x):
            x[3, 5] += 1
            return x
        _rewrite(f, "mean/layer_2", bump)
    assert_refused(made, tmp_path, edit, r"record 'rec003' \(row 3\) layer 2: stored mean differs from the mean of its "
             r"\d+ per-residue rows by \S+ at element 5 \(tolerance \S+ for float16\): pooled vectors and "
             r"per-residue rows come from different runs or were edited", regex=True)


def test_dataset_without_its_checksum_is_refused(made, tmp_path):
    """Rewritten without fletcher32 (values unchanged): nothing could say its rows are intact."""
    assert_refused(made, tmp_path, lambda f: _rewrite(f, "per_residue/layer_0", lambda x: x, plain=True),
             "dataset per_residue/layer_0 has no fletcher32 checksum, so its rows cannot be verified")


def test_non_finite_source_row_is_refused_naming_the_source(made, tmp_path):
    def edit(f):
        def nan(x):
            x[3] = np.nan
            return x
        _rewrite(f, "mean/layer_2", nan)
    assert_refused(made, tmp_path, edit, "dataset mean/layer_2: record 'rec003' (row 3) holds non-finite values")


def test_per_residue_nan_is_refused_naming_the_record(made, tmp_path):
    with h5py.File(made["A"], "r") as f:
        start = int(f["per_residue/offsets"][4])

    def edit(f):
        def nan(x):
            x[start + 1, 0] = np.nan
            return x
        _rewrite(f, "per_residue/layer_0", nan)
    assert_refused(made, tmp_path, edit, "dataset per_residue/layer_0: record 'rec004' (row 4) holds non-finite values")


def test_unknown_long_handling_is_refused(made, tmp_path):
    """main copied the value, and the new store failed validate (length against the sequence:
    the reader itself refuses it, when the store is indexed)."""
    def handling(f):
        _rewrite(f, "long_handling", lambda x: np.where(np.arange(len(x)) == 1, b"odd", x).astype(x.dtype))
    assert_refused(made, tmp_path, handling, "record 'rec001' (row 1): long_handling 'odd' is not known")


def test_only_the_rows_copied_are_checked(made, tmp_path):
    """A tampered row the job does not copy does not stop it (work follows the job's records)."""
    def edit(f):
        def bump(x):
            x[9, 0] += 1
            return x
        _rewrite(f, "mean/layer_2", bump)
    _, index = _tampered(made, tmp_path, edit)
    fasta = write_fasta(tmp_path / "few.fasta", RECORDS[:3])
    out = tmp_path / "few.h5"
    summary = embed_fasta(fasta, model=str(made["model"]), out=out, options=OPTIONS, quiet=True, reuse=[index])
    assert summary.reused == 3
    assert validate_store(out) == []
    ref, got = read_store(made["A"]), read_store(out)
    assert all(np.array_equal(got["per_residue"][2][r], ref["per_residue"][2][r]) for r, _ in RECORDS[:3])


# -- 5. a killed job's work directory is swept -------------------------------------------------


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_dead_owners_work_directory_is_removed_by_the_next_run(made, tmp_path, monkeypatch):
    temp = tmp_path / "temp"
    temp.mkdir()
    dead = temp / f".embedpipe-reuse-{_dead_pid()}-{host_tag()}-k1ll3d"
    live = temp / f".embedpipe-reuse-{os.getppid()}-{host_tag()}-al1ve0"
    other_host = temp / f".embedpipe-reuse-{_dead_pid()}-{'0' * 8 if host_tag() != '0' * 8 else '1' * 8}-h0st00"
    for d in (dead, live, other_host):
        d.mkdir()
        (d / "0.reuse.h5").write_bytes(b"partial")
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    _embed(made, made["A"], tmp_path / "out.h5")  # --reuse a store: indexed into a work directory
    assert not dead.exists()
    assert live.exists() and other_host.exists()  # a live owner's, another host's: left alone
    assert sorted(p.name for p in temp.iterdir()) == sorted([live.name, other_host.name])


#: the CLI in a child whose index build then stalls (so the kill lands mid-job, whatever the machine's speed)
STALLING = """
import sys, time
import embedpipe.extraction.reuse as reuse
built = reuse.build_index
def stall(*args, **kwargs):
    n = built(*args, **kwargs)
    print("indexed", flush=True)
    time.sleep(600)
    return n
reuse.build_index = stall
sys.argv = ["embedpipe", *sys.argv[1:]]
from embedpipe.cli import run
run()
"""


def test_sigkill_while_indexing_then_the_next_run_sweeps(made, tmp_path, monkeypatch):
    temp = tmp_path / "temp"
    temp.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-c", STALLING, "embed", str(made["fasta"]), "--model", str(made["model"]),
         "--out", str(tmp_path / "killed.h5"), "--device", "cpu", "--layers", "0,-1", "--per-residue",
         "--storage-dtype", "float16", "--reuse", str(made["A"]), "-q"],
        env={**os.environ, "TMPDIR": str(temp)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "indexed\n", proc.communicate()
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    left = [p for p in temp.iterdir() if p.name.startswith(".embedpipe-reuse-")]
    assert len(left) == 1 and any(left[0].iterdir())  # no exit handler ran: the index is still there
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    _embed(made, made["A"], tmp_path / "out.h5")
    assert not any(p.name.startswith(".embedpipe-reuse-") for p in temp.iterdir())
