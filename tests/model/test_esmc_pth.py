"""ESM C from the esm package's files: a ``.pth`` state dict, the release names ``esmc_300m`` /
``esmc_600m`` and their hub names in the local hub cache.

Independent computation: the same random weights written as transformers' ``EsmcModel``
directory (make-test-model --family esmc, whose forward tests/model/test_esmc.py checks against
transformers) give the same store through ``embedpipe embed``, bit for bit.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from embedpipe.cli import app
from embedpipe.core.errors import ModelError
from embedpipe.model import describe, esmc_pth_spec, fetch, inspect, load_model, registry
from embedpipe.model.esmc_pth import make_test_model as make_pth
from embedpipe.model.random_checkpoint import make_test_model as make_fair_esm
from embedpipe.model.random_hf import make_hf_test_model
from helpers.embed_helpers import write_fasta

RECORDS = [("a", "MKTAYIAKQRQISFVKSHFSRQ"), ("b", "ACDEFGHIKLMNPQRSTVWY"), ("rare", "UZOBXMKW"), ("w", "W")]
REPO_300M, FILE_300M = "EvolutionaryScale/esmc-300m-2024-12", "data/weights/esmc_300m_2024_12_v0.pth"
#: root attributes that name the model's files, which differ between the two layouts of the same
#: weights (``config`` holds the model's path, ``embed_identity`` its sha256), and each run's own stamps
FILE_ATTRS = {"model_name", "model_source", "model_sha256", "model_format", "config", "embed_identity",
              "attr_digests"}  # the digest of the root attributes differs because they do
RUN_STAMPS = {"created_utc", "finished_utc", "store_uuid"}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def embed_cli(model: Path | str, tmp: Path, name: str, *extra: str) -> Path:
    fasta = write_fasta(tmp / f"{name}.fasta", RECORDS)
    out = tmp / f"{name}.h5"
    result = CliRunner().invoke(app, ["embed", str(fasta), "--model", str(model), "--out", str(out), "--layers",
                                      "0,1,2", "--per-residue", "--pooling", "mean", "--pooling", "bos", "--quiet",
                                      *extra])
    assert result.exit_code == 0, result.output
    return out


def datasets(path: Path) -> dict[str, np.ndarray]:
    """Every dataset of a store, by its path (plain h5py)."""
    found: dict[str, np.ndarray] = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: found.__setitem__(name, obj[()]) if isinstance(obj, h5py.Dataset) else None)
        attrs = dict(f.attrs)
    found["__attrs__"] = attrs  # type: ignore[assignment]
    return found


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_the_pth_and_the_transformers_layout_of_the_same_weights_give_the_same_store(tmp_path: Path,
                                                                                      layout: str) -> None:
    from helpers.engine import engine_override

    pth = make_pth(tmp_path / "m.pth", layers=2, dim=128, seed=3)
    directory = make_hf_test_model(tmp_path / "hf", family="esmc", layers=2, dim=128, heads=2, seed=3, d_ff=512)
    with engine_override(batch_layout=layout):
        a = datasets(embed_cli(pth, tmp_path, "pth"))
        b = datasets(embed_cli(directory, tmp_path, "hf"))
    attrs_a, attrs_b = a.pop("__attrs__"), b.pop("__attrs__")
    assert sorted(a) == sorted(b) and any(k.startswith("per_residue/") for k in a)
    for name in a:  # vectors, ids, sequences, per-record provenance: bit for bit
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert a[name].tobytes() == b[name].tobytes(), name
    differ = {k for k in set(attrs_a) | set(attrs_b) if str(attrs_a.get(k)) != str(attrs_b.get(k))}
    assert differ - RUN_STAMPS == FILE_ATTRS, differ
    assert (attrs_a["model_family"], bool(attrs_a["model_trained"]), attrs_a["batch_layout"]) == ("esmc", False, layout)
    assert (attrs_a["model_format"], attrs_b["model_format"]) == ("esm-pth", "huggingface-esmc")
    assert (attrs_a["model_sha256"], attrs_a["model_name"]) == (sha256(pth), "m")
    import json

    assert json.loads(attrs_a["embed_identity"])["model_family"] == "esmc v1"


def hub_cache(tmp_path: Path, weights: Path, repo: str = REPO_300M, file: str = FILE_300M) -> Path:
    """A hub cache laid out as huggingface_hub leaves it, holding ``weights`` as the release's file."""
    root = tmp_path / "hub" / ("models--" + repo.replace("/", "--"))
    target = root / "snapshots" / "0a1b2c" / file
    target.parent.mkdir(parents=True)
    target.write_bytes(weights.read_bytes())
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text("0a1b2c")
    return target


def test_a_release_resolves_by_its_name_and_its_hub_name_from_the_cache(tmp_path: Path, monkeypatch) -> None:
    """A test-size file stands in for esmc_300m (its table says its sizes: 2 layers, width 128)."""
    pth = make_pth(tmp_path / "m.pth", layers=2, dim=128, seed=4)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setitem(esmc_pth_spec.RELEASES, "esmc_300m", esmc_pth_spec.Release(REPO_300M, FILE_300M, 2, 128, 2))
    cached = hub_cache(tmp_path, pth)
    direct = load_model(str(pth))
    for spec in ("esmc_300m", REPO_300M):
        assert registry.family_for(spec).name == "esmc-pth"
        named = load_model(spec)
        assert (named.name, named.source, named.family, named.sha256) == ("esmc_300m", str(cached), "esmc",
                                                                          sha256(pth))
        assert named.weights.keys() == direct.weights.keys()
        assert all(torch.equal(named.weights[k], direct.weights[k]) for k in direct.weights)
        assert registry.model_files(spec) == [cached]
        identity = registry.model_identity(spec)
        assert identity is not None and (identity.sha256, identity.family, identity.packs) == (sha256(pth), "esmc v1",
                                                                                                True)
        assert fetch.download_problem(spec) is None and fetch.fetch_model(spec) == cached
        with pytest.raises(ModelError, match=r"--dest is for fair-esm checkpoints; an ESM C release lives in the hub"):
            fetch.fetch_model(spec, tmp_path / "elsewhere")
        facts = describe(spec)
        assert (facts.kind, facts.num_layers, facts.embed_dim, facts.attention_heads) == ("name", 2, 128, 2)
        assert facts.weights_bytes == pth.stat().st_size


def test_a_named_release_checks_its_sizes(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    cached = hub_cache(tmp_path, make_pth(tmp_path / "m.pth", layers=2, dim=128, seed=4))
    with pytest.raises(ModelError) as refused:
        load_model("esmc_300m")
    assert str(refused.value) == (f"{cached} is not esmc_300m: its weights are an ESM C of 2 layers, width 128, "
                                  "where esmc_300m has 30 layers, width 960 (15 heads)")


def test_an_uncached_release_is_refused_in_one_line_saying_how_to_fetch_it(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    for spec in ("esmc_600m", "EvolutionaryScale/esmc-600m-2024-12"):
        with pytest.raises(ModelError) as refused:
            load_model(spec)
        message = str(refused.value)
        assert "\n" not in message and "'esmc_600m' is not in the local hub cache" in message
        assert "`hf download EvolutionaryScale/esmc-600m-2024-12`" in message and "never downloads" in message
        assert fetch.download_problem(spec) == message and registry.model_files(spec) == []
        facts = describe(spec)  # the release's sizes, without its file
        assert (facts.family, facts.kind, facts.num_layers, facts.embed_dim, facts.attention_heads) == (
            "esmc", "name", 36, 1152, 18)
    result = CliRunner().invoke(app, ["fetch-model", "esmc_600m"])
    assert result.exit_code == 1 and result.stderr.count("\n") == 1 and "hf download" in result.stderr


class MakesADirectory:
    """Unpickled, it would call ``os.mkdir(path)``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def _edited(tmp_path: Path, edit) -> Path:
    pth = make_pth(tmp_path / "good.pth", layers=2, dim=128, seed=5)
    state = torch.load(pth, weights_only=True)
    edit(state)
    bad = tmp_path / "bad.pth"
    torch.save(state, bad)
    return bad


def _set(key: str, value):
    return lambda state: state.__setitem__(key, value)


@pytest.mark.parametrize(("edit", "message"), [
    (lambda s: s.pop("transformer.blocks.1.ffn.3.weight"),
     "does not match an ESM C with 2 layers: missing transformer.blocks.1.ffn.3.weight"),
    (_set("transformer.blocks.0.attn.extra.weight", torch.zeros(3)),
     ": unexpected weights transformer.blocks.0.attn.extra.weight for an ESM C with 2 layers"),
    (lambda s: s.__setitem__("transformer.blocks.0.ffn.1.weight", s["transformer.blocks.0.ffn.1.weight"][:1000]),
     ": weight for 0.gate_up has shape (1000, 128), embed.weight's width says (1024, 128)"),
    (_set("embed.weight", torch.zeros(64, 96)), ": embed.weight is 96 wide, not a multiple of ESM C's head width 64"),
    (_set("embed.weight", torch.zeros(33, 128)), ": embed.weight has 33 rows, ESM C's embedding has 64"),
    (lambda s: s.pop("embed.weight"), " is not an ESM C state dict as the esm package saves it: no 2-D embed.weight"),
    (_set("transformer.blocks.5000.ffn.3.weight", torch.zeros(1)),
     ": transformer.blocks must be a positive integer no larger than 1024, got 5001"),
    (_set("step", 3), " is not an ESM C state dict as the esm package saves it: 'step' holds a int, not a tensor"),
    (_set(7, torch.zeros(1)), " is not an ESM C state dict as the esm package saves it: a key 7 that is not a weight's"),
    (lambda s: s["transformer.blocks.1.attn.out_proj.weight"].fill_(float("nan")), ": weights for 1.o hold NaN or inf"),
], ids=["missing", "extra", "mis-shaped", "width", "rows", "no-embed", "layers", "not-a-tensor", "int-key",
                                "nan"])
def test_a_malformed_pth_is_refused_in_one_line(tmp_path: Path, edit, message: str) -> None:
    bad = _edited(tmp_path, edit)
    with pytest.raises(ModelError) as refused:
        load_model(str(bad))
    assert str(refused.value).startswith(str(bad)) and message in str(refused.value), str(refused.value)
    assert "\n" not in str(refused.value)


def test_a_pth_that_is_no_torch_file_or_pickles_code_is_refused_in_one_line(tmp_path: Path) -> None:
    junk = tmp_path / "junk.pth"
    junk.write_bytes(b"not a torch file at all")
    with pytest.raises(ModelError, match=r"^cannot read ESM C state dict .*junk\.pth: not a weights-only torch file"):
        load_model(str(junk))
    evil = tmp_path / "evil.pth"
    torch.save({"embed.weight": torch.zeros(64, 128), "x": MakesADirectory(str(tmp_path / "ran"))}, evil)
    with pytest.raises(ModelError) as refused:
        load_model(str(evil))
    assert "refusing to load" in str(refused.value) and "posix.mkdir" in str(refused.value)
    assert "nothing in the file was executed" in str(refused.value) and "\n" not in str(refused.value)
    assert not (tmp_path / "ran").exists()
    with pytest.raises(ModelError, match=r"^ESM C weights not found: .*nope\.pth"):
        load_model(str(tmp_path / "nope.pth"))


def test_a_fair_esm_checkpoint_named_pth_stays_esm2(tmp_path: Path) -> None:
    pth = make_fair_esm(tmp_path / "fair.pth", layers=1, dim=16, heads=2, seed=0)
    assert registry.family_for(str(pth)).name == "fair-esm"
    assert load_model(str(pth)).family == "esm2"
    esm1b = make_fair_esm(tmp_path / "old.pth", layers=1, dim=16, heads=2, seed=0, family="esm1b")
    assert load_model(str(esm1b)).family == "esm1b"


def test_the_spec_says_what_the_loaded_model_answers(tmp_path: Path) -> None:
    from test_capabilities import assert_declared_as_loaded

    pth = make_pth(tmp_path / "m.pth", layers=3, dim=64, seed=6)
    facts = inspect(str(pth))  # shapes read, weights unread
    assert (facts.family, facts.num_layers, facts.embed_dim, facts.attention_heads, facts.trained) == (
        "esmc", 3, 64, 1, False)
    state = torch.load(pth, weights_only=True)
    assert facts.parameters == sum(v.numel() for v in state.values())
    assert_declared_as_loaded(str(pth), facts)


def test_make_test_model_writes_a_marked_pth_and_refuses_what_it_cannot(tmp_path: Path) -> None:
    out = tmp_path / "t.pth"
    result = CliRunner().invoke(app, ["make-test-model", str(out), "--family", "esmc-pth", "--seed", "2"])
    assert result.exit_code == 0, result.output
    state = torch.load(out, weights_only=True)
    assert state["embed.weight"].shape == (64, 128) and state["transformer.blocks.1.ffn.3.weight"].shape == (128, 512)
    assert state._metadata["embedpipe"]["trained"] is False and not load_model(str(out)).trained
    again = CliRunner().invoke(app, ["make-test-model", str(out), "--family", "esmc-pth", "--dim", "192"])
    assert again.exit_code == 0 and torch.load(out, weights_only=True)["embed.weight"].shape == (64, 192)
    foreign = tmp_path / "f.pth"
    foreign.write_text("mine")
    for args, words in [([str(foreign)], "exists and is not a test model make-test-model wrote"),
                        ([str(tmp_path / "x.pth"), "--dim", "96"], "--dim a multiple of 64 and --heads dim / 64"),
                        ([str(tmp_path / "x.pth"), "--dim", "128", "--heads", "4"], "not 128 and 4"),
                        ([str(tmp_path / "x.pt")], "must end in .pth")]:
        refused = CliRunner().invoke(app, ["make-test-model", *args, "--family", "esmc-pth"])
        assert refused.exit_code == 1 and words in refused.stderr and refused.stderr.count("\n") == 1, refused.stderr
    assert foreign.read_text() == "mine" and not (tmp_path / "x.pth").exists()
