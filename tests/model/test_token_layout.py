"""A model family with another token layout (no BOS, one EOS, a 512-residue window), taken
through shard token counts, batching, pooling, storing, the CLI and the workflow (issue 21).

The family is tests/helpers/fake_family_layout.py, registered the way any outside family is
(``EMBEDPIPE_MODEL_FAMILIES``); nothing in embedpipe knows it. The independent computation
is its numpy :func:`~fake_family_layout.reference` on each record's residues alone.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import h5py
import numpy as np
import pytest
from typer.testing import CliRunner

from embedpipe.cli import app
from embedpipe.core.options import EmbedOptions
from embedpipe.extraction.run import embed_fasta
from embedpipe.model import registry
from embedpipe.model.plugins import ENV
from embedpipe.store import validate_store
from helpers import fake_family_layout as fake
from helpers.embed_helpers import random_sequences, read_store, write_fasta
from helpers.engine import embedder_for

SPEC = fake.PREFIX + "toy"
TESTS = Path(__file__).resolve().parents[1]


@pytest.fixture
def family(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "FAMILIES", list(registry.FAMILIES))
    monkeypatch.setenv(ENV, fake.__name__)


def test_the_family_is_registered_from_the_environment(family) -> None:
    facts = registry.describe(SPEC)
    assert (facts.family, facts.token_layout.extra_tokens, facts.token_layout.first_residue) == (fake.NAME, 1, 0)


def test_shard_counts_the_family_tokens_per_record(family, tmp_path: Path) -> None:
    """Four records of 99 residues under a 200-token budget: 100 tokens each with one EOS (two
    per shard); ESM-2's 101 would give four shards."""
    records = random_sequences(4, [99] * 4, seed=1)
    fasta = write_fasta(tmp_path / "in.fasta", records)
    result = CliRunner().invoke(app, ["shard", str(fasta), "--out", str(tmp_path / "s"), "--tokens-per-shard", "200",
                                      "--model", SPEC, "--quiet"])
    assert result.exit_code == 0, result.output
    listing = json.loads((tmp_path / "s" / "shards.json").read_text())
    assert listing["tokens_per_record"] == 1
    assert [(s["records"], s["tokens"]) for s in listing["shards"]] == [(2, 200), (2, 200)]
    default = CliRunner().invoke(app, ["shard", str(fasta), "--out", str(tmp_path / "e"), "--tokens-per-shard", "200",
                                       "--quiet"])
    assert default.exit_code == 0 and len(json.loads((tmp_path / "e" / "shards.json").read_text())["shards"]) == 4


def test_batches_pool_and_store_follow_the_layout(family, tmp_path: Path) -> None:
    """Two 511-residue records are 512 tokens each: one 1024-token batch, tokenized 512 wide.
    Pooling starts at row 0 and stops before EOS; a 700-residue record is cut at 512."""
    records = [("a", random_sequences(1, [511], seed=2)[0][1]), ("b", random_sequences(1, [511], seed=3)[0][1]),
               ("long", random_sequences(1, [700], seed=4)[0][1])] + random_sequences(4, (3, 40), seed=5)
    loaded = registry.load_model(SPEC)
    embedder = embedder_for(loaded, EmbedOptions(tokens_per_batch=1024, device="cpu"), loaded_device())
    plan = embedder.plan(records)
    pieces = [p for batch in plan.batches for p in batch]
    assert all(p.tokens == p.residues + 1 for p in pieces)
    assert [0, 1] in [sorted(p.record for p in batch) for batch in plan.batches]  # 2 x 512 tokens fit 1024
    assert sorted(p.residues for p in pieces if p.record == 2) == [512, 512]  # the family's window
    assert len(list(embedder.embed(records, plan))) == len(records)
    assert loaded.seen_widths == [max(p.tokens for p in batch) for batch in plan.batches]  # no BOS column

    fasta = write_fasta(tmp_path / "in.fasta", records)
    out = tmp_path / "fake.h5"
    embed_fasta(fasta, model=SPEC, out=out, options=EmbedOptions(layers=(0, -1), per_residue=True,
                                                                 tokens_per_batch=1024, device="cpu"), quiet=True)
    assert validate_store(out) == []
    store = read_store(out)
    assert store["attrs"]["model_family"] == fake.NAME
    assert (store["fields"]["long_handling"]["long"], int(store["fields"]["windows"]["long"])) == ("chunked", 2)
    for rid, seq in records:
        want = fake.reference(seq)  # each token on its own: the stitched windows equal the whole
        for layer in (0, fake.LAYERS):
            np.testing.assert_allclose(store["per_residue"][layer][rid], want[layer], rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(store["mean"][layer][rid], want[layer].mean(0), rtol=1e-5, atol=1e-6)


def loaded_device():
    import torch

    return torch.device("cpu")


def test_bos_pooling_is_refused_in_one_line(family, tmp_path: Path) -> None:
    fasta = write_fasta(tmp_path / "in.fasta", [("a", "MKTAYIAK")])
    result = CliRunner().invoke(app, ["embed", str(fasta), "--model", SPEC, "--out", str(tmp_path / "o.h5"),
                                      "--pooling", "bos", "--device", "cpu", "--quiet"])
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines() == [
        "embedpipe: error: --pooling bos: the fake-layout family has no BOS token (its token layout puts none "
        "before the residues); store the mean or per-residue vectors"]
    assert not (tmp_path / "o.h5").exists()


@pytest.mark.slow
def test_the_workflow_runs_the_family(tmp_path: Path) -> None:
    """shard (one token per record), embed, merge, crosscheck and export, offline."""
    from helpers.workflow_helpers import _env, run_config

    records = random_sequences(12, (20, 120), seed=6) + [("long", random_sequences(1, [600], seed=7)[0][1])]
    write_fasta(tmp_path / "in.fasta", records)
    config = {"input": "in.fasta", "outdir": "out", "model": SPEC, "precision": "fp32", "layers": [-1],
              "per_residue": True, "device": "cpu", "tokens_per_batch": 1024, "tokens_per_shard": 700,
              "crosscheck": {"sample": 4, "seed": 0}, "exports": ["npy"]}
    env = _env(**{ENV: fake.__name__, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)])})
    listing = run_config(tmp_path, config, env=env)
    assert listing["tokens_per_record"] == 1 and len(listing["shards"]) > 1
    assert all(s["tokens"] == s["residues"] + s["records"] for s in listing["shards"])
    merged = tmp_path / "out" / "embeddings.h5"
    assert validate_store(merged) == []
    import embedpipe

    with embedpipe.open_store(merged) as store:
        for rid, seq in records:
            want = fake.reference(seq)[fake.LAYERS]
            np.testing.assert_allclose(store.mean_vector(rid), want.mean(0), rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(store.per_residue(rid), want, rtol=1e-5, atol=1e-6)
    report = json.loads((tmp_path / "out" / "crosscheck" / "crosscheck.json").read_text())
    assert report["verdict"] == "pass", report["verdict"]
    with h5py.File(merged, "r") as f:
        assert f.attrs["model_family"] == fake.NAME
    assert (tmp_path / "out" / "exports" / "embeddings.npy").is_file()
