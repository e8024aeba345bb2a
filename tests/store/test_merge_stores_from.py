"""`embedpipe merge --stores-from FILE` (issue 24, §1): the store list in a file, not argv, so a
merge of thousands of shard stores under a long absolute outdir works where the kernel's
ARG_MAX (a quarter of the stack limit: 256 KiB at `ulimit -s 1024`) refuses the command line."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from embedpipe.store import EmbeddedRecord, StoreWriter, validate_store

pytestmark = pytest.mark.slow

STORES = 700
ATTRS = {"model_name": "t", "model_sha256": "0" * 64, "precision_policy": "fp32", "config": {}}


def _write(path: Path, k: int) -> None:
    rid = f"P{k:05d}"
    with StoreWriter(path, ids=[rid], sequences=["MKV"], residue_rows=None, layers=[1], dim=2,
                     storage_dtype="float32", attrs=ATTRS) as w:
        w.write(0, EmbeddedRecord(id=rid, sequence="MKV", precision_used="fp32",
                                  mean={1: np.array([k, -k], dtype=np.float32)}, embedded_length=3))


def _limited(command: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.run(["bash", "-c", f"ulimit -s 1024; {command}"], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=900)


def test_merge_of_700_stores_under_a_long_outdir_with_a_small_stack(tmp_path: Path) -> None:
    outdir = tmp_path / ("scratch-" + "x" * 230) / ("project-" + "y" * 230) / "stores"
    outdir.mkdir(parents=True)
    stores = [outdir / f"shard-{k:05d}.h5" for k in range(STORES)]
    for k, store in enumerate(stores):
        _write(store, k)
    argv_bytes = sum(len(str(s)) + 1 for s in stores)
    assert argv_bytes > 256 * 1024  # more than ARG_MAX allows at this stack limit
    listing = tmp_path / "stores.txt"
    listing.write_text("".join(f"{s}\n" for s in stores))
    merged = tmp_path / "merged.h5"
    cli = f"{shlex.quote(sys.executable)} -m embedpipe.cli.commands merge"
    # the command line the merge rule used to run is refused by the kernel here
    too_long = _limited(f"exec {cli} $(cat stores.txt) --out {merged} -q", tmp_path)
    assert too_long.returncode != 0 and "Argument list too long" in too_long.stderr, too_long.stderr[-2000:]
    proc = _limited(f"exec {cli} --stores-from stores.txt --out {merged} -q", tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert validate_store(merged) == []
    import embedpipe

    with embedpipe.open_store(merged) as store:
        assert len(store.ids) == STORES
        for k in (0, 345, STORES - 1):
            np.testing.assert_array_equal(store.mean_vector(f"P{k:05d}"), [k, -k])


def test_stores_from_a_missing_file_is_one_line(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "embedpipe.cli", "merge", "--stores-from", str(tmp_path / "nope.txt"),
                           "--out", str(tmp_path / "m.h5")], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "nope.txt: cannot read the list of stores" in lines[0], proc.stderr
