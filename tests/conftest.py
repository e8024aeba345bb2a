"""Shared pytest fixtures and markers.

Fixtures (session-scoped, so each test model is written once per run):

* ``tiny_model_path``: a random-weight ESM-2 (2 layers, dim 32, 4 heads, seed 0) in
  fair-esm's checkpoint format, named ``esm2_tiny_t2_32.pt``.
* ``model_factory(layers=2, dim=32, heads=4, seed=0, **overrides)``: the same for other
  shapes or options (any keyword of ``embedpipe.model.random_checkpoint.make_test_model``,
  or of ``embed_helpers.edit_test_checkpoint``, applied to the written file); cached by
  arguments. File names start with ``esm2`` so fair-esm's own loader accepts them.
* ``fair_esm_reference(path)``: ``(model, alphabet)`` loaded by fair-esm's own
  ``esm.pretrained.load_model_and_alphabet_local`` (Namespace allowlisted), eval mode: the
  independent reference for numeric tests.

Markers: tests marked ``slurm``, ``browser`` or ``peer`` must run in CI: under ``CI=true`` a
skip of one of them is reported as a failure (a suite that skips did not run); elsewhere it
stays a skip with its reason.
"""

from __future__ import annotations

import argparse
import itertools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

# fixtures defined beside the helpers they use, shared by every test directory
from helpers.workflow_helpers import checkout_like  # noqa: F401

# --------------------------------------------------------------------------- markers

#: markers whose tests CI must run, never skip
MUST_RUN_IN_CI = ("slurm", "browser", "peer")


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Any:
    """Under CI, a skipped slurm/browser/peer test fails, keeping the skip reason."""
    outcome = yield
    report = outcome.get_result()
    if not (report.skipped and _in_ci()):
        return
    markers = [name for name in MUST_RUN_IN_CI if item.get_closest_marker(name) is not None]
    if markers and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        report.outcome = "failed"
        report.longrepr = f"{markers[0]} test skipped under CI=true (it must run in CI): {reason}"


# --------------------------------------------------------------------------- isolation


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (scripts/test.sh runs several workers, ``--dist loadgroup``), the tests
    that share something beyond their own ``tmp_path`` run on one worker, one at a time: the
    one-node SLURM's CPUs, the benchmark scripts' ``benchmarks/out/``, the README's commands."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        path = Path(str(item.fspath))
        if item.get_closest_marker("slurm") or path.parent.name == "benchmarks" or path.name == "test_readme.py":
            item.add_marker(pytest.mark.xdist_group("shared"))


@pytest.fixture(autouse=True)
def _own_auto_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--precision auto``'s per-node measurements go to a directory of each test's own
    (``XDG_CACHE_HOME``, children included), never the user's or the site's cache
    (``EMBEDPIPE_AUTO_CACHE``): one test's measurement must not decide another's policy."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg-cache")))
    monkeypatch.delenv("EMBEDPIPE_AUTO_CACHE", raising=False)


# --------------------------------------------------------------------------- test models


@pytest.fixture(scope="session")
def session_models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One directory for every session-scoped test checkpoint."""
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def model_factory(session_models_dir: Path) -> Callable[..., Path]:
    """``model_factory(layers=2, dim=32, heads=4, seed=0, **overrides) -> Path``, cached."""
    from embedpipe.model.random_checkpoint import make_test_model
    from helpers.embed_helpers import edit_test_checkpoint

    cache: dict[str, Path] = {}
    counter = itertools.count()

    def make(
        layers: int = 2, dim: int = 32, heads: int = 4, seed: int = 0, **overrides: Any
    ) -> Path:
        key = repr((layers, dim, heads, seed, sorted(overrides.items(), key=lambda kv: kv[0])))
        if key not in cache:
            name = f"esm2_test_t{layers}_d{dim}_h{heads}_s{seed}_{next(counter)}.pt"
            edits = {k: overrides.pop(k) for k in ("token_row_overrides", "edit", "key_prefix") if k in overrides}
            path = make_test_model(
                session_models_dir / name, layers=layers, dim=dim, heads=heads, seed=seed, **overrides
            )
            cache[key] = edit_test_checkpoint(path, **edits) if edits else path
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_model_path(session_models_dir: Path) -> Path:
    """``esm2_tiny_t2_32.pt``: 2 layers, dim 32, 4 heads, seed 0 (with its companion file)."""
    from embedpipe.model.random_checkpoint import make_test_model

    return make_test_model(session_models_dir / "esm2_tiny_t2_32.pt", layers=2, dim=32, heads=4, seed=0)


@pytest.fixture(scope="session")
def fair_esm_reference() -> Callable[[Path], tuple[Any, Any]]:
    """``fair_esm_reference(path) -> (model, alphabet)`` via fair-esm's own local loader."""

    def load(path: Path) -> tuple[Any, Any]:
        import esm
        import torch

        path = Path(path)
        if not path.name.startswith("esm2"):
            raise ValueError(
                f"fair-esm builds an ESM-2 only for file names starting with 'esm2': {path.name}"
            )
        # Scoped allowlist: fair-esm 2.0.0 calls torch.load without weights_only, which on
        # torch >= 2.6 means weights_only=True and refuses the config's argparse.Namespace.
        with torch.serialization.safe_globals([argparse.Namespace]):
            model, alphabet = esm.pretrained.load_model_and_alphabet_local(str(path))
        model.eval()
        return model, alphabet

    return load


@pytest.fixture(scope="session")
def overflow_model(model_factory):
    """The embedding row of 'C' is 7e4: inf once cast to fp16 (max 65504), finite in fp32."""
    return model_factory(layers=2, dim=32, heads=4, seed=21, token_row_overrides={"C": 7e4})


@pytest.fixture(scope="session")
def overflow_records():
    from helpers.embed_helpers import random_sequences  # here, not at the top: test_ci_skips copies this file alone

    no_c = np.array(list("ADEFGHIKLMNPQRSTVWY"))
    plain = random_sequences(6, (20, 80), seed=8, alphabet=no_c)
    with_c = [(f"cys{i}", seq[:10] + "C" + seq[10:])
              for i, (_, seq) in enumerate(random_sequences(4, (20, 80), seed=9, alphabet=no_c))]
    return plain[:3] + with_c[:2] + plain[3:] + with_c[2:]
