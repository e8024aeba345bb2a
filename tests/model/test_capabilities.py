"""What the workflow knows of a family before any job (the capabilities its spec declares, and
extraction/combinations.py's CPU-only policies) is what the loaded model and the runtime say."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from embedpipe.core.errors import EmbedpipeError
from embedpipe.extraction.combinations import CPU_ONLY_POLICIES
from embedpipe.model import capabilities, describe, families, hf_checkpoint, inspect, load_model, plugins, registry
from embedpipe.model.facts import ModelFacts
from embedpipe.model.random_checkpoint import make_test_model
from embedpipe.model.random_hf import make_hf_test_model
from embedpipe.runtime import int8_policy  # noqa: F401 - registers int8-mixed in POLICIES
from embedpipe.runtime.int8_policy import Int8MixedPolicy
from embedpipe.runtime.precision import POLICIES
from helpers import fake_family_layout as fake

#: a test model of every format make-test-model writes (the family table's; ESM++, which it does
#: not write, in tests/model/test_esmc.py)
FAMILY_MODELS = [fmt.name for fmt in families.written()]


def written(tmp_path: Path, name: str) -> str:
    """The smallest test model of format ``name``, by its writer (its own width where it has one)."""
    fmt = families.format_named(name)
    assert fmt is not None and fmt.writer is not None
    out = tmp_path / (name + fmt.writer.suffix)
    return str(fmt.writer.write(out, name, given=("layers", "seed"), layers=1, dim=16, heads=2, seed=0))


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
    spec = written(tmp_path, family)
    # a .pt path's layout (ESM-2's cfg, ESM-1b's args, SaProt's config) is known once its header is
    # read (inspect, weights unread; the workflow reads it so too); describe's answer for it is below
    fair_esm = families.format_named(family) in families.of_reader(families.FAIR_ESM)
    assert_declared_as_loaded(spec, inspect(spec) if fair_esm else None)


def test_every_hugging_face_model_type_but_esm_plusplus_is_written_here() -> None:
    written_types = {fmt.hf.model_type for fmt in families.written() if fmt.hf is not None}
    assert set(hf_checkpoint.MODEL_TYPES) - {"ESMplusplus"} == written_types


def test_every_hugging_face_variant_is_told_apart(tmp_path: Path) -> None:
    """A variant shares its ``model_type`` (ESM-1b/1v: ``esm`` with absolute positions; SaProt:
    ``esm`` with a vocabulary of pair tokens; ProtT5, ProstT5 and Ankh: ``t5``); each make-test-model
    directory is read as its own format, markers left out (the content decides)."""
    for fmt in families.written():
        if fmt.hf is None:
            continue
        directory = Path(written(tmp_path, fmt.name))
        config = hf_checkpoint.read_config(directory)
        del config["embedpipe"]
        assert hf_checkpoint.format_for(str(directory), directory, config) is fmt, fmt.name


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
