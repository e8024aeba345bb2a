"""Merging shard stores: copied tables and means, virtual per-residue datasets, aliases, checks."""

from __future__ import annotations

import hashlib
import random
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest

import embedpipe
from embedpipe.core.errors import StoreError
from embedpipe.store import EmbeddedRecord, merge_stores, store_info, validate_store
from helpers.embed_helpers import flip_byte_in_chunk
from helpers.stores import FROM_RECORDS, as_format2, write_store

AMINO = "ACDEFGHIKLMNPQRSTVWY"
ATTRS = {"model_name": "esm2_t", "model_sha256": "cd" * 32, "precision_policy": "fp16", "device": "cpu",
         "model_trained": False}


def synthetic(prefix: str, n: int, *, start_len: int, dim: int = 8, layers=(1, 2), seed: int = 0):
    records = []
    for i in range(n):
        length = start_len + i
        seq = "".join(AMINO[(i * 3 + j * 7 + seed) % 20] for j in range(length))
        base = np.arange(dim, dtype=np.float64)
        grid = np.arange(length, dtype=np.float64)[:, None] * dim + base[None, :]
        per_residue = {k: np.cos(grid * 0.05 + i + k + seed).astype(np.float32) for k in layers}
        records.append(
            EmbeddedRecord(
                id=f"{prefix}{i}", sequence=seq, precision_used="fp16" if i % 3 else "fp32",
                fallback_reason="" if i % 3 else "nonfinite",
                # the fp32 mean of the rows, as the worker computes it (validate checks it)
                mean={k: per_residue[k].sum(axis=0, dtype=np.float32) / np.float32(length) for k in layers},
                per_residue=per_residue,
                max_abs_activation=float(i), embedded_length=length,
            )
        )
    return records


def write(path: Path, records, *, per_residue: bool = True, attrs=None, **kw) -> Path:
    """A shard store with the merge tests' provenance; its ``config`` names its own ``out``."""
    layers = list(kw.get("layers") or records[0].mean)
    attrs = {**ATTRS, "config": {"out": str(path), "layers": layers}, **(attrs or {})}
    return write_store(path, records, FROM_RECORDS if per_residue else None, attrs=attrs, **kw)


def sha(seq: str) -> str:
    return hashlib.sha256(seq.encode()).hexdigest()


@pytest.fixture
def results(tmp_path):
    """results/stores/shard-0000{0,1,2}.h5 with 6 + 5 + 4 records and a manifest."""
    root = tmp_path / "results"
    shards = [("a", 6, 40), ("b", 5, 46), ("c", 4, 51)]
    all_records, paths = [], []
    for k, (prefix, n, start) in enumerate(shards):
        recs = synthetic(prefix, n, start_len=start, seed=k)
        paths.append(write(root / "stores" / f"shard-{k:05d}.h5", recs))
        all_records.append(recs)
    header = "id\tsource\tlength\tsequence_sha256\tshard\tstatus\tduplicate_of\tnormalised\n"
    rows = []
    for k, recs in enumerate(all_records):
        for r in recs:
            rows.append(f"{r.id}\tin.fa:1\t{len(r.sequence)}\t{sha(r.sequence)}\t{k}\tok\t\t\n")
    dup_of = all_records[1][2]
    rows.insert(3, f"dupB2\tin.fa:9\t{len(dup_of.sequence)}\t{sha(dup_of.sequence)}\t1\tduplicate\t{dup_of.id}\t\n")
    rows.append(f"dupA0\tin.fa:11\t40\t{sha(all_records[0][0].sequence)}\t0\tduplicate\t\t\n")  # by sha only
    rows.append("bad1\tin.fa:13\t0\t\t\tskipped:empty\t\t\n")
    rows.append("bad2\tin.fa:15\t5\t\t\tskipped:invalid_characters\t\t\n")
    manifest = root / "shards" / "manifest.tsv"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(header + "".join(rows))
    return root, paths, [r for recs in all_records for r in recs], manifest


def test_merge_round_trip(results):
    root, paths, records, manifest = results
    out = root / "embeddings.h5"
    summary = merge_stores(paths, out=out, manifest=manifest)
    assert summary.records == 15 and summary.aliases == 2 and summary.skipped == 2
    assert "aliases 2" in summary.render() and "empty 1" in summary.render()
    assert validate_store(out) == []
    with embedpipe.open_store(out) as store:
        assert store.ids == [r.id for r in records]
        np.testing.assert_array_equal(store.mean(1).compute(), np.stack([r.mean[1] for r in records]))
        for r in records:
            np.testing.assert_array_equal(store.per_residue(r.id, 2), r.per_residue[2])
        assert store.aliases == {"dupB2": "b2", "dupA0": "a0"}
        assert store.skipped == {"bad1": "empty", "bad2": "invalid_characters"}
        assert store.index("dupB2") == store.index("b2")
        np.testing.assert_array_equal(store.per_residue("dupB2"), records[8].per_residue[2])
        assert store["dupA0"]["alias_of"] == "a0"
        with pytest.raises(KeyError, match="skipped"):
            store.index("bad1")
        prov = store.provenance
        assert prov["model_sha256"] == "cd" * 32 and prov["precision_policy"] == "fp16"
        assert prov["merged_from"] == [f"stores/shard-0000{k}.h5" for k in range(3)]
        assert prov["alias_count"] == 2 and prov["skipped_count"] == 2
        assert prov["config"] == {"layers": [1, 2]} and prov["config_varying"] == ["out"]
        assert len(prov["shard_provenance"]) == 3
    with h5py.File(out, "r") as f:
        assert f["per_residue/layer_1"].is_virtual and not f["mean/layer_1"].is_virtual
    info = store_info(out)
    assert info["aliases"] == 2 and info["skipped"] == 2 and len(info["merged_from"]) == 3


def test_merged_file_is_small(tmp_path):
    paths = [
        write(tmp_path / f"s{k}.h5", synthetic(f"p{k}_", 10, start_len=200 + 10 * k, dim=64, seed=k), dim=64)
        for k in range(2)
    ]
    out = tmp_path / "m.h5"
    merge_stores(paths, out=out)
    per_residue_bytes = 0
    for p in paths:
        with h5py.File(p, "r") as f:
            per_residue_bytes += sum(f[f"per_residue/layer_{k}"].id.get_storage_size() for k in (1, 2))
    assert per_residue_bytes > 2_000_000
    assert out.stat().st_size < per_residue_bytes / 20
    assert validate_store(out) == []


def test_moved_results_directory_still_works(results, tmp_path):
    root, paths, records, manifest = results
    merge_stores(paths, out=root / "embeddings.h5", manifest=manifest)
    moved = tmp_path / "elsewhere" / "run1"
    moved.parent.mkdir()
    shutil.move(str(root), str(moved))
    assert validate_store(moved / "embeddings.h5") == []
    with embedpipe.open_store(moved / "embeddings.h5") as store:
        np.testing.assert_array_equal(store.per_residue("c3", 1), records[-1].per_residue[1])
        assert float(store.per_residue_array(1).sum().compute()) == pytest.approx(
            float(sum(r.per_residue[1].sum() for r in records)), rel=1e-5
        )


def test_missing_or_replaced_source(results):
    root, paths, records, _ = results
    out = root / "m.h5"
    merge_stores(paths, out=out)
    # replaced by a different store with other records
    paths[1].unlink()
    write(paths[1], synthetic("z", 5, start_len=46))
    problems = validate_store(out)
    assert any("shard-00001.h5 holds different records" in p for p in problems), problems
    paths[1].unlink()
    problems = validate_store(out)
    assert any("source store stores/shard-00001.h5 is missing" in p for p in problems), problems
    with pytest.raises(StoreError, match="shard-00001.h5 is missing"):
        embedpipe.open_store(out)


def test_checksums_verified_through_virtual_datasets(results):
    root, paths, _, _ = results
    out = root / "m.h5"
    merge_stores(paths, out=out)
    flip_byte_in_chunk(paths[2], "per_residue/layer_2", at=10)
    problems = validate_store(out)
    assert any("per_residue/layer_2" in p and "checksum" in p for p in problems), problems


@pytest.mark.parametrize(
    "change, attr",
    [
        (dict(attrs={"model_sha256": "ef" * 32}), "model_sha256"),
        (dict(attrs={"precision_policy": "bf16"}), "precision_policy"),
        (dict(storage_dtype="float16"), "storage_dtype"),
        (dict(layers=(2,)), "layers"),
        (dict(dim=4), "dim"),
        (dict(per_residue=False), "per_residue"),
    ],
)
def test_mismatched_shards_refused(tmp_path, change, attr):
    a = write(tmp_path / "a.h5", synthetic("a", 3, start_len=5))
    dim = change.get("dim", 8)
    b = write(tmp_path / "b.h5", synthetic("b", 3, start_len=9, dim=dim, layers=change.get("layers", (1, 2))), **change)
    with pytest.raises(StoreError, match=rf"b\.h5: {attr} is"):
        merge_stores([a, b], out=tmp_path / "m.h5")
    assert not (tmp_path / "m.h5").exists() and not list(tmp_path.glob("*.tmp"))


def test_duplicate_ids_and_bad_inputs_refused(tmp_path):
    a = write(tmp_path / "a.h5", synthetic("x", 3, start_len=5))
    b = write(tmp_path / "b.h5", synthetic("x", 2, start_len=9))
    with pytest.raises(StoreError, match="duplicate id 'x0'"):
        merge_stores([a, b], out=tmp_path / "m.h5")
    with pytest.raises(StoreError, match="given twice"):
        merge_stores([a, a], out=tmp_path / "m.h5")
    with pytest.raises(StoreError, match="overwrite"):
        merge_stores([a], out=a)
    merge_stores([a], out=tmp_path / "m.h5")
    with pytest.raises(StoreError, match="itself a merged store"):
        merge_stores([tmp_path / "m.h5"], out=tmp_path / "m2.h5")
    with h5py.File(b, "r+") as f:
        del f.attrs["complete"]
    with pytest.raises(StoreError, match="incomplete"):
        merge_stores([b], out=tmp_path / "m3.h5")


def test_manifest_mismatch_refused(results):
    root, paths, records, manifest = results
    text = manifest.read_text()
    missing = root / "missing.tsv"
    missing.write_text(text + f"ghost\tin.fa:99\t3\t{sha('AAA')}\t2\tok\t\t\n")
    with pytest.raises(StoreError, match=r"id 'ghost' \(status ok, shard '2'\) is not in any"):
        merge_stores(paths, out=root / "m.h5", manifest=missing)
    extra = root / "extra.tsv"
    extra.write_text("\n".join(line for line in text.splitlines() if not line.startswith("c3\t")) + "\n")
    with pytest.raises(StoreError, match="holds id 'c3'"):
        merge_stores(paths, out=root / "m.h5", manifest=extra)
    orphan = root / "orphan.tsv"
    orphan.write_text(text + f"dupX\tin.fa:1\t3\t{sha('WWW')}\t1\tduplicate\t\t\n")
    with pytest.raises(StoreError, match="duplicate 'dupX' has no ok record"):
        merge_stores(paths, out=root / "m.h5", manifest=orphan)
    nocol = root / "nocol.tsv"
    nocol.write_text("id\tstatus\nx\tok\n")
    with pytest.raises(StoreError, match="missing column"):
        merge_stores(paths, out=root / "m.h5", manifest=nocol)
    assert not (root / "m.h5").exists()


def test_float16_without_per_residue_is_self_contained(tmp_path):
    a = write(tmp_path / "s" / "a.h5", synthetic("a", 4, start_len=5), storage_dtype="float16", per_residue=False)
    b = write(tmp_path / "s" / "b.h5", synthetic("b", 3, start_len=9), storage_dtype="float16", per_residue=False)
    out = tmp_path / "m.h5"
    merge_stores([a, b], out=out)
    assert validate_store(out) == []
    with h5py.File(out, "r") as f:
        assert "per_residue" not in f and f["mean/layer_2"].dtype == np.float16
    with embedpipe.open_store(out) as store:
        assert store.mean().compute().shape == (7, 8)


def test_cli_merge(results):
    from typer.testing import CliRunner

    from embedpipe.cli import app

    root, paths, _, manifest = results
    out = root / "cli.h5"
    res = CliRunner().invoke(app, ["merge", *map(str, paths), "--out", str(out), "--manifest", str(manifest)])
    assert res.exit_code == 0, res.output
    assert "15 records" in res.output
    res = CliRunner().invoke(app, ["validate", str(out)])
    assert res.exit_code == 0, res.output


def test_merge_without_stores_is_one_clear_line(tmp_path):
    from typer.testing import CliRunner

    from embedpipe.cli import app

    manifest = tmp_path / "manifest.tsv"
    manifest.write_text("id\tsource\tlength\tsequence_sha256\tshard\tstatus\nP1\tin.fa:1\t3\t\t\tskipped:alignment-gap\n")
    result = CliRunner().invoke(app, ["merge", "--out", str(tmp_path / "m.h5"), "--manifest", str(manifest)])
    assert result.exit_code == 1
    assert "no shard stores to merge" in result.output and "skipped" in result.output
    assert not (tmp_path / "m.h5").exists()


# --------------------------------------------------------------------------- merged stores pin their sources


def _embed_shard(tmp: Path, model: Path, records, out: Path, precision: str) -> Path:
    from embedpipe.extraction.run import EmbedOptions, embed_fasta
    from helpers.embed_helpers import write_fasta

    fasta = write_fasta(tmp / f"{out.stem}.fasta", records)
    embed_fasta(fasta, model=str(model), out=out, quiet=True,
                options=EmbedOptions(precision=precision, layers=(0, -1), per_residue=True))
    return out


def test_reembedded_shard_is_refused_by_validate_open_store_and_crosscheck(tmp_path, tiny_model_path):
    """Issue 11 item 2: merge three shards, re-embed one with another policy into the same path."""
    from typer.testing import CliRunner

    from embedpipe.cli import app
    from embedpipe.crosscheck.run import run_crosscheck
    from helpers.embed_helpers import random_sequences

    records = random_sequences(9, (10, 40), seed=11)
    root = tmp_path / "results"
    (root / "stores").mkdir(parents=True)
    shards = [_embed_shard(tmp_path, tiny_model_path, records[3 * k : 3 * k + 3],
                           root / "stores" / f"shard-{k:05d}.h5", "fp32") for k in range(3)]
    merged = root / "embeddings.h5"
    merge_stores(shards, out=merged)
    assert validate_store(merged) == []
    with h5py.File(shards[1], "r") as g:
        old_uuid = g.attrs["store_uuid"]
    _embed_shard(tmp_path, tiny_model_path, records[3:6], shards[1], "bf16")
    with h5py.File(shards[1], "r") as g:
        assert g.attrs["store_uuid"] != old_uuid

    problems = validate_store(merged)
    assert any(p.startswith("source store stores/shard-00001.h5 was rewritten after the merge") for p in problems), problems
    # the pooled vectors (old run) no longer are the means of the per-residue rows (new run)
    assert any(p.startswith(f"record {records[3][0]!r} (row 3) layer 0: stored mean differs") for p in problems), problems
    res = CliRunner().invoke(app, ["validate", str(merged)])
    assert res.exit_code == 1 and "shard-00001.h5 was rewritten" in res.output
    # open_store checks the pins lazily (issue 24: stat at open, store_uuid when a source is first read)
    with embedpipe.open_store(merged) as st, pytest.raises(
            StoreError, match=r"embeddings\.h5: source store stores/shard-00001\.h5 was rewritten") as exc:
        st.per_residue(records[3][0])
    assert "\n" not in str(exc.value)
    with pytest.raises(StoreError, match=r"stores/shard-00001\.h5 was rewritten"):
        run_crosscheck(merged, out=tmp_path / "cc", sample=1, device="cpu", quiet=True)
    assert not (tmp_path / "cc" / "crosscheck.json").exists()
    res = CliRunner().invoke(app, ["crosscheck", str(merged), "--out", str(tmp_path / "cc"), "--device", "cpu"])
    assert res.exit_code == 1 and "shard-00001.h5 was rewritten" in res.output and "Traceback" not in res.output


def test_merged_sources_record_uuid_size_and_sha256_for_legacy_shards(results):
    root, paths, _, _ = results
    with h5py.File(paths[2], "r+") as g:  # a store written before store_uuid existed
        del g.attrs["store_uuid"]
        as_format2(g)  # store_uuid came before format 3's digests
    out = root / "m.h5"
    merge_stores(paths, out=out)
    with embedpipe.open_store(out) as store:
        prov = store.provenance
    sources = prov["merged_sources"]
    assert [s["path"] for s in sources] == [f"stores/shard-0000{k}.h5" for k in range(3)]
    for s, p in zip(sources[:2], paths):
        with h5py.File(p, "r") as g:
            assert s == {"path": s["path"], "store_uuid": g.attrs["store_uuid"], "size": p.stat().st_size}
    assert sources[2] == {"path": "stores/shard-00002.h5", "store_uuid": None, "size": paths[2].stat().st_size,
                          "sha256": hashlib.sha256(paths[2].read_bytes()).hexdigest()}
    assert len(prov["store_uuid"]) == 32 and prov["store_uuid"] not in {s["store_uuid"] for s in sources}
    assert "store_uuid" not in prov["varying_attrs"] and validate_store(out) == []

    # same size, other content: validate re-hashes legacy sources; open_store checks uuid and size only
    with h5py.File(paths[2], "r+") as g:
        g["mean/layer_1"][0] = g["mean/layer_1"][1]  # uncompressed: rewritten in place
    assert paths[2].stat().st_size == sources[2]["size"]
    problems = validate_store(out)
    assert any(p.startswith("source store stores/shard-00002.h5 changed after the merge (sha256") for p in problems)
    embedpipe.open_store(out).close()
    # a legacy source rewritten by this embedpipe now has a store_uuid: open_store notices
    with h5py.File(paths[2], "r+") as g:
        g.attrs["store_uuid"] = "f" * 32
    with pytest.raises(StoreError, match=r"shard-00002\.h5 was rewritten after the merge \(store_uuid f+, merged none\)"):
        embedpipe.open_store(out)


def test_source_that_changed_size_is_refused(results):
    root, paths, _, _ = results
    out = root / "m.h5"
    merge_stores(paths, out=out)
    with open(paths[0], "ab") as fh:
        fh.write(b"\0" * 16)
    with pytest.raises(StoreError, match=r"shard-00000\.h5 changed after the merge \(size"):
        embedpipe.open_store(out)
    assert any("shard-00000.h5 changed after the merge (size" in p for p in validate_store(out))


def test_corrupt_shard_chunk_read_through_merged_store_names_dataset_rows_and_shard(results):
    root, paths, records, _ = results
    out = root / "m.h5"
    merge_stores(paths, out=out)
    flip_byte_in_chunk(paths[1], "per_residue/layer_2", at=10)
    with embedpipe.open_store(out) as store:  # same uuid and size: corruption is the checksums' job
        start, stop = int(store.offsets[6]), int(store.offsets[7])
        with pytest.raises(StoreError) as exc:
            store.per_residue("b0", 2)
    msg = str(exc.value)
    assert msg.startswith(f"{out}: cannot read dataset per_residue/layer_2 rows {start}:{stop}, stored in "
                          "stores/shard-00001.h5: checksum mismatch")
    assert "\n" not in msg
# ------------------------------------------------------------------ manifest checks (issue 11)


def _store_of_fasta(path: Path, fasta: Path, *, dim: int = 8) -> Path:
    """A store holding exactly the records of ``fasta`` (a shard), with synthetic vectors."""
    from embedpipe.inputs.fasta import read_sequences

    records = []
    for i, (rid, seq) in enumerate(read_sequences(fasta)):
        base = np.arange(dim, dtype=np.float32) + i
        records.append(EmbeddedRecord(
            id=rid, sequence=seq, precision_used="fp32", fallback_reason="",
            mean={k: np.sin(base + k) for k in (1, 2)},
            per_residue={k: np.ones((len(seq), dim), dtype=np.float32) * (i + k) for k in (1, 2)},
            max_abs_activation=1.0, embedded_length=len(seq),
        ))
    return write(path, records, dim=dim)


def test_stale_manifest_is_refused_naming_its_line(tmp_path):
    from embedpipe.shard.passes import shard_fasta

    v1 = tmp_path / "v1.fa"
    v1.write_text(">a\nAAAKV\n>b\nCCCKV\n>d\nCCCKV\n")
    v2 = tmp_path / "v2.fa"
    v2.write_text(">a\nCCCKV\n>b\nAAAKV\n>d\nCCCKV\n")
    shard_fasta([v1], out=tmp_path / "s1", tokens_per_shard=100, quiet=True)
    shard_fasta([v2], out=tmp_path / "s2", tokens_per_shard=100, quiet=True)
    st1 = _store_of_fasta(tmp_path / "st1.h5", tmp_path / "s1" / "shard-00000.fasta")
    good = merge_stores([st1], out=tmp_path / "good.h5", manifest=tmp_path / "s1" / "manifest.tsv")
    assert good.aliases == 1
    with embedpipe.open_store(tmp_path / "good.h5") as store:
        assert store.aliases == {"d": "b"}
        assert store["d"]["sequence"] == "CCCKV"
    stale = tmp_path / "s2" / "manifest.tsv"
    with pytest.raises(StoreError) as err:
        merge_stores([st1], out=tmp_path / "m.h5", manifest=stale)
    message = str(err.value)
    assert message.startswith(f"manifest {stale} line 2: id 'a' has sequence_sha256 {sha('CCCKV')[:16]}")
    assert f"{sha('AAAKV')[:16]}" in message and str(st1) in message and "\n" not in message
    assert not (tmp_path / "m.h5").exists()


def test_duplicate_row_whose_target_has_another_sequence_is_refused(results):
    root, paths, records, manifest = results
    text = manifest.read_text()
    # d0 claims to duplicate a1 but carries a0's sequence digest: the alias would point elsewhere
    bad = root / "bad.tsv"
    bad.write_text(text + f"d0\tin.fa:21\t40\t{sha(records[0].sequence)}\t0\tduplicate\ta1\t\n")
    last = len(text.splitlines()) + 1
    with pytest.raises(StoreError, match=rf"manifest {bad} line {last}: duplicate 'd0' of 'a1' has sequence_sha256"):
        merge_stores(paths, out=root / "m.h5", manifest=bad)
    # a wrong digest on an ok row is refused too
    lines = text.splitlines(keepends=True)
    a0 = next(k for k, line in enumerate(lines) if line.startswith("a0\t"))
    lines[a0] = lines[a0].replace(sha(records[0].sequence), sha("MKV"))
    wrong = root / "wrong.tsv"
    wrong.write_text("".join(lines))
    with pytest.raises(StoreError, match=rf"manifest {wrong} line {a0 + 1}: id 'a0' has sequence_sha256"):
        merge_stores(paths, out=root / "m.h5", manifest=wrong)
    assert not (root / "m.h5").exists()


def test_manifest_that_is_not_utf8_names_its_line(results):
    root, paths, _, manifest = results
    lines = manifest.read_bytes().splitlines(keepends=True)
    lines[4] = lines[4].replace(b"in.fa", b"in\xff.fa")
    bad = root / "latin1.tsv"
    bad.write_bytes(b"".join(lines))
    with pytest.raises(StoreError, match=rf"^manifest {bad} line 5: not UTF-8 text \(byte 0xff at column \d+\)$"):
        merge_stores(paths, out=root / "m.h5", manifest=bad)
    from typer.testing import CliRunner

    from embedpipe.cli import app

    res = CliRunner().invoke(app, ["merge", *map(str, paths), "--out", str(root / "m.h5"), "--manifest", str(bad)])
    assert res.exit_code == 1
    col = lines[4].index(b"\xff") + 1
    assert res.stderr.strip().splitlines() == [
        f"embedpipe: error: manifest {bad} line 5: not UTF-8 text (byte 0xff at column {col})"
    ]


def test_manifest_with_quoted_tab_and_newline_paths_merges(results):
    root, paths, records, manifest = results
    rows = manifest.read_text().splitlines(keepends=True)
    rows[1] = rows[1].replace("in.fa:1", '"odd\tdir/new\nline ""q"".fa:1"')
    odd = root / "odd.tsv"
    odd.write_text("".join(rows))
    summary = merge_stores(paths, out=root / "m.h5", manifest=odd)
    assert summary.records == 15 and summary.aliases == 2 and summary.skipped == 2


def test_many_duplicates_all_resolve_streamed_in_small_batches(results, monkeypatch):
    """Hundreds of duplicate rows (by duplicate_of, by content only, repeated, and a stored ID
    naming itself), looked up in batches of 7: every alias points at the record with its sequence."""
    import embedpipe.store.aliases

    monkeypatch.setattr(embedpipe.store.aliases, "BATCH", 7)
    root, paths, records, manifest = results
    rng = random.Random(5)
    rows, want = [], {"dupB2": "b2", "dupA0": "a0"}
    for j in range(400):
        target = rng.choice(records)
        rid = f"many{j}"
        by = target.id if j % 2 else ""  # every other row: found by sequence_sha256 alone
        rows.append(f"{rid}\tin.fa:{j}\t{len(target.sequence)}\t{sha(target.sequence)}\t0\tduplicate\t{by}\t\n")
        if j % 50 == 0:  # the same row twice is one alias
            rows.append(rows[-1])
        want[rid] = target.id
    rows.append(f"a1\tin.fa:1\t0\t{sha(records[1].sequence)}\t0\tduplicate\ta1\t\n")  # itself: no alias
    many = root / "many.tsv"
    many.write_text(manifest.read_text() + "".join(rows))
    summary = merge_stores(paths, out=root / "m.h5", manifest=many)
    assert summary.aliases == len(want)
    with h5py.File(root / "m.h5", "r") as f:
        got = dict(zip(f["aliases/id"].asstr()[()], f["aliases/of"].asstr()[()]))
    assert got == want

    other = next(r for r in records if r.id != want["many3"])
    conflicting = root / "conflict.tsv"
    conflicting.write_text(many.read_text() + f"many3\tin.fa:9\t0\t{sha(other.sequence)}\t0\tduplicate\t{other.id}\t\n")
    with pytest.raises(StoreError, match=rf"id 'many3' is a duplicate of both '{want['many3']}' and '{other.id}'"):
        merge_stores(paths, out=root / "m2.h5", manifest=conflicting)
