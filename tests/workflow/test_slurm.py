"""The workflow on a real SLURM cluster, through snakemake-executor-plugin-slurm.

Needs a running controller: CI starts a one-node cluster with scripts/slurm/start-cluster.sh
(Debian's slurm-wlm and munge, slurmctld and slurmd on localhost, partition `debug`, no
accounting). The run uses the CI profile (workflows/profiles/slurm-ci: squeue for job status)
with a tiny test model, and its merged store must equal a local run's.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
SNAKEFILE = ROOT / "Snakefile"
PROFILE = ROOT / "workflows" / "profiles" / "slurm-ci"
EXAMPLE = ROOT / "examples" / "swissprot100.fasta"


def _slurm_state() -> str | None:
    """None when a controller answers with an up partition; else why not."""
    if shutil.which("sinfo") is None:
        return "no SLURM client (sinfo) on PATH; start one with scripts/slurm/start-cluster.sh"
    try:
        proc = subprocess.run(["sinfo", "-h", "-o", "%P %a %t"], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return "sinfo did not answer within 20 s"
    if proc.returncode != 0:
        return f"sinfo failed ({proc.stderr.strip() or proc.returncode}); start scripts/slurm/start-cluster.sh"
    if not any(line.split()[1:2] == ["up"] for line in proc.stdout.splitlines()):
        return f"no SLURM partition is up: {proc.stdout.strip()!r}"
    return None


_WHY_NOT = _slurm_state()
if _WHY_NOT is not None:
    pytestmark.append(pytest.mark.skip(reason=f"no SLURM cluster: {_WHY_NOT}"))


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _config(workdir: Path) -> Path:
    config = {
        "input": str(EXAMPLE),
        "outdir": "out",
        "model": "out/model/esm2_test_t2_32.pt",
        "test_model": {"layers": 2, "dim": 32, "heads": 4, "seed": 0},
        "precision": "fp32",
        "per_residue": True,
        "device": "cpu",
        "tokens_per_shard": 15000,
        "crosscheck": {"sample": 8, "seed": 0},
    }
    path = workdir / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def _snakemake(workdir: Path, *args: str, timeout: float = 480) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "snakemake", "--snakefile", str(SNAKEFILE), "--directory", str(workdir),
           "--configfile", str(_config(workdir)), *args]
    proc = subprocess.run(cmd, cwd=workdir, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (
        f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    )
    return proc


def _values(path: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    import embedpipe

    with embedpipe.open_store(path) as store:
        return {
            name: (
                np.asarray(store.mean_vector(name), dtype=np.float64),
                np.asarray(store.per_residue(name), dtype=np.float64),
            )
            for name in list(store.ids) + list(store.aliases)
        }


def test_slurm_run_equals_local_run(tmp_path: Path) -> None:
    local, cluster = tmp_path / "local", tmp_path / "slurm"
    local.mkdir()
    cluster.mkdir()
    _snakemake(local, "--cores", "2")
    proc = _snakemake(cluster, "--workflow-profile", str(PROFILE))

    # The jobs really went through sbatch: one per shard, plus shard, merge and crosscheck
    # (make_test_model is a local rule).
    out = proc.stdout + proc.stderr
    shards = sorted(p.stem for p in (cluster / "out" / "shards").glob("shard-*.fasta"))
    assert len(shards) == 3
    assert len(re.findall(r"has been submitted with SLURM jobid \d+", out)) == len(shards) + 3, out[-4000:]
    for shard in shards:
        assert re.search(rf"SLURM jobid \d+ \(log: \S+rule_embed/{shard.split('-')[1]}/", out), shard

    for name in ("shards/manifest.tsv", "embeddings.h5", "crosscheck/crosscheck.json", "crosscheck/crosscheck.html"):
        assert (cluster / "out" / name).is_file(), name
    check = subprocess.run([sys.executable, "-m", "embedpipe.cli", "validate", str(cluster / "out" / "embeddings.h5")],
                           capture_output=True, text=True, env=_env())
    assert check.returncode == 0, check.stderr

    a, b = _values(local / "out" / "embeddings.h5"), _values(cluster / "out" / "embeddings.h5")
    assert sorted(a) == sorted(b)
    for name in a:
        np.testing.assert_allclose(a[name][0], b[name][0], rtol=0, atol=1e-6, err_msg=name)
        np.testing.assert_allclose(a[name][1], b[name][1], rtol=0, atol=1e-6, err_msg=name)

    # Finished on the cluster means finished: nothing to do on rerun.
    rerun = _snakemake(cluster, "--workflow-profile", str(PROFILE), "--dry-run")
    assert "Nothing to be done" in rerun.stdout + rerun.stderr


def test_without_accounting_the_status_command_is_chosen_and_oversized_rules_are_named(tmp_path: Path) -> None:
    """The CI profile without its `slurm-status-command: squeue`, and `set-threads: embed` above
    the node's CPUs (issue 34, item 3). Before: sacct (the plugin's default, accounting off here)
    never saw the shard job finish, and the main process waited in silence. Now the run says it
    asks squeue and finishes; the embed rule's threads are named with the profile line to change."""
    profile = yaml.safe_load((PROFILE / "config.yaml").read_text())
    assert profile.pop("slurm-status-command") == "squeue"
    cpus = max(int(line.split()[0]) for line in subprocess.run(
        ["sinfo", "-h", "-N", "-o", "%c"], capture_output=True, text=True, check=True).stdout.split("\n") if line.strip())
    profile["set-threads"]["embed"] = cpus + 2
    (tmp_path / "profile").mkdir()
    (tmp_path / "profile" / "config.yaml").write_text(yaml.safe_dump(profile))
    proc = _snakemake(tmp_path, "--workflow-profile", str(tmp_path / "profile"), "--until", "shard", timeout=240)
    err = proc.stderr
    assert "embedpipe: SLURM accounting is off on this cluster (accounting_storage/none): job status from squeue" in err
    assert (f"embedpipe: warning: rule embed asks for {cpus + 2} threads, more than any SLURM node has (the most: "
            f"{cpus} CPUs") in err and f"set `set-threads: embed: {cpus}` in the profile" in err
    assert "rule crosscheck asks" not in err  # 1 thread: fits
    assert len(re.findall(r"has been submitted with SLURM jobid \d+", proc.stdout + err)) == 1
    assert (tmp_path / "out" / "shards" / "manifest.tsv").is_file()
