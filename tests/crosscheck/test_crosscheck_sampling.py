"""The cross-check sample always holds the risky records (the longest, those over the model's
window, the fp32 fallbacks), bounded, besides the length-stratified random draw; the report
says why each record was chosen, and its length axis covers the whole store."""

from __future__ import annotations

import html
import re

import numpy as np
import pytest

from embedpipe.crosscheck import sampling
from embedpipe.crosscheck.metrics import stratified_sample
from embedpipe.crosscheck.report.figures import error_scatter
from embedpipe.crosscheck.run import LABELLED_REASON, RANDOM_REASON, LabelOptions, run_crosscheck
from embedpipe.extraction.run import EmbedOptions, embed_fasta
from helpers.embed_helpers import random_sequences, read_store, write_fasta

NO_C = np.array(list("ADEFGHIKLMNPQRSTVWY"))
WINDOW = 1022  # the tiny models' trained residues: longer records are chunked or truncated


def _select(lengths, handling, fallback, sample, seed, candidates=None):
    random_rows = stratified_sample(lengths if candidates is None else lengths[candidates], sample, seed)
    if candidates is not None:
        random_rows = candidates[random_rows]
    sel = sampling.select(lengths, handling, fallback, random_rows, random_reason=RANDOM_REASON, random_rule="r",
                          sample=sample, candidates=candidates)
    return sel, random_rows


# =============================================================================== the rules, on made-up columns


def test_rules_pick_every_risky_record_below_the_bounds_and_keep_the_random_draw():
    rng = np.random.default_rng(3)
    n = 500
    lengths = rng.integers(20, 900, size=n)
    handling = np.array(["none"] * n, dtype=object)
    fallback = np.array([""] * n, dtype=object)
    chunked, truncated, fell_back = [7, 99, 250], [300], [5, 6, 480]
    lengths[chunked] = [1500, 3148, 1100]
    lengths[truncated] = 2000
    handling[chunked], handling[truncated] = "chunked", "truncated"
    fallback[fell_back] = "nonfinite"
    sel, random_rows = _select(lengths, handling, fallback, 16, seed=9)
    why = dict(zip(sel.rows.tolist(), sel.chosen_because))
    # the longest four, by hand
    longest = sorted(range(n), key=lambda i: (-int(lengths[i]), i))[:4]
    assert set(longest) == {99, 300, 7, 250}  # 3148, 2000, 1500, 1100
    expected: dict[int, list[str]] = {}
    for i in longest:
        expected.setdefault(i, []).append("longest")
    for i in sorted(chunked + truncated):
        expected.setdefault(i, []).append(str(handling[i]))
    for i in fell_back:
        expected.setdefault(i, []).append("fp32 fallback")
    for i in random_rows.tolist():
        expected.setdefault(i, []).append(RANDOM_REASON)
    assert why == expected
    assert sel.rows.tolist() == sorted(expected)
    # the random part is today's draw, unchanged: same rows as stratified_sample alone
    assert sorted(i for i, w in why.items() if RANDOM_REASON in w) == sorted(stratified_sample(lengths, 16, 9).tolist())
    by_reason = {r["reason"]: r for r in sel.rules}
    assert by_reason[sampling.LONG_RULE]["eligible"] == 4 and by_reason["fp32 fallback"]["chosen"] == 3
    # per reason, in rule order
    tally = {reason: sum(reason in w for w in expected.values())
             for reason in ("longest", "chunked", "truncated", "fp32 fallback", RANDOM_REASON)}
    assert sel.counts == tally and list(sel.counts) == list(tally)


def test_bounds_hold_when_a_group_is_larger():
    rng = np.random.default_rng(4)
    n = 20_000  # a big store: the sample stays bounded
    lengths = rng.integers(30, 5000, size=n)
    handling = np.where(lengths > 1022, "chunked", "none").astype(object)
    fallback = np.array(["nonfinite" if i % 97 == 0 else "" for i in range(n)], dtype=object)
    sel, random_rows = _select(lengths, handling, fallback, 64, seed=0)
    why = dict(zip(sel.rows.tolist(), sel.chosen_because))
    long_rows = np.flatnonzero(handling == "chunked")
    fb_rows = np.flatnonzero(fallback != "")
    assert long_rows.size > 1000 and fb_rows.size > sampling.FALLBACK
    chosen_long = [i for i, w in why.items() if "chunked" in w]
    chosen_fb = [i for i, w in why.items() if "fp32 fallback" in w]
    assert len(chosen_long) == sampling.LONG_HANDLED and len(chosen_fb) == sampling.FALLBACK
    assert set(chosen_long) <= set(long_rows.tolist()) and set(chosen_fb) <= set(fb_rows.tolist())
    # spread over the group's lengths: its shortest and its longest record are both in
    order = sorted(long_rows.tolist(), key=lambda i: (int(lengths[i]), i))
    assert order[0] in chosen_long and order[-1] in chosen_long
    fb_order = sorted(fb_rows.tolist(), key=lambda i: (int(lengths[i]), i))
    assert fb_order[0] in chosen_fb and fb_order[-1] in chosen_fb
    # evenly: the chosen lengths' ranks are the evenly spaced ranks, by hand
    ranks = sorted(order.index(i) for i in chosen_long)
    step = (len(order) - 1) / (sampling.LONG_HANDLED - 1)
    assert ranks == [int(np.round(j * step)) for j in range(sampling.LONG_HANDLED)]
    assert len([i for i, w in why.items() if "longest" in w]) == sampling.LONGEST
    assert sel.rows.size <= 64 + sampling.MAX_RISK and sampling.MAX_RISK == 4 + 16 + 16
    assert sel.rows.size > 64  # the rules added records the random draw missed
    # random part unchanged in kind: length-stratified, every quantile bin drawn from
    assert sorted(i for i, w in why.items() if RANDOM_REASON in w) == random_rows.tolist()


def test_rules_only_look_at_the_candidates():
    lengths = np.array([10, 5000, 20, 30, 4000, 40, 50, 60])
    handling = np.array(["none", "chunked", "none", "none", "chunked", "none", "none", "none"], dtype=object)
    fallback = np.array(["", "", "nonfinite", "", "", "", "", ""], dtype=object)
    candidates = np.array([0, 2, 3, 5, 6, 7])  # e.g. the labelled or the computed records
    sel, random_rows = _select(lengths, handling, fallback, 2, seed=1, candidates=candidates)
    assert set(sel.rows.tolist()) <= set(candidates.tolist())
    why = dict(zip(sel.rows.tolist(), sel.chosen_because))
    # the chunked rows 1 and 4 are not candidates: no rule picks them, nor does the longest rule
    assert {i for i, w in why.items() if "longest" in w} == {7, 6, 5, 3}
    assert not any("chunked" in w for w in why.values())
    assert why[2] == ["fp32 fallback"] + ([RANDOM_REASON] if 2 in random_rows.tolist() else [])


# =============================================================================== real stores


@pytest.fixture(scope="module")
def risky_store(tmp_path_factory, model_factory):
    """An fp16 store whose 'C' token overflows fp16 (fp32 fallbacks), with long chunked records."""
    tmp = tmp_path_factory.mktemp("risky")
    model = model_factory(layers=2, dim=32, heads=4, seed=21, token_row_overrides={"C": 7e4})
    records = random_sequences(40, (10, 200), seed=5, alphabet=NO_C)
    records += [(f"cys{i}", s[:5] + "C" + s[5:]) for i, (_, s) in enumerate(random_sequences(3, (20, 60), seed=6))]
    records += [(f"long{i}", s) for i, (_, s) in enumerate(random_sequences(5, [1100, 1400, 1700, 2100, 2600], seed=7,
                                                                                 alphabet=NO_C))]
    store = tmp / "risky.h5"
    embed_fasta(write_fasta(tmp / "in.fasta", records), model=str(model), out=store,
                options=EmbedOptions(precision="fp16", layers=(-1,), long_sequences="chunk"), quiet=True)
    plain = read_store(store)  # the store's own columns, read with plain h5py
    ids = plain["ids"]
    columns = {name: [plain["fields"][name][rid] for rid in ids] for name in ("long_handling", "fallback_reason")}
    return store, ids, columns, np.array([plain["fields"]["length"][rid] for rid in ids])


def test_chunked_and_fallback_records_are_all_sampled_with_their_reasons(tmp_path, risky_store):
    store, ids, columns, lengths = risky_store
    chunked = {rid for rid, h in zip(ids, columns["long_handling"]) if h == "chunked"}
    fell_back = {rid for rid, r in zip(ids, columns["fallback_reason"]) if r}
    assert chunked == {f"long{i}" for i in range(5)} and fell_back == {"cys0", "cys1", "cys2"}
    report = run_crosscheck(store, out=tmp_path / "cc", sample=8, seed=2, device="cpu", quiet=True)
    data = report.data
    sampled = dict(zip(data["sample_ids"], data["sample_chosen_because"]))
    assert chunked <= set(sampled) and fell_back <= set(sampled)
    for rid in chunked:
        assert "chunked" in sampled[rid]
    for rid in fell_back:
        assert "fp32 fallback" in sampled[rid]
    longest = {ids[i] for i in np.argsort(-lengths, kind="stable")[:4]}
    assert {rid for rid, w in sampled.items() if "longest" in w} == longest
    # the random part: exactly the seeded length-stratified draw over all records
    random_ids = {ids[i] for i in stratified_sample(lengths, 8, 2)}
    assert {rid for rid, w in sampled.items() if RANDOM_REASON in w} == random_ids
    assert set(sampled) == chunked | fell_back | longest | random_ids
    assert data["sample_size"] == len(sampled) <= 8 + sampling.MAX_RISK
    # every per-record entry carries the reasons too
    assert all(r["chosen_because"] == sampled[r["id"]] for r in data["records"])
    # the length axis covers the store's longest record
    assert data["store_figures"]["length"]["max"] == int(lengths.max()) == 2600
    page = report.html_path.read_text()
    assert "up to its longest (2,600 residues)" in page
    # the page lists every sampled record with its reasons, and the rules with their bounds
    section = re.search(r'<section id="sample">(.*?)</section>', page, flags=re.S).group(1)
    listed = {}
    for row in re.findall(r"<tr>(.*?)</tr>", section.split("<details>")[1], flags=re.S):
        cells = [html.unescape(c) for c in re.findall(r"<td[^>]*>(.*?)</td>", row, flags=re.S)]
        if cells:  # not the header
            listed[cells[0]] = cells[-1]
    assert listed == {rid: ", ".join(w) for rid, w in sampled.items()}
    bounds = re.findall(r"<tr><td[^>]*>([^<]*)</td><td[^>]*>[^<]*</td><td[^>]*>(\d+)</td>",
                        section.split("<details>")[0])
    assert bounds == [("longest", str(sampling.LONGEST)), (sampling.LONG_RULE, str(sampling.LONG_HANDLED)),
                      ("fp32 fallback", str(sampling.FALLBACK)), (RANDOM_REASON, "8")]
    rules = {r["reason"]: r for r in data["sampling"]["rules"]}
    assert rules[sampling.LONG_RULE]["eligible"] == 5 and rules["fp32 fallback"]["eligible"] == 3
    assert data["sampling"]["max_size"] == 8 + sampling.MAX_RISK
    counts = data["sampling"]["chosen_because"]
    assert counts["chunked"] == 5 and counts["fp32 fallback"] == 3 and counts["longest"] == 4
    assert (f"  sample: 4 longest, 5 chunked, 3 fp32 fallback, {counts[RANDOM_REASON]} {RANDOM_REASON} "
            f"(at most {8 + sampling.MAX_RISK})") in report.render().splitlines()


def test_the_length_axis_is_the_stores_not_the_samples(tmp_path, risky_store):
    store, _, _, lengths = risky_store
    report = run_crosscheck(store, out=tmp_path / "cc", sample=4, seed=0, device="cpu", quiet=True)
    data = dict(report.data)
    short = [r for r in data["records"] if r["length"] < 300]  # as if only short records had been sampled
    svg = error_scatter({**data, "records": short})
    assert "up to its longest (2,600 residues)" in svg
    # the x axis reaches past 2,600: a tick labelled 2500 is drawn (none would be for lengths < 300)
    assert re.search(r'text-anchor="middle">2500</text>', svg)


def test_a_truncated_record_is_sampled(tmp_path, tiny_model_path):
    records = random_sequences(12, (30, 80), seed=8) + [("cut", random_sequences(1, [1300], seed=9)[0][1])]
    store = tmp_path / "trunc.h5"
    embed_fasta(write_fasta(tmp_path / "in.fasta", records), model=str(tiny_model_path), out=store,
                options=EmbedOptions(precision="fp32", long_sequences="truncate", layers=(-1,)), quiet=True)
    report = run_crosscheck(store, out=tmp_path / "cc", sample=2, seed=0, device="cpu", quiet=True)
    plain = read_store(store)
    assert plain["fields"]["long_handling"]["cut"] == "truncated"
    lengths = np.array([plain["fields"]["length"][rid] for rid in plain["ids"]])
    random_ids = {plain["ids"][i] for i in stratified_sample(lengths, 2, 0)}
    sampled = dict(zip(report.data["sample_ids"], report.data["sample_chosen_because"]))
    assert sampled["cut"] == ["longest", "truncated"] + ([RANDOM_REASON] if "cut" in random_ids else [])
    assert report.verdict == "pass", report.data["verdict_reasons"]


def test_with_labels_the_risky_labelled_records_are_checked_and_the_fit_is_on_the_labelled_draw(tmp_path, risky_store):
    store, ids, columns, lengths = risky_store
    unlabelled = {"long4", "cys2"}  # a chunked record and a fallback without a label
    labelled = [rid for rid in ids if rid not in unlabelled]
    labels = tmp_path / "labels.tsv"
    labels.write_text("id\tlabel\n" + "".join(f"{rid}\t{'ab'[i % 2]}\n" for i, rid in enumerate(labelled)))
    report = run_crosscheck(store, out=tmp_path / "cc", sample=10, seed=1, device="cpu", quiet=True,
                            labels=LabelOptions(labels, folds=2))
    data = report.data
    sampled = dict(zip(data["sample_ids"], data["sample_chosen_because"]))
    assert not unlabelled & set(sampled)  # only labelled records are sampled
    assert {"long0", "long1", "long2", "long3", "cys0", "cys1"} <= set(sampled)
    assert "chunked" in sampled["long3"] and "fp32 fallback" in sampled["cys1"]
    # the longest labelled records, by hand
    longest = sorted((i for i, rid in enumerate(ids) if rid not in unlabelled), key=lambda i: (-lengths[i], i))[:4]
    assert {rid for rid, w in sampled.items() if "longest" in w} == {ids[i] for i in longest}
    drawn = [rid for rid, w in sampled.items() if LABELLED_REASON in w]
    assert len(drawn) == 10 == data["downstream"]["sampled"] == sum(data["downstream"]["sampled_classes"].values())
    assert data["sample_size"] > 10


@pytest.mark.parametrize("seed", range(5))
def test_the_longest_rule_breaks_ties_by_row(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 5, size=60)  # many ties at the cut
    none = np.array(["none"] * 60, dtype=object)
    sel, _ = _select(lengths, none, np.array([""] * 60, dtype=object), 3, seed=seed)
    by_hand = sorted(range(60), key=lambda i: (-int(lengths[i]), i))[:sampling.LONGEST]
    assert [r for r, w in zip(sel.rows.tolist(), sel.chosen_because) if "longest" in w] == sorted(by_hand)
