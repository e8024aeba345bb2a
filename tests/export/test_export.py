"""`embedpipe export`: every input ID (aliases included) finds its exact vector through the
consumer's own way of reading each format (a protspace-style h5 reader, pyarrow, pandas,
polars, DuckDB, numpy), and exports are atomic and stream in bounded memory."""

from __future__ import annotations

import json
import subprocess
import sys
import tracemalloc
from pathlib import Path

import h5py
import numpy as np
import pytest
from typer.testing import CliRunner

import embedpipe
from embedpipe.cli import app
from embedpipe.core.errors import EmbedpipeError
from embedpipe.export import export_store
from embedpipe.export.keys import decode_key, encode_key
from embedpipe.extraction.run import EmbedOptions
from helpers.embed_helpers import merged_store

# IDs HDF5 cannot name as they are ('/' and a lone '.'), a '%' that must survive decoding,
# duplicates (aliases) and one invalid record (skipped).
RECORDS = [
    ("sp|P1|A/B", "MKTAYIAKQRQISFVKSHFSRQ"),
    ("tr|Q2|C", "MSTNPKPQRKTKRNTNRRPQDVKFPGG"),
    ("dup/of/first", "MKTAYIAKQRQISFVKSHFSRQ"),
    ("50%", "MADEEKLPPGWEKRMSRSSGRVYYFNHITNASQ"),
    (".", "MSTNPKPQRKTKRNTNRRPQDVKFPGG"),
    ("bad", "MK-AL"),
    ("long", "MLSRAVCGTSRQLAPVLGYLGSRQKHSLPDLPYDYGALEPHINAQIMQLHHSKHHAAYVNNLNVTEEKYQEALAK"),
]


@pytest.fixture(scope="module")
def merged(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path) -> Path:
    """A merged store over two shards, with aliases and a skipped record, per-residue on."""
    tmp = tmp_path_factory.mktemp("export")
    return merged_store(tmp, tiny_model_path, RECORDS, tmp / "embeddings.h5", tokens_per_shard=70,
                        options=EmbedOptions(device="cpu", threads=1, per_residue=True, layers=(0, -1)))


def expected(store_path: Path, *, per_residue: bool = False, layer: int = -1) -> dict[str, np.ndarray]:
    """Every input ID's vector (or per-residue rows) as the store's own reader gives it."""
    with embedpipe.open_store(store_path) as store:
        ids = store.ids + list(store.aliases)
        if per_residue:
            return {rid: store.per_residue(rid, layer) for rid in ids}
        return {rid: store.mean_vector(rid, layer) for rid in ids}


def test_keys_are_reversible_and_leave_ordinary_ids_alone():
    for rid in ["sp|P12345|NAME_HUMAN", "sp|X|Y/Z", ".", "..", "%", "%2F", "a/b%c", ".hidden", "x.y"]:
        key = encode_key(rid)
        assert "/" not in key and key not in (".", "")
        assert decode_key(key) == rid
    assert encode_key("sp|P12345|NAME_HUMAN") == "sp|P12345|NAME_HUMAN"


def protspace_style_load(path: Path) -> tuple[str, list[str], np.ndarray]:
    """The rules protspace's ``load_h5`` follows: datasets at the root (or one group down),
    the dataset name is the ID, 1-D vectors, float16 upcast, ``model_name`` root attribute."""
    with h5py.File(path, "r") as f:
        name = f.attrs["model_name"]
        headers, data = [], []
        for key, item in f.items():
            items = item.items() if isinstance(item, h5py.Group) else [(key, item)]
            for sub_key, dataset in items:
                vector = np.array(dataset)
                assert vector.ndim == 1, f"{sub_key}: protspace needs per-protein vectors"
                headers.append(sub_key)
                data.append(vector)
    arr = np.array(data)
    return str(name), headers, arr.astype(np.float32) if arr.dtype == np.float16 else arr


def test_h5_per_id_round_trips_through_a_protspace_style_reader(merged, tmp_path):
    out = tmp_path / "per-id.h5"
    summary = export_store(merged, fmt="h5-per-id", out=out, quiet=True)
    want = expected(merged)
    assert summary.records + summary.aliases == len(want) and summary.aliases >= 2 and summary.skipped == 1
    name, headers, arr = protspace_style_load(out)
    with embedpipe.open_store(merged) as store:
        assert name == store.provenance["model_name"]
    assert sorted(decode_key(h) for h in headers) == sorted(want)
    for header, vector in zip(headers, arr):
        np.testing.assert_array_equal(vector, want[decode_key(header)])
    with h5py.File(out, "r") as f:
        for rid in want:
            ds = f[encode_key(rid)]
            assert ds.attrs["original_id"] == rid
            assert ds.attrs["precision_used"] == "fp32" and ds.attrs["fallback_reason"] == ""
        assert f[encode_key("dup/of/first")].attrs["alias_of"] == "sp|P1|A/B"
        assert "alias_of" not in f[encode_key("sp|P1|A/B")].attrs
        assert f.attrs["precision_policy"] == "fp32" and f.attrs["export_format"] == "h5-per-id"


def test_h5_per_id_per_residue(merged, tmp_path):
    out = tmp_path / "per-residue.h5"
    export_store(merged, fmt="h5-per-id", out=out, per_residue=True, layer=0, quiet=True)
    want = expected(merged, per_residue=True, layer=0)
    with h5py.File(out, "r") as f:
        assert len(f) == len(want)
        for rid, rows in want.items():
            np.testing.assert_array_equal(f[encode_key(rid)][()], rows)


def test_parquet_reads_back_with_pyarrow_pandas_polars_and_duckdb(merged, tmp_path):
    import pyarrow.parquet as pq

    out = tmp_path / "embeddings.parquet"
    export_store(merged, fmt="parquet", out=out, quiet=True)
    want = expected(merged)
    table = pq.read_table(out)
    assert table.num_rows == len(want)
    meta = json.loads(table.schema.metadata[b"embedpipe"])
    assert meta["model_sha256"] and meta["export_counts"]["skipped"] == 1
    by_id = dict(zip(table.column("id").to_pylist(), table.column("embedding").to_pylist()))
    for rid, vector in want.items():
        np.testing.assert_array_equal(np.array(by_id[rid], dtype=vector.dtype), vector)
    frame = __import__("pandas").read_parquet(out)
    row = frame.set_index("id").loc["dup/of/first"]
    assert row["alias_of"] == "sp|P1|A/B" and row["length"] == 22
    np.testing.assert_array_equal(np.stack(row[["embedding"]].to_numpy())[0], want["dup/of/first"])
    polars = pytest.importorskip("polars")
    pl_frame = polars.read_parquet(out)
    got = pl_frame.filter(polars.col("id") == "50%")["embedding"].to_numpy()[0]
    np.testing.assert_array_equal(got, want["50%"])
    duckdb = pytest.importorskip("duckdb")
    rows = duckdb.sql(f"SELECT id, embedding FROM '{out}' WHERE id = '.'").fetchall()
    np.testing.assert_allclose(np.array(rows[0][1], dtype=np.float32), want["."])


def test_parquet_sha256_matches_the_sequence(merged, tmp_path):
    import hashlib

    import pyarrow.parquet as pq

    out = tmp_path / "embeddings.parquet"
    export_store(merged, fmt="parquet", out=out, quiet=True)
    table = pq.read_table(out, columns=["id", "sequence_sha256"]).to_pylist()
    seqs = {rid: seq for rid, seq in RECORDS}
    for row in table:
        assert row["sequence_sha256"] == hashlib.sha256(seqs[row["id"]].encode()).hexdigest()


def test_npy_is_memory_mappable_with_ids_in_the_same_order(merged, tmp_path):
    out = tmp_path / "embeddings.npy"
    export_store(merged, fmt="npy", out=out, quiet=True)
    want = expected(merged)
    matrix = np.load(out, mmap_mode="r")
    ids = (tmp_path / "embeddings.ids.txt").read_text(encoding="utf-8").splitlines()
    assert matrix.shape == (len(want), 32) and sorted(ids) == sorted(want)
    for rid, vector in zip(ids, matrix):
        np.testing.assert_array_equal(vector, want[rid])
    provenance = json.loads((tmp_path / "embeddings.provenance.json").read_text())
    assert provenance["export_format"] == "npy" and provenance["model_trained"] is False


def test_npy_per_residue_offsets(merged, tmp_path):
    out = tmp_path / "pr.npy"
    export_store(merged, fmt="npy", out=out, per_residue=True, quiet=True)
    want = expected(merged, per_residue=True)
    rows, offsets = np.load(out, mmap_mode="r"), np.load(tmp_path / "pr.offsets.npy")
    ids = (tmp_path / "pr.ids.txt").read_text().splitlines()
    assert len(offsets) == len(ids) + 1 and offsets[-1] == len(rows)
    for k, rid in enumerate(ids):
        np.testing.assert_array_equal(rows[offsets[k] : offsets[k + 1]], want[rid])


def test_npy_out_without_the_suffix_writes_out_npy_as_the_doc_says(merged, tmp_path):
    """``--out pr`` writes ``pr.npy`` (docs/exports.md: ``OUT.npy``, as ``numpy.save`` names a
    file) beside ``pr.ids.txt`` and ``pr.offsets.npy``; before, the matrix was ``pr`` itself."""
    result = CliRunner().invoke(app, ["export", str(merged), "--format", "npy", "--out", str(tmp_path / "pr"),
                                      "--per-residue"])
    assert result.exit_code == 0, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pr.ids.txt", "pr.npy", "pr.offsets.npy",
                                                         "pr.provenance.json"]
    assert f"-> {tmp_path / 'pr.npy'}:" in result.stderr
    want = expected(merged, per_residue=True)
    rows, offsets = np.load(tmp_path / "pr.npy", mmap_mode="r"), np.load(tmp_path / "pr.offsets.npy")
    ids = (tmp_path / "pr.ids.txt").read_text().splitlines()
    for k, rid in enumerate(ids):
        np.testing.assert_array_equal(rows[offsets[k] : offsets[k + 1]], want[rid])


@pytest.mark.parametrize("fmt", ["h5-per-id", "parquet", "npy"])
def test_small_blocks_give_the_same_export(merged, tmp_path, fmt):
    big, small = tmp_path / f"big.{fmt}", tmp_path / f"small.{fmt}"
    export_store(merged, fmt=fmt, out=big, quiet=True)
    export_store(merged, fmt=fmt, out=small, quiet=True, block_bytes=1)  # one record per block
    if fmt == "npy":
        np.testing.assert_array_equal(np.load(big), np.load(small))
    elif fmt == "parquet":
        import pyarrow.parquet as pq

        assert pq.read_table(big).equals(pq.read_table(small))
        assert pq.ParquetFile(small).num_row_groups > pq.ParquetFile(big).num_row_groups
    else:
        with h5py.File(big) as a, h5py.File(small) as b:
            assert sorted(a) == sorted(b)
            for key in a:
                np.testing.assert_array_equal(a[key][()], b[key][()])


def test_bad_requests_are_one_line_and_write_nothing(merged, tmp_path):
    with pytest.raises(EmbedpipeError, match="--format must be one of h5-per-id, parquet, npy"):
        export_store(merged, fmt="csv", out=tmp_path / "x.csv")
    with pytest.raises(EmbedpipeError, match="would overwrite the store"):
        export_store(merged, fmt="h5-per-id", out=merged)
    with pytest.raises(EmbedpipeError, match="not stored"):
        export_store(merged, fmt="npy", out=tmp_path / "x.npy", layer=5)
    assert list(tmp_path.iterdir()) == []


def test_a_failed_export_leaves_no_file_and_keeps_the_old_one(merged, tmp_path, monkeypatch):
    from embedpipe.export import blocks

    out = tmp_path / "embeddings.npy"
    export_store(merged, fmt="npy", out=out, quiet=True)
    before = sorted(p.name for p in tmp_path.iterdir())
    old = np.load(out)

    def broken(*args, **kwargs):
        yield from ()
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("embedpipe.export.run.iter_blocks", broken)
    with pytest.raises(EmbedpipeError, match="No space left on device"):
        export_store(merged, fmt="npy", out=out, quiet=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no temp files left
    np.testing.assert_array_equal(np.load(out), old)
    assert blocks.BLOCK_BYTES > 1


def test_export_memory_is_bounded_by_a_block(tmp_path, monkeypatch):
    """Peak Python/numpy allocation while exporting stays near one block, not the store size."""
    from embedpipe.store import StoreWriter
    from embedpipe.store.columns import EmbeddedRecord

    n, dim = 4_000, 320
    rng = np.random.default_rng(0)
    path = tmp_path / "big.h5"
    with StoreWriter(path, ids=[f"r{i}" for i in range(n)], sequences=["MKV"] * n, residue_rows=None, layers=[1],
                     dim=dim, storage_dtype="float32", attrs={"model_name": "synthetic"}) as writer:
        for i in range(n):
            vec = rng.standard_normal(dim, dtype=np.float32)
            writer.write(i, EmbeddedRecord(id=f"r{i}", sequence="MKV", precision_used="fp32", mean={1: vec},
                                           max_abs_activation=1.0, embedded_length=3))
    matrix_bytes = n * dim * 4  # 4.9 MiB
    for fmt in ("npy", "parquet", "h5-per-id"):
        tracemalloc.start()
        export_store(path, fmt=fmt, out=tmp_path / f"out-{fmt}", quiet=True, block_bytes=256 << 10)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        # the store's ID index (issue 15 makes it constant) plus a few 256 KiB blocks
        assert peak < matrix_bytes, f"{fmt}: peak {peak} B for a {matrix_bytes} B matrix"


def test_cli_export(merged, tmp_path):
    out = tmp_path / "e.parquet"
    proc = subprocess.run([sys.executable, "-m", "embedpipe.cli", "export", str(merged), "--format", "parquet",
                           "--out", str(out), "--layer", "0"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "exported" in proc.stderr and "1 input IDs were skipped" in proc.stderr
    import pyarrow.parquet as pq

    assert json.loads(pq.read_schema(out).metadata[b"embedpipe"])["export_layer"] == 0
    proc = subprocess.run([sys.executable, "-m", "embedpipe.cli", "export", str(merged), "--format", "xml",
                           "--out", str(tmp_path / "x")], capture_output=True, text=True)
    assert proc.returncode != 0 and proc.stderr.count("\n") == 1 and "embedpipe: error:" in proc.stderr
