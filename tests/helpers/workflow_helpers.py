"""What the workflow tests share: the checkout's paths, a small demo config, running
`snakemake` on the root Snakefile in a temporary directory with a stand-in torch hub cache, and
reading what a run leaves (job counts, the manifest, store values)."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
SNAKEFILE = ROOT / "Snakefile"
EXAMPLE = ROOT / "examples" / "swissprot100.fasta"
CONTRACT_OUTPUTS = (
    "shards/manifest.tsv",
    "embeddings.h5",
    "crosscheck/crosscheck.json",
    "crosscheck/crosscheck.html",
)
CORES = "2"


# --------------------------------------------------------------------------- helpers


# The workflow stops at start-up when a fair-esm name is neither cached nor downloadable (CI
# has no internet): a torch hub cache holding stand-ins for the configs' model names lets the
# dry runs and lints see the whole DAG. Tests that run a model give their own TORCH_HOME.
STAND_IN_TORCH_HOME = Path(__file__).resolve().parents[2] / ".pytest-torch-home"


def _stand_in_torch_home() -> str:
    checkpoints = STAND_IN_TORCH_HOME / "hub" / "checkpoints"
    checkpoints.mkdir(parents=True, exist_ok=True)
    for name in ("esm2_t6_8M_UR50D", "esm2_t33_650M_UR50D"):
        (checkpoints / f"{name}.pt").touch()
    return str(STAND_IN_TORCH_HOME.resolve())


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["TORCH_HOME"] = _stand_in_torch_home()
    # The rules call `embedpipe`: make the one next to this interpreter win.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra)
    return env


def demo_config(workdir: Path, **overrides: object) -> Path:
    """A config like configs/offline-demo.yaml, smaller: 2-layer dim-32 model, 3 shards."""
    config: dict[str, object] = {
        "input": str(EXAMPLE),
        "outdir": "out",
        "model": "out/model/esm2_test_t2_32.pt",
        "test_model": {"layers": 2, "dim": 32, "heads": 4, "seed": 0},
        "precision": "fp32",
        "layers": [-1],
        "per_residue": True,
        "device": "cpu",
        "tokens_per_batch": 4096,
        "tokens_per_shard": 15000,
        "crosscheck": {"sample": 8, "seed": 0},
    }
    config.update(overrides)
    path = workdir / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def snakemake(
    workdir: Path,
    *args: str,
    configfile: Path | None = None,
    check: bool = True,
    timeout: float = 300,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "snakemake", "--snakefile", str(SNAKEFILE), "--directory", str(workdir)]
    if configfile is not None:
        cmd += ["--configfile", str(configfile)]
    cmd += list(args)
    proc = subprocess.run(
        cmd, cwd=workdir, env=env or _env(), capture_output=True, text=True, timeout=timeout
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}"
            f"\n--- stderr\n{proc.stderr[-8000:]}"
        )
    return proc


def run_workflow(workdir: Path, configfile: Path, *args: str, **kw: object) -> subprocess.CompletedProcess[str]:
    return snakemake(workdir, "--cores", CORES, *args, configfile=configfile, **kw)  # type: ignore[arg-type]


def run_config(workdir: Path, config: dict[str, object], *, env: dict[str, str], timeout: float = 600) -> dict:
    """Write ``config`` as ``workdir/config.yaml``, run the whole workflow on it and return the
    run's ``shards.json`` (under ``config["outdir"]``), the first thing a model family's test checks."""
    path = workdir / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    run_workflow(workdir, path, env=env, timeout=timeout)
    return json.loads((workdir / str(config["outdir"]) / "shards" / "shards.json").read_text())


def nothing_to_do(workdir: Path, configfile: Path) -> bool:
    proc = run_workflow(workdir, configfile, "--dry-run")
    return "Nothing to be done" in proc.stdout + proc.stderr


def job_counts(output: str) -> dict[str, int]:
    """The "Job stats" table of a (dry-)run: rule -> job count."""
    counts: dict[str, int] = {}
    lines = output.split("Job stats:", 1)[1].splitlines() if "Job stats:" in output else []
    for line in lines[3:]:
        parts = line.split()
        if len(parts) != 2 or parts[0] == "total":
            break
        counts[parts[0]] = int(parts[1])
    return counts


def read_manifest(path: Path) -> list[dict[str, str]]:
    with open(path, newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh, delimiter="\t"))


def store_values(path: Path) -> dict[str, tuple[np.ndarray, np.ndarray | None]]:
    """ID -> (mean vector, per-residue matrix or None) for every record and alias."""
    import embedpipe

    out: dict[str, tuple[np.ndarray, np.ndarray | None]] = {}
    with embedpipe.open_store(path) as store:
        names = list(store.ids) + list(store.aliases)
        for name in names:
            mean = np.asarray(store.mean_vector(name), dtype=np.float64)
            residues = (
                np.asarray(store.per_residue(name), dtype=np.float64) if store.has_per_residue else None
            )
            out[name] = (mean, residues)
    return out


def assert_same_store(a: Path, b: Path, atol: float = 1e-6, *, exact: bool = False) -> None:
    """Two stores hold the same IDs and values: within ``atol``, or bit for bit (``exact``,
    ``np.array_equal``: batch-invariant runs, docs/precision.md "Reproducibility")."""
    va, vb = store_values(a), store_values(b)
    assert sorted(va) == sorted(vb), "the stores hold different IDs"
    for name in va:
        for got, want in zip(va[name], vb[name]):
            if got is None and want is None:
                continue
            if exact:
                assert got is not None and want is not None and np.array_equal(got, want), name
            else:
                np.testing.assert_allclose(got, want, rtol=0, atol=atol, err_msg=name)


def validate(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "embedpipe.cli", "validate", str(path)],
        capture_output=True, text=True, env=_env(), timeout=120,
    )


@pytest.fixture()
def checkout_like(tmp_path: Path) -> Path:
    """A working directory that looks like the checkout (configs/ and examples/ present)."""
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    return tmp_path
