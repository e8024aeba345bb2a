"""T5 encoders (ProtT5, Ankh) through the whole pipeline: embed, the fp32 fallback, stores, the
workflow (issue 22, part 2).

Independent computations: transformers' own ``T5EncoderModel`` in fp32 on the same directory,
read as ProtTrans' ``prott5_embedder.py`` reads it (mean over the residue rows, ``</s>``
excluded), and embedpipe's own fp32 run for the fallback.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from test_t5 import hf_inputs, overflowing

from embedpipe.core.options import EmbedOptions
from embedpipe.extraction.run import embed_fasta
from embedpipe.model.random_hf import make_hf_test_model
from embedpipe.store import validate_store
from helpers.embed_helpers import overflowing_prot_t5, random_sequences, read_store, write_fasta

HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
needs_transformers = pytest.mark.skipif(not HAVE_TRANSFORMERS, reason="transformers is not installed")
RECORDS = [("a", "MKTAYIAKQRQISFVKSHFSRQ"), ("b", "ACDEFGHIKLMNPQRSTVWY"), ("rare", "UZOBXMKW"), ("w", "W")]


def transformers_fp32(directory: Path, family: str, seqs: list[str]) -> list[np.ndarray]:
    """Per-residue rows of the last hidden state (``</s>`` dropped), one record at a time."""
    from transformers import AutoTokenizer, T5EncoderModel

    model = T5EncoderModel.from_pretrained(str(directory), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    rows = []
    with torch.no_grad():
        for seq in seqs:
            out = model(**hf_inputs(tokenizer, family, [seq])).last_hidden_state[0]
            rows.append(out[: len(seq)].numpy())  # residues only: the recipe drops </s>
    return rows


def embed(directory: Path, tmp: Path, records, name: str, **options) -> dict:
    fasta = write_fasta(tmp / f"{name}.fasta", records)
    out = tmp / f"{name}.h5"
    embed_fasta(fasta, model=str(directory), out=out,
                options=EmbedOptions(device="cpu", tokens_per_batch=4096, **options), quiet=True)
    assert validate_store(out) == []
    return read_store(out)


def close(got: np.ndarray, want: np.ndarray, rel: float = 1e-5) -> None:
    assert float(np.abs(got - want).max()) <= rel * float(np.abs(want).max())


@pytest.mark.peer
@needs_transformers
@pytest.mark.parametrize("family", ["prot-t5", "ankh"])
def test_embed_end_to_end_equals_transformers(family: str, tmp_path: Path) -> None:
    directory = make_hf_test_model(tmp_path / family, family=family, layers=2, dim=32, heads=4, seed=1)
    store = embed(directory, tmp_path, RECORDS, "s", per_residue=True)
    assert (store["attrs"]["model_family"], bool(store["attrs"]["model_trained"])) == (family, False)
    assert store["attrs"]["batch_layout"] == "padded"
    want = transformers_fp32(directory, family, [s for _, s in RECORDS])
    last = int(store["attrs"]["model_num_layers"])
    for (rid, _seq), rows in zip(RECORDS, want):
        close(store["per_residue"][last][rid], rows)
        close(store["mean"][last][rid], rows.mean(0))


@pytest.mark.peer
@needs_transformers
def test_long_records_are_windowed_at_the_family_limit_with_one_eos_per_window(tmp_path: Path) -> None:
    """4100 residues: two 4096-residue windows (starts 0 and 4); window 0's kept rows (up to
    residue 2050) equal transformers on residues 0:4096 with one </s> and no BOS."""
    directory = make_hf_test_model(tmp_path / "pt5", family="prot-t5", layers=1, dim=16, heads=2, seed=2)
    seq = random_sequences(1, [4100], seed=3)[0][1]
    store = embed(directory, tmp_path, [("long", seq)], "long", per_residue=True)
    assert (store["fields"]["long_handling"]["long"], store["fields"]["windows"]["long"]) == ("chunked", 2)
    rows = store["per_residue"][1]["long"]
    assert rows.shape == (4100, 16)
    window0 = transformers_fp32(directory, "prot-t5", [seq[:4096]])[0]
    close(rows[:2050], window0[:2050])


def _fp16_overflows(tmp_path: Path) -> Path:
    base = make_hf_test_model(tmp_path / "base", family="prot-t5", layers=2, dim=32, heads=4, seed=5)
    return overflowing(base, 1e5, tmp_path / "big")


@pytest.mark.parametrize("policy", ["fp16", "fp16-mixed"])
def test_every_overflowing_record_falls_back_and_stores_fp32_values(policy: str, tmp_path: Path) -> None:
    big = _fp16_overflows(tmp_path)
    reference = embed(big, tmp_path, RECORDS, "fp32", per_residue=True)
    store = embed(big, tmp_path, RECORDS, policy, per_residue=True, precision=policy)
    assert int(store["attrs"]["fallback_count"]) == len(RECORDS)
    for rid, _ in RECORDS:
        assert store["fields"]["precision_used"][rid] == "fp32"
        assert store["fields"]["fallback_reason"][rid] == "nonfinite", rid
        for layer in store["mean"]:  # fp32's values (re-run alone: not bit-equal to a padded batch)
            close(store["mean"][layer][rid], reference["mean"][layer][rid])
            close(store["per_residue"][layer][rid], reference["per_residue"][layer][rid])
        assert float(store["fields"]["max_abs_activation"][rid]) != float(reference["fields"]["max_abs_activation"][rid])
    if HAVE_TRANSFORMERS:  # and fp32's values are transformers' fp32 ones
        want = transformers_fp32(big, "prot-t5", [s for _, s in RECORDS])
        for (rid, _), rows in zip(RECORDS, want):
            close(store["mean"][2][rid], rows.mean(0))


def test_a_batch_with_one_overflowing_record_falls_back_exactly_that_record(tmp_path: Path) -> None:
    """'C' embeds at 7e4 (inf in fp16): only the record with a C falls back, in one batch."""
    directory = overflowing_prot_t5(tmp_path / "c")
    records = [("clean1", "MKTAYIAK"), ("bad", "MKCAYIAKQRQ"), ("clean2", "GAVLIGAVLIW"), ("clean3", "PQRST")]
    reference = embed(directory, tmp_path, records, "fp32")
    store = embed(directory, tmp_path, records, "fp16", precision="fp16")
    assert int(store["attrs"]["fallback_count"]) == 1
    assert {rid: store["fields"]["fallback_reason"][rid] for rid, _ in records} == {
        "clean1": "", "bad": "nonfinite", "clean2": "", "clean3": ""}
    close(store["mean"][2]["bad"], reference["mean"][2]["bad"])
    for rid in ("clean1", "clean2", "clean3"):
        assert store["fields"]["precision_used"][rid] == "fp16"
        a, b = store["mean"][2][rid], reference["mean"][2][rid]
        assert float(np.dot(a, b) / np.linalg.norm(a) / np.linalg.norm(b)) > 0.99


def test_bos_pooling_of_a_t5_is_refused_in_one_line(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from embedpipe.cli import app

    directory = make_hf_test_model(tmp_path / "a", family="ankh", layers=1, dim=16, heads=2)
    fasta = write_fasta(tmp_path / "in.fasta", [("a", "MKTAYIAK")])
    for extra, env in ((["--pooling", "bos"], {}), ([], {"EMBEDPIPE_ENGINE": "batch_layout=packed"})):
        result = CliRunner().invoke(app, ["embed", str(fasta), "--model", str(directory), "--out",
                                          str(tmp_path / "o.h5"), "--device", "cpu", "--quiet", *extra], env=env)
        assert result.exit_code == 1 and len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert "the ankh family" in result.stderr and not (tmp_path / "o.h5").exists()


@pytest.mark.slow
def test_the_workflow_runs_a_t5_directory(tmp_path: Path) -> None:
    """model: a prot-t5 test directory; shards count one token per record; offline."""
    from helpers.workflow_helpers import _env, run_config

    directory = make_hf_test_model(tmp_path / "pt5", family="prot-t5", layers=1, dim=16, heads=2, seed=4)
    records = random_sequences(10, (20, 120), seed=6)
    write_fasta(tmp_path / "in.fasta", records)
    config = {"input": "in.fasta", "outdir": "out", "model": str(directory), "precision": "bf16", "layers": [-1],
              "per_residue": False, "device": "cpu", "tokens_per_batch": 1024, "tokens_per_shard": 400,
              "crosscheck": {"sample": 4, "seed": 0}, "exports": ["npy"]}
    env = _env(PYTHONPATH=str(Path(__file__).resolve().parents[1]) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    listing = run_config(tmp_path, config, env=env)
    assert listing["tokens_per_record"] == 1 and len(listing["shards"]) > 1
    merged = tmp_path / "out" / "embeddings.h5"
    assert validate_store(merged) == []
    with h5py.File(merged, "r") as f:
        assert (f.attrs["model_family"], f.attrs["precision_policy"]) == ("prot-t5", "bf16")
    report = json.loads((tmp_path / "out" / "crosscheck" / "crosscheck.json").read_text())
    assert report["verdict"] in ("pass", "warn"), report["verdict"]
    assert (tmp_path / "out" / "exports" / "embeddings.npy").is_file()
