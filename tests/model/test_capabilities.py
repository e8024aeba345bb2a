"""What the workflow knows of a family before any job (embedpipe.model.capabilities' table, and
embed/combinations.py's CPU-only policies) is what the loaded model and the runtime say."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from embedpipe.core.errors import EmbedpipeError
from embedpipe.embed.combinations import CPU_ONLY_POLICIES
from embedpipe.model import describe, inspect, load_model
from embedpipe.model.capabilities import packs_by_family
from embedpipe.model.random_checkpoint import make_test_model
from embedpipe.model.random_hf import make_hf_test_model
from embedpipe.runtime import int8_policy  # noqa: F401 - registers int8-mixed in POLICIES
from embedpipe.runtime.int8_policy import Int8MixedPolicy
from embedpipe.runtime.precision import POLICIES


@pytest.mark.parametrize("family", ["esm2", "esm1b", "hf-esm", "hf-esm1b", "prot-t5", "ankh"])
def test_the_family_table_says_what_the_loaded_model_declares(tmp_path: Path, family: str) -> None:
    if family in ("esm2", "esm1b"):
        spec = tmp_path / f"{family}_test.pt"
        make_test_model(spec, layers=1, dim=16, heads=2, seed=0, family=family)
    else:
        spec = make_hf_test_model(tmp_path / family, family=family, layers=1, dim=16, heads=2)
    # a .pt path's layout (ESM-2's cfg or ESM-1b's args) is known once its header is read
    facts, loaded = (inspect if family == "esm1b" else describe)(str(spec)), load_model(str(spec))
    assert facts.family == loaded.family
    assert packs_by_family(facts.family) == ("packed" in loaded.batch_layouts)
    assert facts.token_layout == loaded.token_layout


def test_an_unlisted_family_is_left_to_its_loaded_model() -> None:
    assert packs_by_family("some-outside-family") is None


def test_the_cpu_only_policies_are_the_runtime_s() -> None:
    assert sorted(name for name, p in POLICIES.items() if isinstance(p, Int8MixedPolicy)) == sorted(CPU_ONLY_POLICIES)
    for name in CPU_ONLY_POLICIES:
        with pytest.raises(EmbedpipeError, match="runs on the CPU only"):
            POLICIES[name].check_device(torch.device("cuda"))
