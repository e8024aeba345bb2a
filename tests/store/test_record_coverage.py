"""Every byte that describes a record is covered (docs/store-format.md, "Row digests"): a
format-3 ``row_digest`` ends with a digest of the record's ID, stored sequence and per-record
columns, and ``attr_digests`` holds one digest per root attribute. Each edit below passed
``validate`` (or an export, an index build, a resume or ``--reuse``) when only the vectors were
digested; each is now named in one line. Expected digests are computed here with hashlib
(helpers.stores), not by embedpipe."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest

import embedpipe
from embedpipe.core.errors import EmbedpipeError, StoreError
from embedpipe.core.options import EmbedOptions
from embedpipe.export.run import export_store
from embedpipe.extraction.run import embed_fasta, embed_shards
from embedpipe.neighbours.build import build_index
from embedpipe.store.validate import validate_report, validate_store
from helpers.embed_helpers import random_sequences, write_fasta
from helpers.processes import run_cli
from helpers.stores import attr_digests, record_part

OPTIONS = EmbedOptions(device="cpu", layers=(0, -1), per_residue=False)


@pytest.fixture(scope="module")
def embedded(tmp_path_factory, tiny_model_path):
    tmp = tmp_path_factory.mktemp("coverage")
    records = random_sequences(8, (8, 30), seed=11)
    fasta = write_fasta(tmp / "in.fasta", records)
    store = tmp / "clean.h5"
    embed_fasta(fasta, model=str(tiny_model_path), out=store, options=OPTIONS, quiet=True)
    return {"store": store, "fasta": fasta, "records": records, "model": str(tiny_model_path)}


def copy(embedded: dict, tmp_path: Path, name: str = "edited.h5") -> Path:
    out = tmp_path / name
    shutil.copy(embedded["store"], out)
    return out


def digest_of(path: Path, row: int) -> str:
    with h5py.File(path, "r") as f:
        return f["row_digest"].asstr()[row][-32:]


def record_line(path: Path, clean: Path, rid: str, row: int) -> str:
    with h5py.File(path, "r") as f:
        got = record_part(f, row)
    return (f"record {rid!r} (row {row}): its ID, sequence or per-record columns hold other bytes than were written "
            f"(blake2b-128 {got}, row_digest records {digest_of(clean, row)}): edited after the store was written")


def test_the_writer_records_the_record_part_and_every_root_attribute(embedded):
    with h5py.File(embedded["store"], "r") as f:
        assert int(f.attrs["format_version"]) == 3
        for row in range(len(embedded["records"])):
            assert f["row_digest"].asstr()[row][-32:] == record_part(f, row)
        assert json.loads(f.attrs["attr_digests"]) == attr_digests(f)
        assert {"precision_policy", "platform", "model_trained", "model_sha256", "config", "layers", "pooling",
                "storage_dtype", "embed_identity"} <= set(json.loads(f.attrs["attr_digests"]))
    assert validate_report(embedded["store"]) == ([], [])


def test_one_residue_edited_in_place_is_named_by_validate_and_refused_by_reuse(embedded, tmp_path):
    edited = copy(embedded, tmp_path)
    rid, sequence = embedded["records"][3]
    with h5py.File(edited, "r+") as f:
        a = int(f["sequence/offsets"][3])
        data = f["sequence/data"][a : a + 1]
        data[0] = ord("W") if data[0] != ord("W") else ord("Y")  # same length: the length check passes
        f["sequence/data"][a : a + 1] = data
        changed = chr(int(data[0])) + sequence[1:]
    assert validate_store(edited) == [record_line(edited, embedded["store"], rid, 3)]  # main: [] (ok)

    fasta = write_fasta(tmp_path / "changed.fasta", [(rid, changed)])
    with pytest.raises(EmbedpipeError) as info:  # main: the old vectors copied to the edited sequence
        embed_fasta(fasta, model=embedded["model"], out=tmp_path / "new.h5", options=OPTIONS, quiet=True,
                    reuse=[edited])
    assert f"record {rid!r} (row 3): its ID, sequence or per-record columns" in str(info.value)
    assert "\n" not in str(info.value) and not (tmp_path / "new.h5").exists()


def swap_ids(path: Path, a: int, b: int) -> None:
    with h5py.File(path, "r+") as f:
        ids = f["ids"][()]
        ids[[a, b]] = ids[[b, a]]
        f["ids"][:] = ids


def test_swapped_ids_are_refused_by_export_and_index_build(embedded, tmp_path):
    edited = copy(embedded, tmp_path)
    swap_ids(edited, 1, 5)
    first = embedded["records"][5][0]  # now in row 1
    assert validate_store(edited)[-1] == (f"{record_line(edited, embedded['store'], first, 1)}; "
                                          "2 record(s) differ")
    # export and index check IDs and id_index as validate does before any block: the index holds
    # the IDs as written, so the swap is named by the first ID whose row changed
    swapped = (f"id_index does not match the store's ids, aliases and skipped ids (8 keys, expected 8; first: id "
               f"{embedded['records'][1][0]!r} is in row 5, the index says row 1): ID lookups would give wrong rows")
    with pytest.raises(StoreError) as info:  # main: exit 0, the records' vectors swapped
        export_store(edited, fmt="npy", out=tmp_path / "x.npy", quiet=True)
    assert str(info.value) == (f"{edited}: {swapped}: export refuses a store embedpipe validate rejects; "
                               f"run embedpipe validate {edited}")
    assert not (tmp_path / "x.npy").exists()
    with pytest.raises(StoreError) as info:  # main: an index that search answered with at score 1
        build_index(edited, tmp_path / "x.index")
    assert str(info.value) == (f"{edited}: {swapped}: index refuses a store embedpipe validate rejects; "
                               f"run embedpipe validate {edited}")
    assert not (tmp_path / "x.index").exists()
    with embedpipe.open_store(edited) as store, pytest.raises(StoreError) as info:  # the verified reader itself
        store.records(rows=slice(0, 3))
    assert f"record {first!r} (row 1): its ID, sequence or per-record columns" in str(info.value)
    with embedpipe.open_store(edited) as store, pytest.raises(StoreError) as info:  # the API's reader
        store[first]
    assert "\n" not in str(info.value)


def test_an_edited_per_record_column_is_named_by_validate_and_not_kept_by_resume(embedded, tmp_path):
    shards = tmp_path / "stores"
    fasta = tmp_path / "shard-00000.fasta"
    shutil.copy(embedded["fasta"], fasta)
    embed_shards([fasta], model=embedded["model"], out_dir=shards, options=OPTIONS, quiet=True)
    store = shards / "shard-00000.h5"
    clean = tmp_path / "clean.h5"
    shutil.copy(store, clean)
    with h5py.File(store, "r+") as f:
        values = f["precision_used"][()]
        values[2] = b"fp16" if values[2] != b"fp16" else b"fp32"
        f["precision_used"][:] = values
        rid = f["ids"].asstr()[2]
    line = record_line(store, clean, rid, 2)
    assert validate_store(store) == [line]  # main: ok
    summary = embed_shards([fasta], model=embedded["model"], out_dir=shards, options=OPTIONS, quiet=True)
    assert summary.kept == [] and len(summary.embedded) == 1  # main: kept, the false value with it
    with h5py.File(store, "r") as f, h5py.File(clean, "r") as g:
        assert (f["precision_used"][()] == g["precision_used"][()]).all()


@pytest.mark.parametrize("name, value", [("precision_policy", "bf16-mixed"), ("platform", "cpu avx2 (torch AVX2)"),
                                         ("model_trained", True)])
def test_an_edited_root_attribute_is_named_by_validate_open_and_reuse(embedded, tmp_path, name, value):
    edited = copy(embedded, tmp_path)
    with h5py.File(edited, "r+") as f:
        f.attrs[name] = value
        now = attr_digests(f)[name]
        was = json.loads(f.attrs["attr_digests"])[name]
    line = (f"root attribute {name} holds another value than was written (blake2b-64 {now}, attr_digests records "
            f"{was}): edited after the store was written")
    assert validate_store(edited) == [line]  # main: ok
    with pytest.raises(StoreError) as info:
        embedpipe.open_store(edited)
    assert str(info.value) == f"{edited.absolute()}: {line}: refusing to read it; run embedpipe validate {edited.absolute()}"
    with pytest.raises(EmbedpipeError) as info:  # main: the false value copied onward
        embed_fasta(embedded["fasta"], model=embedded["model"], out=tmp_path / "new.h5", options=OPTIONS, quiet=True,
                    reuse=[edited])
    assert f"root attribute {name} holds another value" in str(info.value) and "\n" not in str(info.value)
    assert not (tmp_path / "new.h5").exists()


def test_a_root_attribute_added_or_removed_is_named(embedded, tmp_path):
    edited = copy(embedded, tmp_path)
    with h5py.File(edited, "r+") as f:
        del f.attrs["model_sha256"]
        f.attrs["precision_requested"] = "auto"
    assert validate_store(edited) == ["root attribute model_sha256 was removed after the store was written",
                                      "root attribute precision_requested was added after the store was written"]


def test_row_digest_deleted_or_emptied_is_refused_not_excused(embedded, tmp_path):
    deleted = copy(embedded, tmp_path, "deleted.h5")
    with h5py.File(deleted, "r+") as f:
        del f["row_digest"]
    problems, notes = validate_report(deleted)
    assert problems == ["dataset row_digest is missing"] and notes == []  # main: ok, with a note excusing it
    result = run_cli("validate", str(deleted))
    assert result.returncode == 1 and "row digests are not recorded" not in result.stderr
    with pytest.raises(StoreError) as info:
        embedpipe.open_store(deleted)
    assert "dataset row_digest is missing; a store of format 3 records one: refusing to read it" in str(info.value)

    emptied = copy(embedded, tmp_path, "emptied.h5")
    with h5py.File(emptied, "r+") as f:
        f["row_digest"][:] = np.array([b""] * f["row_digest"].shape[0], dtype=f["row_digest"].dtype)
        first = f["ids"].asstr()[0]
    problems, notes = validate_report(emptied)
    empty = f"record {first!r} (row 0): row_digest is empty; every record of this format has one"
    assert problems and all(p.startswith(empty) for p in problems) and notes == []
    with pytest.raises(StoreError) as info:
        export_store(emptied, fmt="npy", out=tmp_path / "x.npy", quiet=True)
    assert empty in str(info.value)

    stripped = copy(embedded, tmp_path, "stripped.h5")
    with h5py.File(stripped, "r+") as f:
        del f.attrs["attr_digests"]
    assert validate_store(stripped)[0].startswith("root attribute attr_digests is missing")


def test_the_archived_format_3_store_reads_and_validates_and_format_2_is_still_excused():
    """tests/data holds a store of each format: format 3's digests checked with hashlib here,
    format 2's missing coverage stated (a note), not refused."""
    data = Path(__file__).resolve().parents[1] / "data"
    v3 = data / "store-v3-example.h5"
    with h5py.File(v3, "r") as f:
        assert int(f.attrs["format_version"]) == 3
        assert [d[-32:] for d in f["row_digest"].asstr()[()]] == [record_part(f, row) for row in range(3)]
        assert json.loads(f.attrs["attr_digests"]) == attr_digests(f)
    assert validate_report(v3) == ([], [])
    with embedpipe.open_store(v3) as store:
        assert list(store.records(sequence=True)["sequence"]) == ["MKTAYIAK", "GSHMLE", "PEPTIDEK"]
    problems, notes = validate_report(data / "store-v2-example.h5")
    assert problems == [] and notes[0].startswith("row digests are not recorded")
