"""The store at scale (format 2): the on-disk ID index, ``ids`` as a lazy sequence, ragged
sequences, and merged stores over many shard stores under a low open-file limit."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import h5py
import numpy as np
import pytest

import embedpipe
from embedpipe.core.errors import StoreError
from embedpipe.store import EmbeddedRecord, merge_stores, validate_store
from embedpipe.store.idindex import BLOCK_ROWS, IdIndex, UnknownIdError, encode_ids, index_keys, write_id_index
from helpers.stores import write_store

ROOT = Path(__file__).resolve().parents[2]
V2 = Path(__file__).resolve().parents[1] / "data" / "store-v2-example.h5"
ATTRS = {"model_name": "t", "model_sha256": "0" * 64, "precision_policy": "fp32", "config": {}}


def _records(prefix: str, lengths: list[int], dim: int, seed: int) -> list[EmbeddedRecord]:
    rng = np.random.default_rng(seed)
    out = []
    for i, n in enumerate(lengths):
        rows = rng.standard_normal((min(n, 6), dim)).astype(np.float32)
        out.append(EmbeddedRecord(id=f"{prefix}{i}", sequence="".join(rng.choice(list("ACDEFGHIKLMNPQRSTVWY"), n)),
                                  precision_used="fp32", mean={1: rows.mean(axis=0)}, per_residue={1: rows},
                                  embedded_length=len(rows), long_handling="truncated" if n > 6 else "none"))
    return out


def test_index_lookup_equals_a_dict_including_aliases_skipped_and_misses(tmp_path):
    rng = random.Random(0)
    ids = [f"UniRef50_{rng.getrandbits(40):x}" for _ in range(3 * BLOCK_ROWS + 17)]
    ids = list(dict.fromkeys(ids)) + ["é-unicode", "Z", "A"]
    aliases = [(f"alias{i}", ids[rng.randrange(len(ids))]) for i in range(500)]
    skipped = [(f"skip{i}", "too_short") for i in range(300)]
    with h5py.File(tmp_path / "i.h5", "w") as f:
        write_id_index(f, *index_keys(encode_ids(ids), aliases, skipped))
    with h5py.File(tmp_path / "i.h5", "r") as f:
        index = IdIndex.open(f)
        expected = {rid: i for i, rid in enumerate(ids)}
        expected |= {a: expected[of] for a, of in aliases} | {s: -1 - j for j, (s, _) in enumerate(skipped)}
        probes = list(expected) + ["", "missing", "UniRef50_", "zzzz", "0", ids[0] + "x"]
        for key in rng.sample(probes, len(probes)):
            assert index.lookup(key) == expected.get(key), key


def test_store_lookups_ids_sequence_and_misses(tmp_path):
    records = _records("r", [3] * (BLOCK_ROWS + 50), dim=2, seed=1)
    path = write_store(tmp_path / "s.h5", records, None, attrs=ATTRS)
    with embedpipe.open_store(path) as store:
        ids = store.ids
        assert len(ids) == len(records) and ids[0] == "r0" and ids[-1] == records[-1].id
        assert ids[10:13] == ["r10", "r11", "r12"] and list(ids) == [r.id for r in records] == ids
        assert "r77" in ids and "nope" not in ids and "r77" in store and "nope" not in store
        for i in random.Random(2).sample(range(len(records)), 200):
            assert store.index(records[i].id) == i
            np.testing.assert_array_equal(store.mean_vector(records[i].id), records[i].mean[1])
        with pytest.raises(UnknownIdError, match="'nope' is not in s.h5"):
            store.index("nope")
        with pytest.raises(IndexError):
            ids[len(records)]
    with pytest.raises(StoreError, match="closed"):
        store.index("r1")


def test_ragged_sequences_round_trip_with_a_35000_residue_record(tmp_path):
    records = _records("a", [5, 35_000, 7, 1], dim=3, seed=3)
    a = write_store(tmp_path / "a.h5", records[:2], attrs=ATTRS)
    b = write_store(tmp_path / "b.h5", records[2:], attrs=ATTRS)
    merged = merge_stores([a, b], out=tmp_path / "m.h5").out
    for path in (a, merged):
        assert validate_store(path) == []
        with embedpipe.open_store(path) as store:
            table = store.records(sequence=True)
            assert list(table["sequence"]) == [r.sequence for r in records][: len(store)]
            assert store["a1"]["sequence"] == records[1].sequence and store["a1"]["length"] == 35_000
    with h5py.File(merged, "r") as f:  # no padding: the bytes of the sequences and nothing more
        assert f["sequence/data"].shape == (sum(len(r.sequence) for r in records),)


def test_archived_v2_example_reads_and_validates():
    assert validate_store(V2) == []
    with embedpipe.open_store(V2) as store:
        assert store.provenance["format_version"] == 2 and store.ids == ["v0", "v1", "v2"]
        assert store["v1"]["sequence"] == json.loads((V2.with_suffix(".json")).read_text())["sequences"][1]


def _many_shards(tmp_path: Path, count: int) -> tuple[Path, list[EmbeddedRecord]]:
    stores, records = tmp_path / "stores", []
    stores.mkdir()
    paths = []
    for s in range(count):
        recs = _records(f"s{s}_", [2, 4], dim=2, seed=s)
        paths.append(write_store(stores / f"shard-{s:04d}.h5", recs, attrs=ATTRS))
        records += recs
    return merge_stores(paths, out=tmp_path / "m.h5").out, records


CHILD = textwrap.dedent("""
    import json, os, resource, sys
    import numpy as np
    import embedpipe
    from embedpipe.store import validate_store
    path, nofile, exhaust = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    out = {}
    store = embedpipe.open_store(path)
    held = []
    if exhaust:  # every descriptor taken: opening any shard store fails with EMFILE
        try:
            while True:
                held.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            pass
    try:
        out["rows"] = [store.per_residue(rid).tolist() for rid in store.ids]
        arr = store.per_residue_array().compute()
        out["array"] = arr.tolist()
    except Exception as exc:
        out["error"] = str(exc)
    out["validate"] = validate_store(path)
    print(json.dumps(out))
""")


def _child(path: Path, nofile: int, exhaust: bool) -> dict:
    res = subprocess.run([sys.executable, "-c", CHILD, str(path), str(nofile), "1" if exhaust else "0"],
                         capture_output=True, text=True, cwd=ROOT, check=True,
                         env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_300_shard_stores_read_and_validate_with_64_open_files(tmp_path):
    merged, records = _many_shards(tmp_path, 300)
    out = _child(merged, 64, exhaust=False)
    assert "error" not in out and out["validate"] == []
    expected = np.concatenate([r.per_residue[1] for r in records])
    np.testing.assert_array_equal(np.array(out["array"], dtype=np.float32), expected)
    for r, rows in zip(records, out["rows"]):
        np.testing.assert_array_equal(np.array(rows, dtype=np.float32), r.per_residue[1])


def test_too_many_open_files_is_reported_as_a_resource_limit_never_as_corruption(tmp_path):
    merged, _ = _many_shards(tmp_path, 3)
    out = _child(merged, 64, exhaust=True)
    assert "too many open files" in out["error"] and "not a problem of the store" in out["error"]
    assert out["validate"] and all("too many open files" in p for p in out["validate"]), out["validate"]
    assert not any("non-finite" in p or "checksum" in p or "corrupt" in p for p in out["validate"])
