"""The model interface: a family is one module plus a registration, and `model-info` describes
models without loading weights.

This module is itself a (fake) model family: it defines ``load`` and ``inspect`` as a
family's module must; its model implementing ``EmbeddingModel`` is the deterministic toy of
tests/helpers/fake_family_layout.py with a layout and weights of its own. The worker, the store writer
and ``embed_fasta`` run it end to end without knowing about it. Its
token layout has no special tokens at all (the worker follows the declared layout, so the
family need not copy ESM-2's BOS and EOS); tests/model/test_token_layout.py takes a family with
another layout through shard, workflow and CLI.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from embedpipe.cli import app
from embedpipe.core.options import EmbedOptions
from embedpipe.extraction.run import embed_fasta
from embedpipe.model import Family, ModelFacts, registry
from embedpipe.model.base import TokenLayout
from embedpipe.store import validate_store
from helpers import fake_family_layout as toy_family
from helpers.embed_helpers import random_sequences, read_store, write_fasta
from helpers.fake_family_layout import DIM, LAYERS

PREFIX = "fake:"
WINDOW = 50
LAYOUT = TokenLayout(bos=False, eos=False, window=WINDOW)  # residues only
#: the toy model of tests/helpers/fake_family_layout.py, with this family's layout and weights
TOY = toy_family.Toy(LAYOUT, letters="ACDEFGHIKLMNPQRSTVWY", seed=0)
reference = TOY.reference


def describe(spec: str) -> ModelFacts:
    return ModelFacts(family="fake", spec=spec, kind="name", name=spec.removeprefix(PREFIX),
                      trained_window=WINDOW, num_layers=LAYERS, embed_dim=DIM, trained=False, token_layout=LAYOUT)


def load(spec: str) -> toy_family.Model:  # the family module's loader
    return toy_family.Model(name=spec.removeprefix(PREFIX), toy=TOY, source="fake", sha256="0" * 64, family="fake",
                            provenance={"fair_esm_version": "none"})


def inspect(facts: ModelFacts) -> ModelFacts:  # the family module's header reader
    return facts


FAKE = Family("fake", lambda spec: spec.startswith(PREFIX), describe, lambda spec: spec.startswith(PREFIX), __name__)


@pytest.fixture
def fake_family(monkeypatch: pytest.MonkeyPatch) -> Family:
    monkeypatch.setattr(registry, "FAMILIES", list(registry.FAMILIES))
    registry.register(FAKE)
    return FAKE


def test_a_registered_family_embeds_a_fasta_through_the_interface_only(fake_family, tmp_path: Path) -> None:
    records = random_sequences(5, (5, 40), seed=4) + [("long", random_sequences(1, [130], seed=5)[0][1])]
    fasta = write_fasta(tmp_path / "in.fasta", records)
    out = tmp_path / "fake.h5"
    options = EmbedOptions(layers=(0, -1), per_residue=True, tokens_per_batch=120)
    embed_fasta(fasta, model="fake:toy", out=out, options=options, quiet=True)
    assert validate_store(out) == []
    store = read_store(out)
    assert store["attrs"]["model_name"] == "toy"
    assert store["attrs"]["trained_window_residues"] == WINDOW
    assert bool(store["attrs"]["model_trained"]) is False
    assert store["fields"]["long_handling"]["long"] == "chunked"
    for rid, seq in records:
        assert store["per_residue"][LAYERS][rid].shape == (len(seq), DIM)
        if len(seq) <= WINDOW:  # one window: exactly the numpy model on the sequence alone
            expected = reference(seq)
            for layer in (0, LAYERS):
                np.testing.assert_allclose(store["per_residue"][layer][rid], expected[layer], rtol=1e-5, atol=1e-6)
                np.testing.assert_allclose(store["mean"][layer][rid], expected[layer].mean(0), rtol=1e-5, atol=1e-6)
    # each token on its own: the stitched windows of the long record are the model on the whole
    whole = reference(records[-1][1])
    np.testing.assert_allclose(store["per_residue"][LAYERS]["long"], whole[LAYERS], rtol=1e-5, atol=1e-6)


def test_model_info_describes_a_registered_family(fake_family) -> None:
    result = CliRunner().invoke(app, ["model-info", "fake:toy", "--json"])
    assert result.exit_code == 0, result.output
    facts = json.loads(result.stdout)
    assert (facts["family"], facts["kind"], facts["name"], facts["num_layers"]) == ("fake", "name", "toy", LAYERS)
    assert facts["token_layout"] == {"bos": False, "eos": False, "window": WINDOW}


def _env(**extra: str) -> dict[str, str]:
    root = str(Path(__file__).resolve().parents[2])
    return os.environ | {"PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")} | extra


def test_model_info_for_a_name_reads_nothing_and_imports_no_torch(tmp_path: Path) -> None:
    """Offline with an empty cache: a name is described from the name table alone."""
    code = ("import sys\nfrom embedpipe.cli import run\nsys.argv = ['embedpipe', 'model-info', "
            "'esm2_t33_650M_UR50D', '--json']\ntry:\n    run()\nexcept SystemExit as exc:\n"
            "    print('torch' in sys.modules, exc.code, file=sys.stderr)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=_env(TORCH_HOME=str(tmp_path / "empty"), EMBEDPIPE_OFFLINE="1"))
    assert proc.stderr.split() == ["False", "0"], proc.stderr
    facts = json.loads(proc.stdout)
    assert facts == {
        "family": "esm2", "spec": "esm2_t33_650M_UR50D", "kind": "name", "name": "esm2_t33_650M_UR50D",
        "trained_window": 1022, "num_layers": 33, "embed_dim": 1280, "attention_heads": 20,
        "parameters": 651_043_254, "weights_bytes": 4 * 651_043_254, "trained": True, "host_mem_mb": 9728,
        "token_layout": {"bos": True, "eos": True, "window": 1022}, "packs": True,
    }
    assert not (tmp_path / "empty").exists()


def test_model_info_for_a_path_reads_the_header_not_the_weights(tiny_model_path: Path, monkeypatch) -> None:
    from embedpipe.model import esm2

    def no_build(*args, **kwargs):
        raise AssertionError("model-info built the model")

    monkeypatch.setattr(esm2, "build_model", no_build)
    result = CliRunner().invoke(app, ["model-info", str(tiny_model_path), "--json"])
    assert result.exit_code == 0, result.output
    facts = json.loads(result.stdout)
    assert (facts["kind"], facts["name"], facts["trained"]) == ("path", "esm2_tiny_t2_32", False)
    assert (facts["num_layers"], facts["embed_dim"], facts["attention_heads"]) == (2, 32, 4)
    monkeypatch.undo()
    loaded = registry.load_model(str(tiny_model_path))
    assert facts["parameters"] == sum(p.numel() for p in loaded.model.parameters())
    assert facts["weights_bytes"] == tiny_model_path.stat().st_size
    assert facts["host_mem_mb"] == 2560


def test_model_info_for_a_bad_path_is_one_line(tmp_path: Path) -> None:
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint")
    result = CliRunner().invoke(app, ["model-info", str(junk), "--json"])
    assert result.exit_code == 1
    assert "embedpipe: error:" in result.stderr and "cannot read checkpoint" in result.stderr


def test_describing_a_model_imports_no_torch() -> None:
    """The workflow describes the model while Snakemake parses the rules (in every job)."""
    code = ("import sys, embedpipe.model as m\nm.describe('esm2_t6_8M_UR50D')\nm.describe('missing.pt')\n"
            "print('torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=_env())
    assert proc.stdout.strip() == "False", proc.stderr
