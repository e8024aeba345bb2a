"""The cross-check's fp32 re-run is a ``ResolvedRun`` built by ``resolve_run`` (through
``resolve_loaded``), with the attention kernel the store records: a store made under an
``EMBEDPIPE_ENGINE`` override is compared with the same kernel, and the run resolves once."""

from __future__ import annotations

import numpy as np
import pytest

import embedpipe.extraction.resolved as resolved_module
from embedpipe.core.errors import EmbedpipeError
from embedpipe.crosscheck.reference import _reference_options
from embedpipe.crosscheck.run import run_crosscheck
from embedpipe.runtime.engine_override import EngineChoice
from helpers.embed_helpers import embed_store, random_sequences


@pytest.mark.parametrize(("provenance", "kernel"), [
    ({"attention": "math", "config": {"tokens_per_batch": "auto"}}, "math"),  # a store written now: the root attribute
    ({"attention": "sdpa", "config": {"attention": "fair-esm"}}, "fair-esm"),  # an older store: its config's option
    ({"config": {}}, "sdpa"),  # neither: the derived kernel
])
def test_the_reference_takes_the_kernel_the_store_records(provenance, kernel) -> None:
    options, engine, settings = _reference_options(provenance, [1], per_residue=False)
    assert engine == EngineChoice(attention=kernel) and settings["attention"] == kernel
    assert options.precision == "fp32"


def test_a_kernel_this_embedpipe_does_not_run_is_one_line() -> None:
    with pytest.raises(EmbedpipeError) as refused:
        _reference_options({"attention": "flash"}, [1], per_residue=False)
    assert str(refused.value) == "the store records attention 'flash'; this embedpipe runs sdpa, math, fair-esm"


def test_a_store_made_with_the_math_kernel_is_rechecked_with_it(tmp_path, tiny_model_path, monkeypatch) -> None:
    store = embed_store(tmp_path, tiny_model_path, random_sequences(6, (10, 60), seed=3), "math", device="cpu",
                        attention="math")
    runs: list = []
    real = resolved_module.resolve_run
    monkeypatch.setattr(resolved_module, "resolve_run", lambda *a, **k: runs.append(k.get("engine")) or real(*a, **k))
    report = run_crosscheck(store, out=tmp_path / "cc", sample=6, seed=1, device="cpu", quiet=True)
    assert runs == [EngineChoice(attention="math")]  # one run, resolved with the store's kernel
    assert report.data["reference"]["attention"] == "math"
    # fp32 with the same kernel on the same machine: the stored vectors exactly
    assert len(report.data["records"]) >= 6
    assert all(np.isclose(r["pooled_cosine"], 1.0, atol=1e-7) for r in report.data["records"]), report.data["records"][:2]
