"""--pooling mean|bos: BOS vectors against fair-esm's own forward, storage, merge, validate,
export, CLI and the fp32 fallback (docs/store-format.md, "Pooling")."""

from __future__ import annotations

import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest
from typer.testing import CliRunner

from embedpipe.cli import app
from embedpipe.core.errors import EmbedpipeError, StoreError
from embedpipe.export import export_store
from embedpipe.extraction.run import EmbedOptions, embed_fasta
from embedpipe.store import merge_stores, open_store, validate_store
from helpers.embed_helpers import fair_esm_bos, random_sequences, write_fasta

ARCHIVED_V1 = Path(__file__).resolve().parents[1] / "data" / "store-v1-example.h5"
LAYERS = (0, 1, 2)


def _embed(tmp_path: Path, model: Path, records, name: str, **options) -> Path:
    fasta = write_fasta(tmp_path / f"{name}.fasta", records)
    out = tmp_path / f"{name}.h5"
    embed_fasta(fasta, model=str(model), out=out, options=EmbedOptions(**options), quiet=True)
    return out


@pytest.fixture(scope="module")
def records():
    return random_sequences(5, (15, 60), seed=41)


@pytest.fixture(scope="module")
def both(tmp_path_factory, tiny_model_path, records) -> Path:
    """A store with mean and bos, every layer, one batch for all records."""
    return _embed(tmp_path_factory.mktemp("both"), tiny_model_path, records, "both",
                  layers=LAYERS, pooling=("mean", "bos"))


def _assert_bos_is_fair_esms(store_path: Path, model_path: Path, records, fair_esm_reference) -> None:
    model, alphabet = fair_esm_reference(model_path)
    with open_store(store_path) as store:
        assert store.pooling == ["mean", "bos"]
        for rid, seq in records:
            expected = fair_esm_bos(model, alphabet, seq, LAYERS)
            for k in LAYERS:
                got = store.mean_vector(rid, k, pooling="bos")
                np.testing.assert_allclose(got, expected[k], rtol=1e-5, atol=1e-5)


def test_bos_equals_fair_esms_token_0_in_one_batch_and_alone(tmp_path, both, tiny_model_path, records,
                                                             fair_esm_reference):
    _assert_bos_is_fair_esms(both, tiny_model_path, records, fair_esm_reference)
    alone = _embed(tmp_path, tiny_model_path, records[:1], "alone", layers=LAYERS, pooling=("bos",))
    _assert_bos_is_fair_esms(alone, tiny_model_path, records[:1], fair_esm_reference)
    with open_store(both) as a, open_store(alone) as b:
        np.testing.assert_allclose(a.mean_vector(records[0][0], pooling="bos"),
                                   b.mean_vector(records[0][0], pooling="bos"), rtol=1e-5, atol=1e-6)


def test_bos_of_a_chunked_record_is_its_first_windows(tmp_path, tiny_model_path, fair_esm_reference):
    records = random_sequences(2, [2500, 40], seed=42)
    path = _embed(tmp_path, tiny_model_path, records, "long", layers=LAYERS, pooling=("bos",))
    model, alphabet = fair_esm_reference(tiny_model_path)
    with open_store(path) as store:
        rec = store[records[0][0]]
        assert rec["long_handling"] == "chunked" and rec["windows"] > 1
        expected = fair_esm_bos(model, alphabet, records[0][1][:1022], LAYERS)
        for k in LAYERS:
            np.testing.assert_allclose(rec["bos"][k], expected[k], rtol=1e-5, atol=1e-5)


def test_adding_bos_leaves_the_mean_unchanged_and_reads_both(tmp_path, both, tiny_model_path, records):
    mean_only = _embed(tmp_path, tiny_model_path, records, "mean", layers=LAYERS)
    with open_store(both) as a, open_store(mean_only) as b:
        assert b.pooling == ["mean"] and "bos" not in b[records[0][0]]
        assert a.provenance["pooling"] == ["mean", "bos"]
        for k in LAYERS:
            np.testing.assert_array_equal(a.mean(k).compute(), b.mean(k).compute())
            np.testing.assert_array_equal(a.pooled(k).compute(), a.mean(k).compute())
            bos = a.pooled(k, "bos").compute()
            assert bos.shape == (len(records), a.dim) and bos.dtype == np.float32
            np.testing.assert_array_equal(a.mean_rows(slice(1, 3), k, pooling="bos"), bos[1:3])
            assert not np.allclose(bos, a.mean(k).compute())
        with pytest.raises(StoreError, match="--pooling bos"):
            b.pooled(pooling="bos")
    assert validate_store(both) == []


def test_a_store_without_bos_still_reads_validates_and_merges(tmp_path):
    with open_store(ARCHIVED_V1) as store:
        assert store.pooling == ["mean"]
        assert set(store[store.ids[0]]) >= {"mean"} and "bos" not in store[store.ids[0]]
    assert validate_store(ARCHIVED_V1) == []
    merge_stores([ARCHIVED_V1], out=tmp_path / "merged.h5")
    # merged stores get the mean check, which the archive's synthetic means fail by design
    # (docs/store-format.md, "Checking a store"); nothing else may be wrong
    problems = validate_store(tmp_path / "merged.h5")
    assert [p for p in problems if "stored mean differs" not in p] == []
    with open_store(tmp_path / "merged.h5") as merged:
        assert merged.pooling == ["mean"]


def test_merge_copies_bos_and_refuses_mixed_pooling(tmp_path, tiny_model_path):
    a_records = random_sequences(3, (15, 40), seed=43)
    b_records = [(f"b{rid}", seq) for rid, seq in random_sequences(3, (15, 40), seed=44)]
    a = _embed(tmp_path, tiny_model_path, a_records, "a", pooling=("mean", "bos"))
    b = _embed(tmp_path, tiny_model_path, b_records, "b", pooling=("bos",))
    merged = tmp_path / "merged.h5"
    merge_stores([a, b], out=merged)
    assert validate_store(merged) == []
    with open_store(merged) as m, open_store(a) as sa, open_store(b) as sb:
        assert m.pooling == ["mean", "bos"]
        for shard in (sa, sb):
            for rid in shard.ids:
                np.testing.assert_array_equal(m.mean_vector(rid, pooling="bos"), shard.mean_vector(rid, pooling="bos"))
    mean_only = _embed(tmp_path, tiny_model_path, [(f"c{r}", s) for r, s in a_records], "c")
    with pytest.raises(StoreError, match="pooling"):
        merge_stores([a, mean_only], out=tmp_path / "mixed.h5")


def test_validate_catches_a_non_finite_bos_value_and_a_pooling_mismatch(tmp_path, both):
    bad = tmp_path / "bad.h5"
    shutil.copy(both, bad)
    with h5py.File(bad, "r+") as f:
        f["bos/layer_2"][3, 5] = np.inf
    problems = validate_store(bad)
    assert any("bos/layer_2" in p and "non-finite" in p for p in problems), problems
    with h5py.File(bad, "r+") as f:
        del f["bos"]
    assert any("pooling attribute" in p for p in validate_store(bad))


@pytest.mark.parametrize("fmt", ["npy", "h5-per-id"])
def test_export_pooling_bos_round_trips(tmp_path, both, records, fmt):
    out = tmp_path / ("bos.npy" if fmt == "npy" else "bos.h5")
    summary = export_store(both, fmt=fmt, out=out, layer=1, pooling="bos", quiet=True)
    assert "bos vectors" in summary.render()
    with open_store(both) as store:
        expected = {rid: store.mean_vector(rid, 1, pooling="bos") for rid in store.ids}
    if fmt == "npy":
        ids = out.with_name("bos.ids.txt").read_text().split()
        got = dict(zip(ids, np.load(out)))
    else:
        with h5py.File(out, "r") as f:
            got = {f[k].attrs["original_id"]: f[k][()] for k in f}
            assert f.attrs["export_pooling"] == "bos"
    assert set(got) == set(expected)
    for rid, vec in expected.items():
        np.testing.assert_array_equal(got[rid], vec)


def test_export_pooling_bos_needs_a_store_with_bos(tmp_path):
    with pytest.raises(EmbedpipeError, match="no bos vectors"):
        export_store(ARCHIVED_V1, fmt="npy", out=tmp_path / "x.npy", pooling="bos", quiet=True)


def test_cli_accepts_repeated_pooling_for_embed_and_export(tmp_path, tiny_model_path, records):
    fasta = write_fasta(tmp_path / "cli.fasta", records[:2])
    out = tmp_path / "cli.h5"
    result = CliRunner().invoke(app, ["embed", str(fasta), "--model", str(tiny_model_path), "--out", str(out),
                                      "--pooling", "mean", "--pooling", "bos", "--quiet"])
    assert result.exit_code == 0, result.output
    with open_store(out) as store:
        assert store.pooling == ["mean", "bos"]
    result = CliRunner().invoke(app, ["export", str(out), "--format", "npy", "--out", str(tmp_path / "e.npy"),
                                      "--pooling", "bos", "--quiet"])
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(app, ["embed", str(fasta), "--model", str(tiny_model_path),
                                      "--out", str(tmp_path / "x.h5"), "--pooling", "cls"])
    assert result.exit_code != 0 and "--pooling must be one of mean, bos" in result.output


def test_fp16_overflow_at_bos_falls_back_to_fp32(tmp_path, model_factory, records, fair_esm_reference):
    """The BOS row of the embedding is 7e4: inf in fp16, finite in fp32."""
    path = model_factory(layers=2, dim=32, heads=4, seed=23, token_row_overrides={"<cls>": 7e4})
    store_path = _embed(tmp_path, path, records, "fp16", precision="fp16", layers=LAYERS, pooling=("bos",))
    with open_store(store_path) as store:
        table = store.records()
        assert set(table["precision_used"]) == {"fp32"} and set(table["fallback_reason"]) == {"nonfinite"}
    _assert_bos_is_fair_esms(store_path, path, records, fair_esm_reference)


def test_bos_beyond_the_storage_dtype_is_checked_before_writing(tmp_path, model_factory, records):
    """BOS at layer 0 is 0.88 x 8e4 = 70400: over float16's 65504 in fp32 too; the residues fit."""
    path = model_factory(layers=2, dim=32, heads=4, seed=24, token_row_overrides={"<cls>": 8e4})
    _embed(tmp_path, path, records, "mean16", layers=(0,), storage_dtype="float16")  # BOS not stored: fine
    with pytest.raises(EmbedpipeError, match="do not fit --storage-dtype float16"):
        _embed(tmp_path, path, records, "bos16", layers=(0,), storage_dtype="float16", pooling=("bos",))
