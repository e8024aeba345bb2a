"""Issue 24 §2: merge and validate in memory independent of the record count; open_store of a
merged store without opening its sources; merged stores, old layout and new, open, validate
and read."""

from __future__ import annotations

import hashlib
import sys
import tracemalloc
from pathlib import Path

import h5py
import numpy as np
import pytest

import embedpipe
from embedpipe.core.errors import StoreError
from embedpipe.store import merge_stores, validate_store

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from store_scale import write_shard  # noqa: E402 - synthetic format-1 shard stores, written fast

PER_SHARD = 6000


def _stores(root: Path, shards: int) -> tuple[list[Path], Path]:
    """``shards`` stores of PER_SHARD records and a manifest (ok rows, 10% duplicates, skipped)."""
    rng = np.random.default_rng(shards)
    (root / "stores").mkdir(parents=True)
    paths = [root / "stores" / f"shard-{k:05d}.h5" for k in range(shards)]
    lines = ["id\tsource\tlength\tsequence_sha256\tshard\tstatus\tduplicate_of\tnormalised\n"]
    for k, path in enumerate(paths):
        write_shard(path, k * PER_SHARD, PER_SHARD, rng, long_record=False)
        with h5py.File(path, "r") as f:
            ids, seqs = f["ids"].asstr()[()], f["sequence"][()]
        for j, (rid, seq) in enumerate(zip(ids, seqs)):
            sha = hashlib.sha256(seq).hexdigest()
            lines.append(f"{rid}\tin.fa:1\t{len(seq)}\t{sha}\t{k}\tok\t\t\n")
            if j % 10 == 0:
                lines.append(f"D{rid}\tin.fa:2\t{len(seq)}\t{sha}\t{k}\tduplicate\t{rid if j % 20 else ''}\t\n")
            if j % 50 == 0:
                lines.append(f"X{rid}\tin.fa:3\t0\t\t\tskipped:empty\t\t\n")
    manifest = root / "manifest.tsv"
    manifest.write_text("".join(lines))
    return paths, manifest


def _peak(fn) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.fixture(scope="module")
def sizes(tmp_path_factory):
    """The same layout at two sizes: 2 and 8 stores of 6,000 records."""
    return {k: _stores(tmp_path_factory.mktemp(f"n{k}"), k) for k in (2, 8)}


def test_merge_and_validate_peak_does_not_grow_with_the_records(sizes, monkeypatch):
    """Traced peak allocation at 48,000 records stays below 1.6x that at 12,000 (4x the records;
    before, every ID was a dict entry and a list item: the peak grew ~4x)."""
    monkeypatch.setattr("embedpipe.core.external_sort.CHUNK_BYTES", 1 << 20)
    merged, checked = {}, {}
    for k, (paths, manifest) in sizes.items():
        out = paths[0].parents[1] / "embeddings.h5"
        merged[k] = _peak(lambda: merge_stores(paths, out=out, manifest=manifest))
        problems: list[str] = []
        checked[k] = _peak(lambda: problems.extend(validate_store(out)))
        assert problems == []
    assert merged[8] < 1.6 * merged[2], merged
    assert checked[8] < 1.6 * checked[2], checked


def test_merged_store_lookups_equal_the_manifest(sizes):
    paths, manifest = sizes[2]
    out = paths[0].parents[1] / "lookups.h5"
    summary = merge_stores(paths, out=out, manifest=manifest)
    rows = [line.rstrip("\n").split("\t") for line in manifest.read_text().splitlines(keepends=True)[1:]]
    ok = [r[0] for r in rows if r[5] == "ok"]
    first: dict[str, str] = {}
    for r in rows:
        if r[5] == "ok":
            first.setdefault(r[3], r[0])
    # by duplicate_of, else (empty) the first stored record with the same sequence
    dup = {r[0]: r[6] or first[r[3]] for r in rows if r[5] == "duplicate"}
    assert summary.records == len(ok) and summary.aliases == len(dup) and summary.skipped == len(rows) - len(ok) - len(dup)
    with embedpipe.open_store(out) as st, h5py.File(paths[1], "r") as shard:
        assert st.aliases == dup and list(st.ids) == ok
        rid = ok[PER_SHARD + 7]
        assert np.array_equal(st.mean_vector(rid), shard["mean/layer_1"][7])
        assert st.resolve(f"D{ok[PER_SHARD + 10]}") == ok[PER_SHARD + 10]
        lo, hi = shard["per_residue/offsets"][7], shard["per_residue/offsets"][8]
        assert np.array_equal(st.per_residue(rid), shard["per_residue/layer_1"][lo:hi])
        with pytest.raises(StoreError, match="was skipped"):
            st.index(f"X{ok[0]}")


def test_a_merged_store_with_the_former_index_layout_opens_validates_and_reads(sizes):
    """Stores merged before issue 24 (index written in one piece, aliases in manifest order)."""
    from embedpipe.store.format import decode_strings
    from embedpipe.store.idindex import encode_ids, index_keys, write_id_index

    paths, manifest = sizes[2]
    out = paths[0].parents[1] / "former.h5"
    merge_stores(paths, out=out, manifest=manifest)
    with h5py.File(out, "r+") as f:
        aliases = list(zip(decode_strings(f["aliases/id"][()]), decode_strings(f["aliases/of"][()])))[::-1]
        skipped = list(zip(decode_strings(f["skipped/id"][()]), decode_strings(f["skipped/reason"][()])))
        ids = encode_ids(np.asarray(f["ids"][()]))
        for name in ("id_index", "aliases/id", "aliases/of"):
            del f[name]
        f["aliases"].create_dataset("id", data=encode_ids([a for a, _ in aliases]))
        f["aliases"].create_dataset("of", data=encode_ids([b for _, b in aliases]), fletcher32=True)
        write_id_index(f, *index_keys(ids, aliases, skipped))
    with h5py.File(out, "r+") as f:  # the strings as the writer tags them
        for name in ("aliases/id", "aliases/of"):
            data = f[name][()]
            del f[name]
            from embedpipe.store.format import create_string_dataset
            create_string_dataset(f["aliases"], name.split("/")[1], decode_strings(data))
    assert validate_store(out) == []
    with embedpipe.open_store(out) as st:
        alias, of = aliases[0]
        assert st.resolve(alias) == of and st.index(of) == st.index(alias)


def test_validate_reports_an_index_that_misses_a_record(sizes):
    paths, manifest = sizes[2]
    out = paths[0].parents[1] / "swapped.h5"
    merge_stores(paths, out=out, manifest=manifest)
    with h5py.File(out, "r+") as f:
        rows = f["id_index/rows"]
        a, b = int(rows[10]), int(rows[11])
        rows[10], rows[11] = b, a
    assert any(p.startswith("id_index does not match") for p in validate_store(out))


def test_open_store_opens_no_source_and_checks_a_pin_when_the_source_is_read(tmp_path):
    """A source overwritten in place (same size, not an HDF5 file any more): open_store and
    pooled reads work without opening it; reading its per-residue rows is refused in one line
    (before, open_store opened every source's header: ~10 s at 16,000 sources)."""
    paths, _ = _stores(tmp_path, 2)
    out = tmp_path / "embeddings.h5"
    merge_stores(paths, out=out)
    size = paths[1].stat().st_size
    paths[1].write_bytes(b"\0" * size)
    with embedpipe.open_store(out) as st:
        rid = st.ids[PER_SHARD + 3]
        assert st.mean_vector(rid).shape == (8,)
        with pytest.raises(StoreError) as err:
            st.per_residue(rid)
    assert "shard-00001.h5" in str(err.value) and "\n" not in str(err.value)
    assert any("shard-00001.h5" in p for p in validate_store(out))
