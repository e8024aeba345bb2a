"""The embed options resolved once (embedpipe/extraction/resolved.py, docs/architecture.md "The embed
run"): the run predicted from a model's files and the one resolved from the loaded model agree,
and the identity a store records is the one ``resolve_run`` gives from plain values."""

from __future__ import annotations

import dataclasses

import h5py
import pytest
import torch

from embedpipe.core.errors import EmbedpipeError
from embedpipe.core.options import EmbedOptions
from embedpipe.extraction.resolved import resolve_run
from embedpipe.extraction.run import embed_fasta
from embedpipe.model import capabilities, load_model
from embedpipe.model.identity import ModelIdentity
from embedpipe.model.random_hf import make_hf_test_model
from embedpipe.model.registry import model_identity
from helpers.embed_helpers import random_sequences, write_fasta

CPU = torch.device("cpu")
OPTIONS = {"fp32": EmbedOptions(device="cpu", layers=(0, -1), per_residue=True, pooling=("bos",)),
           "bf16-mixed": EmbedOptions(precision="bf16-mixed", device="cpu", storage_dtype="float16"),
           "int8-smoothquant": EmbedOptions(precision="int8-mixed", int8_smoothing="smoothquant", device="cpu")}


@pytest.fixture(scope="module")
def models(tiny_model_path, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("resolved")
    return {"esm2": tiny_model_path,
            "prot-t5": make_hf_test_model(root / "t5", family="prot-t5", layers=2, dim=32, heads=4, seed=0)}


@pytest.mark.parametrize("family", ["esm2", "prot-t5"])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_the_run_predicted_from_the_files_equals_the_one_from_the_loaded_model(models, family, name):
    options = OPTIONS[name] if family == "esm2" or name != "fp32" else dataclasses.replace(OPTIONS[name], pooling=())
    facts = model_identity(str(models[family]))
    loaded = load_model(str(models[family]))
    assert facts is not None and facts.sha256 == loaded.sha256
    predicted = resolve_run(options, CPU, num_layers=loaded.num_layers, packs=facts.packs, model=facts,
                            width=loaded.embed_dim)
    resolved = resolve_run(options, CPU, num_layers=loaded.num_layers, packs=capabilities.packs(loaded), model=facts,
                           width=loaded.embed_dim)
    assert dataclasses.asdict(predicted) == dataclasses.asdict(resolved)
    assert resolved.batch_layout == "padded" and resolved.attention_inputs == "fp32"  # auto on the CPU
    assert resolved.layers[-1] == loaded.num_layers and resolved.pooling[0] == "mean"
    assert (resolved.calibration is not None) == (name == "int8-smoothquant")
    with pytest.raises(dataclasses.FrozenInstanceError):
        resolved.batch_layout = "packed"  # type: ignore[misc]


@pytest.mark.parametrize("name", list(OPTIONS))
def test_a_store_records_the_identity_resolve_run_gives_from_plain_values(tmp_path, models, name):
    fasta = write_fasta(tmp_path / "in.fasta", random_sequences(5, (10, 60), seed=3))
    out = tmp_path / "out.h5"
    embed_fasta(fasta, model=str(models["esm2"]), out=out, options=OPTIONS[name], quiet=True)
    facts = model_identity(str(models["esm2"]))
    assert facts is not None
    with h5py.File(out, "r") as f:
        stored = f.attrs["embed_identity"]
        num_layers, width = int(f.attrs["model_num_layers"]), int(f.attrs["dim"])
    run = resolve_run(OPTIONS[name], CPU, num_layers=num_layers, packs=facts.packs, model=facts, width=width)
    assert stored == run.identity


def test_a_bad_option_is_refused_before_anything_resolves():
    with pytest.raises(EmbedpipeError, match="unknown precision policy 'fp8'"):
        resolve_run(EmbedOptions(precision="fp8"), CPU, num_layers=2, packs=True, model=ModelIdentity("0" * 64, True))
