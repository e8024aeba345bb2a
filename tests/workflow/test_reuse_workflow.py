"""Release to release with the workflow's `reuse` key (issue 24, section 3): release 1, then
release 2 (10% of sequences changed, 5% new, the same IDs otherwise) with `reuse: [release 1's
embeddings.h5]`: only the changed and new records are computed, every reused vector equals
release 1's bit for bit, the computed ones a fresh embed's, and the cross-check samples the
computed records and names the reused ones' source (docs/cluster.md, "Release to release")."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import yaml

import embedpipe
from embedpipe.core.options import EmbedOptions
from embedpipe.extraction.run import embed_fasta
from embedpipe.inputs.fasta import read_sequences
from helpers.embed_helpers import write_fasta
from helpers.workflow_helpers import EXAMPLE, demo_config, run_workflow, validate


def _release_two(records: list[tuple[str, str]]) -> tuple[list[tuple[str, str]], set[str]]:
    """Every 10th sequence changed (one residue), 5% new records; the IDs of both."""
    changed = [(rid, ("W" if seq[0] != "W" else "A") + seq[1:]) if k % 10 == 0 else (rid, seq)
               for k, (rid, seq) in enumerate(records)]
    new = [(f"NEW{k}", "MKT" + seq[::-1]) for k, (_, seq) in enumerate(records[1: 1 + len(records) // 20])]
    return changed + new, {rid for k, (rid, _) in enumerate(records) if k % 10 == 0} | {r for r, _ in new}


def test_release_two_reuses_release_one(tmp_path: Path) -> None:
    one, two = tmp_path / "r1", tmp_path / "r2"
    one.mkdir(), two.mkdir()
    run_workflow(one, demo_config(one))
    first = one / "out" / "embeddings.h5"
    records = list(read_sequences(EXAMPLE))
    second, recomputed = _release_two(records)
    fasta = write_fasta(two / "release2.fasta", second)
    model = one / "out" / "model" / "esm2_test_t2_32.pt"
    config = demo_config(two, input=str(fasta), model=str(model), reuse=[str(first)])
    settings = yaml.safe_load(config.read_text())
    del settings["test_model"]  # release 1's model file itself: the same sha256
    config.write_text(yaml.safe_dump(settings, sort_keys=False))
    proc = run_workflow(two, config, "--printshellcmds")
    index = two / "out" / "reuse" / "reuse-0.h5"
    assert index.is_file() and f"--reuse {index.relative_to(two)}" in proc.stdout + proc.stderr
    merged = two / "out" / "embeddings.h5"
    assert validate(merged).returncode == 0
    with embedpipe.open_store(first) as old, embedpipe.open_store(merged) as new:
        table = new.records(sequence=True)
        computed = {rid for rid, src in zip(table["id"], table["reused_from"]) if not src}
        assert computed == recomputed
        assert int(new.provenance["reused_count"]) == len(table["id"]) - len(recomputed)
        uuid1 = old.provenance["store_uuid"]
        assert set(table["reused_from"]) == {"", uuid1}
        by_sequence = dict(zip(old.records(sequence=True)["sequence"].tolist(), old.ids))
        for rid, seq, src in zip(table["id"], table["sequence"], table["reused_from"]):
            if src:
                assert np.array_equal(new.mean_vector(rid), old.mean_vector(by_sequence[seq]))
                assert np.array_equal(new.per_residue(rid), old.per_residue(by_sequence[seq]))
        fresh_records = [(rid, seq) for rid, seq in second if rid in computed]
        fresh = tmp_path / "fresh.h5"
        embed_fasta(write_fasta(tmp_path / "fresh.fasta", fresh_records), model=str(model), out=fresh,
                    options=EmbedOptions(precision="fp32", layers=(-1,), per_residue=True, device="cpu"), quiet=True)
        with embedpipe.open_store(fresh) as ref:
            for rid in computed:
                # bit for bit: batch-invariant (docs/precision.md, "Reproducibility")
                assert np.array_equal(new.mean_vector(rid), ref.mean_vector(rid)), rid
                assert np.array_equal(new.per_residue(rid), ref.per_residue(rid)), rid
        computed_rows = {n for n, src in enumerate(table["reused_from"]) if not src}
    report = json.loads((two / "out" / "crosscheck" / "crosscheck.json").read_text())
    assert set(report["sample_rows"]) <= computed_rows  # the risky records too: from the computed ones
    drawn = [why for why in report["sample_chosen_because"] if "length-stratified random" in why]
    assert len(drawn) == 8 and report["sample_size"] <= report["sampling"]["max_size"]
    assert report["reuse"]["reused_records"] == len(table["id"]) - len(recomputed)
    assert report["reuse"]["sources"] == [{"store_uuid": uuid1, "path": str(first.absolute()),
                                           "records": len(table["id"]) - len(recomputed)}]
    html = (two / "out" / "crosscheck" / "crosscheck.html").read_text()
    assert "reused records" in html and uuid1 in html
    print(f"recomputed {len(recomputed)} of {len(table['id'])} records ({len(recomputed) / len(table['id']):.1%})")
