"""Issue 30, item 3 (friction): every output gets the mode any file the user writes gets (0666,
0777 for directories, less the umask): 0644 and 0755 under umask 022, not mkstemp's 0600 or
safetensors' (docs/store-format.md, "Atomic writes"). One of each output kind: stores (single,
group, merged), the group marker, the reuse index, exports and their companion files, model
files (fair-esm checkpoint and companion, a Hugging Face directory), the shard outputs."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from embedpipe.core.options import EmbedOptions
from embedpipe.export import export_store
from embedpipe.extraction.run import embed_fasta, embed_shards
from embedpipe.model.random_checkpoint import make_test_model
from embedpipe.model.random_hf import make_hf_test_model
from embedpipe.shard.passes import shard_fasta
from embedpipe.store import merge_stores
from embedpipe.store.reuse_index import build_index
from helpers.embed_helpers import random_sequences, write_fasta

OPTIONS = EmbedOptions(device="cpu", per_residue=True)


@pytest.fixture
def umask_022() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def _modes(root: Path) -> dict[str, str]:
    """Every entry under ``root`` (relative name -> octal permission bits)."""
    return {str(p.relative_to(root)): oct(stat.S_IMODE(p.stat().st_mode)) for p in sorted(root.rglob("*"))}


def test_every_output_kind_gets_the_umask_mode(tmp_path, umask_022):
    out = tmp_path / "out"
    make_test_model(out / "m.pt")
    make_hf_test_model(out / "ankh", family="ankh")
    fasta = write_fasta(tmp_path / "in.fasta", random_sequences(4, (8, 30), seed=7))
    shard_fasta([fasta], out=out / "shards", tokens_per_shard=60, quiet=True)
    embed_fasta(fasta, model=str(out / "m.pt"), out=out / "one.h5", options=OPTIONS, quiet=True)
    shards = sorted((out / "shards").glob("shard-*.fasta"))
    embed_shards(shards, model=str(out / "m.pt"), out_dir=out / "stores", options=OPTIONS,
                 done=out / "stores" / "group-00000.json", quiet=True)
    merge_stores(sorted((out / "stores").glob("*.h5")), out=out / "embeddings.h5")
    build_index(out / "embeddings.h5", out / "reuse.h5")
    for fmt, name in (("h5-per-id", "e.h5"), ("parquet", "e.parquet"), ("npy", "e.npy")):
        export_store(out / "embeddings.h5", fmt=fmt, out=out / "exports" / name, quiet=True)
    modes = _modes(out)
    assert {"ankh/model.safetensors", "ankh/config.json", "m.pt", "m-contact-regression.pt", "shards/manifest.tsv",
            "shards/shards.json", "stores/group-00000.json", "exports/e.ids.txt", "exports/e.provenance.json",
            "reuse.h5", "one.h5"} <= set(modes)
    wrong = {name: mode for name, mode in modes.items() if mode != ("0o755" if (out / name).is_dir() else "0o644")}
    assert wrong == {}
    assert not [name for name in modes if name.endswith(".lock") or ".tmp" in name]  # nothing left behind
