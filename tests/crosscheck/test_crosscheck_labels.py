"""The downstream cross-check on the user's own labels (issue 25), and a pass naming every
rule it applied (issue 19 item E).

The stores come from a random-weight model, the labels from the sequences themselves
(composition classes: residues drawn from three disjoint alphabets; a numeric target: the
hydrophobic fraction), so the stored vectors do carry the labels. The scores are checked
against scikit-learn fits run here by hand on the same folds, the fp32 side on vectors from
fair-esm's own forward pass; the store is a merged one, so alias IDs resolve.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest
from sklearn.linear_model import LogisticRegression, Ridge
from sklearn.metrics import accuracy_score, r2_score
from sklearn.model_selection import KFold, StratifiedKFold
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from typer.testing import CliRunner

from embedpipe import open_store
from embedpipe.cli import app
from embedpipe.core.errors import EmbedpipeError
from embedpipe.crosscheck.run import LabelOptions, Thresholds, run_crosscheck
from helpers.embed_helpers import fair_esm_forward, random_sequences, read_store, write_fasta
from helpers.stores import rewrite_digests
from helpers.workflow_helpers import snakemake

ALPHABETS = {"hydrophobic": "AILMFVW", "charged": "DEKR", "polar": "GSTNQ"}
HYDROPHOBIC = set(ALPHABETS["hydrophobic"])
LAYERS = (1, 2)


# =============================================================================== fixtures


def _records() -> list[tuple[str, str, str]]:
    """(id, sequence, class): 16 per composition class; residues mixed a little so the
    hydrophobic fraction varies within a class too."""
    out = []
    mixed = np.array(list("".join(ALPHABETS.values())))
    for c, (name, alphabet) in enumerate(ALPHABETS.items()):
        main = random_sequences(16, (20, 60), seed=10 + c, alphabet=np.array(list(alphabet)))
        noise = random_sequences(16, (3, 12), seed=20 + c, alphabet=mixed)
        for i, ((_, a), (_, b)) in enumerate(zip(main, noise)):
            out.append((f"{name}{i:02d}", a + b, name))
    return out


@pytest.fixture(scope="module")
def labelled(tmp_path_factory, tiny_model_path):
    """A merged fp32 store (with an alias: ``dup_charged03`` repeats ``charged03``) and its records."""
    from embedpipe.extraction.run import EmbedOptions, embed_fasta
    from embedpipe.shard.passes import shard_fasta
    from embedpipe.store import merge_stores

    tmp = tmp_path_factory.mktemp("labels")
    records = _records()
    seqs = {rid: seq for rid, seq, _ in records}
    fasta = write_fasta(tmp / "in.fasta", [(r, s) for r, s, _ in records] + [("dup_charged03", seqs["charged03"])])
    shard_fasta([fasta], out=tmp / "shards", tokens_per_shard=100_000, quiet=True)
    part = tmp / "shard.h5"
    embed_fasta(tmp / "shards" / "shard-00000.fasta", model=str(tiny_model_path), out=part,
                options=EmbedOptions(precision="fp32", layers=LAYERS, per_residue=True), quiet=True)
    merged = tmp / "merged.h5"
    merge_stores([part], out=merged, manifest=tmp / "shards" / "manifest.tsv")
    with open_store(merged) as st:
        assert st.aliases == {"dup_charged03": "charged03"}
    return merged, records


def _write_labels(path: Path, rows: list[tuple[str, str]], header: str = "id\tlabel") -> Path:
    path.write_text(header + "\n" + "".join(f"{a}\t{b}\n" for a, b in rows))
    return path


def _class_labels(records, alias: bool = True) -> list[tuple[str, str]]:
    rows = [(rid, name) for rid, _, name in records]
    if alias:  # the record charged03 is labelled through its alias only
        rows = [("dup_charged03" if rid == "charged03" else rid, name) for rid, name in rows]
    return rows


def _fraction_labels(records) -> list[tuple[str, str]]:
    return [(rid, repr(sum(ch in HYDROPHOBIC for ch in seq) / len(seq))) for rid, seq, _ in records]


# =============================================================================== independent fits


def _hand_fit(kind: str, x: np.ndarray, y: np.ndarray, seed: int, folds: int = 5):
    """Per-fold scores and out-of-fold predictions of the documented model, fitted here."""
    splitter = (StratifiedKFold if kind == "classes" else KFold)(n_splits=folds, shuffle=True, random_state=seed)
    pred = np.empty(len(y), dtype=y.dtype)
    scores = []
    for train, test in splitter.split(x, y):
        head = LogisticRegression(max_iter=2000) if kind == "classes" else Ridge(alpha=1.0)
        model = make_pipeline(StandardScaler(), head).fit(x[train], y[train])
        pred[test] = model.predict(x[test])
        scores.append(accuracy_score(y[test], pred[test]) if kind == "classes" else r2_score(y[test], pred[test]))
    return scores, pred


def _fair_esm_pooled(model_path, fair_esm_reference, sequences: list[str], layer: int) -> np.ndarray:
    model, alphabet = fair_esm_reference(model_path)
    return np.stack([fair_esm_forward(model, alphabet, s, [layer])[layer].astype(np.float64).mean(axis=0)
                     for s in sequences])


# =============================================================================== results


def test_fp32_store_scores_the_same_as_its_recomputation(tmp_path, labelled):
    store, records = labelled
    labels = _write_labels(tmp_path / "labels.tsv", _class_labels(records))
    report = run_crosscheck(store, out=tmp_path / "cc", sample=100, device="cpu", quiet=True,
                            labels=LabelOptions(labels))
    data = json.loads(report.json_path.read_text())
    ds = data["downstream"]
    assert report.verdict == "pass", data["verdict_reasons"]
    assert ds["kind"] == "classes" and ds["model"].startswith("StandardScaler + LogisticRegression")
    assert ds["labelled_in_store"] == ds["sampled"] == 48 and ds["unknown_ids"] == {"count": 0, "ids": []}
    assert ds["classes"] == {"charged": 16, "hydrophobic": 16, "polar": 16}
    assert "charged03" in data["sample_ids"]  # labelled through its alias
    for layer in map(str, LAYERS):
        e = ds["layers"][layer]
        assert e["difference"] == 0 and e["agreement"] == 1.0 and e["ci95"] == [0.0, 0.0]
        assert e["stored"] == e["fp32"] > 1 / 3 + 0.3  # the labels are learnable from the vectors
        assert e["per_fold"]["stored"] == e["per_fold"]["fp32"] and len(e["per_fold"]["stored"]) == 5
    assert "your labels" in data["verdict_reasons"][0]
    text = report.render()
    assert "downstream (classes" in text and "agreement 1.000" in text


def test_perturbed_store_scores_lower_fails_the_rule_and_equals_a_hand_run_fit(tmp_path, labelled, tiny_model_path,
                                                                               fair_esm_reference):
    store, records = labelled
    noisy = store.parent / "noisy.h5"  # beside the merged store: its shard store is found
    shutil.copyfile(store, noisy)
    with h5py.File(noisy, "r+") as f:  # HDF5's fletcher32 filter rewrites the chunk checksums
        ds = f["mean/layer_2"]
        clean = ds[()].astype(np.float64)
        noise = np.random.default_rng(7).normal(size=clean.shape) * 3.0 * clean.std(axis=0)
        ds[...] = (clean + noise).astype(np.float32)
        rewrite_digests(f)  # a store written with these vectors (not one edited in place)
    with open_store(noisy) as st:  # still reads: the checksums are good, only the values moved
        np.testing.assert_allclose(st.mean_vector(st.ids[0], 2), (clean + noise)[0], rtol=1e-6)
    labels = _write_labels(tmp_path / "labels.tsv", _class_labels(records))
    report = run_crosscheck(noisy, out=tmp_path / "cc", sample=100, seed=3, device="cpu", quiet=True,
                            labels=LabelOptions(labels))
    ds = report.data["downstream"]
    hit, kept = ds["layers"]["2"], ds["layers"]["1"]
    assert hit["stored"] < hit["fp32"] and hit["ci95"][1] < -0.01 and hit["agreement"] < 1.0
    assert kept["difference"] == 0 and kept["agreement"] == 1.0
    assert report.verdict == "fail"
    assert any(r.startswith("fail: layer 2: accuracy on your labels") for r in report.data["verdict_reasons"])

    # the same model fitted by hand on the same folds: stored vectors as h5py reads them, fp32 from fair-esm
    order = report.data["sample_ids"]
    by_id = {rid: (seq, name) for rid, seq, name in records}
    y = np.array([by_id[rid][1] for rid in order], dtype=object)
    stored = np.stack([read_store(noisy)["mean"][2][rid] for rid in order]).astype(np.float64)
    scores, pred_s = _hand_fit("classes", stored, y, seed=3)
    assert hit["per_fold"]["stored"] == pytest.approx(scores, abs=1e-12)
    fp32 = _fair_esm_pooled(tiny_model_path, fair_esm_reference, [by_id[rid][0] for rid in order], 2)
    scores_f, pred_f = _hand_fit("classes", fp32, y, seed=3)
    assert hit["per_fold"]["fp32"] == pytest.approx(scores_f, abs=1e-12)
    assert hit["stored"] == pytest.approx(accuracy_score(y, pred_s)) and hit["fp32"] == pytest.approx(accuracy_score(y, pred_f))
    assert hit["agreement"] == pytest.approx(float(np.mean(pred_s == pred_f)))
    assert hit["ci95"][0] <= hit["difference"] <= hit["ci95"][1]


def test_numeric_labels_are_a_ridge_regression_equal_to_a_hand_run_fit(tmp_path, labelled, tiny_model_path,
                                                                       fair_esm_reference):
    store, records = labelled
    labels = _write_labels(tmp_path / "fraction.tsv", _fraction_labels(records), header="protein\thydrophobic")
    report = run_crosscheck(store, out=tmp_path / "cc", sample=30, seed=1, device="cpu", quiet=True,
                            labels=LabelOptions(labels))
    ds = report.data["downstream"]
    assert ds["kind"] == "numbers" and ds["score"] == "R2" and ds["kind_from"].startswith("auto")
    # the fit is on the label-stratified draw; the risky records the sample holds besides it are not fitted
    order = [rid for rid, why in zip(report.data["sample_ids"], report.data["sample_chosen_because"])
             if "label-stratified random" in why]
    assert ds["sampled"] == len(order) == 30 and report.data["sample_size"] >= 30
    target = dict(_fraction_labels(records))
    y = np.array([float(target[rid]) for rid in order])
    seqs = {rid: seq for rid, seq, _ in records}
    for layer in LAYERS:
        e = ds["layers"][str(layer)]
        assert e["difference"] == pytest.approx(0, abs=1e-6) and e["agreement"] == 1.0
        fp32 = _fair_esm_pooled(tiny_model_path, fair_esm_reference, [seqs[r] for r in order], layer)
        scores, pred = _hand_fit("numbers", fp32, y, seed=1)
        assert e["per_fold"]["fp32"] == pytest.approx(scores, abs=1e-4)
        assert e["fp32"] == pytest.approx(r2_score(y, pred), abs=1e-4)
        from scipy.stats import spearmanr

        assert e["spearman"]["fp32"] == pytest.approx(spearmanr(y, pred).statistic, abs=1e-3)
    assert report.verdict == "pass", report.data["verdict_reasons"]


def test_integer_labels_are_classes_unless_asked(tmp_path, labelled):
    store, records = labelled
    code = {"hydrophobic": "0", "charged": "1", "polar": "2"}
    labels = _write_labels(tmp_path / "ints.tsv", [(rid, code[name]) for rid, _, name in records])
    report = run_crosscheck(store, out=tmp_path / "cc", sample=100, device="cpu", quiet=True,
                            labels=LabelOptions(labels))
    assert report.data["downstream"]["kind"] == "classes"
    assert "--label-kind numbers" in report.data["downstream"]["kind_from"]
    report = run_crosscheck(store, out=tmp_path / "cc2", sample=100, device="cpu", quiet=True,
                            labels=LabelOptions(labels, kind="numbers"))
    assert report.data["downstream"]["kind"] == "numbers"


def test_class_stratified_sample_keeps_every_class_and_is_seeded(tmp_path, labelled):
    store, records = labelled
    rows = _class_labels(records)[:16 + 16] + [(rid, "polar") for rid, _, name in records if name == "polar"][:6]
    labels = _write_labels(tmp_path / "l.tsv", rows)
    a = run_crosscheck(store, out=tmp_path / "a", sample=19, seed=5, device="cpu", quiet=True, labels=LabelOptions(labels))
    b = run_crosscheck(store, out=tmp_path / "b", sample=19, seed=5, device="cpu", quiet=True, labels=LabelOptions(labels))
    assert a.data["sample_ids"] == b.data["sample_ids"]
    got = a.data["downstream"]["sampled_classes"]
    # 5 per class first (the folds), the other 4 in proportion to what is left (11, 11, 1)
    assert sum(got.values()) == 19 and got["polar"] >= 5 and got["hydrophobic"] >= 6 and got["charged"] >= 6
    labelled_ids = {r for r, _ in rows} - {"dup_charged03"} | {"charged03"}
    assert set(a.data["sample_ids"]) <= labelled_ids
    with pytest.raises(EmbedpipeError, match=r"--sample 14 is too small for 3 classes with 5 folds: at least 15"):
        run_crosscheck(store, out=tmp_path / "c", sample=14, device="cpu", quiet=True, labels=LabelOptions(labels))


# =============================================================================== bad label files


def _bad(records) -> dict[str, tuple[list[tuple[str, str]], str]]:
    classes = _class_labels(records, alias=False)
    fraction = _fraction_labels(records)
    return {
        "unknown": (classes[:3] + [("nope", "polar")] + classes[3:],
                    r"line 5: ID 'nope' is not in merged\.h5 \(1 of 49 labelled IDs are not: 'nope'\); "
                    r"--ignore-unknown-ids"),
        "one-class": ([(rid, "same") for rid, _ in classes],
                      r"line 2: every stored record is labelled 'same': one class only"),
        "few": ([(rid, "rare" if i in (7, 20, 30) else lab) for i, (rid, lab) in enumerate(classes)],
                r"line 9: class 'rare' has 3 labelled record\(s\) in the store, fewer than the 5 folds"),
        "non-numeric": (fraction[:10] + [(fraction[10][0], "n/a")] + fraction[11:],
                        r"line 12: label 'n/a' is not a finite number"),
        "columns": (classes[:2] + [(classes[2][0], "polar\textra")] + classes[3:],
                    r"line 4: expected 2 tab-separated columns \(id<TAB>label\), found 3"),
        "twice": (classes + [classes[0]], r"line 50: ID 'hydrophobic00' is labelled twice \(also line 2\)"),
        "alias-conflict": (classes + [("dup_charged03", "polar")],
                           r"line 50: 'dup_charged03' is the same stored record as 'charged03' \(line 21\) but "
                           r"labelled 'polar', not 'charged'"),
    }


@pytest.mark.parametrize("case", ["unknown", "one-class", "few", "non-numeric", "columns", "twice", "alias-conflict"])
def test_bad_label_file_is_one_line_naming_file_and_line(tmp_path, labelled, case):
    store, records = labelled
    rows, pattern = _bad(records)[case]
    labels = _write_labels(tmp_path / f"{case}.tsv", rows)
    result = CliRunner().invoke(app, ["crosscheck", str(store), "--out", str(tmp_path / "cc"), "--device", "cpu",
                                      "--labels", str(labels), "-q"])
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"embedpipe: error: {labels} line "), result.stderr
    assert re.search(pattern, lines[0]), lines[0]
    assert not (tmp_path / "cc" / "crosscheck.json").exists()  # refused before any output


def test_unknown_ids_can_be_left_out_and_are_listed(tmp_path, labelled):
    store, records = labelled
    rows = _class_labels(records) + [("ghost1", "polar"), ("ghost2", "charged")]
    labels = _write_labels(tmp_path / "l.tsv", rows)
    result = CliRunner().invoke(app, ["crosscheck", str(store), "--out", str(tmp_path / "cc"), "--device", "cpu",
                                      "--labels", str(labels), "--ignore-unknown-ids", "--folds", "4", "-q"])
    assert result.exit_code == 0, result.output
    ds = json.loads((tmp_path / "cc" / "crosscheck.json").read_text())["downstream"]
    assert ds["unknown_ids"] == {"count": 2, "ids": ["ghost1", "ghost2"]}
    assert ds["folds"] == 4 and ds["label_lines"] == 50 and ds["labelled_in_store"] == 48
    assert "2 not, left out" in (tmp_path / "cc" / "crosscheck.html").read_text()


# =============================================================================== the verdict names every rule


def test_a_pass_names_every_rule_applied_including_the_residue_cosine(tmp_path, labelled):
    """Issue 19 item E: with per-residue vectors, the pass reason (verdict line and page) names
    the residue cosine rule too; before, only the pooled cosine and overlap rules."""
    store, _ = labelled
    report = run_crosscheck(store, out=tmp_path / "cc", sample=100, device="cpu", quiet=True,
                            thresholds=Thresholds(residue_cosine=0.995))
    assert report.verdict == "pass" and report.data["store"]["per_residue"]
    (reason,) = report.data["verdict_reasons"]
    for rule in ("pooled cosine >= 0.99999", "residue's cosine >= 0.995", "median overlap@10 >= 0.9",
                 "all values finite", "embedded the same residues"):
        assert rule in reason, reason
    assert "labels" not in reason  # no downstream rule without labels
    assert "residue&#x27;s cosine &gt;= 0.995" in report.html_path.read_text().split('id="cosine"')[0]
    assert "residue's cosine >= 0.995" in report.render().splitlines()[1]


# =============================================================================== the workflow key


def test_workflow_passes_the_labels_to_the_crosscheck(checkout_like):
    import yaml

    (checkout_like / "labels.tsv").write_text("id\tlabel\n")
    config = checkout_like / "cfg.yaml"
    config.write_text(yaml.safe_dump({"crosscheck": {"sample": 8, "seed": 0, "labels": "labels.tsv",
                                                     "label_kind": "classes", "ignore_unknown_ids": True}}))
    proc = snakemake(checkout_like, "--dry-run", "--printshellcmds", "--cores", "1", "--configfile",
                     "configs/offline-demo.yaml", str(config))
    out = proc.stdout + proc.stderr
    assert "--labels labels.tsv --label-kind classes --ignore-unknown-ids" in out, out[-3000:]
    config.write_text(yaml.safe_dump({"crosscheck": {"sample": 8, "seed": 0, "labels": "labels.tsv",
                                                     "label_kind": "regression"}}))
    proc = snakemake(checkout_like, "--dry-run", "--cores", "1", "--configfile", "configs/offline-demo.yaml",
                     str(config), check=False)
    assert proc.returncode != 0 and "label_kind" in proc.stdout + proc.stderr


# =============================================================================== the page in a browser

# The page runs no script; a copy with this probe measures the fold-score plot in the browser.
_PLOT_PROBE = """<script>
const svg = document.querySelector('svg.fold-scores');
const box = svg ? svg.getBoundingClientRect() : {width: 0, height: 0};
const marks = svg ? [...svg.querySelectorAll('circle')].filter(c => c.getBoundingClientRect().width > 0).length : 0;
document.title = JSON.stringify({width: box.width, height: box.height, marks: marks,
                                 section: !!document.querySelector('#downstream table')});
</script></body>"""


@pytest.mark.slow
@pytest.mark.browser
def test_downstream_section_renders_in_headless_chromium(tmp_path, labelled):
    import html

    from test_report_browser import CHROMIUM, _chromium, _dom

    if CHROMIUM is None:
        pytest.skip("no chromium on PATH (CI installs Debian's chromium: apt-get install -y chromium)")
    store, records = labelled
    labels = _write_labels(tmp_path / "labels.tsv", _class_labels(records))
    report = run_crosscheck(store, out=tmp_path / "cc", sample=100, device="cpu", quiet=True,
                            labels=LabelOptions(labels))
    dom, messages = _dom(report.html_path, tmp_path)
    assert messages == [], f"console messages while loading the report: {messages}"
    match = re.search(r'<svg class="plot fold-scores"[^>]*>(.*?)</svg>', dom, flags=re.S)
    assert match and len(re.findall(r"<circle\b", match.group(1))) == 2 * 5 * len(LAYERS)
    assert dom.index('id="verdict"') < dom.index("your labels") < dom.index('id="downstream"')
    probe = tmp_path / "probe.html"
    probe.write_text(report.html_path.read_text(encoding="utf-8").replace("</body>", _PLOT_PROBE), encoding="utf-8")
    result = _chromium(probe, tmp_path, "--dump-dom")
    measured = json.loads(html.unescape(re.search(r"<title>(.*?)</title>", result.stdout, flags=re.S).group(1)))
    assert measured["section"] and measured["width"] > 600 and measured["height"] > 200, measured
    assert measured["marks"] == 2 * 5 * len(LAYERS), measured
