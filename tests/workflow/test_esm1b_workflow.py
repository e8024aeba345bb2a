"""The workflow end to end with an ESM-1b name: fetched from the torch hub cache like ESM-2's
default model, embedded, merged and validated; the store says the family (``esm1b``).

A random-weight ESM-1b in fair-esm's released layout stands in for ``esm1b_t33_650M_UR50S`` in
the cache, as ``test_default_config_with_a_cached_model`` does for ESM-2: nothing is downloaded.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from helpers.workflow_helpers import CONTRACT_OUTPUTS, CORES, _env, snakemake, validate

pytestmark = pytest.mark.slow

def test_default_config_with_a_cached_esm1b(checkout_like: Path, tmp_path: Path) -> None:
    name = "esm1b_t33_650M_UR50S"
    torch_home = tmp_path / "torch-home"
    checkpoint = torch_home / "hub" / "checkpoints" / f"{name}.pt"
    subprocess.run([sys.executable, "-m", "embedpipe.cli", "make-test-model", str(checkpoint), "--family", "esm1b"],
                   check=True, capture_output=True, env=_env())
    env = _env(TORCH_HOME=str(torch_home))
    snakemake(checkout_like, "--cores", CORES, "--config", f"model={name}", "precision=bf16-mixed", env=env)
    results = checkout_like / "results"
    for output in CONTRACT_OUTPUTS:
        assert (results / output).is_file(), output
    assert (results / "model" / f"{name}.fetched").read_text().strip() == str(checkpoint)
    assert validate(results / "embeddings.h5").returncode == 0
    import embedpipe

    with embedpipe.open_store(results / "embeddings.h5") as store:
        assert store.provenance["model_name"] == name
        assert store.provenance["model_family"] == "esm1b"
        assert store.provenance["precision_policy"] == "bf16-mixed"
