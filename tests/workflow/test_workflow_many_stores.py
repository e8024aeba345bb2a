"""The workflow at 700 shard stores under a long absolute outdir (two 238-character folders)
with `ulimit -s 1024` (ARG_MAX 256 KiB): the stores' paths alone would overflow any command
line, yet every command's argv stays short (the merge reads its stores from a file), and the
merged store validates with every record."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.workflow_helpers import SNAKEFILE, _env, demo_config, validate

pytestmark = pytest.mark.slow

SHARDS = 700


def test_700_shard_stores_under_a_long_outdir_with_a_small_stack(tmp_path: Path) -> None:
    fasta = tmp_path / "many.fasta"
    aa = "ACDEFGHIKLMNPQRSTVWY"
    # unique sequences (no duplicates to fold): 3 letters of k in base 20 after "MKVLA"
    fasta.write_text("".join(f">R{k:05d}\nMKVLA{aa[k // 400]}{aa[k // 20 % 20]}{aa[k % 20]}\n" for k in range(SHARDS)))
    outdir = tmp_path / ("scratch-" + "x" * 230) / ("project-" + "y" * 230) / "run"
    config = demo_config(tmp_path, input=str(fasta), outdir=str(outdir), model=str(tmp_path / "model" / "t.pt"),
                         tokens_per_shard=10,  # 8 residues + 2: one record per shard
                         max_jobs=4, per_residue=False, crosscheck={"sample": 4, "seed": 0})
    stores_argv = SHARDS * (len(str(outdir / "stores" / "shard-00000.h5")) + 1)
    assert stores_argv > 256 * 1024
    cmd = shlex.join([sys.executable, "-m", "snakemake", "--snakefile", str(SNAKEFILE), "--directory", str(tmp_path),
                      "--configfile", str(config), "--cores", "2"])
    proc = subprocess.run(["bash", "-c", f"ulimit -s 1024; exec {cmd}"], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-5000:])
    assert len(list((outdir / "stores").glob("shard-*.h5"))) == SHARDS
    assert validate(outdir / "embeddings.h5").returncode == 0
    import embedpipe

    with embedpipe.open_store(outdir / "embeddings.h5") as store:
        assert len(store.ids) == SHARDS
