"""Issue 19, E: a group job's resume identity holds what the options resolve to, not how they
are spelt: ``--device auto`` and ``--device cpu`` on the CPU, ``--layers 2`` and ``--layers -1``
on a 2-layer model keep each other's stores (embedpipe/extraction/run.py, ``embed_identity``)."""

from __future__ import annotations

import json
from pathlib import Path

import h5py

from embedpipe.core.options import EmbedOptions
from embedpipe.extraction.run import embed_shards
from helpers.embed_helpers import random_sequences, write_fasta


def _shards(tmp: Path) -> list[Path]:
    return [write_fasta(tmp / f"shard-{k}.fasta", [(f"s{k}-{i}", s) for i, s in random_sequences(3, (8, 30), seed=k)])
            for k in range(2)]


def test_spellings_that_resolve_alike_keep_the_stores(tmp_path, tiny_model_path):
    shards, out = _shards(tmp_path), tmp_path / "stores"
    first = embed_shards(shards, model=str(tiny_model_path), out_dir=out, quiet=True,
                         options=EmbedOptions(device="cpu", layers=(-1,)))
    assert len(first.embedded) == 2
    done = tmp_path / "done.json"
    again = embed_shards(shards, model=str(tiny_model_path), out_dir=out, quiet=True, done=done,
                         options=EmbedOptions(device="auto", layers=(2,)))
    assert again.embedded == [] and again.kept == sorted(out.glob("*.h5"))
    identity = json.loads(done.read_text())["identity"]
    assert identity["layers"] == [2] and "device" not in identity and identity["computed_as"]["device_type"] == "cpu"
    other = embed_shards(shards, model=str(tiny_model_path), out_dir=out, quiet=True,
                         options=EmbedOptions(device="cpu", layers=(1,)))
    assert len(other.embedded) == 2  # another layer is another store


def test_a_store_with_the_identity_written_before_is_embedded_again_saying_why(tmp_path, tiny_model_path, capsys):
    # issue 30: the identity an older embedpipe wrote did not cover the model's config and
    # tokenizer files, the family's version or the int8 weight range: not current, said so
    shards, out = _shards(tmp_path), tmp_path / "stores"
    options = EmbedOptions(device="cpu", layers=(-1,))
    embed_shards(shards, model=str(tiny_model_path), out_dir=out, options=options, quiet=True)
    for store in out.glob("*.h5"):  # as an older embedpipe wrote it
        with h5py.File(store, "r+") as f:
            old = json.loads(f.attrs["embed_identity"])
            for key in ("identity_version", "model_files", "model_family"):
                del old[key]
            f.attrs["embed_identity"] = json.dumps(old | {"pooling": ["mean"]}, sort_keys=True)
    capsys.readouterr()
    again = embed_shards(shards, model=str(tiny_model_path), out_dir=out, options=options)
    assert len(again.embedded) == 2 and again.kept == []
    said = [line for line in capsys.readouterr().err.splitlines() if "embedding it again" in line]
    assert said == [f"{out / s.stem}.h5: written by an older embedpipe whose identity did not cover the model's "
                    "config.json and tokenizer files, the model family's version or the int8 weight range; "
                    "embedding it again" for s in shards]
