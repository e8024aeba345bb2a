"""`embedpipe embed --reuse STORE`: records an earlier store holds (same sequence sha256, same
identity) are copied bit for bit with their provenance, not computed; another identity is
refused naming the option; a job with nothing to compute loads no model (issue 24, section 3)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

import embedpipe
import embedpipe.extraction.job as job_module
import embedpipe.store.reuse_index as reuse_index
from embedpipe.core.errors import EmbedpipeError
from embedpipe.core.options import EmbedOptions
from embedpipe.extraction.run import embed_fasta, embed_shards
from embedpipe.store.merge import merge_stores
from embedpipe.store.validate import validate_store
from helpers.embed_helpers import random_sequences, read_store, write_fasta
from helpers.stores import as_format2

OPTIONS = EmbedOptions(per_residue=True, device="cpu", layers=(0, -1), pooling=("mean", "bos"),
                       storage_dtype="float16")
DATA = Path(__file__).resolve().parents[1] / "data"


def _releases(n: int = 40) -> tuple[list[tuple[str, str]], list[tuple[str, str]], set[str]]:
    """Release 1, and release 2: the same IDs, 10% of sequences changed, 5% new records."""
    first = random_sequences(n, (8, 60), seed=3)
    changed = {rid for rid, _ in first[: n // 10]}
    fresh = random_sequences(n // 10 + n // 20, (8, 60), seed=77)
    second = [(rid, fresh[k][1]) for k, (rid, _) in enumerate(first[: n // 10])] + first[n // 10:]
    second += [(f"new{k}", s) for k, (_, s) in enumerate(fresh[n // 10:])]
    return first, second, changed | {f"new{k}" for k in range(n // 20)}


def _embed(tmp: Path, model: Path, records, name: str, reuse=(), options: EmbedOptions = OPTIONS):
    fasta = write_fasta(tmp / f"{name}.fasta", records)
    summary = embed_fasta(fasta, model=str(model), out=tmp / f"{name}.h5", options=options, quiet=True,
                          reuse=[Path(p) for p in reuse])
    return tmp / f"{name}.h5", summary


def _by_sequence(store: dict) -> dict[str, str]:
    with embedpipe.open_store(store["path"]) as opened:
        seqs = opened.records(sequence=True)["sequence"]
    return dict(zip(seqs.tolist(), store["ids"]))


def _vectors(path: Path) -> dict:
    out = read_store(path)
    out["path"] = path
    with h5py.File(path, "r") as f:
        out["bos"] = {int(k.split("_")[1]): {i: f["bos"][k][n] for n, i in enumerate(out["ids"])} for k in f["bos"]}
        out["reused_from"] = dict(zip(out["ids"], [v.decode() for v in f["reused_from"][()]]))
    return out


def test_release_two_computes_only_changed_and_new_records(tmp_path, tiny_model_path, monkeypatch):
    first, second, recomputed = _releases()
    r1, _ = _embed(tmp_path, tiny_model_path, first, "r1")
    r2, summary = _embed(tmp_path, tiny_model_path, second, "r2", reuse=[r1])
    fresh, _ = _embed(tmp_path, tiny_model_path, second, "fresh")
    a, b, c = _vectors(r1), _vectors(r2), _vectors(fresh)
    uuid1 = a["attrs"]["store_uuid"]
    assert summary.reused == len(second) - len(recomputed)
    assert {i for i, u in b["reused_from"].items() if not u} == recomputed
    assert {u for i, u in b["reused_from"].items() if u} == {uuid1}
    assert int(b["attrs"]["reused_count"]) == len(second) - len(recomputed)
    assert json.loads(b["attrs"]["reused_sources"]) == [
        {"store_uuid": uuid1, "path": str(r1.absolute()), "records": len(second) - len(recomputed)}]
    row1 = _by_sequence(a)
    for rid, seq in second:
        if rid in recomputed:  # computed: a fresh embed's numbers, bit for bit (batch-invariant)
            for k in (0, 2):
                assert np.array_equal(b["mean"][k][rid], c["mean"][k][rid]), (rid, k)
                assert np.array_equal(b["per_residue"][k][rid], c["per_residue"][k][rid]), (rid, k)
            continue
        old = row1[seq]
        for k in (0, 2):  # every layer, mean, BOS and per-residue, bit for bit
            assert np.array_equal(b["mean"][k][rid], a["mean"][k][old])
            assert np.array_equal(b["bos"][k][rid], a["bos"][k][old])
            assert np.array_equal(b["per_residue"][k][rid], a["per_residue"][k][old])
        for name, values in b["fields"].items():  # the provenance comes with the copy
            assert values[rid] == a["fields"][name][old] or (values[rid] != values[rid] and name == "max_abs_activation")
    assert validate_store(r2) == []


def test_identity_mismatch_is_refused_naming_the_option(tmp_path, tiny_model_path):
    first, _, _ = _releases(20)
    r1, _ = _embed(tmp_path, tiny_model_path, first, "r1")
    fasta = write_fasta(tmp_path / "r2.fasta", first)
    proc = subprocess.run(
        [sys.executable, "-m", "embedpipe.cli", "embed", str(fasta), "--model", str(tiny_model_path), "--out",
         str(tmp_path / "r2.h5"), "--device", "cpu", "--layers", "0,-1", "--per-residue", "--pooling", "mean", "--pooling", "bos",
         "--storage-dtype", "float32", "--reuse", str(r1), "-q"], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [
        f"embedpipe: error: --reuse {r1}: embedded with storage_dtype 'float16', this run 'float32'; only a store "
        "embedded with the same model and options can be reused"]
    assert not (tmp_path / "r2.h5").exists()


def test_another_model_is_named_first(tmp_path, tiny_model_path, model_factory):
    first, _, _ = _releases(20)
    r1, _ = _embed(tmp_path, tiny_model_path, first, "r1")
    other = model_factory(seed=5)
    with pytest.raises(EmbedpipeError, match=r"embedded with model_sha256 '[0-9a-f]{64}', this run '[0-9a-f]{64}'"):
        _embed(tmp_path, other, first, "r2", reuse=[r1])


def test_all_reused_group_job_loads_no_model(tmp_path, tiny_model_path, monkeypatch):
    first, _, _ = _releases(20)
    r1, _ = _embed(tmp_path, tiny_model_path, first, "r1")
    index = tmp_path / "r1.reuse.h5"
    assert reuse_index.build_index(r1, index) == len({s for _, s in first})

    def no_model(spec: str):
        raise AssertionError(f"load_model({spec!r}) called for a job with nothing to compute")

    monkeypatch.setattr(job_module, "load_model", no_model)
    shards = [write_fasta(tmp_path / f"shard-{k}.fasta", first[k * 10:(k + 1) * 10]) for k in range(2)]
    summary = embed_shards(shards, model=str(tiny_model_path), out_dir=tmp_path / "stores", options=OPTIONS,
                           done=tmp_path / "done.json", quiet=True, reuse=[index])
    assert [s.reused for s in summary.embedded] == [10, 10]
    ref = _vectors(r1)
    for shard in shards:
        got = _vectors(tmp_path / "stores" / f"{shard.stem}.h5")
        for rid in got["ids"]:
            assert np.array_equal(got["per_residue"][2][rid], ref["per_residue"][2][rid])
        assert validate_store(tmp_path / "stores" / f"{shard.stem}.h5") == []
    # the rerun keeps them (the predicted identity is the one they carry), still without a model
    again = embed_shards(shards, model=str(tiny_model_path), out_dir=tmp_path / "stores", options=OPTIONS,
                         done=tmp_path / "done.json", quiet=True, reuse=[index])
    assert len(again.kept) == 2 and not again.embedded


def test_merged_store_reuse_and_counts_through_merge(tmp_path, tiny_model_path):
    first, second, recomputed = _releases(40)
    parts = [_embed(tmp_path, tiny_model_path, first[k::2], f"s{k}")[0] for k in range(2)]
    merged = tmp_path / "embeddings.h5"
    merge_stores(parts, out=merged)
    halves = [_embed(tmp_path, tiny_model_path, second[k::2], f"t{k}", reuse=[merged])[0] for k in range(2)]
    release2 = tmp_path / "release2.h5"
    merge_stores(halves, out=release2)
    with embedpipe.open_store(release2) as st:
        table = st.records()
        assert int(st.provenance["reused_count"]) == len(second) - len(recomputed)
        sources = json.loads(st.provenance["reused_sources"])
        assert [(s["path"], s["records"]) for s in sources] == [(str(merged.absolute()), len(second) - len(recomputed))]
        assert {i for i, u in zip(table["id"], table["reused_from"]) if not u} == recomputed
    assert validate_store(release2) == []


def test_stores_without_the_column_read_validate_and_merge(tmp_path, tiny_model_path):
    for name in ("store-v1-example.h5", "store-v2-example.h5"):
        with embedpipe.open_store(DATA / name) as st:
            assert set(st.records()["reused_from"].tolist()) == {""}
            assert st[st.ids[0]]["reused_from"] == ""
        assert validate_store(DATA / name) == []
    first, _, _ = _releases(20)
    new, _ = _embed(tmp_path, tiny_model_path, first[:10], "new", reuse=[])
    old, _ = _embed(tmp_path, tiny_model_path, first[10:], "old")
    with h5py.File(old, "a") as f:  # as written before the column existed (format 2)
        as_format2(f)
        del f["reused_from"]
    merge_stores([new, old], out=tmp_path / "m.h5")
    with embedpipe.open_store(tmp_path / "m.h5") as st:
        assert set(st.records()["reused_from"].tolist()) == {""}
        assert int(st.provenance["reused_count"]) == 0
    assert validate_store(tmp_path / "m.h5") == []


def test_index_lookup_reads_blocks_and_finds_every_sequence(tmp_path, tiny_model_path, monkeypatch):
    first, second, recomputed = _releases(40)
    r1, _ = _embed(tmp_path, tiny_model_path, first, "r1")
    monkeypatch.setattr(reuse_index, "BLOCK", 4)  # 10 blocks: lookups cross block bounds
    reuse_index.build_index(r1, tmp_path / "idx.h5")
    index = reuse_index.ReuseIndex(tmp_path / "idx.h5")
    assert index.block == 4 and len(index.fence) == 10
    rows = index.lookup(reuse_index.sequence_digests(s for _, s in second))
    expected = {hashlib.sha256(s.encode()).digest(): n for n, (_, s) in enumerate(first)}
    for (rid, seq), row in zip(second, rows.tolist()):
        assert row == expected.get(hashlib.sha256(seq.encode()).digest(), -1), rid
    assert sum(r < 0 for r in rows.tolist()) == len(recomputed)
    index.close()
