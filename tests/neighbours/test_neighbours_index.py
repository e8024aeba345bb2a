"""``embedpipe index`` and ``embedpipe search`` (and ``Embedder.search``, ``embedpipe.search``):
the exact index finds what a brute-force numpy cosine search finds; HNSW's recall is measured;
queries of another layer, policy or model are refused in one line; a changed store's index is
refused; the files are written atomically."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import numpy as np
import pytest

import embedpipe
from embedpipe.core.errors import EmbedpipeError
from embedpipe.neighbours.build import build_index
from embedpipe.neighbours.hits import search_index
from embedpipe.neighbours.index_file import ids_path, meta_path, open_index, read_meta
from embedpipe.store import EmbeddedRecord, open_store
from helpers.embed_helpers import embed_store, random_sequences, write_fasta
from helpers.processes import ROOT, run_cli
from helpers.stores import ATTRS, write_store

STORE_RECORDS = random_sequences(40, (8, 50), seed=11)
QUERIES = random_sequences(5, (8, 50), seed=12)


def brute_force(database: np.ndarray, ids: list[str], queries: np.ndarray,
                k: int) -> tuple[tuple[tuple[str, ...], ...], np.ndarray]:
    """The k highest cosines by numpy in float64, best first (independent of FAISS and the index's code)."""
    db = database.astype(np.float64)
    q = queries.astype(np.float64)
    cosine = (q / np.linalg.norm(q, axis=1, keepdims=True)) @ (db / np.linalg.norm(db, axis=1, keepdims=True)).T
    order = np.argsort(-cosine, axis=1, kind="stable")[:, :k]
    return tuple(tuple(ids[j] for j in row) for row in order), np.take_along_axis(cosine, order, axis=1)


def synthetic_store(path: Path, vectors: np.ndarray, layer: int = 3, storage_dtype: str = "float32") -> Path:
    records = [EmbeddedRecord(id=f"r{i:04d}", sequence="A", precision_used="fp32", mean={layer: v},
                              max_abs_activation=1.0, embedded_length=1) for i, v in enumerate(vectors)]
    attrs = ATTRS | {"embed_identity": "{}", "model_source": "synthetic"}
    return write_store(path, records, None, attrs=attrs, storage_dtype=storage_dtype)


@pytest.mark.parametrize("storage_dtype", ["float32", "float16"])
def test_the_exact_index_equals_a_brute_force_search(storage_dtype, tmp_path):
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((700, 24)).astype(np.float32)
    store = synthetic_store(tmp_path / "s.h5", vectors, storage_dtype=storage_dtype)
    build_index(store, tmp_path / "idx")
    with open_store(store) as st:
        stored, ids = np.asarray(st.mean(3).compute()), list(st.ids)
    queries = rng.standard_normal((30, 24)).astype(np.float32)
    hits = search_index(open_index(tmp_path / "idx"), [f"q{i}" for i in range(30)], queries, 10)
    expected_ids, expected_scores = brute_force(stored, ids, queries, 10)
    assert hits.hits == expected_ids
    np.testing.assert_allclose(hits.scores, expected_scores, rtol=0, atol=2e-6)
    meta = json.loads(meta_path(tmp_path / "idx").read_text())
    assert (meta["layer"], meta["pooling"], meta["kind"], meta["rows"], meta["storage_dtype"]) == \
        (3, "mean", "exact", 700, storage_dtype)
    # k beyond the index: every row, once
    assert sorted(search_index(open_index(tmp_path / "idx"), ["q"], queries[:1], 5000).hits[0]) == ids


def test_hnsw_recall_is_measured_against_the_exact_index():
    """The recall docs/python.md states comes from this script; here at a small size, with its bar."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import search_recall
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert search_recall.measure(rows=1500, dim=32, queries=100, k=10) >= 0.95


@pytest.fixture(scope="module")
def indexed(tmp_path_factory, tiny_model_path) -> tuple[Path, Path, Path]:
    """A bf16-mixed store of layers 1 and 2 and the exact index of its last layer."""
    tmp = tmp_path_factory.mktemp("indexed")
    store = embed_store(tmp, tiny_model_path, STORE_RECORDS, name="store", precision="bf16-mixed", layers=(1, 2),
                        device="cpu")
    proc = run_cli("index", str(store), "--out", str(tmp / "idx"))
    assert proc.returncode == 0, proc.stderr
    return tmp, store, tmp / "idx"


def test_search_embeds_the_queries_as_the_store_was_and_finds_the_brute_force_hits(indexed, tiny_model_path):
    tmp, store, index = indexed
    hits = embedpipe.search(QUERIES, index, k=7, device="cpu")  # model, policy, layer: the index's
    with embedpipe.Embedder(tiny_model_path, precision="bf16-mixed", layers=(2,), device="cpu") as embedder:
        queries = embedder.embed(QUERIES).mean()
        same = embedder.search(QUERIES, index, k=7)
    with open_store(store) as st:
        expected, scores = brute_force(np.asarray(st.mean(2).compute()), list(st.ids), queries, 7)
    assert hits.hits == expected == same.hits
    np.testing.assert_allclose(hits.scores, scores, rtol=0, atol=2e-6)
    # the CLI: the same hits as a TSV with the header query hit score rank
    out = tmp / "hits.tsv"
    fasta = write_fasta(tmp / "queries.fasta", QUERIES)
    proc = run_cli("search", str(fasta), "--index", str(index), "--k", "7", "--out", str(out), "--device", "cpu", "-q")
    assert proc.returncode == 0, proc.stderr
    rows = list(csv.reader(out.open(), delimiter="\t"))
    assert rows[0] == ["query", "hit", "score", "rank"]
    assert [(q, h, int(r)) for q, h, _, r in rows[1:]] == [(q, h, r) for q, h, _, r in hits.rows()]
    np.testing.assert_allclose([float(s) for _, _, s, _ in rows[1:]], hits.scores.ravel(), rtol=1e-6)


@pytest.mark.parametrize("options,words", [
    (dict(precision="fp32"), "embedded with the precision policy 'bf16-mixed', the queries 'fp32'"),
    (dict(layers=(1,)), "holds layer 2 of its store; the queries embed layers [1]"),
    (dict(storage_dtype="float16"), "embedded with storage_dtype 'float32', the queries 'float16'"),
])
def test_queries_of_another_layer_or_policy_are_refused(indexed, tiny_model_path, options, words):
    _, _, index = indexed
    with pytest.raises(EmbedpipeError) as caught:
        embedpipe.search(QUERIES, index, device="cpu", **options)
    assert words in str(caught.value) and "\n" not in str(caught.value)
    full = dict(precision="bf16-mixed", layers=(2,)) | options
    with embedpipe.Embedder(tiny_model_path, device="cpu", **full) as embedder:
        with pytest.raises(EmbedpipeError, match=words.replace("[", r"\[").replace("]", r"\]")):
            embedder.search(QUERIES, index)


def test_queries_of_another_model_are_refused_by_the_cli(indexed, model_factory):
    tmp, _, index = indexed
    other = model_factory(layers=2, dim=32, heads=4, seed=99)
    fasta = write_fasta(tmp / "q2.fasta", QUERIES)
    proc = run_cli("search", str(fasta), "--index", str(index), "--model", str(other), "--out", str(tmp / "x.tsv"),
                   "--device", "cpu")
    assert proc.returncode != 0 and not (tmp / "x.tsv").exists()
    errors = [line for line in proc.stderr.splitlines() if line.startswith("embedpipe: error:")]
    assert len(errors) == 1 and "model_sha256" in errors[0], proc.stderr  # warnings (an emulated bf16) may precede it
    proc = run_cli("search", str(fasta), "--index", str(index), "--layer", "1", "--out", str(tmp / "x.tsv"))
    assert proc.returncode != 0 and "holds layer 2 of its store" in proc.stderr


def test_an_index_whose_store_changed_is_refused(tmp_path):
    rng = np.random.default_rng(1)
    store = synthetic_store(tmp_path / "s.h5", rng.standard_normal((20, 8)).astype(np.float32))
    build_index(store, tmp_path / "idx")
    synthetic_store(store, rng.standard_normal((20, 8)).astype(np.float32))  # rewritten in place: a new store
    with pytest.raises(EmbedpipeError, match=r"changed since it was indexed .*rebuild it with embedpipe index"):
        read_meta(tmp_path / "idx")


def test_a_failed_index_leaves_no_file_and_a_good_one_all_three(tmp_path):
    rng = np.random.default_rng(2)
    store = synthetic_store(tmp_path / "s.h5", rng.standard_normal((20, 8)).astype(np.float32))
    proc = run_cli("index", str(store), "--out", str(tmp_path / "idx"), "--pooling", "bos")
    assert proc.returncode != 0 and "pooling 'bos' is not stored" in proc.stderr
    proc = run_cli("index", str(store), "--out", str(tmp_path / "idx"), "--layer", "5")
    assert proc.returncode != 0 and "layer 5 is not stored" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.h5"]
    proc = run_cli("index", str(store), "--out", str(tmp_path / "idx"), "--kind", "hnsw")
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["idx", "idx.ids.txt", "idx.json", "s.h5"]
    assert ids_path(tmp_path / "idx").read_text().split() == [f"r{i:04d}" for i in range(20)]
    with pytest.raises(EmbedpipeError, match="not an embedpipe index"):
        read_meta(tmp_path / "s.h5")


def test_without_faiss_index_says_how_to_install_it(tmp_path, monkeypatch):
    store = synthetic_store(tmp_path / "s.h5", np.ones((3, 4), dtype=np.float32))
    monkeypatch.setitem(sys.modules, "faiss", None)  # an import of faiss now fails, as when not installed
    with pytest.raises(EmbedpipeError, match=r"pip install 'embedpipe\[search\]'"):
        build_index(store, tmp_path / "idx")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.h5"]


def test_search_never_writes_over_its_inputs(indexed):
    tmp, _, index = indexed
    fasta = write_fasta(tmp / "q3.fasta", QUERIES)
    before = fasta.read_bytes()
    for out in (fasta, ids_path(index)):
        proc = run_cli("search", str(fasta), "--index", str(index), "--out", str(out), "--device", "cpu", "-q")
        assert proc.returncode != 0 and "\n" not in proc.stderr.strip(), proc.stderr
    assert fasta.read_bytes() == before
    assert len(ids_path(index).read_text().split()) == len(STORE_RECORDS)
