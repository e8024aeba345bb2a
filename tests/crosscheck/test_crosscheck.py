"""Cross-check against fp32 (issue 5): metrics, sampling, neighbours, verdicts, the report files.

Every numeric claim is checked against an independent computation: plain-Python or plain-numpy
formulas for the metrics, brute-force sorting for the neighbour search, stores whose vectors
were perturbed by a known rotation, and fair-esm's own fp32 forward for the re-embedding.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from collections import Counter
from pathlib import Path

import h5py
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from embedpipe.core.errors import EmbedpipeError
from embedpipe.crosscheck import metrics
from embedpipe.crosscheck.report.page import render_html
from embedpipe.crosscheck.run import Thresholds, run_crosscheck
from helpers.embed_helpers import embed_store, fair_esm_forward, flip_byte_in_chunk, plain_sequences, random_sequences, read_store
from helpers.stores import rewrite_digests

CONTRACT_RECORD_KEYS = {"id", "length", "layer", "pooled_cosine", "pooled_max_abs_diff", "pooled_rel_l2",
                        "chosen_because"}


# =============================================================================== helpers


def _py_cosine(a, b) -> float:
    """Cosine in plain Python floats (independent of embedpipe.crosscheck.metrics)."""
    a, b = [float(x) for x in a], [float(x) for x in b]
    dot = math.fsum(x * y for x, y in zip(a, b))
    return dot / (math.sqrt(math.fsum(x * x for x in a)) * math.sqrt(math.fsum(y * y for y in b)))


def _rotate(v: np.ndarray, cos_theta: float, seed: int) -> np.ndarray:
    """``v`` turned by the angle arccos(cos_theta) in a random plane through it; norm kept."""
    v = v.astype(np.float64)
    u = v / np.linalg.norm(v)
    r = np.random.default_rng(seed).normal(size=v.shape)
    w = r - (r @ u) * u
    w /= np.linalg.norm(w)
    return np.linalg.norm(v) * (cos_theta * u + math.sqrt(1 - cos_theta**2) * w)


def _records_by(report, layer: int) -> dict[str, dict]:
    return {r["id"]: r for r in report.data["records"] if r["layer"] == layer}


def _expected_sample(store: Path, n: int, seed: int) -> tuple[set[str], set[str]]:
    """The random draw's IDs and all sampled IDs, from plain h5py reads: the seeded
    length-stratified draw, and besides it the 4 longest records, every record over the window
    and every fp32 fallback (these stores hold fewer than the bounds)."""
    plain = read_store(store)
    ids, fields = plain["ids"], plain["fields"]
    lengths = np.array([fields["length"][rid] for rid in ids])
    drawn = {ids[i] for i in metrics.stratified_sample(lengths, n, seed)}
    longest = {ids[i] for i in sorted(range(len(ids)), key=lambda i: (-lengths[i], i))[:4]}
    risky = {rid for rid in ids if fields["long_handling"][rid] != "none" or fields["fallback_reason"][rid]}
    return drawn, drawn | longest | risky


def _random_part(data: dict) -> set[str]:
    return {rid for rid, why in zip(data["sample_ids"], data["sample_chosen_because"])
            if "length-stratified random" in why}


def _load_json_strict(path: Path) -> dict:
    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(path.read_text(), parse_constant=refuse)


# =============================================================================== metrics


def test_cosine_maxabs_rel_l2_on_constructed_vectors():
    rng = np.random.default_rng(0)
    for _ in range(20):
        a = rng.normal(size=64) * rng.uniform(0.01, 100)
        b = a + rng.normal(size=64) * 10 ** rng.uniform(-6, 0)
        assert metrics.cosine(a, b) == pytest.approx(_py_cosine(a, b), abs=1e-12)
        assert metrics.max_abs_diff(a, b) == max(abs(float(x) - float(y)) for x, y in zip(a, b))
        assert metrics.mean_abs_diff(a, b) == pytest.approx(math.fsum(abs(x - y) for x, y in zip(a, b)) / 64, rel=1e-12)
        num = math.sqrt(math.fsum((x - y) ** 2 for x, y in zip(a, b)))
        assert metrics.rel_l2(b, a) == pytest.approx(num / math.sqrt(math.fsum(x * x for x in a)), rel=1e-12)
    # a known angle and a known max-abs: e0 turned towards e1 by theta
    theta = 0.1
    a = np.zeros(8)
    a[0] = 2.0
    b = np.zeros(8)
    b[0], b[1] = 2 * math.cos(theta), 2 * math.sin(theta)
    assert metrics.cosine(a, b) == pytest.approx(math.cos(theta), abs=1e-15)
    assert metrics.max_abs_diff(a, b) == pytest.approx(2 * math.sin(theta), abs=1e-15)
    assert metrics.rel_l2(b, a) == pytest.approx(2 * math.sin(theta / 2), abs=1e-15)
    # float16 inputs are computed in float64
    h = a.astype(np.float16)
    assert isinstance(metrics.cosine(h, h), float) and metrics.cosine(h, h) == 1.0


def test_metric_edge_cases_zero_and_non_finite():
    z = np.zeros(4)
    one = np.array([1.0, 0, 0, 0])
    assert metrics.cosine(z, z) == 1.0
    assert metrics.cosine(z, one) == 0.0
    assert metrics.rel_l2(z, z) == 0.0
    assert metrics.rel_l2(one, z) == math.inf
    bad = np.array([np.nan, 0, 0, 0])
    assert math.isnan(metrics.cosine(bad, one))
    assert math.isnan(metrics.max_abs_diff(bad, one))
    assert math.isnan(metrics.rel_l2(one, np.array([np.inf, 0, 0, 0])))
    rows = np.stack([one, bad])
    out = metrics.cosine(rows, np.stack([one, one]))
    assert out[0] == 1.0 and math.isnan(out[1])
    with pytest.raises(ValueError):
        metrics.cosine(one, np.zeros(3))


def test_compare_residues_min_cosine_is_the_worst_residue():
    rng = np.random.default_rng(1)
    ref = rng.normal(size=(30, 16))
    stored = ref.copy()
    stored[17] = _rotate(ref[17], 0.98, seed=2)
    stored[3] = _rotate(ref[3], 0.995, seed=3)
    out = metrics.compare_residues(stored, ref)
    assert out["min_cosine"] == pytest.approx(0.98, abs=1e-12)
    expected_mean = (28 + 0.98 + 0.995) / 30
    assert out["mean_cosine"] == pytest.approx(expected_mean, abs=1e-12)
    assert out["max_abs_diff"] == pytest.approx(float(np.abs(stored - ref).max()), abs=0)
    assert out["rel_l2"] == pytest.approx(math.sqrt(((stored - ref) ** 2).sum() / (ref**2).sum()), rel=1e-12)


def test_aggregate_against_sorted_values():
    values = [5.0, 1.0, 4.0, 2.0, 3.0, float("nan"), float("inf")]
    agg = metrics.aggregate(values)
    assert agg["count"] == 7 and agg["nonfinite"] == 2
    assert (agg["min"], agg["median"], agg["max"]) == (1.0, 3.0, 5.0)
    # linear interpolation between order statistics: p5 of 1..5 is 1 + 0.05 * 4
    assert agg["p5"] == pytest.approx(1.2) and agg["p1"] == pytest.approx(1.04)
    assert agg["mean"] == 3.0
    empty = metrics.aggregate([float("nan")])
    assert empty["min"] is None and empty["median"] is None and empty["nonfinite"] == 1


def test_wilson_interval_textbook_values():
    # Wilson (1927) / Newcombe (1998) table values
    lo, hi = metrics.wilson_interval(8, 10)
    assert (round(lo, 4), round(hi, 4)) == (0.4902, 0.9433)
    lo, hi = metrics.wilson_interval(0, 10)
    assert lo == 0.0 and hi == pytest.approx(0.2775, abs=1e-4)
    lo, hi = metrics.wilson_interval(64, 64)
    assert hi == 1.0 and lo == pytest.approx(64 / (64 + metrics.Z95**2), abs=1e-12)
    assert metrics.wilson_interval(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError):
        metrics.wilson_interval(3, 2)


@given(st.integers(0, 200), st.integers(1, 200))
def test_wilson_interval_contains_the_estimate(successes, n):
    successes = min(successes, n)
    lo, hi = metrics.wilson_interval(successes, n)
    assert 0.0 <= lo <= successes / n <= hi <= 1.0


# =============================================================================== sampling


def test_length_bins_are_quantiles_and_cover_every_record():
    lengths = np.arange(1, 101)
    edges, which = metrics.length_bins(lengths, 4)
    assert list(edges) == pytest.approx([1, 25.75, 50.5, 75.25, 100])
    assert Counter(which.tolist()) == {0: 25, 1: 25, 2: 25, 3: 25}
    same, which = metrics.length_bins([7] * 10, 4)
    assert len(same) == 2 and set(which.tolist()) == {0}
    edges, which = metrics.length_bins([5, 5, 5, 5, 5, 5, 9], 4)  # heavy ties: no empty bins
    assert set(which.tolist()) == set(range(len(edges) - 1))


def test_stratified_sample_is_seeded_proportional_and_sorted():
    rng = np.random.default_rng(5)
    lengths = np.concatenate([rng.integers(20, 60, 300), rng.integers(400, 900, 100)])
    a = metrics.stratified_sample(lengths, 40, seed=1)
    assert np.array_equal(a, metrics.stratified_sample(lengths, 40, seed=1))
    assert not np.array_equal(a, metrics.stratified_sample(lengths, 40, seed=2))
    assert a.size == 40 and np.array_equal(a, np.unique(a))
    _, which = metrics.length_bins(lengths, 4)
    per_bin = Counter(which[a].tolist())
    sizes = Counter(which.tolist())
    for b, size in sizes.items():  # proportional within one record
        assert abs(per_bin[b] - 40 * size / lengths.size) < 1.0 + 1e-9
    assert np.array_equal(metrics.stratified_sample(lengths[:10], 64, seed=0), np.arange(10))


def test_stratified_sample_takes_one_per_quartile_when_sampling_four():
    lengths = np.concatenate([np.arange(10, 35), np.arange(100, 125), np.arange(500, 525), np.arange(2000, 2025)])
    for seed in range(20):
        rows = metrics.stratified_sample(lengths, 4, seed=seed)
        assert [int(np.digitize(v, [50, 300, 1000])) for v in lengths[rows]] == [0, 1, 2, 3]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 5000), min_size=1, max_size=300), st.integers(1, 80), st.integers(0, 2**32 - 1))
def test_stratified_sample_properties(lengths, n, seed):
    lengths = np.array(lengths)
    rows = metrics.stratified_sample(lengths, n, seed)
    assert rows.size == min(n, lengths.size)
    assert np.array_equal(rows, np.unique(rows)) and (rows >= 0).all() and (rows < lengths.size).all()
    if n < lengths.size:
        _, which = metrics.length_bins(lengths, min(4, n))
        assert set(which[rows].tolist()) == set(which.tolist())  # every bin sampled


@given(st.lists(st.integers(0, 50), min_size=1, max_size=8), st.integers(0, 200))
def test_allocate_proportional_properties(sizes, total):
    alloc = metrics.allocate_proportional(sizes, total)
    assert sum(alloc) == min(total, sum(sizes))
    assert all(0 <= a <= s for a, s in zip(alloc, sizes))
    nonempty = sum(1 for s in sizes if s)
    if total >= nonempty:
        assert all(a >= 1 for a, s in zip(alloc, sizes) if s)


# =============================================================================== neighbours


def _brute_force(queries, db, k, exclude):
    qn = queries / np.linalg.norm(queries, axis=1, keepdims=True)
    dn = db / np.linalg.norm(db, axis=1, keepdims=True)
    out = []
    for i, q in enumerate(qn):
        sims = [(-float(q @ d), j) for j, d in enumerate(dn) if j != exclude[i]]
        out.append([j for _, j in sorted(sims)[:k]])
    return np.array(out)


@pytest.mark.parametrize("block", [1, 7, 64, 1000])
def test_top_k_neighbours_match_brute_force_for_any_block_size(block):
    rng = np.random.default_rng(3)
    db = rng.normal(size=(150, 12))
    queries = np.concatenate([db[:5], rng.normal(size=(3, 12))])
    exclude = [0, 1, 2, 3, 4, -1, -1, -1]
    blocks = ((s, db[s : s + block]) for s in range(0, len(db), block))
    rows, sims = metrics.top_k_neighbours(queries, blocks, 10, exclude=exclude)
    assert np.array_equal(rows, _brute_force(queries, db, 10, exclude))
    assert (np.diff(sims, axis=1) <= 0).all()
    assert all(i not in rows[i] for i in range(5))


def test_top_k_ties_go_to_the_lower_row_and_non_finite_rows_are_skipped():
    db = np.array([[1.0, 0], [2.0, 0], [np.nan, 0], [3.0, 0], [0, 1.0]])
    rows, _ = metrics.top_k_neighbours(np.array([[1.0, 0]]), [(0, db[:2]), (2, db[2:])], 3)
    assert rows.tolist() == [[0, 1, 3]]
    rows, _ = metrics.top_k_neighbours(np.array([[np.nan, 0]]), [(0, db)], 2)
    assert rows.tolist() == [[-1, -1]]
    assert math.isnan(metrics.knn_overlap(rows, rows)[0])
    a, b = np.array([[1, 2, 3, 4]]), np.array([[4, 3, 9, 8]])
    assert metrics.knn_overlap(a, b).tolist() == [0.5]


# =============================================================================== stores


@pytest.fixture(scope="module")
def records():
    return random_sequences(30, (8, 140), seed=21)


@pytest.fixture(scope="module")
def fp32_store(tmp_path_factory, tiny_model_path, records) -> Path:
    tmp = tmp_path_factory.mktemp("fp32store")
    return embed_store(tmp, tiny_model_path, records, "fp32", precision="fp32", layers=(0, 1, 2), per_residue=True)


@pytest.fixture(scope="module")
def low_store(tmp_path_factory, tiny_model_path, records) -> Path:
    tmp = tmp_path_factory.mktemp("lowstore")
    return embed_store(tmp, tiny_model_path, records, "bf16", precision="bf16-mixed", layers=(0, 2), per_residue=True,
                  tokens_per_batch=700)


def _perturbed_copy(src: Path, dst: Path, changes: dict[tuple[int, int], float]) -> dict[tuple[int, int], np.ndarray]:
    """Copy ``src`` and turn the pooled vector of (row, layer) by arccos(cos); returns the new vectors."""
    shutil.copyfile(src, dst)
    out = {}
    with h5py.File(dst, "r+") as f:
        for (row, layer), cos_theta in changes.items():
            ds = f[f"mean/layer_{layer}"]
            new = _rotate(ds[row], cos_theta, seed=row * 10 + layer).astype(np.float32)
            ds[row] = new
            out[(row, layer)] = new
        rewrite_digests(f, sorted({row for row, _ in changes}))  # a store written with these vectors
    return out


def test_report_pooled_cosines_equal_an_independent_fair_esm_fp32_computation(tmp_path, low_store, tiny_model_path,
                                                                             fair_esm_reference):
    report = run_crosscheck(low_store, out=tmp_path / "cc", sample=12, seed=4, device="cpu", quiet=True)
    data = _load_json_strict(report.json_path)
    assert data["store"]["precision_policy"] == "bf16-mixed" and data["mode"] == "precision"
    drawn, sampled = _expected_sample(low_store, 12, 4)
    assert _random_part(data) == drawn and len(drawn) == 12
    assert set(data["sample_ids"]) == sampled and data["sample_size"] == len(sampled)
    assert len(data["records"]) == len(sampled) * 2
    stored = read_store(low_store)  # plain h5py
    model, alphabet = fair_esm_reference(tiny_model_path)
    with h5py.File(low_store, "r") as f:
        sequences = dict(zip(stored["ids"], plain_sequences(f)))
    checked = 0
    for rec in data["records"]:
        assert CONTRACT_RECORD_KEYS <= set(rec)
        layer, rid = rec["layer"], rec["id"]
        ref = fair_esm_forward(model, alphabet, sequences[rid], [layer])[layer].astype(np.float64)
        pooled_ref = ref.mean(axis=0)
        vec = stored["mean"][layer][rid].astype(np.float64)
        assert abs(rec["pooled_cosine"] - _py_cosine(vec, pooled_ref)) <= 1e-5
        assert abs(rec["pooled_max_abs_diff"] - float(np.abs(vec - pooled_ref).max())) <= 1e-5
        rel = float(np.linalg.norm(vec - pooled_ref) / np.linalg.norm(pooled_ref))
        assert abs(rec["pooled_rel_l2"] - rel) <= 1e-5
        res = stored["per_residue"][layer][rid].astype(np.float64)
        res_cos = [_py_cosine(a, b) for a, b in zip(res, ref)]
        assert abs(rec["residue_min_cosine"] - min(res_cos)) <= 1e-5
        checked += 1
    assert checked == len(sampled) * 2
    # the low-precision store really differs from fp32, so the check measured something
    assert min(r["pooled_max_abs_diff"] for r in data["records"]) > 0


def test_same_seed_same_sample_different_seed_different_sample(tmp_path, fp32_store):
    a = run_crosscheck(fp32_store, out=tmp_path / "a", sample=6, seed=11, device="cpu", quiet=True)
    b = run_crosscheck(fp32_store, out=tmp_path / "b", sample=6, seed=11, device="cpu", quiet=True)
    c = run_crosscheck(fp32_store, out=tmp_path / "c", sample=6, seed=12, device="cpu", quiet=True)
    assert a.data["sample_ids"] == b.data["sample_ids"]
    assert [(r["id"], r["layer"]) for r in a.data["records"]] == [(r["id"], r["layer"]) for r in b.data["records"]]
    assert a.data["sample_ids"] != c.data["sample_ids"]
    assert a.data["sample_seed"] == 11 and c.data["sample_seed"] == 12
    rows = [r["row"] for r in a.data["records"]]
    assert rows == sorted(rows)  # deterministic order: by row, then layer
    # stratified: every length bin is sampled
    assert all(b["sampled"] >= 1 for b in a.data["length_bins"])
    assert sum(b["sampled"] for b in a.data["length_bins"]) == a.data["sample_size"]
    drawn, sampled = _expected_sample(fp32_store, 6, 11)
    assert _random_part(a.data) == drawn and set(a.data["sample_ids"]) == sampled


def test_fp32_store_is_a_passing_determinism_check(tmp_path, fp32_store, records):
    report = run_crosscheck(fp32_store, out=tmp_path / "cc", sample=64, seed=0, device="cpu", quiet=True)
    data = report.data
    assert data["mode"] == "determinism" and report.verdict == "pass", data["verdict_reasons"]
    assert data["sample_size"] == len(records) == data["store"]["records"]  # all when fewer than --sample
    assert data["thresholds"]["effective_pass_cosine"] == 0.99999
    assert all(r["pooled_cosine"] > 1 - 1e-9 and r["pooled_max_abs_diff"] < 1e-5 for r in data["records"])
    assert all(r["overlap_at_k"] == 1.0 and r["k"] == 10 for r in data["records"])
    s = data["summary"]["layers"]["2"]["fraction_above_pass"]
    assert s["count"] == s["n"] == len(records) and s["ci95"][1] == 1.0
    assert s["ci95"][0] == pytest.approx(metrics.wilson_interval(len(records), len(records))[0])


def test_fp32_compute_with_float16_storage_passes_the_determinism_check(tmp_path, tiny_model_path, records):
    store = embed_store(tmp_path, tiny_model_path, records[:10], "f16", precision="fp32", storage_dtype="float16",
                   per_residue=True)
    report = run_crosscheck(store, out=tmp_path / "cc", device="cpu", quiet=True)
    assert report.data["mode"] == "determinism" and report.verdict == "pass", report.data["verdict_reasons"]
    stored = read_store(store)
    # the only difference is float16 rounding of the stored values: at most half an fp16 ulp
    for rec in report.data["records"]:
        vec = stored["mean"][rec["layer"]][rec["id"]].astype(np.float64)
        assert rec["pooled_max_abs_diff"] <= float(np.abs(vec).max()) * 2.0**-11 + 1e-6


def test_known_perturbations_give_the_expected_cosine_max_abs_and_verdicts(tmp_path, fp32_store):
    original = read_store(fp32_store)
    ids = original["ids"]
    warn_store = tmp_path / "warn.h5"
    new = _perturbed_copy(fp32_store, warn_store, {(3, 2): 0.995, (10, 1): 0.9995})
    report = run_crosscheck(warn_store, out=tmp_path / "warn", sample=100, seed=0, device="cpu", quiet=True)
    assert report.verdict == "warn", report.data["verdict_reasons"]
    for (row, layer), cos_theta in {(3, 2): 0.995, (10, 1): 0.9995}.items():
        rec = _records_by(report, layer)[ids[row]]
        assert rec["pooled_cosine"] == pytest.approx(cos_theta, abs=1e-5)
        expected_max = float(np.abs(new[(row, layer)].astype(np.float64) - original["mean"][layer][ids[row]]).max())
        assert rec["pooled_max_abs_diff"] == pytest.approx(expected_max, abs=1e-5)
        assert rec["status"] == "warn"
    assert _records_by(report, 2)[ids[4]]["status"] == "pass"
    assert report.data["summary"]["overall"]["status"] == {"pass": 30 * 3 - 2, "warn": 2}
    assert any("layer 2" in r for r in report.data["verdict_reasons"])

    fail_store = tmp_path / "fail.h5"
    new = _perturbed_copy(fp32_store, fail_store, {(7, 2): 0.95})
    report = run_crosscheck(fail_store, out=tmp_path / "fail", sample=100, seed=0, device="cpu", quiet=True)
    assert report.verdict == "fail"
    rec = _records_by(report, 2)[ids[7]]
    assert rec["pooled_cosine"] == pytest.approx(0.95, abs=1e-5) and rec["status"] == "fail"
    # overlap@10 of the turned vector, by brute force over the stored pooled vectors
    db = np.stack([original["mean"][2][i] for i in ids]).astype(np.float64)
    db[7] = new[(7, 2)]
    stored_nn = _brute_force(db[7:8], db, 10, [7])[0]
    fp32_nn = _brute_force(original["mean"][2][ids[7]][None].astype(np.float64), db, 10, [7])[0]
    assert rec["overlap_at_k"] == pytest.approx(len(set(stored_nn) & set(fp32_nn)) / 10)


def test_non_finite_stored_values_fail(tmp_path, fp32_store):
    bad = tmp_path / "nan.h5"
    shutil.copyfile(fp32_store, bad)
    with h5py.File(bad, "r+") as f:
        row = f["mean/layer_1"][5]
        row[2] = np.nan
        f["mean/layer_1"][5] = row
        rewrite_digests(f, [5])  # as written (the writer refuses it: what if one were)
    report = run_crosscheck(bad, out=tmp_path / "cc", sample=100, seed=0, device="cpu", quiet=True)
    assert report.verdict == "fail"
    assert any("non-finite" in r for r in report.data["verdict_reasons"])
    rec = _records_by(report, 1)[read_store(fp32_store)["ids"][5]]
    assert rec["pooled_cosine"] is None and rec["status"] == "fail"  # JSON null, not NaN
    _load_json_strict(report.json_path)


def test_json_contract_and_outputs(tmp_path, low_store):
    out = tmp_path / "report"
    report = run_crosscheck(low_store, out=out, sample=5, seed=2, device="cpu", quiet=True)
    assert sorted(p.name for p in out.iterdir()) == ["crosscheck.html", "crosscheck.json"]  # no temp files left
    data = _load_json_strict(out / "crosscheck.json")
    for key in ("records", "summary", "verdict", "sample_seed", "provenance", "store_sha256"):
        assert key in data
    assert data["verdict"] in ("pass", "warn", "fail") and data["verdict"] == report.verdict
    assert data["store_sha256"] == hashlib.sha256(low_store.read_bytes()).hexdigest()
    assert data["provenance"]["model_sha256"] == data["model"]["sha256"] and data["model"]["sha256_matches"]
    assert data["provenance"]["precision_policy"] == "bf16-mixed"
    drawn, sampled = _expected_sample(low_store, 5, 2)
    assert _random_part(data) == drawn and set(data["sample_ids"]) == sampled
    assert len(data["records"]) == len(sampled) * 2 and {r["layer"] for r in data["records"]} == {0, 2}
    for rec in data["records"]:
        assert CONTRACT_RECORD_KEYS <= set(rec)
    fig = data["store_figures"]
    assert fig["records"] == 30 and sum(v["count"] for v in fig["precision_used"].values()) == 30
    assert fig["fallback"]["count"] == sum(v["count"] for v in fig["fallback"]["by_reason"].values())
    assert fig["max_abs_activation"]["count"] == 30
    text = report.render()
    assert report.verdict.upper() in text and str(out / "crosscheck.html") in text and "fallback" in text


def test_long_sequence_handling_is_reproduced(tmp_path, tiny_model_path):
    records = random_sequences(3, (30, 60), seed=5) + [("long", random_sequences(1, [1100], seed=6)[0][1])]
    store = embed_store(tmp_path, tiny_model_path, records, "trunc", precision="fp32", per_residue=True,
                   long_sequences="truncate", tokens_per_batch=1100)
    report = run_crosscheck(store, out=tmp_path / "cc", device="cpu", quiet=True)
    assert report.verdict == "pass", report.data["verdict_reasons"] + report.data["problems"]
    assert report.data["reference"]["long_sequences"] == "truncate"
    assert report.data["reference"]["tokens_per_batch"] == 1100
    assert _records_by(report, 2)["long"]["long_handling"] == "truncated"


def test_merged_store_matches_its_shards(tmp_path, tiny_model_path, records):
    from embedpipe.store import merge_stores

    a = embed_store(tmp_path, tiny_model_path, records[:14], "shard-a", precision="bf16", per_residue=True, layers=(2,))
    b = embed_store(tmp_path, tiny_model_path, records[14:], "shard-b", precision="bf16", per_residue=True, layers=(2,))
    merged = tmp_path / "merged.h5"
    merge_stores([a, b], out=merged)
    report = run_crosscheck(merged, out=tmp_path / "cc", sample=100, device="cpu", quiet=True)
    assert report.data["store"]["merged"] and report.data["store"]["records"] == 30
    assert report.data["neighbours"]["database_records"] == 30
    by_id = _records_by(report, 2)
    for shard in (a, b):
        part = run_crosscheck(shard, out=tmp_path / f"cc-{shard.stem}", sample=100, device="cpu", quiet=True)
        for rid, rec in _records_by(part, 2).items():
            assert by_id[rid]["pooled_cosine"] == pytest.approx(rec["pooled_cosine"], abs=1e-6)
            assert by_id[rid]["residue_min_cosine"] == pytest.approx(rec["residue_min_cosine"], abs=1e-6)


def test_model_checks_moved_checkpoint_and_mismatch(tmp_path, model_factory, records):
    from embedpipe.model.random_checkpoint import make_test_model

    model = make_test_model(tmp_path / "models" / "esm2_moving.pt", layers=2, dim=32, heads=4, seed=7)
    store = embed_store(tmp_path, model, records[:8], "moving", precision="bf16")
    moved = tmp_path / "elsewhere" / "esm2_moving.pt"
    moved.parent.mkdir()
    shutil.move(model, moved)
    with pytest.raises(EmbedpipeError, match="--model"):
        run_crosscheck(store, out=tmp_path / "cc", device="cpu", quiet=True)
    report = run_crosscheck(store, out=tmp_path / "cc", device="cpu", model=str(moved), quiet=True)
    assert report.data["model"]["sha256_matches"] and report.data["model"]["from"] == "--model"

    other = model_factory(layers=2, dim=32, heads=4, seed=8)
    with pytest.raises(EmbedpipeError, match="sha256.*--allow-model-mismatch"):
        run_crosscheck(store, out=tmp_path / "cc2", device="cpu", model=str(other), quiet=True)
    report = run_crosscheck(store, out=tmp_path / "cc2", device="cpu", model=str(other), allow_model_mismatch=True,
                            quiet=True)
    assert report.verdict != "pass"
    assert any("MODEL MISMATCH" in n for n in report.data["notes"])
    assert "MODEL MISMATCH" in report.html_path.read_text()
    wrong_dim = model_factory(layers=2, dim=16, heads=4, seed=8)
    with pytest.raises(EmbedpipeError, match="dim"):
        run_crosscheck(store, out=tmp_path / "cc3", device="cpu", model=str(wrong_dim), allow_model_mismatch=True,
                       quiet=True)


def test_single_record_store_has_no_neighbours(tmp_path, tiny_model_path):
    store = embed_store(tmp_path, tiny_model_path, [("only", "MKTAYIAKQR")], "one", precision="bf16")
    report = run_crosscheck(store, out=tmp_path / "cc", device="cpu", quiet=True)
    assert report.data["neighbours"]["k"] == 0
    assert all(r["overlap_at_k"] is None for r in report.data["records"])
    assert "overlap@" not in report.render()
    assert "<svg" in report.html_path.read_text()


def test_thresholds_are_validated_and_configurable(tmp_path, fp32_store):
    with pytest.raises(EmbedpipeError, match="must not exceed"):
        Thresholds(pass_cosine=0.9, fail_cosine=0.99).validate()
    with pytest.raises(EmbedpipeError):
        Thresholds(pass_overlap=1.5).validate()
    warn_store = tmp_path / "w.h5"
    _perturbed_copy(fp32_store, warn_store, {(3, 2): 0.995})
    strict = run_crosscheck(warn_store, out=tmp_path / "s", sample=100, device="cpu", quiet=True,
                            thresholds=Thresholds(fail_cosine=0.999, pass_cosine=0.9999))
    assert strict.verdict == "fail"
    lax = run_crosscheck(warn_store, out=tmp_path / "l", sample=100, device="cpu", quiet=True,
                         thresholds=Thresholds(pass_cosine=0.99, fail_cosine=0.9, determinism_cosine=0.99))
    assert lax.verdict == "pass", lax.data["verdict_reasons"]


def test_cli_exit_codes_and_fail_on_threshold(tmp_path, fp32_store):
    from typer.testing import CliRunner

    from embedpipe.cli import app

    fail_store = tmp_path / "fail.h5"
    _perturbed_copy(fp32_store, fail_store, {(7, 2): 0.95})
    runner = CliRunner()
    base = ["crosscheck", str(fail_store), "--out", str(tmp_path / "cc"), "--sample", "100", "--device", "cpu"]
    result = runner.invoke(app, base)
    assert result.exit_code == 0, result.output
    assert "FAIL" in result.stderr
    result = runner.invoke(app, [*base, "--fail-on-threshold", "--quiet"])
    assert result.exit_code == 1
    result = runner.invoke(app, [*base, "--fail-on-threshold", "--fail-cosine", "0.9", "--pass-cosine", "0.94",
                                 "--determinism-cosine", "0.9", "-q"])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "cc" / "crosscheck.json").read_text())["verdict"] == "pass"
    result = runner.invoke(app, ["crosscheck", str(tmp_path / "missing.h5"), "--out", str(tmp_path / "x")])
    assert result.exit_code == 1 and "embedpipe: error:" in result.stderr


@pytest.mark.parametrize("damage, expected", [
    ("missing", "dataset per_residue/layer_0 is missing (run embedpipe validate "),
    ("flip-mean", "cannot read dataset mean/layer_1 rows "),  # a sampled row read as rows r:r+1
    ("flip-residues", "cannot read dataset per_residue/layer_2 rows "),
])
def test_damaged_store_is_one_line_naming_store_and_dataset(tmp_path, fp32_store, damage, expected):
    """Issue 11 item 7: no KeyError traceback, no bare "Can't synchronously read data"."""
    from typer.testing import CliRunner

    from embedpipe.cli import app

    bad = tmp_path / "bad.h5"
    shutil.copyfile(fp32_store, bad)
    if damage == "missing":
        with h5py.File(bad, "r+") as f:
            del f["per_residue/layer_0"]
    else:
        flip_byte_in_chunk(bad, "mean/layer_1" if damage == "flip-mean" else "per_residue/layer_2")
    with pytest.raises(EmbedpipeError) as exc:
        run_crosscheck(bad, out=tmp_path / "cc", sample=100, device="cpu", quiet=True)
    assert str(exc.value).startswith(f"{bad}: {expected}"), str(exc.value)
    result = CliRunner().invoke(app, ["crosscheck", str(bad), "--out", str(tmp_path / "cc2"), "--device", "cpu", "-q"])
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0] == f"embedpipe: error: {exc.value}", result.stderr


# =============================================================================== HTML


def test_html_is_self_contained_and_escapes_text(tmp_path, low_store):
    report = run_crosscheck(low_store, out=tmp_path / "cc", sample=6, seed=1, device="cpu", quiet=True)
    page = report.html_path.read_text()
    assert page.index("PASS" if report.verdict == "pass" else report.verdict.upper()) < page.index("<svg")
    for name in ("cosine-histogram", "error-scatter", "overlap-histogram", "activation-histogram"):
        assert f'class="plot {name}"' in page
    for marker in ('id="layers"', 'id="overlap"', 'id="store"', 'id="provenance"', "fp32 fallback"):
        assert marker in page
    lowered = page.lower()
    assert "<script" not in lowered and "http://" not in lowered and "https://" not in lowered
    assert "src=" not in lowered and "url(" not in lowered
    data = json.loads(report.json_path.read_text())
    evil = '<script>alert("x")</script>&'
    data["records"][0]["id"] = evil
    data["store"]["path"] = evil
    data["provenance"]["model_name"] = evil
    data["notes"] = [evil]
    page = render_html(data)
    assert "<script>" not in page and "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;&amp;" in page


def test_store_table_read_in_blocks_gives_the_whole_table_figures(low_store, monkeypatch):
    """The figures from the block-by-block table (no IDs or sequences kept) equal those from
    the whole per-record table."""
    import embedpipe.crosscheck.run as crosscheck
    from embedpipe import open_store
    from embedpipe.crosscheck.verdict import store_figures

    monkeypatch.setattr(crosscheck, "TABLE_BLOCK", 7)
    with open_store(low_store) as st:
        table, lengths = crosscheck._store_table(st)
        whole = st.records()
    np.testing.assert_array_equal(lengths, whole["length"])
    assert store_figures(table, lengths) == store_figures(whole, np.asarray(whole["length"], dtype=np.int64))


def test_an_fp32_stores_crosscheck_reports_exactly_zero_difference(tmp_path, tiny_model_path, records):
    """Batch invariance (docs/precision.md, "Reproducibility"): the cross-check's fp32
    recomputation batches the sampled records its own way, yet every pooled and per-residue
    value it recomputes is bit-identical to the store's, which embedded them 300 tokens a batch."""
    store = embed_store(tmp_path, tiny_model_path, records, "small-batches", precision="fp32", layers=(0, 2),
                        per_residue=True, tokens_per_batch=300)
    report = run_crosscheck(store, out=tmp_path / "cc", sample=12, seed=3, device="cpu", quiet=True)
    rows = report.data["records"]
    _, sampled = _expected_sample(store, 12, 3)  # 12 drawn, the longest besides them
    assert report.data["mode"] == "determinism" and len(rows) == len(sampled) * 2  # 2 layers
    diffs = {key: [r[key] for r in rows] for key in rows[0] if key.endswith("max_abs_diff")}
    assert "pooled_max_abs_diff" in diffs and "residue_max_abs_diff" in diffs, sorted(rows[0])
    assert all(value == 0.0 for values in diffs.values() for value in values), diffs
