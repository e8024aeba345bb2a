"""A group of shards in one embed job (`embedpipe embed SHARD... --out-dir DIR`): one model
load, a store per shard equal to embedding that shard alone, and resume at shard granularity
(complete stores of the same shard, model and options are kept; missing, incomplete or
different ones are embedded again). Also the group plan in shards.json (`--max-jobs`)."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import embedpipe.extraction.job as job_module
import embedpipe.extraction.run as embed_module
from embedpipe.cli import app
from embedpipe.core.errors import EmbedpipeError, InputError
from embedpipe.core.options import EmbedOptions
from embedpipe.extraction.identity import embed_identity
from embedpipe.extraction.run import embed_fasta, embed_shards
from embedpipe.runtime.platform import describe as describe_platform
from embedpipe.runtime.precision import get_policy
from embedpipe.shard.passes import plan_groups, shard_fasta
from helpers.embed_helpers import random_sequences, write_fasta
from helpers.stores import store_uuid

OPTIONS = EmbedOptions(per_residue=True, device="cpu", layers=(0, -1))


def _shards(tmp: Path, n: int = 3) -> list[Path]:
    return [write_fasta(tmp / f"shard-{k:05d}.fasta", random_sequences(4, (8, 50), seed=10 + k)) for k in range(n)]


def _arrays(path: Path) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: out.__setitem__(name, obj[()]) if isinstance(obj, h5py.Dataset) else None)
    return out



def _count_loads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    loads: list[str] = []
    real = job_module.load_model

    def counting(spec: str):
        loads.append(spec)
        return real(spec)

    monkeypatch.setattr(job_module, "load_model", counting)
    return loads


def test_group_stores_equal_each_shard_embedded_alone(tmp_path, tiny_model_path, monkeypatch):
    shards = _shards(tmp_path)
    loads = _count_loads(monkeypatch)
    done = tmp_path / "stores" / "group-00000.json"
    summary = embed_shards(shards, model=str(tiny_model_path), out_dir=tmp_path / "stores", options=OPTIONS,
                           done=done, quiet=True)
    assert loads == [str(tiny_model_path)]  # one model load for the whole group
    assert (len(summary.embedded), len(summary.kept)) == (3, 0)
    listing = json.loads(done.read_text())
    assert [Path(s["store"]).name for s in listing["stores"]] == [f"shard-{k:05d}.h5" for k in range(3)]
    for shard in shards:
        alone = tmp_path / f"alone-{shard.stem}.h5"
        embed_fasta(shard, model=str(tiny_model_path), out=alone, options=OPTIONS, quiet=True)
        grouped, single = _arrays(tmp_path / "stores" / f"{shard.stem}.h5"), _arrays(alone)
        assert sorted(grouped) == sorted(single)
        for name in single:
            np.testing.assert_array_equal(grouped[name], single[name], err_msg=name)


def test_complete_stores_are_kept_missing_and_incomplete_ones_redone(tmp_path, tiny_model_path, monkeypatch):
    shards = _shards(tmp_path)
    out = tmp_path / "stores"
    embed_shards(shards, model=str(tiny_model_path), out_dir=out, options=OPTIONS, quiet=True)
    stores = [out / f"{s.stem}.h5" for s in shards]
    before = [(store_uuid(p), p.stat().st_mtime_ns) for p in stores]
    stores[1].unlink()  # missing
    with h5py.File(stores[2], "r+") as f:  # incomplete: a writer that never finished
        f.attrs["complete"] = False
    # A retry runs with a smaller batch and other threads: that keeps the finished stores.
    retry = EmbedOptions(**{**OPTIONS.__dict__, "tokens_per_batch": 100, "threads": 1})
    summary = embed_shards(shards, model=str(tiny_model_path), out_dir=out, options=retry, quiet=True)
    assert summary.kept == [stores[0]]
    assert [s.out for s in summary.embedded] == stores[1:]
    assert (store_uuid(stores[0]), stores[0].stat().st_mtime_ns) == before[0]
    assert store_uuid(stores[2]) != before[2][0]
    on_cpu = {"device_type": "cpu", "batch_layout": "padded", "attention_inputs": "float32"}
    identity = embed_identity(OPTIONS, get_policy(OPTIONS.precision), _model(tiny_model_path), on_cpu, [0, 2],
                              ["mean"], calibration=None, platform=describe_platform(torch.device("cpu")), attention="sdpa")
    assert all(embed_module.store_is_current(p, identity, _input(p))
               for p in stores)


def _model(path: Path):
    """The model's part of the identity (weights sha256, family version: embedpipe.model.identity)."""
    from embedpipe.model.registry import model_identity

    return model_identity(str(path))


def _input(store: Path) -> str:
    with h5py.File(store, "r") as f:
        return str(f.attrs["input_sha256"])


@pytest.mark.parametrize("change", ["options", "model", "shard"])
def test_a_store_of_other_options_model_or_shard_content_is_embedded_again(
        tmp_path, tiny_model_path, model_factory, change):
    shards = _shards(tmp_path, 2)
    out = tmp_path / "stores"
    embed_shards(shards, model=str(tiny_model_path), out_dir=out, options=OPTIONS, quiet=True)
    before = store_uuid(out / "shard-00000.h5")
    model, options = tiny_model_path, OPTIONS
    if change == "options":
        options = EmbedOptions(**{**OPTIONS.__dict__, "storage_dtype": "float16"})
    elif change == "model":
        model = model_factory(seed=1)
    else:
        write_fasta(shards[0], random_sequences(4, (8, 50), seed=99))
        write_fasta(shards[1], random_sequences(4, (8, 50), seed=11))  # same content as before
    summary = embed_shards(shards, model=str(model), out_dir=out, options=options, quiet=True)
    assert store_uuid(out / "shard-00000.h5") != before
    assert len(summary.embedded) == (1 if change == "shard" else 2)


def test_a_store_computed_padded_is_not_kept_where_auto_means_packed(tmp_path, tiny_model_path, monkeypatch):
    """The same options (``auto``) on another device are other numbers: the identity holds what
    ``auto`` resolved to. The second job pretends the varlen kernel runs (a CPU stand-in)."""
    from embedpipe.runtime import cuda
    from embedpipe.runtime.packed import per_sequence_attention

    shards = _shards(tmp_path, 1)
    out = tmp_path / "stores"
    options = EmbedOptions(**{**OPTIONS.__dict__, "precision": "bf16-mixed"})
    monkeypatch.setenv("EMBEDPIPE_ENGINE", "attention_inputs=compute")
    embed_shards(shards, model=str(tiny_model_path), out_dir=out, options=options, quiet=True)
    before = store_uuid(out / "shard-00000.h5")
    assert embed_shards(shards, model=str(tiny_model_path), out_dir=out, options=options, quiet=True).kept
    monkeypatch.setattr(cuda, "varlen_available", lambda device, dtype: dtype in cuda.VARLEN_DTYPES)
    monkeypatch.setattr(cuda, "varlen_attention",
                        lambda q, k, v, offsets, max_len: per_sequence_attention(q, k, v, offsets.tolist()))
    summary = embed_shards(shards, model=str(tiny_model_path), out_dir=out, options=options, quiet=True)
    assert len(summary.embedded) == 1 and store_uuid(out / "shard-00000.h5") != before
    with h5py.File(out / "shard-00000.h5", "r") as f:
        assert f.attrs["attention_path"] == "packed-varlen-flash" and f.attrs["batch_layout"] == "packed"


def test_a_group_prepares_its_model_once_for_every_shard(tmp_path, tiny_model_path, monkeypatch):
    """One embedder per group job: the low-precision copy of the model is made once, not per shard."""
    from embedpipe.model.esm2 import Esm2Model

    real = Esm2Model.prepare
    prepared: list[str] = []
    monkeypatch.setattr(Esm2Model, "prepare", lambda self, policy, *a, **k: (prepared.append(policy.name),
                                                                           real(self, policy, *a, **k))[1])
    options = EmbedOptions(**{**OPTIONS.__dict__, "precision": "bf16-mixed"})
    summary = embed_shards(_shards(tmp_path, 3), model=str(tiny_model_path), out_dir=tmp_path / "stores",
                           options=options, quiet=True)
    assert len(summary.embedded) == 3 and prepared == ["bf16-mixed"]
    for store in summary.embedded:
        with h5py.File(store.out, "r") as f:  # per-shard counters start again
            assert f.attrs["fallback_count"] == 0 and len(f["ids"]) == 4


def test_cli_group_and_the_single_store_contract(tmp_path, tiny_model_path):
    shards = _shards(tmp_path, 2)
    runner = CliRunner()
    args = ["embed", *map(str, shards), "--model", str(tiny_model_path), "--device", "cpu"]
    result = runner.invoke(app, [*args, "--out-dir", str(tmp_path / "st"), "--done", str(tmp_path / "g.json")])
    assert result.exit_code == 0, result.output
    assert "2 embedded, 0 kept" in result.output and (tmp_path / "g.json").is_file()
    result = runner.invoke(app, [*args, "--out-dir", str(tmp_path / "st")])
    assert result.exit_code == 0 and "0 embedded, 2 kept" in result.output, result.output
    for bad in ([*args, "--out", str(tmp_path / "x.h5")], [*args[:2], *args[3:]]):
        result = runner.invoke(app, bad)
        assert result.exit_code != 0 and "--out" in result.output, result.output
    result = runner.invoke(app, [*args[:2], *args[3:], "--out", str(tmp_path / "one.h5")])
    assert result.exit_code == 0 and "embedded 4 records" in result.output, result.output


def test_two_shards_with_one_store_name_are_refused(tmp_path, tiny_model_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    shards = [write_fasta(tmp_path / d / "shard-00000.fasta", random_sequences(2, (8, 20))) for d in "ab"]
    with pytest.raises(EmbedpipeError, match="same file name"):
        embed_shards(shards, model=str(tiny_model_path), out_dir=tmp_path / "st", options=OPTIONS, quiet=True)


@pytest.mark.parametrize("n_shards", [0, 1, 5, 999, 1000, 1001, 16_100])
@pytest.mark.parametrize("max_jobs", [1, 7, 1000])
def test_groups_cover_every_shard_once_in_order_within_max_jobs(n_shards, max_jobs):
    groups = plan_groups(n_shards, max_jobs)
    assert [k for g in groups for k in g] == list(range(n_shards))
    assert len(groups) == min(n_shards, max_jobs) and all(groups)
    sizes = [len(g) for g in groups]
    assert not sizes or max(sizes) - min(sizes) <= 1


def test_shards_json_lists_the_groups(tmp_path):
    fasta = write_fasta(tmp_path / "in.fasta", random_sequences(40, (20, 60), seed=3))
    summary = shard_fasta([fasta], out=tmp_path / "shards", tokens_per_shard=200, max_jobs=4, quiet=True)
    listing = json.loads((tmp_path / "shards" / "shards.json").read_text())
    assert summary.n_shards > 4
    assert listing["max_jobs"] == 4 and listing["groups"] == plan_groups(summary.n_shards, 4)
    with pytest.raises(InputError, match="max-jobs"):
        shard_fasta([fasta], out=tmp_path / "other", tokens_per_shard=200, max_jobs=0, quiet=True)
