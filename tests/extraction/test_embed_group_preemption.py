"""Issue 24 §4: a group embed job preempted on SLURM (SIGTERM: `scancel`, a time limit, a
preemption with GraceTime) resumes shard by shard when it is requeued or resubmitted.

The job is the workflow's embed command (workflows/rules/embed.smk: several shards,
`--out-dir`, `--done`), a real subprocess of the CLI. To signal it deterministically in the
middle of its group, the child's second shard never finishes embedding (the first is real),
and the test sends SIGTERM once that shard's temporary exists. The same command is then run
again, unpatched, as a requeued job would be (docs/cluster.md, "Preemption and requeue")."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

import embedpipe.extraction.engine as engine
from embedpipe.core.interrupts import progress_of
from embedpipe.core.options import EmbedOptions
from embedpipe.extraction.run import embed_shards
from embedpipe.store import validate_store
from helpers.embed_helpers import random_sequences, write_fasta
from helpers.processes import wait_until
from helpers.stores import store_uuid

ROOT = Path(__file__).resolve().parents[2]

#: the child: shard number STOP (0-based, among those it embeds) never ends; then the real CLI
CHILD = """
import itertools, sys, time
import embedpipe.extraction.engine as engine
STOP = int(sys.argv.pop(1))
real, calls = engine.Engine.embed, itertools.count()
def endless():
    while True:
        time.sleep(0.02)
        yield from ()
def embed(self, *args, **kwargs):
    return endless() if next(calls) == STOP else real(self, *args, **kwargs)
engine.Engine.embed = embed
sys.argv = ["embedpipe", *sys.argv[1:]]
from embedpipe.cli import run
run()
"""

#: the unpatched CLI, as the rule's shell command runs it
CLI = "import sys; sys.argv = ['embedpipe', *sys.argv[1:]]; from embedpipe.cli import run; run()"


def _command(tmp: Path, model: Path, shards: list[Path], out: Path) -> list[str]:
    """The embed rule's command line for one group (options as `embed_options()` spells them)."""
    return ["embed", *map(str, shards), "--model", str(model), "--out-dir", str(out), "--done",
            str(out / "group-00000.json"), "--device", "cpu", "--per-residue", "--tokens-per-batch", "200",
            "--threads", "1", "-q"]


def _env() -> dict[str, str]:
    return os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _vectors(path: Path) -> dict[str, np.ndarray]:
    with h5py.File(path, "r") as f:
        out = {"ids": f["ids"][()]}
        f.visititems(lambda name, obj: out.__setitem__(name, obj[()])
                     if isinstance(obj, h5py.Dataset) and "layer_" in name else None)
    return out



def test_a_group_job_sigtermed_mid_group_exits_143_and_its_rerun_embeds_only_the_rest(tmp_path, tiny_model_path):
    shards = [write_fasta(tmp_path / f"shard-{k:05d}.fasta", random_sequences(3, (8, 40), seed=40 + k))
              for k in range(3)]
    out = tmp_path / "stores"
    args = _command(tmp_path, tiny_model_path, shards, out)
    stores = [out / f"{s.stem}.h5" for s in shards]
    done = out / "group-00000.json"

    proc = subprocess.Popen([sys.executable, "-c", CHILD, "1", *args], cwd=tmp_path, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_until(proc, lambda: stores[0].exists() and any(out.glob(f".{stores[1].name}.*.tmp")),
               "the job reached its second shard")
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 143, stderr
    # the log's last line says which shards were done and which one was under way
    assert stderr.strip().splitlines()[-1] == (f"embedpipe: interrupted during shard 2 of 3 ({shards[1]} -> "
                                               f"{stores[1]}, not finished); done: {stores[0]} (embedded)")
    # the finished shard stays, complete and valid; the one being written leaves nothing
    assert validate_store(stores[0]) == []
    assert not stores[1].exists() and not stores[2].exists() and not done.exists()
    assert list(out.glob("*.tmp")) == [] and list(out.glob(".*.tmp")) == []
    kept = (store_uuid(stores[0]), stores[0].stat().st_mtime_ns, stores[0].read_bytes())

    rerun = subprocess.run([sys.executable, "-c", CLI, *args[:-1]], cwd=tmp_path, env=_env(),
                           capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr
    assert ": 2 embedded, 1 kept" in rerun.stderr, rerun.stderr  # the summary line
    assert (store_uuid(stores[0]), stores[0].stat().st_mtime_ns, stores[0].read_bytes()) == kept
    listing = json.loads(done.read_text())
    assert [e["stamp"]["store_uuid"] for e in listing["stores"]] == [store_uuid(s) for s in stores]

    # independent: the same group embedded in one uninterrupted job
    clean = tmp_path / "clean"
    subprocess.run([sys.executable, "-c", CLI, *_command(tmp_path, tiny_model_path, shards, clean)],
                   cwd=tmp_path, env=_env(), check=True, capture_output=True, timeout=600)
    for store in stores:
        resumed, whole = _vectors(store), _vectors(clean / store.name)
        assert sorted(resumed) == sorted(whole) and len(whole) > 2
        np.testing.assert_array_equal(resumed.pop("ids"), whole.pop("ids"))
        for name in whole:
            np.testing.assert_allclose(resumed[name], whole[name], rtol=0, atol=1e-4, err_msg=f"{store.name} {name}")


@pytest.mark.parametrize("stop", [0, 1])
def test_an_interrupted_group_names_its_kept_and_embedded_shards_and_the_one_under_way(tmp_path, tiny_model_path,
                                                                                      monkeypatch, stop):
    """Shard 0 is kept from an earlier run, shard 1 is embedded, and Ctrl-C comes while shard 2
    (``stop=1``) or shard 1 (``stop=0``) is embedded: the interrupt carries what the CLI prints."""
    shards = [write_fasta(tmp_path / f"shard-{k:05d}.fasta", random_sequences(3, (8, 40), seed=60 + k))
              for k in range(3)]
    out, options = tmp_path / "stores", EmbedOptions(device="cpu", tokens_per_batch=200)
    embed_shards(shards[:1], model=str(tiny_model_path), out_dir=out, options=options, quiet=True)
    real, calls = engine.Engine.embed, []

    def embed(self, *args, **kwargs):
        calls.append(1)
        if len(calls) > stop:
            raise KeyboardInterrupt
        return real(self, *args, **kwargs)

    monkeypatch.setattr(engine.Engine, "embed", embed)
    with pytest.raises(KeyboardInterrupt) as info:
        embed_shards(shards, model=str(tiny_model_path), out_dir=out, options=options, quiet=True)
    done = [f"{out / 'shard-00000.h5'} (kept)", f"{out / 'shard-00001.h5'} (embedded)"][:stop + 1]
    k = stop + 1
    assert progress_of(info.value) == (f"during shard {k + 1} of 3 ({shards[k]} -> {out / shards[k].stem}.h5, "
                                       f"not finished); done: {', '.join(done)}")
    assert sorted(p.name for p in out.glob("*.h5")) == [f"shard-{j:05d}.h5" for j in range(k)]

