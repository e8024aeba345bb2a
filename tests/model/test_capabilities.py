"""What the workflow knows of a family before any job (the capabilities its spec declares, and
embed/combinations.py's CPU-only policies) is what the loaded model and the runtime say."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from embedpipe.core.errors import EmbedpipeError
from embedpipe.embed.combinations import CPU_ONLY_POLICIES
from embedpipe.model import capabilities, describe, hf_checkpoint, load_model, plugins, registry
from embedpipe.model.random_checkpoint import make_test_model
from embedpipe.model.random_hf import make_hf_test_model
from embedpipe.runtime import int8_policy  # noqa: F401 - registers int8-mixed in POLICIES
from embedpipe.runtime.int8_policy import Int8MixedPolicy
from embedpipe.runtime.precision import POLICIES
from helpers import fake_family_layout as fake

#: a test model of every family embedpipe registers: make-test-model's formats (fair-esm and one
#: directory per Hugging Face ``model_type`` it writes; ESM++ in tests/model/test_esmc.py)
FAMILY_MODELS = ("esm2", "hf-esm", "saprot", "prot-t5", "prostt5", "ankh", "esmc")
#: model_type of each make-test-model family (the Hugging Face spec it is declared by)
MODEL_TYPES = {"hf-esm": "esm", "saprot": "esm", "prot-t5": "t5", "prostt5": "t5", "ankh": "t5", "esmc": "esmc"}


def assert_declared_as_loaded(spec: str) -> None:
    """What the torch-free spec says (describe: the workflow's checks; the file identity: the
    run predicted for ``--reuse``) equals what the loaded model answers."""
    facts, identity, loaded = describe(spec), registry.model_identity(spec), load_model(spec)
    assert facts.family == loaded.family
    assert facts.packs == capabilities.packs(loaded)
    assert facts.token_layout == loaded.token_layout
    assert facts.trained_window == loaded.trained_window
    assert identity is None or identity.packs == capabilities.packs(loaded)


@pytest.mark.parametrize("family", FAMILY_MODELS)
def test_every_family_s_spec_says_what_its_loaded_model_answers(tmp_path: Path, family: str) -> None:
    if family == "esm2":
        spec = tmp_path / "esm2_test.pt"
        make_test_model(spec, layers=1, dim=16, heads=2, seed=0)
    else:
        spec = make_hf_test_model(tmp_path / family, family=family, layers=1, dim=16, heads=2)
    assert_declared_as_loaded(str(spec))


def test_every_hugging_face_model_type_but_esm_plusplus_is_covered_here() -> None:
    assert set(hf_checkpoint.FAMILIES) - {"ESMplusplus"} == set(MODEL_TYPES.values())
    assert set(MODEL_TYPES) | {"esm2"} == set(FAMILY_MODELS)


def test_esm_c_packs_before_its_model_loads(tmp_path: Path) -> None:
    """The drift this catches: ESM C's spec and model packed while the workflow's table said
    nothing of it (a batch-layout check before any job left it to the job)."""
    spec = make_hf_test_model(tmp_path / "esmc", family="esmc", layers=1, dim=16, heads=2)
    assert describe(str(spec)).packs is True


def test_a_plugin_family_declares_its_capabilities_in_its_describe(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "FAMILIES", list(registry.FAMILIES))
    monkeypatch.setenv(plugins.ENV, fake.__name__)
    assert_declared_as_loaded(fake.PREFIX + "toy")


def test_the_cpu_only_policies_are_the_runtime_s() -> None:
    assert sorted(name for name, p in POLICIES.items() if isinstance(p, Int8MixedPolicy)) == sorted(CPU_ONLY_POLICIES)
    for name in CPU_ONLY_POLICIES:
        with pytest.raises(EmbedpipeError, match="runs on the CPU only"):
            POLICIES[name].check_device(torch.device("cuda"))
