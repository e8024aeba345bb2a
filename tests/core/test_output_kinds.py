"""An output replaces an existing file only when that file is its command's own kind of output
(embedpipe/core/output_guard.py, ``OutputKind``): ``embed`` and ``Result.save`` a store, ``index``
an index, ``search`` a search TSV, ``export`` an export of its format. Anything else (a FASTA, the
model, the store an index was built from) is refused in one line naming the path and what it
is, and kept byte for byte; output paths are resolved first (``..``, symlinks)."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pyarrow.parquet as pq
import pytest

import embedpipe
from embedpipe.api.querying import search_fasta
from embedpipe.core.errors import EmbedpipeError
from embedpipe.core.options import EmbedOptions
from embedpipe.export import export_store
from embedpipe.extraction.run import embed_fasta, embed_shards
from embedpipe.neighbours.build import build_index
from embedpipe.store import open_store
from helpers.embed_helpers import random_sequences, write_fasta
from helpers.processes import ROOT

RECORDS = random_sequences(6, (8, 30), seed=31)
QUERIES = random_sequences(2, (8, 30), seed=32)
OPTIONS = EmbedOptions(device="cpu")


@pytest.fixture(scope="module")
def indexed(tmp_path_factory, tiny_model_path) -> tuple[Path, Path, Path]:
    """A store of RECORDS and its exact index (``idx``), in a directory of their own."""
    tmp = tmp_path_factory.mktemp("kinds")
    store = tmp / "s.h5"
    embed_fasta(write_fasta(tmp / "s.fasta", RECORDS), model=str(tiny_model_path), out=store, options=OPTIONS,
                quiet=True)
    build_index(store, tmp / "idx")
    return tmp, store, tmp / "idx"


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """``python -m embedpipe.cli ARGS`` in ``cwd``, with this checkout's package first on the path."""
    return subprocess.run([sys.executable, "-m", "embedpipe.cli", *args], capture_output=True, text=True, cwd=cwd,
                          env=os.environ | {"PYTHONPATH": str(ROOT)})


def _one_error_line(proc) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    return lines[0]


def _refusal(label: str, path: Path | str, what: str, kind: str, command: str) -> str:
    return (f"{label} {path} exists and is {what}, not {kind}; {command} replaces only {kind}: "
            "remove the file or choose another output path")


# ------------------------------------------------------------------ the reported cases, by the CLI


def test_search_out_that_is_the_indexs_store_is_refused_and_the_store_kept(indexed, tmp_path):
    tmp, store, index = indexed
    before = store.read_bytes()
    queries = write_fasta(tmp_path / "q.fasta", QUERIES)
    (tmp_path / "sub").mkdir()
    spelled = os.path.relpath(store, tmp_path / "sub")  # ../../kinds0/s.h5: resolved before it is compared
    proc = run_cli("search", str(queries), "--index", str(index), "--out", spelled, "--device", "cpu", "-q",
                   cwd=tmp_path / "sub")
    assert _one_error_line(proc) == (f"embedpipe: error: --out {spelled} is the input {store}; search never writes "
                                     "over its inputs: choose another output path")
    assert store.read_bytes() == before


def test_index_out_that_is_the_model_is_refused_and_the_model_kept(indexed, tmp_path, tiny_model_path):
    _, store, _ = indexed
    model = tmp_path / "m.pt"
    model.write_bytes(tiny_model_path.read_bytes())
    (tmp_path / "sub").mkdir()
    proc = run_cli("index", str(store), "--out", "../m.pt", cwd=tmp_path / "sub")
    assert _one_error_line(proc) == "embedpipe: error: " + _refusal(
        "--out", "../m.pt", "a zip file (a torch checkpoint, for example)", "an embedpipe index", "index")
    assert model.read_bytes() == tiny_model_path.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pt", "sub"]  # no INDEX.json or ids beside it


def test_an_output_symlink_to_a_fasta_is_refused_and_the_fasta_kept(indexed, tmp_path, tiny_model_path):
    fasta = write_fasta(tmp_path / "keep.fasta", RECORDS)
    before = fasta.read_bytes()
    link = tmp_path / "out.h5"
    link.symlink_to(fasta)
    other = write_fasta(tmp_path / "x.fasta", RECORDS[:2])
    with pytest.raises(EmbedpipeError) as caught:
        embed_fasta(other, model=str(tiny_model_path), out=link, options=OPTIONS, quiet=True)
    assert str(caught.value) == _refusal("--out", link, "a FASTA file", "an embedpipe store", "embed")
    assert fasta.read_bytes() == before and link.is_symlink()


# ------------------------------------------------------------------ every command, over a FASTA


def _embed(out: Path, tmp: Path, model: Path, store: Path, index: Path) -> None:
    embed_fasta(write_fasta(tmp / "in.fasta", RECORDS[:2]), model=str(model), out=out, options=OPTIONS, quiet=True)


def _save(out: Path, tmp: Path, model: Path, store: Path, index: Path) -> None:
    with embedpipe.Embedder(model, device="cpu") as embedder:
        embedder.embed(RECORDS[:2]).save(out)


def _index(out: Path, tmp: Path, model: Path, store: Path, index: Path) -> None:
    build_index(store, out)


def _search(out: Path, tmp: Path, model: Path, store: Path, index: Path) -> None:
    search_fasta(write_fasta(tmp / "q.fasta", QUERIES), index, out, quiet=True, device="cpu")


def _export(fmt: str):
    def run(out: Path, tmp: Path, model: Path, store: Path, index: Path) -> None:
        export_store(store, fmt=fmt, out=out, quiet=True)
    return run


#: command, how the Python API runs it, the output's name, its label and what it replaces
WRITERS = [
    ("embed", _embed, "out.h5", "--out", "an embedpipe store"),
    ("save", _save, "out.h5", "path", "an embedpipe store"),
    ("index", _index, "out.idx", "--out", "an embedpipe index"),
    ("search", _search, "out.tsv", "--out", "a search TSV"),
    ("export", _export("h5-per-id"), "out.h5", "--out", "an h5-per-id export"),
    ("export", _export("parquet"), "out.parquet", "--out", "a parquet export"),
    ("export", _export("npy"), "out.npy", "--out", "an npy export"),
]
IDS = ["embed", "save", "index", "search", "h5-per-id", "parquet", "npy"]


@pytest.mark.parametrize(("command", "run", "name", "label", "kind"), WRITERS, ids=IDS)
def test_an_output_over_a_fasta_is_refused_naming_what_it_is(indexed, tmp_path, tiny_model_path, command, run,
                                                             name, label, kind):
    _, store, index = indexed
    victim = write_fasta(tmp_path / name, RECORDS)
    before = victim.read_bytes()
    with pytest.raises(EmbedpipeError) as caught:
        run(victim, tmp_path, tiny_model_path, store, index)
    assert str(caught.value) == _refusal(label, victim, "a FASTA file", kind, command)
    assert victim.read_bytes() == before


@pytest.mark.parametrize(("command", "run", "name", "label", "kind"), WRITERS[:2] + WRITERS[4:], ids=IDS[:2] + IDS[4:])
def test_a_store_or_export_output_over_another_kind_of_hdf5_is_refused(indexed, tmp_path, tiny_model_path, command,
                                                                       run, name, label, kind):
    """An HDF5 file that is neither a store nor an export (a user's own) is kept too."""
    _, store, index = indexed
    victim = tmp_path / name
    with h5py.File(victim, "w") as f:
        f["mine"] = np.arange(3)
    before = victim.read_bytes()
    with pytest.raises(EmbedpipeError) as caught:
        run(victim, tmp_path, tiny_model_path, store, index)
    assert str(caught.value) == _refusal(label, victim, "an HDF5 file", kind, command)
    assert victim.read_bytes() == before


@pytest.mark.parametrize(("command", "run", "name", "label", "kind"), WRITERS, ids=IDS)
def test_each_command_replaces_its_own_earlier_output(indexed, tmp_path, tiny_model_path, command, run, name, label,
                                                      kind):
    """Run twice into the same path: the second run replaces the first's output (the one file a
    user means to overwrite), and what it wrote reads back as that kind."""
    _, store, index = indexed
    out = tmp_path / name
    run(out, tmp_path, tiny_model_path, store, index)
    first = out.stat().st_ino
    run(out, tmp_path, tiny_model_path, store, index)
    assert out.stat().st_ino != first  # a new file renamed into place
    if kind == "an embedpipe store":
        with open_store(out) as st:
            assert list(st.ids) == [rid for rid, _ in RECORDS[:2]]
    elif kind == "an embedpipe index":
        assert Path(f"{out}.ids.txt").read_text().split() == [rid for rid, _ in RECORDS]
    elif kind == "a search TSV":
        rows = list(csv.reader(out.open(), delimiter="\t"))
        assert rows[0] == ["query", "hit", "score", "rank"] and {r[0] for r in rows[1:]} == {q for q, _ in QUERIES}
    elif kind == "a parquet export":
        assert pq.read_table(out).column("id").to_pylist() == [rid for rid, _ in RECORDS]
    elif kind == "an npy export":
        assert np.load(out).shape[0] == len(RECORDS)
    else:
        with h5py.File(out, "r") as f:
            assert sorted(f) == sorted(rid for rid, _ in RECORDS)


def test_an_index_output_whose_description_is_a_users_json_is_refused(indexed, tmp_path):
    """The index's files are one set: ``OUT.json`` that is not an index's keeps ``OUT`` and itself."""
    _, store, _ = indexed
    mine = tmp_path / "idx.json"
    mine.write_text('{"format": "my-notes"}\n')
    with pytest.raises(EmbedpipeError) as caught:
        build_index(store, tmp_path / "idx")
    assert str(caught.value) == _refusal("--out", mine, "a JSON file", "an embedpipe index", "index")
    assert mine.read_text() == '{"format": "my-notes"}\n' and not (tmp_path / "idx").exists()


@pytest.mark.parametrize(("command", "run", "name", "label", "kind"), WRITERS, ids=IDS)
def test_an_empty_file_is_replaced(indexed, tmp_path, tiny_model_path, command, run, name, label, kind):
    """An empty file holds nothing to lose (``--out "$(mktemp)"``): every command writes over it."""
    _, store, index = indexed
    out = tmp_path / name
    out.write_bytes(b"")
    run(out, tmp_path, tiny_model_path, store, index)
    assert out.stat().st_size > 0


def test_a_groups_done_marker_replaces_only_a_group_marker(tmp_path, tiny_model_path):
    """``--done`` over a FASTA is refused before any shard is embedded; over the group's own
    earlier marker the rerun writes it again."""
    shard = write_fasta(tmp_path / "shard-0.fasta", RECORDS[:2])
    victim = write_fasta(tmp_path / "done.json", RECORDS)
    before = victim.read_bytes()
    with pytest.raises(EmbedpipeError) as caught:
        embed_shards([shard], model=str(tiny_model_path), out_dir=tmp_path / "st", done=victim, options=OPTIONS,
                     quiet=True)
    assert str(caught.value) == _refusal("--done", victim, "a FASTA file", "an embedpipe group marker", "embed")
    assert victim.read_bytes() == before and not (tmp_path / "st" / "shard-0.h5").exists()
    done = tmp_path / "group.json"
    for _ in range(2):
        embed_shards([shard], model=str(tiny_model_path), out_dir=tmp_path / "st", done=done, options=OPTIONS,
                     quiet=True)
        assert json.loads(done.read_text())["stores"][0]["store"] == str(tmp_path / "st" / "shard-0.h5")
