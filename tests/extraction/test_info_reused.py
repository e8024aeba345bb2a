"""Issue 30, friction: ``embedpipe info STORE`` says how many records ``embed --reuse`` copied
from which source store(s), for a shard store and a merged one, as text and in ``--json``."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
from typer.testing import CliRunner

from embedpipe.cli import app
from embedpipe.core.options import EmbedOptions
from embedpipe.extraction.run import embed_fasta
from embedpipe.store import merge_stores, render_info, store_info
from helpers.embed_helpers import embed_store, random_sequences, write_fasta

FIRST = random_sequences(6, (8, 24), seed=21)
FRESH = [(f"new{i}", s) for i, (_, s) in enumerate(random_sequences(2, (8, 24), seed=22))]


def _uuid(path: Path) -> str:
    with h5py.File(path, "r") as f:
        return str(f.attrs["store_uuid"])


def _reusing(tmp: Path, model: Path, name: str, records, source: Path) -> Path:
    out = tmp / f"{name}.h5"
    embed_fasta(write_fasta(tmp / f"{name}.fasta", records), model=str(model), out=out,
                options=EmbedOptions(device="cpu"), quiet=True, reuse=[source])
    return out


def test_info_counts_reused_records_per_source_for_shard_and_merged_stores(tmp_path, tiny_model_path):
    release1 = embed_store(tmp_path, tiny_model_path, FIRST, "release1", device="cpu")
    source = {"store_uuid": _uuid(release1), "path": str(release1.absolute())}
    half = _reusing(tmp_path, tiny_model_path, "half", FIRST[:4] + FRESH, release1)  # 4 copied, 2 computed
    info = store_info(half)
    assert info["reused"] == {"count": 4, "sources": [source | {"records": 4}]}
    lines = render_info(info).splitlines()
    at = lines.index("  reused      4 of 6 records copied by embed --reuse, not computed")
    assert lines[at + 1] == f"              4 from {release1.absolute()} (store_uuid {source['store_uuid']})"
    other = _reusing(tmp_path, tiny_model_path, "other", FIRST[4:], release1)  # 2 copied
    merged = tmp_path / "merged.h5"
    merge_stores([half, other], out=merged)
    result = CliRunner().invoke(app, ["info", str(merged), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["reused"] == {"count": 6, "sources": [source | {"records": 6}]}
    text = CliRunner().invoke(app, ["info", str(merged)]).output
    assert "  reused      6 of 8 records copied by embed --reuse, not computed" in text.splitlines()


def test_info_of_a_store_without_reuse_says_none(tmp_path, tiny_model_path):
    plain = embed_store(tmp_path, tiny_model_path, FIRST, "plain", device="cpu")
    info = store_info(plain)
    assert info["reused"] == {"count": 0, "sources": []}
    assert not [line for line in render_info(info).splitlines() if "reused" in line]
