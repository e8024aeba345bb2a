"""Group embed jobs on one --out-dir (issue 19, B): a store locked by another job is refused in
one line naming the holder; a store replaced by another writer during the job leaves no marker;
a complete-looking store with a corrupt chunk is embedded again, not kept; the marker's stamps
say when a store was deleted or replaced since."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import h5py
import numpy as np
import pytest

import embedpipe.extraction.run as embed_module
from embedpipe.core.errors import EmbedpipeError
from embedpipe.core.locks import LockedError, acquire
from embedpipe.core.options import EmbedOptions
from embedpipe.extraction.group_marker import marker_problem
from embedpipe.extraction.run import embed_shards
from embedpipe.store.validate import validate_store
from helpers.embed_helpers import random_sequences, write_fasta
from helpers.stores import store_uuid

OPTIONS = EmbedOptions(per_residue=True, device="cpu", layers=(-1,))


def _shards(tmp: Path, n: int = 2) -> list[Path]:
    return [write_fasta(tmp / f"shard-{k:05d}.fasta", random_sequences(4, (8, 40), seed=30 + k)) for k in range(n)]



def _corrupt_first_chunk(store: Path, dataset: str) -> None:
    """Flip bytes inside the first stored chunk of ``dataset`` (fletcher32 must catch it)."""
    with h5py.File(store, "r") as f:
        info = f[dataset].id.get_chunk_info(0)
    with open(store, "r+b") as fh:
        fh.seek(info.byte_offset + 4)
        raw = bytearray(fh.read(8))
        fh.seek(info.byte_offset + 4)
        fh.write(bytes(b ^ 0xFF for b in raw))


def test_a_store_locked_by_another_job_is_refused_naming_the_holder(tmp_path, tiny_model_path):
    shards = _shards(tmp_path)
    out = tmp_path / "stores"
    holder = acquire(out / ".shard-00001.h5.lock", "stand-in for a running job")  # as a job running now
    try:
        with pytest.raises(LockedError) as err:
            embed_shards(shards, model=str(tiny_model_path), out_dir=out, options=OPTIONS,
                         done=out / "group-00000.json", quiet=True)
    finally:
        holder.close()
    message = str(err.value)
    assert "\n" not in message and "shard-00001.h5" in message
    assert f"pid {os.getpid()} on host {socket.gethostname()}" in message
    assert not (out / "group-00000.json").exists() and not list(out.glob("*.h5"))
    # the holder gone (the kernel drops the lock of a dead process): the same job now runs
    embed_shards(shards, model=str(tiny_model_path), out_dir=out, options=OPTIONS,
                 done=out / "group-00000.json", quiet=True)
    assert marker_problem(out / "group-00000.json") is None


def test_a_store_replaced_during_the_job_leaves_no_marker(tmp_path, tiny_model_path, monkeypatch):
    """A float16 writer replaces shard 0's store while this float32 job embeds shard 1."""
    shards = _shards(tmp_path)
    out = tmp_path / "stores"
    other = tmp_path / "other"
    embed_shards(shards[:1], model=str(tiny_model_path), out_dir=other, quiet=True,
                 options=EmbedOptions(per_residue=True, device="cpu", layers=(-1,), storage_dtype="float16"))
    real = embed_module._embed_records

    def embed_then_replace(embedder, records, fasta, store, *args):
        summary = real(embedder, records, fasta, store, *args)
        if store.name == "shard-00001.h5":
            os.replace(other / "shard-00000.h5", out / "shard-00000.h5")
        return summary

    monkeypatch.setattr(embed_module, "_embed_records", embed_then_replace)
    with pytest.raises(EmbedpipeError, match="shard-00000.h5: replaced by another writer"):
        embed_shards(shards, model=str(tiny_model_path), out_dir=out, options=OPTIONS,
                     done=out / "group-00000.json", quiet=True)
    assert not (out / "group-00000.json").exists()


@pytest.mark.parametrize("dataset", ["mean/layer_2", "per_residue/layer_2"])
def test_a_complete_store_with_a_corrupt_chunk_is_embedded_again(tmp_path, tiny_model_path, dataset):
    shards = _shards(tmp_path)
    out = tmp_path / "stores"
    done = out / "group-00000.json"
    embed_shards(shards, model=str(tiny_model_path), out_dir=out, options=OPTIONS, done=done, quiet=True)
    store = out / "shard-00000.h5"
    with h5py.File(store, "r") as f:
        good = f[dataset][()]
    before = store_uuid(store)
    _corrupt_first_chunk(store, dataset)
    assert validate_store(store), "the corruption is not visible to validate"
    summary = embed_shards(shards, model=str(tiny_model_path), out_dir=out, options=OPTIONS, done=done, quiet=True)
    assert [p.name for p in summary.kept] == ["shard-00001.h5"]
    assert store_uuid(store) != before and validate_store(store) == []
    with h5py.File(store, "r") as f:
        np.testing.assert_array_equal(f[dataset][()], good)
    assert marker_problem(done) is None


def test_the_marker_goes_stale_when_a_store_is_deleted_or_replaced(tmp_path, tiny_model_path):
    shards = _shards(tmp_path)
    out = tmp_path / "stores"
    done = out / "group-00000.json"
    embed_shards(shards, model=str(tiny_model_path), out_dir=out, options=OPTIONS, done=done, quiet=True)
    listing = json.loads(done.read_text())
    assert listing["format"] == "embedpipe.embed.run-group"  # what earlier releases wrote: their markers still hold
    assert [e["stamp"]["path"] for e in listing["stores"]] == ["shard-00000.h5", "shard-00001.h5"]
    assert all(e["stamp"]["store_uuid"] == store_uuid(out / e["stamp"]["path"]) for e in listing["stores"])
    assert marker_problem(done) is None
    copy = tmp_path / "copy.h5"
    copy.write_bytes((out / "shard-00001.h5").read_bytes())
    os.replace(copy, out / "shard-00001.h5")  # same bytes, another file
    assert "shard-00001.h5 changed since the marker was written" in marker_problem(done)
    (out / "shard-00001.h5").unlink()
    assert "shard-00001.h5 is missing" in marker_problem(done)
