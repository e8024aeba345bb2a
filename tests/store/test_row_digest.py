"""Row digests (docs/store-format.md, "Row digests"): a store edited in place with h5py
(fletcher32 recomputed on the write) was valid, copied by ``embed --reuse``, exported and
cross-checked. The writer now records blake2b-128 of each record's stored bytes per vector
dataset; validate, reuse, export and crosscheck each name the edited record in one line.
Expected digests here are computed with hashlib on the bytes h5py reads, not by embedpipe."""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path

import h5py
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from embedpipe.core.errors import EmbedpipeError, StoreError
from embedpipe.core.options import EmbedOptions
from embedpipe.crosscheck.run import run_crosscheck
from embedpipe.export.run import export_store
from embedpipe.extraction.run import embed_fasta
from embedpipe.store import EmbeddedRecord, StoreWriter, open_store
from embedpipe.store.merge import merge_stores
from embedpipe.store.row_checks import RowChecks
from embedpipe.store.validate import validate_report, validate_store
from helpers.embed_helpers import random_sequences, write_fasta
from helpers.processes import run_cli
from helpers.stores import record_part

DATA = Path(__file__).resolve().parents[1] / "data"


def blake(values: np.ndarray) -> str:
    """The independent digest: blake2b-128 of the little-endian bytes as stored."""
    data = np.ascontiguousarray(values)
    return hashlib.blake2b(data.astype(data.dtype.newbyteorder("<")).tobytes(), digest_size=16).hexdigest()


def recorded(path: Path, row: int) -> str:
    with h5py.File(path, "r") as f:
        return f["row_digest"].asstr()[row]


def bump(path: Path, name: str, row: int, element: int = 0, delta: float = 0.5) -> tuple[np.ndarray, np.ndarray]:
    """``d[row] = row + delta`` at one element, with h5py (its checksum recomputed): (old, new)."""
    with h5py.File(path, "r+") as f:
        d = f[name]
        old = d[row]
        new = old.copy()
        new[element] += np.asarray(delta, dtype=new.dtype)
        d[row] = new
    return old, new


# -- the case: a pooled-only store, one mean edited -------------------------------------------


@pytest.fixture(scope="module")
def embedded(tmp_path_factory, tiny_model_path):
    tmp = tmp_path_factory.mktemp("digest")
    records = random_sequences(12, (8, 40), seed=5)
    fasta = write_fasta(tmp / "in.fasta", records)
    store = tmp / "clean.h5"
    options = EmbedOptions(device="cpu", layers=(0, -1), per_residue=False)
    embed_fasta(fasta, model=str(tiny_model_path), out=store, options=options, quiet=True)
    return {"store": store, "fasta": fasta, "options": options, "ids": [r for r, _ in records]}


def test_the_writer_records_the_digest_of_the_bytes_it_stored(embedded):
    with h5py.File(embedded["store"], "r") as f:
        digests = f["row_digest"].asstr()[()]
        for row in range(len(embedded["ids"])):  # mean/layer_0, mean/layer_2: no bos, no per-residue rows
            assert digests[row] == blake(f["mean/layer_0"][row]) + blake(f["mean/layer_2"][row]) + record_part(f, row)
    assert validate_report(embedded["store"]) == ([], [])


def test_a_mean_edited_in_place_is_refused_by_validate_reuse_export_and_crosscheck(embedded, tmp_path,
                                                                                      tiny_model_path):
    """Main: validate said ok, --reuse copied the edited vector, export and crosscheck used it."""
    edited = tmp_path / "edited.h5"
    shutil.copy(embedded["store"], edited)
    rid = embedded["ids"][3]
    old, new = bump(edited, "mean/layer_2", 3)
    line = (f"record {rid!r} (row 3): dataset mean/layer_2 holds other bytes than were written (blake2b-128 "
            f"{blake(new)}, row_digest records {blake(old)}): edited after the store was written")
    assert validate_store(edited) == [line]  # main: [] (ok)
    assert recorded(edited, 3)[32:64] == blake(old)

    out = tmp_path / "reused.h5"
    with pytest.raises(EmbedpipeError) as info:
        embed_fasta(embedded["fasta"], model=str(tiny_model_path), out=out, options=embedded["options"], quiet=True,
                    reuse=[edited])
    assert str(info.value) == f"--reuse {edited}: {line}; refusing to copy from it (run embedpipe validate {edited})"
    assert not out.exists()

    with pytest.raises(StoreError) as info:
        export_store(edited, fmt="npy", out=tmp_path / "x.npy", quiet=True)
    assert str(info.value) == f"{edited.absolute()}: {line}: export refuses them; run embedpipe validate {edited.absolute()}"
    assert not (tmp_path / "x.npy").exists()

    with pytest.raises(StoreError) as info:
        run_crosscheck(edited, out=tmp_path / "cc", sample=4, seed=0, device="cpu", quiet=True)
    assert str(info.value) == (f"{edited.absolute()}: {line}: crosscheck refuses to judge them; "
                               f"run embedpipe validate {edited.absolute()}")
    assert not (tmp_path / "cc" / "crosscheck.json").exists()

    # the untouched store is still copied, exported and cross-checked
    embed_fasta(embedded["fasta"], model=str(tiny_model_path), out=out, options=embedded["options"], quiet=True,
                reuse=[embedded["store"]])
    with h5py.File(out, "r") as f, h5py.File(embedded["store"], "r") as g:
        copies, sources = f["row_digest"].asstr()[()], g["row_digest"].asstr()[()]
        assert [d[:-32] for d in copies] == [d[:-32] for d in sources]  # bit-for-bit vectors, the same digests
        assert [d[-32:] for d in copies] == [record_part(f, row) for row in range(len(copies))]  # reused_from its own


def test_validate_of_a_store_written_before_digests_notes_it_and_passes(tmp_path):
    for name in ("store-v1-example.h5", "store-v2-example.h5"):
        problems, notes = validate_report(DATA / name)
        assert problems == [] and len(notes) == 1 and notes[0].startswith("row digests are not recorded")
        result = run_cli("validate", str(DATA / name))
        assert result.returncode == 0 and result.stdout.strip() == f"{DATA / name}: ok"
        assert f"{DATA / name}: note: row digests are not recorded" in result.stderr


# -- merged stores: copied pooled vectors and virtual per-residue rows ---------------------------


def synthetic(n: int, seed: int, prefix: str, dim: int = 6) -> list[EmbeddedRecord]:
    """Records whose means are the fp32 means of their rows (validate's mean check passes)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = int(rng.integers(1, 9))
        rows = {k: rng.standard_normal((length, dim)).astype(np.float32) for k in (0, 3)}
        out.append(EmbeddedRecord(id=f"{prefix}{i}", sequence="ACDEFGHIK"[:length], precision_used="fp32",
                                  mean={k: r.mean(axis=0) for k, r in rows.items()},
                                  bos={k: rng.standard_normal(dim).astype(np.float32) for k in (0, 3)},
                                  per_residue=rows))
    return out


def write(path: Path, records: list[EmbeddedRecord], dtype: str = "float16") -> Path:
    with StoreWriter(path, ids=[r.id for r in records], sequences=[r.sequence for r in records],
                     residue_rows=[len(r.per_residue[0]) for r in records], layers=[3, 0], dim=6,
                     storage_dtype=dtype, attrs={"model_name": "synthetic"}, pooling=["mean", "bos"]) as w:
        for i in reversed(range(len(records))):
            w.write(i, records[i])
    return path


def test_merged_store_keeps_digests_valid_and_names_an_edit_in_a_shard_or_in_the_merged_file(tmp_path):
    a = write(tmp_path / "a.h5", synthetic(5, 1, "a"))
    b = write(tmp_path / "b.h5", synthetic(4, 2, "b"))
    merged = tmp_path / "m.h5"
    merge_stores([a, b], out=merged)
    with h5py.File(merged, "r") as f:
        digest = f["row_digest"].asstr()[6]  # b1
        off = f["per_residue/offsets"][6:8]
        parts = [f[n][6] for n in ("mean/layer_0", "mean/layer_3", "bos/layer_0", "bos/layer_3")]
        parts += [f[f"per_residue/layer_{k}"][off[0]:off[1]] for k in (0, 3)]  # through the virtual datasets
        record = record_part(f, 6)  # the shard's columns copied: the same bytes
    assert digest == "".join(blake(p) for p in parts) + record
    assert validate_report(merged) == ([], [])

    bump(merged, "bos/layer_3", 6)  # the merged file's own copy
    problems = validate_store(merged)
    assert len(problems) == 1 and problems[0].startswith("record 'b1' (row 6): dataset bos/layer_3 holds other bytes")

    merge_stores([a, b], out=merged)  # again, then a per-residue row edited in the shard itself
    with h5py.File(b, "r") as f:
        first = int(f["per_residue/offsets"][2])
    bump(b, "per_residue/layer_0", first, element=2)  # b2's first row: merged row 7
    problems = validate_store(merged)
    assert any(p.startswith("record 'b2' (row 7): dataset per_residue/layer_0 (its per-residue rows ") for p in problems)
    with open_store(merged) as store, pytest.raises(StoreError) as info:
        RowChecks(store, merged).check([7])
    assert "record 'b2' (row 7)" in str(info.value) and "\n" not in str(info.value)


def test_a_merged_store_of_shards_without_digests_notes_how_many_records_lack_one(tmp_path):
    a = write(tmp_path / "a.h5", synthetic(3, 1, "a"))
    b = write(tmp_path / "b.h5", synthetic(2, 2, "b"))
    with h5py.File(b, "r+") as f:
        del f["row_digest"]  # as written before digests existed (format 2)
        f.attrs["format_version"] = 2
    merged = tmp_path / "m.h5"
    merge_stores([a, b], out=merged)
    problems, notes = validate_report(merged)
    assert problems == [] and notes == ["2 of 5 record(s) carry no row digest (copied from stores written before "
                                        "embedpipe recorded them): their vectors edited in place cannot be detected"]


# -- any byte of any record, in any vector dataset ------------------------------------------------


@pytest.fixture(scope="module")
def clean_store(tmp_path_factory) -> Path:
    return write(tmp_path_factory.mktemp("prop") / "clean.h5", synthetic(9, 7, "p"), dtype="float32")


DATASETS = ["mean/layer_0", "mean/layer_3", "bos/layer_0", "bos/layer_3", "per_residue/layer_0", "per_residue/layer_3"]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(row=st.integers(0, 8), name=st.sampled_from(DATASETS), where=st.floats(0, 1, exclude_max=True),
       flip=st.integers(1, 255))
def test_any_edited_byte_is_named_by_validate_reuse_and_export(clean_store, row, name, where, flip):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "edited.h5"
        shutil.copy(clean_store, path)
        with h5py.File(path, "r+") as f:
            off = f["per_residue/offsets"][row : row + 2]
            rows = slice(int(off[0]), int(off[1])) if name.startswith("per_residue/") else slice(row, row + 1)
            values = f[name][rows]
            raw = values.view(np.uint8).reshape(-1)
            byte = int(where * raw.size)
            raw[byte] ^= flip  # any byte of the record's values in this dataset, changed
            f[name][rows] = values
        rid = f"p{row}"
        named = f"record {rid!r} (row {row}"

        problems = validate_store(path)
        assert any(p.startswith(f"{named}): dataset {name}") and "holds other bytes" in p for p in problems), problems
        assert all("\n" not in p for p in problems)

        with open_store(path) as store, pytest.raises(StoreError) as info:  # what embed --reuse runs first
            RowChecks(store, path).check(range(9))
        assert named in str(info.value) and "\n" not in str(info.value)

        per_residue = name.startswith("per_residue/")
        layer = int(name.rsplit("_", 1)[1])
        pooling = "mean" if per_residue else name.split("/")[0]
        with pytest.raises(StoreError) as info:
            export_store(path, fmt="npy", out=Path(tmp) / "x.npy", layer=layer, per_residue=per_residue,
                         pooling=pooling, quiet=True)
        assert named in str(info.value) and "\n" not in str(info.value)
