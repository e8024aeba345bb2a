"""What the workflow knows of a family before any job (the capabilities its spec declares, and
extraction/combinations.py's CPU-only policies) is what the loaded model and the runtime say."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from embedpipe.core.errors import EmbedpipeError
from embedpipe.extraction.combinations import CPU_ONLY_POLICIES
from embedpipe.model import capabilities, describe, hf_checkpoint, inspect, load_model, plugins, registry
from embedpipe.model.facts import ModelFacts
from embedpipe.model.random_checkpoint import make_test_model
from embedpipe.model.random_hf import make_hf_test_model
from embedpipe.runtime import int8_policy  # noqa: F401 - registers int8-mixed in POLICIES
from embedpipe.runtime.int8_policy import Int8MixedPolicy
from embedpipe.runtime.precision import POLICIES
from helpers import fake_family_layout as fake

#: a test model of every family embedpipe registers: make-test-model's formats (fair-esm's two
#: .pt layouts and one directory per Hugging Face ``model_type`` or variant it writes; ESM++ in
#: tests/model/test_esmc.py)
FAMILY_MODELS = ("esm2", "esm1b", "hf-esm", "hf-esm1b", "saprot", "prot-t5", "prostt5", "ankh", "esmc")
#: fair-esm .pt families (make-test-model's default format)
FAIR_ESM = ("esm2", "esm1b")
#: model_type of each make-test-model family (the Hugging Face spec it is declared by)
MODEL_TYPES = {"hf-esm": "esm", "hf-esm1b": "esm", "saprot": "esm", "prot-t5": "t5", "prostt5": "t5", "ankh": "t5",
               "esmc": "esmc"}


def assert_declared_as_loaded(spec: str, facts: ModelFacts | None = None) -> None:
    """What the torch-free spec says (describe: the workflow's checks; the file identity: the
    run predicted for ``--reuse``) equals what the loaded model answers (``facts``: the spec's
    answer when it is not ``describe``'s)."""
    facts = describe(spec) if facts is None else facts
    identity, loaded = registry.model_identity(spec), load_model(spec)
    assert facts.family == loaded.family
    assert facts.packs == capabilities.packs(loaded)
    assert facts.token_layout == loaded.token_layout
    assert facts.trained_window == loaded.trained_window
    assert identity is None or identity.packs == capabilities.packs(loaded)


@pytest.mark.parametrize("family", FAMILY_MODELS)
def test_every_family_s_spec_says_what_its_loaded_model_answers(tmp_path: Path, family: str) -> None:
    if family in FAIR_ESM:
        spec = tmp_path / f"{family}_test.pt"
        make_test_model(spec, layers=1, dim=16, heads=2, seed=0, family=family)
    else:
        spec = make_hf_test_model(tmp_path / family, family=family, layers=1, dim=16, heads=2)
    # a .pt path's layout (ESM-2's cfg or ESM-1b's args) is known once its header is read
    # (inspect, weights unread; the workflow reads it so too); describe's answer for it is below
    assert_declared_as_loaded(str(spec), inspect(str(spec)) if family == "esm1b" else None)


def test_every_hugging_face_model_type_but_esm_plusplus_is_covered_here() -> None:
    assert set(hf_checkpoint.FAMILIES) - {"ESMplusplus"} == set(MODEL_TYPES.values())
    assert set(MODEL_TYPES) | set(FAIR_ESM) == set(FAMILY_MODELS)


def test_every_hugging_face_variant_is_covered_here(tmp_path: Path) -> None:
    """A variant shares its ``model_type`` (ESM-1b/1v: ``esm`` with absolute positions; SaProt:
    ``esm`` with a vocabulary of pair tokens); each
    make-test-model directory is read as one family, and together they are every variant."""
    directories = [make_hf_test_model(tmp_path / family, family=family, layers=1, dim=16, heads=2)
                   for family in MODEL_TYPES]
    read = {hf_checkpoint.family_for_config(directory, hf_checkpoint.read_config(directory)).label
            for directory in directories}
    assert {v.label for v in hf_checkpoint.VARIANTS} <= read


def test_an_esm1b_name_s_table_says_what_its_loaded_model_answers(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """An ESM-1v name in the torch hub cache: its facts from the name table (torch-free)."""
    name = "esm1v_t33_650M_UR90S_1"
    cached = tmp_path / "torch" / "hub" / "checkpoints" / f"{name}.pt"
    cached.parent.mkdir(parents=True)
    make_test_model(cached, layers=1, dim=16, heads=2, seed=0, family="esm1b", companion=False)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    monkeypatch.setenv("EMBEDPIPE_OFFLINE", "1")
    assert describe(name).family == "esm1b"
    assert_declared_as_loaded(name)


def test_an_esm1b_path_s_torch_free_facts_already_declare_its_capabilities(tmp_path: Path) -> None:
    """Before its header is read a .pt path is described as ESM-2 (torch-free, while the workflow
    parses); ESM-1b declares the same capabilities, so the checks made on them hold."""
    spec = make_test_model(tmp_path / "esm1b_test.pt", layers=1, dim=16, heads=2, seed=0, family="esm1b")
    facts, loaded = describe(str(spec)), load_model(str(spec))
    assert (facts.packs, facts.token_layout, facts.trained_window) == \
        (capabilities.packs(loaded), loaded.token_layout, loaded.trained_window)


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
