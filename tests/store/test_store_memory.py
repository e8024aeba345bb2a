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
        merged[k] = _peak(lambda: merge_stores(paths, out=out, manifest=manifest))  # noqa: B023 - run at once
        problems: list[str] = []
        checked[k] = _peak(lambda: problems.extend(validate_store(out)))  # noqa: B023 - run at once
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
            from embedpipe.store.create import create_string_dataset
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


# --------------------------------------------------------------------------------------------
# the column checks of validate and the offsets of merge, in blocks (issue 24 §2, second half)

#: every block size made small, so that both sizes below are many blocks long
SMALL_BLOCKS = {"embedpipe.core.external_sort.CHUNK_BYTES": 1 << 20, "embedpipe.store.format.READ_BLOCK_BYTES": 1 << 20,
                "embedpipe.store.sequences.READ_BLOCK_BYTES": 1 << 20, "embedpipe.store.sequences.SEQUENCE_ROWS": 8192,
                "embedpipe.store.validate.COLUMN_ROWS": 8192, "embedpipe.store.id_checks.ID_ROWS": 8192,
                "embedpipe.store.meancheck.OFFSET_ROWS": 8192}


def _small_blocks(monkeypatch) -> None:
    for target, value in SMALL_BLOCKS.items():
        monkeypatch.setattr(target, value, raising=False)
    monkeypatch.setattr("store_scale.CHUNK_BYTES", 256 << 10)  # the synthetic stores' chunks


def test_validate_column_checks_peak_does_not_grow_with_the_records(tmp_path, monkeypatch):
    """One store of 70,000 and one of 280,000 records (more than the hard-wired 65,536-ID blocks
    of the index check): validate's traced peak grows by less than 1.25x (measured 1.0x).
    Before, ``length``, ``embedded_length``, the sequence lengths and the offsets (also the mean
    check's) were whole int64 arrays, and ``long_handling`` and the sequences of a format-1
    store blocks of a million Python strings: 3.2x."""
    from embedpipe.store.idindex import encode_ids, index_keys, write_id_index

    _small_blocks(monkeypatch)
    rng = np.random.default_rng(5)
    peaks = {}
    for n in (70_000, 280_000):
        path = tmp_path / f"s{n}.h5"
        write_shard(path, 0, n, rng, long_record=False)
        with h5py.File(path, "r+") as f:  # an ID index, so that the comparison runs too
            write_id_index(f, *index_keys(encode_ids(np.asarray(f["ids"][()]))))
        problems: list[str] = []
        peaks[n] = _peak(lambda: problems.extend(validate_store(path)))  # noqa: B023 - run at once
        assert problems == []
    assert peaks[280_000] < 1.25 * peaks[70_000], peaks


def _edit(path: Path, name: str, row: int, change) -> None:
    with h5py.File(path, "r+") as f:
        value = f[name][row]
        f[name][row] = change(value)


@pytest.mark.parametrize("edit, expected", [
    (("per_residue/offsets", 16, lambda v: 0), "per_residue/offsets not monotonic (first drop after row 15)"),
    (("embedded_length", 21, lambda v: v - 1), "record 'UniRef50_000000021': "),
    (("length", 9, lambda v: v + 1), "record 'UniRef50_000000009': length "),
    (("mean/layer_1", 33, lambda v: v + 0.5), "record 'UniRef50_000000033' (row 33) layer 1: stored mean differs"),
])
def test_validate_in_small_blocks_reports_what_it_reports_in_one(tmp_path, monkeypatch, edit, expected):
    """A problem on a block boundary (offsets row 16 with blocks of 8 records) or inside a later
    block is reported in the same words with blocks of 8 records and offsets as in one block."""
    path = tmp_path / "s.h5"
    write_shard(path, 0, 40, np.random.default_rng(3), long_record=False)
    _edit(path, *edit)
    whole = validate_store(path)
    assert any(p.startswith(expected) for p in whole), whole
    for rows in (1, 3, 8):
        monkeypatch.setattr("embedpipe.store.validate.COLUMN_ROWS", rows)
        monkeypatch.setattr("embedpipe.store.meancheck.OFFSET_ROWS", rows)
        assert validate_store(path) == whole, rows


def test_mean_check_reads_the_offsets_dataset_in_windows(tmp_path, monkeypatch):
    """The mean check reads offsets as its blocks advance: any window size and any block split
    name the same first record and count."""
    from embedpipe.store.meancheck import MeanCheck

    path = tmp_path / "s.h5"
    write_shard(path, 0, 60, np.random.default_rng(4), long_record=False)
    _edit(path, "mean/layer_1", 17, lambda v: v + 0.5)
    _edit(path, "mean/layer_1", 41, lambda v: v - 0.5)
    results = set()
    with h5py.File(path, "r") as f:
        ids = [i.decode() for i in f["ids"][()]]
        data = f["per_residue/layer_1"][()]
        for window in (1, 2, 5, 1 << 16):
            monkeypatch.setattr("embedpipe.store.meancheck.OFFSET_ROWS", window)
            for size in (1, 4, 13, len(data)):
                check = MeanCheck(f["mean/layer_1"], f["per_residue/offsets"], ids, 1)
                for start in range(0, len(data), size):
                    check.feed(slice(start, min(start + size, len(data))), data[start : start + size])
                results.add(check.problem())
    (problem,) = results
    assert problem.startswith("record 'UniRef50_000000017' (row 17) layer 1:") and "2 record(s)" in problem


def test_merge_peak_besides_the_id_sort_does_not_grow_with_the_records(tmp_path, monkeypatch):
    """8 and 32 shard stores of 5,000 records, no manifest: merge's traced peak outside the ID
    sort (its own test is above) grows by less than 1.25x for 4x the records (measured 1.09x).
    Before, ``per_residue/offsets`` was built as one array (8 B per record): 1.66x."""
    from embedpipe.store.merge import _Merge

    _small_blocks(monkeypatch)
    segments: list[int] = []
    write_ids = _Merge.write_ids

    def untraced(self, *args):  # the peak so far, then the ID sort not traced
        segments.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
        try:
            write_ids(self, *args)
        finally:
            tracemalloc.start()

    monkeypatch.setattr(_Merge, "write_ids", untraced)
    rng = np.random.default_rng(6)
    peaks = {}
    for k in (8, 32):
        (tmp_path / str(k)).mkdir()
        paths = [tmp_path / str(k) / f"shard-{s:02d}.h5" for s in range(k)]
        for s, path in enumerate(paths):
            write_shard(path, s * 5000, 5000, rng, long_record=False)
        out = tmp_path / str(k) / "merged.h5"
        segments.clear()
        peaks[k] = max(_peak(lambda: merge_stores(paths, out=out)), *segments)  # noqa: B023 - run at once
        with embedpipe.open_store(out) as st:  # the offsets written shard by shard are the shards'
            with h5py.File(paths[-1], "r") as last:
                assert np.array_equal(st.offsets[-5001:] - st.offsets[-5001], last["per_residue/offsets"][()])
    assert peaks[32] < 1.25 * peaks[8], peaks


def _old_h5_per_id(path: Path, blocks) -> None:
    """The former writer (h5py's high-level API, ~1 ms per ID): the reference."""
    from embedpipe.export.keys import encode_key

    with h5py.File(path, "w") as f:
        for block in blocks:
            for j, record_id in enumerate(block.ids):
                ds = f.create_dataset(encode_key(record_id), data=block.record_rows(j))
                i = int(block.source[j])
                ds.attrs["original_id"] = record_id
                ds.attrs["precision_used"] = block.table["precision_used"][i]
                ds.attrs["fallback_reason"] = block.table["fallback_reason"][i]
                if block.alias_of[j]:
                    ds.attrs["alias_of"] = block.alias_of[j]


def _h5_objects(path: Path) -> dict:
    """Every dataset: data, dtype, layout, and each attribute's value, string type and charset."""
    out = {}
    with h5py.File(path, "r") as f:
        for name in f:
            ds = f[name]
            attrs = {}
            for key in ds.attrs:
                t = ds.attrs.get_id(key).get_type()
                attrs[key] = (ds.attrs[key], ds.attrs.get_id(key).shape, t.is_variable_str(), t.get_cset())
            out[name] = (ds[()].tobytes(), ds.dtype, ds.shape, ds.id.get_create_plist().get_layout(), attrs)
    return out


@pytest.mark.parametrize("per_residue", [False, True])
def test_h5_per_id_writes_what_the_high_level_api_wrote(tmp_path, per_residue):
    """The low-level writer's datasets and attributes equal the former writer's, for IDs that
    need escaping, a non-ASCII one and aliases."""
    from embedpipe.export import export_store
    from embedpipe.export.blocks import iter_blocks

    paths = [tmp_path / f"shard-{k}.h5" for k in range(2)]
    for k, path in enumerate(paths):
        write_shard(path, k * 30, 30, np.random.default_rng(k), long_record=False)
    with h5py.File(paths[1], "r+") as f:  # IDs to escape, one non-ASCII, and a record without rows
        ids = f["ids"].asstr()[()].tolist()
        ids[:3] = ["sp|P1|A/B", ".hidden", "Ünïcode%"]
        del f["ids"]
        f.create_dataset("ids", data=np.array([i.encode() for i in ids], dtype=h5py.string_dtype("utf-8", 20)),
                         fletcher32=True, chunks=True).attrs.update(
                             {"encoding-type": "fixed-utf8-array", "encoding-version": "1"})
    out = tmp_path / "merged.h5"
    merge_stores(paths, out=out)
    with h5py.File(out, "r+") as f:  # two aliases, as a manifest's duplicates make them
        g = f.create_group("aliases")
        g.attrs.update({"encoding-type": "aliases", "encoding-version": "2"})
        for name, values in (("id", [b"dupA", b"dup/B"]), ("of", [b"UniRef50_000000004", ids[2].encode()])):
            ds = g.create_dataset(name, data=np.array(values, dtype=h5py.string_dtype("utf-8", 20)), fletcher32=True, chunks=True)
            ds.attrs.update({"encoding-type": "fixed-utf8-array", "encoding-version": "2"})
        del f["id_index"]
    new = tmp_path / "new.h5"
    export_store(out, fmt="h5-per-id", out=new, per_residue=per_residue, quiet=True)
    reference = tmp_path / "reference.h5"
    with embedpipe.open_store(out) as st:
        _old_h5_per_id(reference, iter_blocks(st, layer=1, per_residue=per_residue))
    got, want = _h5_objects(new), _h5_objects(reference)
    assert len(want) == 62 and got == want


def test_open_store_parses_the_per_source_attributes_when_first_asked(tmp_path, monkeypatch):
    """``shard_provenance`` (every source's root attributes: ~1-2 KB per source) is not parsed
    at open; ``provenance`` parses it when asked, also once the store is closed."""
    import json

    from embedpipe.store import format as store_format

    paths = [tmp_path / f"shard-{k}.h5" for k in range(3)]
    for k, path in enumerate(paths):
        write_shard(path, k * 20, 20, np.random.default_rng(k), long_record=False)
    out = tmp_path / "merged.h5"
    merge_stores(paths, out=out)
    parsed: list[str] = []
    loads = json.loads
    monkeypatch.setattr(store_format.json, "loads", lambda s, *a, **k: parsed.append(s) or loads(s, *a, **k))
    st = embedpipe.open_store(out)
    assert not any("shard-1.h5" in s and "model_sha256" in s for s in parsed)  # merged_sources is parsed: the pins
    with st:
        assert st.mean_vector("UniRef50_000000025").shape == (8,)
    prov = st.provenance
    assert [p["path"] for p in prov["shard_provenance"]] == [p.name for p in paths]
    assert [p["path"] for p in prov["merged_sources"]] == [p.name for p in paths] and prov["model_sha256"] == "0" * 64
    with h5py.File(out, "r") as f:
        assert prov == store_format.read_root_attrs(f)
