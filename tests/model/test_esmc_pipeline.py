"""ESM C through the whole pipeline (issue 33): embed in both batch layouts, the fp32 fallback
where fp16 overflows, the workflow.

Independent computations: transformers' ``EsmcModel`` (eager, fp32) on the same directory, its
residue rows (``<cls>`` and ``<eos>`` dropped) one record at a time, and a forward pre-hook on its
final norm showing that every record's stream passes 65504 before it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from test_t5_pipeline import close, embed  # the same store-writing run and relative check

from embedpipe.model.random_hf import make_hf_test_model
from embedpipe.store import validate_store
from helpers.embed_helpers import random_sequences, write_fasta
from helpers.engine import engine_override
from helpers.stores import cosine

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.peer

RECORDS = [("a", "MKTAYIAKQRQISFVKSHFSRQ"), ("b", "ACDEFGHIKLMNPQRSTVWY"), ("rare", "UZOBXMKW"), ("w", "W")]
FP16_MAX = 65504.0


def transformers_fp32(directory: Path, seqs: list[str]) -> tuple[list[list[np.ndarray]], list[float]]:
    """Per layer, per record: the residue rows; and each record's largest |stream| entering the final norm."""
    model = transformers.EsmcModel.from_pretrained(str(directory), attn_implementation="eager",
                                                   dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory))
    before_norm: list[float] = []
    hook = model.norm.register_forward_pre_hook(lambda _, args: before_norm.append(float(args[0].abs().max())))
    rows = []
    with torch.no_grad():
        for seq in seqs:
            out = model(**tokenizer([seq], return_tensors="pt"), output_hidden_states=True)
            rows.append([h[0, 1 : 1 + len(seq)].numpy() for h in out.hidden_states])
    hook.remove()
    return [list(layer) for layer in zip(*rows)], before_norm


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_embed_end_to_end_equals_transformers(layout: str, tmp_path: Path) -> None:
    directory = make_hf_test_model(tmp_path / "m", family="esmc", layers=2, dim=32, heads=4, seed=1)
    with engine_override(batch_layout=layout):
        store = embed(directory, tmp_path, RECORDS, "s", per_residue=True, layers=(0, 1, 2))
    attrs = store["attrs"]
    assert (attrs["model_family"], bool(attrs["model_trained"]), attrs["batch_layout"]) == ("esmc", False, layout)
    want, _ = transformers_fp32(directory, [s for _, s in RECORDS])
    for layer, per_record in enumerate(want):
        for (rid, _seq), rows in zip(RECORDS, per_record):
            close(store["per_residue"][layer][rid], rows)
            close(store["mean"][layer][rid], rows.mean(0))
    assert json.loads(attrs["embed_identity"])["model_family"] == "esmc v1"


def _overflowing(tmp_path: Path) -> Path:
    """An ESM C whose last feed-forward is scaled so that fp16 cannot hold its stream."""
    from safetensors.torch import load_file, save_file

    base = make_hf_test_model(tmp_path / "base", family="esmc", layers=2, dim=32, heads=4, seed=5)
    big = tmp_path / "big"
    shutil.copytree(base, big)
    state = load_file(str(big / "model.safetensors"))
    state["layers.1.mlp.down_proj.weight"] *= 1e5
    save_file(state, str(big / "model.safetensors"))
    return big


@pytest.mark.parametrize("policy", ["fp16", "fp16-mixed"])
def test_every_overflowing_record_falls_back_and_stores_fp32_values(policy: str, tmp_path: Path) -> None:
    big = _overflowing(tmp_path)
    want, before_norm = transformers_fp32(big, [s for _, s in RECORDS])
    assert min(before_norm) > FP16_MAX  # every record passes fp16's largest value in fp32
    reference = embed(big, tmp_path, RECORDS, "fp32", per_residue=True)
    store = embed(big, tmp_path, RECORDS, policy, per_residue=True, precision=policy)
    assert int(store["attrs"]["fallback_count"]) == len(RECORDS)
    for (rid, _), rows in zip(RECORDS, want[-1]):
        assert store["fields"]["precision_used"][rid] == "fp32"
        assert store["fields"]["fallback_reason"][rid] == "nonfinite", rid  # fp16 linears overflow to inf
        for layer in store["mean"]:
            close(store["mean"][layer][rid], reference["mean"][layer][rid])
            close(store["per_residue"][layer][rid], reference["per_residue"][layer][rid])
        close(store["mean"][2][rid], rows.mean(0))  # and fp32's values are transformers' fp32 ones


def _big_c(directory: Path, value: float) -> Path:
    """A 2-layer ESM C test directory whose 'C' embeds at ``value`` in every channel."""
    from safetensors.torch import load_file, save_file

    from embedpipe.model.esmc_spec import VOCABULARY

    make_hf_test_model(directory, family="esmc", layers=2, dim=32, heads=4, seed=2)
    state = load_file(str(directory / "model.safetensors"))
    state["embed_tokens.weight"][VOCABULARY.index("C")] = value
    save_file(state, str(directory / "model.safetensors"))
    return directory


MIXED_BATCH = [("clean1", "MKTAYIAK"), ("bad", "MKCAYIAKQRQ"), ("clean2", "GAVLIGAVLIW"), ("clean3", "PQRST")]


@pytest.mark.parametrize(("policy", "value", "margin", "reason"), [
    ("fp16", 7e4, None, "nonfinite"),  # inf once cast to fp16
    ("fp16-mixed", 4e4, 0.5, "overflow-margin"),  # finite, but past half of 65504 in the fp32 stream
], ids=["fp16-inf", "fp16-mixed-margin"])
def test_a_batch_with_one_overflowing_record_falls_back_exactly_that_record(
        tmp_path: Path, policy: str, value: float, margin: float | None, reason: str) -> None:
    """Only the record with a 'C' falls back, in one batch, and stores fp32's values."""
    directory = _big_c(tmp_path / "c", value)
    reference = embed(directory, tmp_path, MIXED_BATCH, "fp32")
    store = embed(directory, tmp_path, MIXED_BATCH, policy, precision=policy, overflow_margin=margin)
    assert int(store["attrs"]["fallback_count"]) == 1
    assert {rid: store["fields"]["fallback_reason"][rid] for rid, _ in MIXED_BATCH} == {
        "clean1": "", "bad": reason, "clean2": "", "clean3": ""}
    close(store["mean"][2]["bad"], reference["mean"][2]["bad"])
    for rid in ("clean1", "clean2", "clean3"):
        assert store["fields"]["precision_used"][rid] == policy
        assert cosine(store["mean"][2][rid], reference["mean"][2][rid]) > 0.99


@pytest.mark.slow
def test_the_workflow_runs_an_esmc_directory(tmp_path: Path) -> None:
    """model: an ESM C test directory; shards count BOS and EOS; offline."""
    from helpers.workflow_helpers import _env, run_config

    directory = make_hf_test_model(tmp_path / "esmc", family="esmc", layers=1, dim=16, heads=2, seed=4)
    write_fasta(tmp_path / "in.fasta", random_sequences(10, (20, 120), seed=6))
    config = {"input": "in.fasta", "outdir": "out", "model": str(directory), "precision": "bf16-mixed",
              "layers": [-1], "per_residue": False, "device": "cpu", "tokens_per_batch": 1024,
              "tokens_per_shard": 400, "crosscheck": {"sample": 4, "seed": 0}, "exports": ["npy"]}
    env = _env(PYTHONPATH=str(Path(__file__).resolve().parents[1]) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    listing = run_config(tmp_path, config, env=env)
    assert listing["tokens_per_record"] == 2 and len(listing["shards"]) > 1
    merged = tmp_path / "out" / "embeddings.h5"
    assert validate_store(merged) == []
    with h5py.File(merged, "r") as f:
        assert (f.attrs["model_family"], f.attrs["precision_policy"]) == ("esmc", "bf16-mixed")
    report = json.loads((tmp_path / "out" / "crosscheck" / "crosscheck.json").read_text())
    assert report["verdict"] in ("pass", "warn"), report["verdict"]
    assert (tmp_path / "out" / "exports" / "embeddings.npy").is_file()
