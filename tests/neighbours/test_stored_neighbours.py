"""Neighbours of stored records by ID (``embedpipe search --ids``, ``embedpipe.search(ids=...)``,
``embedpipe.api.neighbours``): the stored vectors, exactly as indexed, searched without a
model; each ID's own record and aliases left out unless asked; hits collapsed to one per alias
group when asked (ID and sequence queries alike); the command and the function agree."""

from __future__ import annotations

import csv
import io
import shutil
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import embedpipe
from embedpipe.api.querying import neighbours
from embedpipe.cli import app
from embedpipe.core.errors import EmbedpipeError
from embedpipe.extraction.run import EmbedOptions
from embedpipe.neighbours import stored
from embedpipe.neighbours.build import build_index, unit_rows
from embedpipe.neighbours.hits import GROUPED_HEADER, HEADER
from embedpipe.neighbours.index_file import open_index
from embedpipe.store import EmbeddedRecord, open_store
from helpers.embed_helpers import merged_store, random_sequences, write_fasta
from helpers.stores import ATTRS, write_store

BASE = random_sequences(24, (8, 40), seed=31)
#: duplicates of two records (a merged store's alias groups: r00 + 2 aliases, r05 + 1) and one
#: invalid record (skipped when sharding)
RECORDS = [(f"r{i:02d}", seq) for i, (_, seq) in enumerate(BASE)] + [
    ("dupA1", BASE[0][1]), ("dupA2", BASE[0][1]), ("dupB1", BASE[5][1]), ("bad", "MK-AL")]
GROUPS = {"r00": ("r00", "dupA1", "dupA2"), "r05": ("r05", "dupB1")}


@pytest.fixture(scope="module")
def merged(tmp_path_factory, tiny_model_path) -> tuple[Path, Path]:
    """A merged store over shards, with two alias groups and a skipped ID, and its exact index."""
    tmp = tmp_path_factory.mktemp("stored-neighbours")
    store = merged_store(tmp, tiny_model_path, RECORDS, tmp / "merged.h5", tokens_per_shard=300,
                         options=EmbedOptions(device="cpu", threads=1, layers=(1, 2)))
    build_index(store, tmp / "idx", layer=1)
    with open_store(store) as st:
        assert {a: st.aliases[a] for a in ("dupA1", "dupA2", "dupB1")} == {"dupA1": "r00", "dupA2": "r00",
                                                                            "dupB1": "r05"}
        assert "bad" in st.skipped
    return store, tmp / "idx"


def _every_vector(store: Path, layer: int) -> dict[str, np.ndarray]:
    """Every input ID's stored vector (records and aliases), through the store's reader."""
    with open_store(store) as st:
        return {rid: st.mean_vector(rid, layer) for rid in [*st.ids, *st.aliases]}


def _brute_force(vectors: dict[str, np.ndarray], query: np.ndarray) -> dict[str, float]:
    """Each ID's cosine to ``query``, by numpy in float64 (independent of FAISS and the index's code)."""
    q = query.astype(np.float64)
    return {rid: float(v.astype(np.float64) @ q / (np.linalg.norm(v.astype(np.float64)) * np.linalg.norm(q)))
            for rid, v in vectors.items()}


def _group(rid: str) -> set[str]:
    return next((set(members) for members in GROUPS.values() if rid in members), {rid})


@pytest.mark.parametrize("query", ["r00", "dupA1", "r05", "r11"])
def test_an_id_query_finds_the_brute_force_hits_without_its_group(merged, query) -> None:
    store, index = merged
    vectors = _every_vector(store, 1)
    cosine = _brute_force(vectors, vectors[query])
    hits = neighbours(index, [query], k=8)
    own = _group(query)
    others = sorted((score for rid, score in cosine.items() if rid not in own), reverse=True)
    assert len(hits.hits[0]) == 8 and len(set(hits.hits[0])) == 8
    assert not own & set(hits.hits[0])  # the record itself and its aliases are left out
    np.testing.assert_allclose(hits.scores[0], others[:8], rtol=0, atol=2e-6)  # the best 8 of the rest ...
    for hit, score in zip(hits.hits[0], hits.scores[0]):  # ... each the ID whose cosine it is (ties: an alias group)
        assert abs(cosine[hit] - score) <= 2e-6


def test_id_queries_equal_a_brute_force_search_rank_for_rank(tmp_path: Path) -> None:
    """No ties (random vectors, float16 storage): the IDs in order, and the scores."""
    rng = np.random.default_rng(3)
    vectors = rng.standard_normal((300, 16)).astype(np.float32)
    records = [EmbeddedRecord(id=f"s{i:03d}", sequence="A", precision_used="fp32", mean={2: v},
                              max_abs_activation=1.0, embedded_length=1) for i, v in enumerate(vectors)]
    store = write_store(tmp_path / "s.h5", records, None, storage_dtype="float16",
                        attrs=ATTRS | {"embed_identity": "{}", "model_source": "synthetic"})
    build_index(store, tmp_path / "idx")
    with open_store(store) as st:
        ids, rows = list(st.ids), np.asarray(st.mean(2).compute())
    queries = ["s000", "s123", "s299"]
    hits = neighbours(tmp_path / "idx", queries, k=10)
    db = rows.astype(np.float64)
    db /= np.linalg.norm(db, axis=1, keepdims=True)
    for i, query in enumerate(queries):
        cosine = db @ db[ids.index(query)]
        cosine[ids.index(query)] = -np.inf  # itself left out
        order = np.argsort(-cosine, kind="stable")[:10]
        assert hits.hits[i] == tuple(ids[j] for j in order)
        np.testing.assert_allclose(hits.scores[i], cosine[order], rtol=0, atol=2e-6)
    with_self = neighbours(tmp_path / "idx", queries, k=10, include_self=True)
    assert [row[0] for row in with_self.hits] == queries
    assert [row[1:] for row in with_self.hits] == [row[:9] for row in hits.hits]


def test_the_query_vectors_are_the_indexed_ones(merged, monkeypatch) -> None:
    """What is searched for an ID is, bit for bit, the row the index holds for it: the store's
    vector of the index's layer and pooling, cast and normalised by the build's function."""
    store, index = merged
    seen: list[np.ndarray] = []
    search = stored.search_index
    monkeypatch.setattr(stored, "search_index", lambda loaded, q, vectors, k: (seen.append(vectors),
                                                                                search(loaded, q, vectors, k))[1])
    queries = ["r03", "dupB1", "r00"]
    neighbours(index, queries, k=3)
    loaded = open_index(index)
    indexed = np.stack([loaded.index.reconstruct(loaded.ids.index(q)) for q in queries])
    assert unit_rows(seen[0]).tobytes() == indexed.tobytes()
    with open_store(store) as st:  # the layer the index was built from (1), not the last stored (2)
        assert seen[0].tobytes() == np.stack([st.mean_vector(q, 1) for q in queries]).tobytes()


def test_include_self_puts_the_group_first(merged) -> None:
    _, index = merged
    hits = neighbours(index, ["dupA1", "r05"], k=4, include_self=True)
    assert set(hits.hits[0][:3]) == set(GROUPS["r00"]) and set(hits.hits[1][:2]) == set(GROUPS["r05"])
    np.testing.assert_allclose(hits.scores[0, :3], 1.0, rtol=0, atol=1e-5)
    assert hits.groups is None


def test_collapse_gives_one_row_per_alias_group(merged) -> None:
    store, index = merged
    with open_store(store) as st:
        records, aliases = list(st.ids), st.aliases
    everything = neighbours(index, ["r11"], k=len(records) + len(aliases))
    hits = neighbours(index, ["r11"], k=len(records), collapse_aliases=True)
    assert hits.groups is not None
    # every record but the query's own, once, named by its record's ID, in the order of its best member
    assert sorted(hits.hits[0]) == sorted(set(records) - {"r11"})
    expected = tuple(dict.fromkeys(aliases.get(h, h) for h in everything.hits[0]))
    assert hits.hits[0] == expected
    for hit, group in zip(hits.hits[0], hits.groups[0]):
        assert group == GROUPS.get(hit, (hit,))
    # the query's own group, kept when asked: one row, its record's ID, naming the group
    mine = neighbours(index, ["dupA2"], k=3, include_self=True, collapse_aliases=True)
    assert mine.hits[0][0] == "r00" and mine.groups is not None and mine.groups[0][0] == GROUPS["r00"]
    assert "dupA1" not in mine.hits[0] and "dupA2" not in mine.hits[0]
    # fewer groups than asked: every group, the rest of the scores NaN
    assert len(neighbours(index, ["r11"], k=1000, collapse_aliases=True).hits[0]) == len(records) - 1


def test_collapse_applies_to_sequence_queries(merged, tmp_path) -> None:
    store, index = merged
    queries = [("q0", BASE[0][1]), ("q1", BASE[9][1])]
    with open_store(store) as st:
        aliases, total = st.aliases, len(st) + len(st.aliases)
    plain = embedpipe.search(queries, index, k=total, device="cpu")
    hits = embedpipe.search(queries, index, k=6, collapse_aliases=True, device="cpu")
    assert hits.groups is not None
    for i in range(len(queries)):
        assert hits.hits[i] == tuple(dict.fromkeys(aliases.get(h, h) for h in plain.hits[i]))[:6]
    assert hits.hits[0][0] == "r00" and hits.groups[0][0] == GROUPS["r00"]
    # the command: the same rows, the group column added
    fasta = write_fasta(tmp_path / "q.fasta", queries)
    result = CliRunner().invoke(app, ["search", str(fasta), "--index", str(index), "--k", "6", "--collapse-aliases",
                                      "--device", "cpu", "--out", str(tmp_path / "h.tsv"), "-q"])
    assert result.exit_code == 0, result.output
    rows = _tsv((tmp_path / "h.tsv").read_text())
    assert tuple(rows[0]) == GROUPED_HEADER
    assert [(r[0], r[1], tuple(r[4].split(" "))) for r in rows[1:]] == [
        (q, h, g) for q, per_query, groups in zip(hits.queries, hits.hits, hits.groups) for h, g in zip(per_query, groups)]


def _tsv(text: str) -> list[list[str]]:
    return list(csv.reader(io.StringIO(text), delimiter="\t"))


def _no_model(monkeypatch) -> None:
    """Every way a model could load, or an Embedder be made, raises."""
    import embedpipe.api.querying
    import embedpipe.extraction.job
    import embedpipe.model
    import embedpipe.model.registry

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    for module in (embedpipe.model, embedpipe.model.registry, embedpipe.extraction.job):
        monkeypatch.setattr(module, "load_model", refuse)
    monkeypatch.setattr(embedpipe.api.querying, "Embedder", refuse)


def test_the_command_writes_what_the_function_returns_and_loads_no_model(merged, tmp_path, monkeypatch) -> None:
    _, index = merged
    _no_model(monkeypatch)
    runner = CliRunner()
    for flags, header in (([], HEADER), (["--collapse-aliases"], GROUPED_HEADER)):
        out = tmp_path / "hits.tsv"  # the second run replaces the first's TSV: an earlier search's
        result = runner.invoke(app, ["search", "--index", str(index), "--ids", "r00,dupB1", "--ids", "r11",
                                     "--k", "4", "--out", str(out), *flags])
        assert result.exit_code == 0, result.output
        assert "searched 3 IDs" in result.stderr
        hits = embedpipe.search(index=index, ids=["r00", "dupB1", "r11"], k=4, collapse_aliases=bool(flags))
        rows = _tsv(out.read_text())
        assert tuple(rows[0]) == header
        assert [r[:4] for r in rows[1:]] == [[q, h, f"{s:.7g}", str(r)] for q, h, s, r in hits.rows()]
        if flags:
            assert hits.groups is not None
            assert [tuple(r[4].split(" ")) for r in rows[1:]] == [g for per_query in hits.groups for g in per_query]
    result = runner.invoke(app, ["search", "--index", str(index), "--ids", "dupA1", "--include-self", "--k", "2",
                                 "--out", str(tmp_path / "self.tsv"), "-q"])
    assert result.exit_code == 0, result.output
    assert {r[1] for r in _tsv((tmp_path / "self.tsv").read_text())[1:]} <= set(GROUPS["r00"])


def _error(result) -> str:
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_an_unknown_or_skipped_id_is_one_line_naming_it_and_the_store(merged, tmp_path, monkeypatch) -> None:
    store, index = merged
    _no_model(monkeypatch)
    with pytest.raises(EmbedpipeError) as unknown:
        neighbours(index, ["r01", "P99999"])
    assert str(unknown.value) == (f"unknown ID 'P99999': not in the store {store} of the index {index}: "
                                  "no record or alias has it")
    with pytest.raises(EmbedpipeError, match=r"unknown ID 'bad': .* it was skipped when sharding \("):
        neighbours(index, "bad")
    line = _error(CliRunner().invoke(app, ["search", "--index", str(index), "--ids", "r01,P99999",
                                           "--out", str(tmp_path / "h.tsv")]))
    assert line == f"embedpipe: error: {unknown.value}"
    assert not (tmp_path / "h.tsv").exists()
    line = _error(CliRunner().invoke(app, ["search", "--index", str(index), "--ids", "r01,,r02",
                                           "--out", str(tmp_path / "h.tsv")]))
    assert "an empty ID" in line


def test_ids_and_queries_are_one_or_the_other(merged, tmp_path, monkeypatch) -> None:
    _, index = merged
    _no_model(monkeypatch)
    fasta = write_fasta(tmp_path / "q.fasta", [("q", "MKV")])
    runner = CliRunner()
    base = ["search", "--index", str(index), "--out", str(tmp_path / "h.tsv")]
    cases = [
        ([str(fasta), "--ids", "r01"], "search: give a FASTA of queries or --ids, not both"),
        ([], "search: give a FASTA of queries to embed, or --ids of records the index's store holds"),
        ([str(fasta), "--include-self"], "search: --include-self applies to --ids"),
        (["--ids", "r01", "--model", "esm2_t6_8M_UR50D"], "search: --model is for a FASTA of queries"),
    ]
    for args, words in cases:
        assert _error(runner.invoke(app, [*base, *args])).startswith(f"embedpipe: error: {words}")
    with pytest.raises(EmbedpipeError, match=r"^search: give queries or ids=, not both"):
        embedpipe.search([("q", "MKV")], index, ids=["r01"])
    with pytest.raises(EmbedpipeError, match=r"^search: device= is for queries"):
        embedpipe.search(index=index, ids=["r01"], device="cpu")
    with pytest.raises(EmbedpipeError, match=r"^search: give the index"):
        embedpipe.search(ids=["r01"])


def test_id_queries_need_the_store_the_index_was_built_from(merged, tmp_path) -> None:
    store, index = merged
    moved = tmp_path / "moved.h5"
    shutil.move(store, moved)
    try:
        with pytest.raises(EmbedpipeError) as missing:
            neighbours(index, ["r01"])
        assert str(missing.value).startswith(f"{index}: its store {store} is not there (moved or removed)")
        with pytest.raises(EmbedpipeError, match="is not there"):
            embedpipe.search([("q", "MKV")], index, collapse_aliases=True)  # refused before a model loads
    finally:
        shutil.move(moved, store)
    assert len(neighbours(index, ["r01"], k=2).hits[0]) == 2
