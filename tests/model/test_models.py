"""embedpipe.model (ESM-2): test checkpoints, safe loading, resolving names and paths, downloads."""

from __future__ import annotations

import hashlib
import os
import pickle
import shutil
import threading
import urllib.error
import warnings
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from typer.testing import CliRunner

from embedpipe.cli import app
from embedpipe.core.errors import ModelError
from embedpipe.model import downloads as sources
from embedpipe.model import families, load_model
from embedpipe.model.checkpoint import load_checkpoint_safely
from embedpipe.model.downloads import companion_path, fetch_model, resolve_checkpoint
from embedpipe.model.esm2 import Esm2Model
from embedpipe.model.esm2_spec import ESM2_MODELS
from embedpipe.model.random_checkpoint import make_test_model
from helpers.embed_helpers import edit_test_checkpoint

SEQS = [
    ("a", "MKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQ"),
    ("b", "GGGGSGGGGSGGGGS"),
    ("c", "MKTAYIAKQRQISFVKSHFSRQLEERLGLIEVA"),
    ("d", "WWCCPPHHYYFFDDEE"),
]


def _sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _mean_embeddings(model, alphabet, layer: int) -> torch.Tensor:
    _, _, tokens = alphabet.get_batch_converter()(SEQS)
    with torch.no_grad():
        reps = model(tokens, repr_layers=[layer])["representations"][layer]
    return torch.stack([reps[i, 1 : len(s) + 1].mean(0) for i, (_, s) in enumerate(SEQS)])


# --------------------------------------------------------------------------- round trip


def test_round_trip_make_then_load(tiny_model_path: Path) -> None:
    assert tiny_model_path.name == "esm2_tiny_t2_32.pt"
    assert companion_path(tiny_model_path).is_file()
    loaded = load_model(str(tiny_model_path))
    assert isinstance(loaded, Esm2Model)
    assert loaded.name == "esm2_tiny_t2_32"
    assert loaded.source == str(tiny_model_path.resolve())
    assert loaded.sha256 == _sha256(tiny_model_path)
    assert loaded.trained is False
    assert (loaded.num_layers, loaded.embed_dim, loaded.attention_heads) == (2, 32, 4)

    model = loaded.model
    assert not model.training
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in model.parameters())
    assert not any(p.requires_grad for p in model.parameters())
    assert not any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
    assert model.lm_head.weight is model.embed_tokens.weight  # ESM-2's tie survives loading
    assert (model.num_layers, model.embed_dim, model.attention_heads) == (2, 32, 4)

    _, _, tokens = loaded.alphabet.get_batch_converter()(SEQS)
    with torch.no_grad():
        out = model(tokens, repr_layers=[0, 1, 2])
    for layer in (0, 1, 2):
        assert out["representations"][layer].shape == (len(SEQS), tokens.shape[1], 32)
    assert out["logits"].shape == (len(SEQS), tokens.shape[1], len(loaded.alphabet))


def test_each_load_returns_a_fresh_model(tiny_model_path: Path) -> None:
    first, second = load_model(str(tiny_model_path)), load_model(str(tiny_model_path))
    assert first.model is not second.model
    assert first.sha256 == second.sha256


def test_checkpoint_layout_is_fair_esms(tiny_model_path: Path) -> None:
    data = load_checkpoint_safely(tiny_model_path)
    assert set(data) == {"model", "cfg", "embedpipe"}
    assert all(k.startswith("encoder.sentence_encoder.") for k in data["model"])
    assert not any("contact_head" in k for k in data["model"])  # lives in the companion
    cfg = data["cfg"]["model"]
    assert (cfg.encoder_layers, cfg.encoder_embed_dim, cfg.encoder_attention_heads) == (2, 32, 4)
    assert cfg.token_dropout is True
    assert data["embedpipe"]["trained"] is False
    assert data["embedpipe"]["seed"] == 0
    assert data["embedpipe"]["created_by"] == "embedpipe make-test-model"
    regression = load_checkpoint_safely(companion_path(tiny_model_path))
    assert set(regression["model"]) == {"contact_head.regression.weight", "contact_head.regression.bias"}
    assert regression["model"]["contact_head.regression.weight"].shape == (1, 2 * 4)


# --------------------------------------------------------------------------- fair-esm as reference


def test_same_weights_and_outputs_as_fair_esm(tiny_model_path: Path, fair_esm_reference) -> None:
    ref_model, ref_alphabet = fair_esm_reference(tiny_model_path)
    loaded = load_model(str(tiny_model_path))
    ours, theirs = loaded.model.state_dict(), ref_model.state_dict()
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key
    assert loaded.alphabet.all_toks == ref_alphabet.all_toks
    assert torch.equal(_mean_embeddings(loaded.model, loaded.alphabet, 2), _mean_embeddings(ref_model, ref_alphabet, 2))


@pytest.mark.parametrize("prefix", ["encoder.", ""])
def test_other_state_dict_prefixes_load(model_factory, fair_esm_reference, prefix: str) -> None:
    path = model_factory(seed=5, key_prefix=prefix)
    reference = model_factory(seed=5)
    ours = load_model(str(path)).model.state_dict()
    theirs = fair_esm_reference(reference)[0].state_dict()
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


def test_load_by_path_without_companion(tiny_model_path: Path, tmp_path: Path) -> None:
    copy = tmp_path / "my_model.pt"
    shutil.copyfile(tiny_model_path, copy)
    assert not companion_path(copy).exists()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "regression weights not found" spam
        loaded = load_model(str(copy))
    assert loaded.name == "my_model"
    assert loaded.sha256 == _sha256(tiny_model_path)
    reference = load_model(str(tiny_model_path)).model.state_dict()
    state = loaded.model.state_dict()
    for key in reference:
        if not key.startswith("contact_head"):
            assert torch.equal(state[key], reference[key]), key
    assert torch.count_nonzero(state["contact_head.regression.weight"]) == 0


def test_file_name_does_not_decide_the_architecture(tiny_model_path: Path, tmp_path: Path) -> None:
    copy = tmp_path / "esm1b_t33_650M_UR50S.pt"  # a misleading name is ignored: cfg decides
    shutil.copyfile(tiny_model_path, copy)
    assert load_model(str(copy)).embed_dim == 32


def test_fp16_checkpoint_loads_as_fp32(model_factory) -> None:
    path = model_factory(seed=2, storage_dtype=torch.float16)
    assert load_checkpoint_safely(path)["model"]["encoder.sentence_encoder.embed_tokens.weight"].dtype == torch.float16
    loaded = load_model(str(path))
    assert all(p.dtype == torch.float32 for p in loaded.model.parameters())
    assert loaded.model.lm_head.weight is loaded.model.embed_tokens.weight


# --------------------------------------------------------------------------- weights


def test_random_weights_are_deterministic_by_seed(model_factory, tmp_path: Path) -> None:
    again = make_test_model(tmp_path / "esm2_again.pt", layers=2, dim=32, heads=4, seed=0)
    first = load_checkpoint_safely(model_factory(seed=0))["model"]
    second = load_checkpoint_safely(again)["model"]
    assert all(torch.equal(first[k], second[k]) for k in first)
    other = load_checkpoint_safely(model_factory(seed=1))["model"]
    key = "encoder.sentence_encoder.embed_tokens.weight"
    assert not torch.equal(first[key], other[key])


def test_making_a_model_leaves_the_global_rng_alone(tmp_path: Path) -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    make_test_model(tmp_path / "esm2_rng.pt", layers=1, dim=16, heads=2, seed=9)
    assert torch.equal(torch.rand(3), expected)


def test_random_model_is_not_degenerate(tiny_model_path: Path) -> None:
    loaded = load_model(str(tiny_model_path))
    for layer in (0, 1, 2):
        means = torch.nn.functional.normalize(_mean_embeddings(loaded.model, loaded.alphabet, layer), dim=1)
        cosine = means @ means.T
        assert torch.isfinite(cosine).all()
        # b and d share no residue with a: clearly different embeddings
        assert cosine[0, 1] < 0.9 and cosine[0, 3] < 0.9 and cosine[1, 3] < 0.9, cosine
    # no parameter is left constant (layer norms and biases are randomised too)
    for name, param in loaded.model.named_parameters():
        if param.numel() > 1 and not name.startswith("contact_head"):
            assert param.std() > 0, name


def test_token_row_override_and_edit_hook(model_factory, fair_esm_reference) -> None:
    path = model_factory(seed=3, token_row_overrides={"C": 7e4})
    loaded = load_model(str(path))
    c = loaded.alphabet.get_idx("C")
    assert torch.all(loaded.model.embed_tokens.weight[c] == 7e4)
    assert not torch.any(loaded.model.embed_tokens.weight[loaded.alphabet.get_idx("A")] == 7e4)
    ref_model, ref_alphabet = fair_esm_reference(path)
    assert torch.all(ref_model.embed_tokens.weight[ref_alphabet.get_idx("C")] == 7e4)

    def edit(state: dict[str, torch.Tensor]) -> None:
        state["emb_layer_norm_after.bias"] = torch.full_like(state["emb_layer_norm_after.bias"], 0.5)

    edited = load_model(str(model_factory(seed=3, edit=edit)))
    assert torch.all(edited.model.emb_layer_norm_after.bias == 0.5)
    assert load_checkpoint_safely(model_factory(seed=3, edit=edit))["embedpipe"]["edited"] is True


def test_unknown_override_token_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="not a token"):
        edit_test_checkpoint(make_test_model(tmp_path / "esm2_x.pt"), token_row_overrides={"CC": 1.0})


@pytest.mark.parametrize(
    ("dim", "heads", "message"),
    [(30, 4, "not divisible"), (12, 4, "must be even"), (32, 0, "positive integer")],
)
def test_invalid_shapes_are_refused(tmp_path: Path, dim: int, heads: int, message: str) -> None:
    with pytest.raises(ModelError, match=message):
        make_test_model(tmp_path / "bad.pt", dim=dim, heads=heads)
    assert not (tmp_path / "bad.pt").exists()


def test_make_test_model_writes_atomically(tmp_path: Path) -> None:
    make_test_model(tmp_path / "esm2_a.pt", layers=1, dim=16, heads=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["esm2_a-contact-regression.pt", "esm2_a.pt"]


# --------------------------------------------------------------------------- trained flag


def test_checkpoint_without_marker_counts_as_trained(tiny_model_path: Path, tmp_path: Path) -> None:
    data = load_checkpoint_safely(tiny_model_path)
    del data["embedpipe"]
    real_like = tmp_path / "real_like.pt"
    torch.save(data, real_like)
    assert load_model(str(real_like)).trained is True


def test_marker_without_explicit_true_is_untrained(tiny_model_path: Path, tmp_path: Path) -> None:
    data = load_checkpoint_safely(tiny_model_path)
    data["embedpipe"] = {"seed": 1}
    path = tmp_path / "odd_marker.pt"
    torch.save(data, path)
    assert load_model(str(path)).trained is False


# --------------------------------------------------------------------------- safety


class _RunsCode:
    """Unpickling this object would run ``touch MARKER``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch '{self.marker}'",))


class _WritesFile:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "pwned"))


@pytest.mark.parametrize("payload", [_RunsCode, _WritesFile])
def test_code_running_pickle_is_refused_and_not_run(tiny_model_path: Path, tmp_path: Path, payload) -> None:
    marker = tmp_path / "MARKER"
    # A real-looking checkpoint with one poisoned entry (torch.save writes a zip archive).
    data = load_checkpoint_safely(tiny_model_path)
    data["cfg"]["extra"] = payload(marker)
    evil = tmp_path / "evil.pt"
    torch.save(data, evil)
    assert not marker.exists()
    with pytest.raises(ModelError) as info:
        load_model(str(evil))
    message = str(info.value)
    assert str(evil) in message and "refusing" in message
    # the offending global is named (a bound method pickles as getattr(pathlib.Path, ...))
    assert ("system" in message) if payload is _RunsCode else ("pathlib.Path" in message)
    assert not marker.exists()


def test_plain_pickle_file_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "MARKER"
    evil = tmp_path / "plain.pt"
    evil.write_bytes(pickle.dumps({"model": _RunsCode(marker)}, protocol=2))  # not a zip archive
    with pytest.raises(ModelError, match="refusing to load .*system"):
        load_checkpoint_safely(evil)
    assert not marker.exists()


def test_poisoned_companion_is_refused(tiny_model_path: Path, tmp_path: Path) -> None:
    marker = tmp_path / "MARKER"
    model = tmp_path / "m.pt"
    shutil.copyfile(tiny_model_path, model)
    torch.save({"model": {"x": _RunsCode(marker)}}, companion_path(model))
    with pytest.raises(ModelError, match="contact-regression"):
        load_model(str(model))
    assert not marker.exists()


def test_corrupt_and_foreign_files(tmp_path: Path, tiny_model_path: Path) -> None:
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint")
    with pytest.raises(ModelError, match="cannot read checkpoint"):
        load_model(str(junk))
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(tiny_model_path.read_bytes()[:2000])
    with pytest.raises(ModelError, match="cannot read checkpoint"):
        load_model(str(truncated))
    plain = tmp_path / "state_dict_only.pt"
    torch.save({"model": {"w": torch.zeros(1)}}, plain)
    with pytest.raises(ModelError, match="no 'cfg'"):
        load_model(str(plain))
    esm1 = tmp_path / "esm1.pt"
    torch.save({"model": {}, "args": {"arch": "roberta_large"}}, esm1)
    with pytest.raises(ModelError, match="'args' must be an argparse.Namespace"):  # ESM-1b's layout, args malformed
        load_model(str(esm1))


def test_mismatched_weights_are_refused(tiny_model_path: Path, tmp_path: Path) -> None:
    data = load_checkpoint_safely(tiny_model_path)
    data["cfg"]["model"].encoder_layers = 3
    path = tmp_path / "wrong_layers.pt"
    torch.save(data, path)
    with pytest.raises(ModelError, match="missing"):
        load_model(str(path))

    data = load_checkpoint_safely(tiny_model_path)
    data["cfg"]["model"].encoder_embed_dim = 64
    path = tmp_path / "wrong_dim.pt"
    torch.save(data, path)
    with pytest.raises(ModelError, match="do not fit"):
        load_model(str(path))


class _CountOps(TorchDispatchMode):
    """Counts the aten ops that really run (names without overload), in this thread."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


RANDOM_INIT_OPS = {"uniform_", "normal_"}


def test_loading_skips_random_init_and_puts_it_back(tiny_model_path: Path, tmp_path: Path) -> None:
    """Constructor init is thrown-away work (minutes for 15B): skipped while building, and only
    there: torch.nn.init is never swapped, and init works again right after (also after an error)."""
    names = ("normal_", "uniform_", "kaiming_uniform_", "xavier_uniform_", "ones_", "zeros_")
    functions = {name: getattr(torch.nn.init, name) for name in names}
    with _CountOps() as ops:
        loaded = load_model(str(tiny_model_path))
    calls = [op for op in ops.calls if op in RANDOM_INIT_OPS]
    assert calls == []
    assert all(getattr(torch.nn.init, name) is function for name, function in functions.items())
    assert all(torch.isfinite(p).all() for p in loaded.model.parameters())

    data = load_checkpoint_safely(tiny_model_path)
    data["cfg"]["model"].encoder_embed_dim = 64
    torch.save(data, tmp_path / "wrong_dim.pt")
    with pytest.raises(ModelError):
        load_model(str(tmp_path / "wrong_dim.pt"))
    assert all(getattr(torch.nn.init, name) is function for name, function in functions.items())
    with _CountOps() as ops:
        torch.nn.Linear(3, 2)  # init works again outside the loader
    assert "uniform_" in ops.calls


def test_skipping_init_is_local_to_its_thread() -> None:
    """Another thread building a module meanwhile still initialises it."""
    from embedpipe.model.esm2 import skip_random_init

    built: list[torch.nn.Linear] = []
    with skip_random_init():
        worker = threading.Thread(target=lambda: built.append(torch.nn.Linear(64, 64)))
        worker.start()
        worker.join()
        skipped = torch.nn.Linear(64, 64)
    bound = 1 / 8  # kaiming_uniform_(a=sqrt(5)) on fan_in 64
    assert built[0].weight.abs().max() <= bound and built[0].weight.std() > bound / 4
    with torch.no_grad():
        skipped.weight.fill_(7.0)  # outside the block fills work again
    assert torch.all(skipped.weight == 7.0)


def test_legacy_format_checkpoint_loads_without_mmap(tiny_model_path: Path, tmp_path: Path) -> None:
    """Zip-format files are memory-mapped; pre-zip (legacy) files cannot be and are read whole."""
    legacy = tmp_path / "legacy.pt"
    torch.save(load_checkpoint_safely(tiny_model_path), legacy, _use_new_zipfile_serialization=False)
    with pytest.raises(RuntimeError, match="mmap"):
        torch.load(legacy, weights_only=True, mmap=True)  # the fallback's trigger
    ours = load_model(str(legacy)).model.state_dict()
    reference = load_model(str(tiny_model_path)).model.state_dict()
    for key in reference:
        if not key.startswith("contact_head"):  # no companion next to the copy
            assert torch.equal(ours[key], reference[key]), key


def test_untied_embedding_is_refused(tiny_model_path: Path, tmp_path: Path) -> None:
    data = load_checkpoint_safely(tiny_model_path)
    key = "encoder.sentence_encoder.embed_tokens.weight"
    data["model"][key] = data["model"][key].clone() + 1.0
    path = tmp_path / "untied.pt"
    torch.save(data, path)
    with pytest.raises(ModelError, match="lm_head.weight differ"):
        load_model(str(path))


# --------------------------------------------------------------------------- resolving names


def test_known_names() -> None:
    assert set(ESM2_MODELS) == {
        "esm2_t6_8M_UR50D",
        "esm2_t12_35M_UR50D",
        "esm2_t30_150M_UR50D",
        "esm2_t33_650M_UR50D",
        "esm2_t36_3B_UR50D",
        "esm2_t48_15B_UR50D",
    }
    for layers, dim, heads in ESM2_MODELS.values():
        assert dim % heads == 0 and (dim // heads) % 2 == 0 and layers > 0
    assert families.ESM2.window == 1022


def test_unknown_name_lists_valid_names() -> None:
    with pytest.raises(ModelError) as info:
        resolve_checkpoint("esm2_t99_huge")
    assert "esm2_t33_650M_UR50D" in str(info.value) and "esm2_t6_8M_UR50D" in str(info.value)
    assert "esm1b_t33_650M_UR50S" in str(info.value) and "esm1v_t33_650M_UR90S_5" in str(info.value)
    with pytest.raises(ModelError, match="unknown model"):
        fetch_model("esm1_t34_670M_UR50S")  # ESM-1 (not 1b) is not read


def test_missing_path_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="not found"):
        resolve_checkpoint(str(tmp_path / "nope.pt"))
    with pytest.raises(ModelError, match="not a file"):
        resolve_checkpoint(str(tmp_path))


@pytest.fixture
def empty_torch_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "torch_home"
    monkeypatch.setenv("TORCH_HOME", str(home))
    monkeypatch.delenv(sources.OFFLINE_ENV, raising=False)
    return home


def _no_network(url: str, dest: Path, **kwargs) -> None:
    raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")


def test_offline_name_error_says_how_to_prefetch(empty_torch_home: Path, monkeypatch) -> None:
    monkeypatch.setattr(sources, "_download", _no_network)
    with pytest.raises(ModelError) as info:
        load_model("esm2_t6_8M_UR50D")
    message = str(info.value)
    assert "embedpipe fetch-model esm2_t6_8M_UR50D" in message
    assert ".pt" in message and "configs/offline-demo.yaml" in message
    assert str(empty_torch_home) in message
    assert "\n" not in message
    checkpoints = empty_torch_home / "hub" / "checkpoints"
    assert not checkpoints.exists() or not any(checkpoints.iterdir())  # no partial file


def test_offline_env_skips_the_download(empty_torch_home: Path, monkeypatch) -> None:
    def must_not_download(*args, **kwargs):
        raise AssertionError("download attempted")

    monkeypatch.setattr(sources, "_download", must_not_download)
    monkeypatch.setenv(sources.OFFLINE_ENV, "1")
    with pytest.raises(ModelError, match="fetch-model esm2_t12_35M_UR50D"):
        resolve_checkpoint("esm2_t12_35M_UR50D")


def test_truncated_download_leaves_nothing(empty_torch_home: Path, monkeypatch) -> None:
    def partial(url: str, dest: Path, **kwargs) -> None:
        Path(dest).write_bytes(b"half a checkpoint")
        raise OSError("download truncated: 17 of 1000 bytes")

    monkeypatch.setattr(sources, "_download", partial)
    with pytest.raises(ModelError, match="truncated"):
        fetch_model("esm2_t6_8M_UR50D")
    checkpoints = empty_torch_home / "hub" / "checkpoints"
    assert list(checkpoints.iterdir()) == []


def test_fetch_then_load_by_name(empty_torch_home: Path, monkeypatch, tiny_model_path: Path) -> None:
    """A 'download' (served from a local test model) lands in the hub cache and loads by name;
    being a test model it still says trained = False."""
    urls: list[str] = []

    def serve(url: str, dest: Path, **kwargs) -> None:
        urls.append(url)
        source = companion_path(tiny_model_path) if "regression" in url else tiny_model_path
        shutil.copyfile(source, dest)

    monkeypatch.setattr(sources, "_download", serve)
    path = fetch_model("esm2_t6_8M_UR50D")
    assert path == empty_torch_home / "hub" / "checkpoints" / "esm2_t6_8M_UR50D.pt"
    assert companion_path(path).is_file()
    assert urls == [
        "https://dl.fbaipublicfiles.com/fair-esm/models/esm2_t6_8M_UR50D.pt",
        "https://dl.fbaipublicfiles.com/fair-esm/regression/esm2_t6_8M_UR50D-contact-regression.pt",
    ]
    assert sorted(p.name for p in path.parent.iterdir()) == [
        "esm2_t6_8M_UR50D-contact-regression.pt",
        "esm2_t6_8M_UR50D.pt",
    ]
    assert fetch_model("esm2_t6_8M_UR50D") == path and len(urls) == 2  # already there

    monkeypatch.setattr(sources, "_download", _no_network)  # cached: no network needed
    loaded = load_model("esm2_t6_8M_UR50D")
    assert loaded.name == "esm2_t6_8M_UR50D"
    assert loaded.source == str(path)
    assert loaded.trained is False
    assert loaded.sha256 == _sha256(tiny_model_path)


def test_fetch_into_dest_and_missing_companion_only_warns(tmp_path: Path, monkeypatch, tiny_model_path: Path) -> None:
    def serve(url: str, dest: Path, **kwargs) -> None:
        if "regression" in url:
            raise urllib.error.HTTPError(url, 404, "Not Found", {}, None)
        shutil.copyfile(tiny_model_path, dest)

    monkeypatch.setattr(sources, "_download", serve)
    with pytest.warns(UserWarning, match="contact-regression"):
        path = fetch_model("esm2_t12_35M_UR50D", dest=tmp_path / "weights")
    assert path == tmp_path / "weights" / "esm2_t12_35M_UR50D.pt"
    assert [p.name for p in path.parent.iterdir()] == ["esm2_t12_35M_UR50D.pt"]


def test_http_error_message(empty_torch_home: Path, monkeypatch) -> None:
    def not_found(url: str, dest: Path, **kwargs) -> None:
        raise urllib.error.HTTPError(url, 404, "Not Found", {}, None)

    monkeypatch.setattr(sources, "_download", not_found)
    with pytest.raises(ModelError, match="HTTP 404"):
        fetch_model("esm2_t6_8M_UR50D")


# --------------------------------------------------------------------------- CLI


def test_cli_make_test_model(tmp_path: Path, fair_esm_reference) -> None:
    out = tmp_path / "esm2_cli.pt"
    result = CliRunner().invoke(
        app, ["make-test-model", str(out), "--layers", "3", "--dim", "24", "--heads", "3", "--seed", "7"]
    )
    assert result.exit_code == 0, result.output
    assert str(out) in result.stdout
    assert companion_path(out).is_file()
    loaded = load_model(str(out))
    assert (loaded.num_layers, loaded.embed_dim, loaded.attention_heads) == (3, 24, 3)
    assert loaded.trained is False
    assert load_checkpoint_safely(out)["embedpipe"]["seed"] == 7
    ref_model, _ = fair_esm_reference(out)
    assert all(torch.equal(v, ref_model.state_dict()[k]) for k, v in loaded.model.state_dict().items())


def test_cli_make_test_model_bad_shape(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["make-test-model", str(tmp_path / "x.pt"), "--dim", "30"])
    assert result.exit_code == 1
    assert "embedpipe: error:" in result.stderr and "divisible" in result.stderr


def test_cli_fetch_model_offline(empty_torch_home: Path, monkeypatch) -> None:
    monkeypatch.setattr(sources, "_download", _no_network)
    result = CliRunner().invoke(app, ["fetch-model", "esm2_t6_8M_UR50D"])
    assert result.exit_code == 1
    # the user ran fetch-model already: the fix is where to run it, not to run it
    assert "run this same command where the internet is reachable" in result.stderr
    assert "embedpipe fetch-model" not in result.stderr


def test_download_streams_a_url_to_a_file(tmp_path: Path, tiny_model_path: Path) -> None:
    """The real download function, on a file:// URL (no network)."""
    dest = tmp_path / "copy.pt"
    sources._download(tiny_model_path.resolve().as_uri(), dest)
    assert _sha256(dest) == _sha256(tiny_model_path)


def test_fetch_model_respects_embedpipe_offline(tmp_path, monkeypatch):
    def no_network(*args, **kwargs):  # pragma: no cover - must not be reached
        raise AssertionError("fetch_model tried the network while EMBEDPIPE_OFFLINE is set")

    monkeypatch.setenv("EMBEDPIPE_OFFLINE", "1")
    monkeypatch.setattr(sources, "_download", no_network)
    with pytest.raises(ModelError, match="EMBEDPIPE_OFFLINE is set.*run this same command where the internet"):
        sources.fetch_model("esm2_t6_8M_UR50D", dest=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_checkpoint_sha256_is_cached_per_unchanged_file(tmp_path, monkeypatch):
    import json as _json

    from embedpipe.core import checksums

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = tmp_path / "weights.pt"
    path.write_bytes(b"abc" * 1000)
    first = checksums.file_sha256(path, cache=True)
    assert first == hashlib.sha256(b"abc" * 1000).hexdigest()
    entry = checksums._cache_file(path)
    saved = _json.loads(entry.read_text())
    saved["sha256"] = "cached-value"
    entry.write_text(_json.dumps(saved))
    assert checksums.file_sha256(path, cache=True) == "cached-value"  # unchanged file: no re-read
    assert checksums.file_sha256(path) == first  # cache only when asked
    path.write_bytes(b"abcd" * 1000)  # changed size and mtime: the cache entry no longer applies
    assert checksums.file_sha256(path, cache=True) == hashlib.sha256(b"abcd" * 1000).hexdigest()


def test_fetch_model_offline_does_not_tell_the_user_to_run_fetch_model(empty_torch_home: Path, monkeypatch) -> None:
    monkeypatch.setattr(sources, "_download", _no_network)
    with pytest.raises(ModelError) as info:
        fetch_model("esm2_t6_8M_UR50D")
    message = str(info.value)
    assert "embedpipe fetch-model" not in message and "run this same command where the internet is reachable" in message
    assert "snakemake --cores 2 --configfile configs/offline-demo.yaml" in message


def test_download_problem_is_none_for_a_cached_model_and_names_the_fix_offline(empty_torch_home: Path, monkeypatch):
    monkeypatch.setenv(sources.OFFLINE_ENV, "1")
    problem = sources.download_problem("esm2_t6_8M_UR50D")
    assert problem and "embedpipe fetch-model esm2_t6_8M_UR50D" in problem and "\n" not in problem
    target = sources.hub_checkpoint_path("esm2_t6_8M_UR50D")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(b"cached")
    assert sources.download_problem("esm2_t6_8M_UR50D") is None


def test_checkpoint_sha256_cache_misses_a_rewrite_in_place_with_mtime_set_back(tmp_path, monkeypatch):
    """``rsync --inplace --times`` or ``cp -p`` over a checkpoint: same inode, size and mtime,
    other bytes. The cache must not hand back the old weights' digest (ctime moved)."""
    import os as _os
    import time as _time

    from embedpipe.core import checksums

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = tmp_path / "weights.pt"
    path.write_bytes(b"old!" * 1000)
    before = path.stat()
    assert checksums.file_sha256(path, cache=True) == hashlib.sha256(b"old!" * 1000).hexdigest()
    _time.sleep(0.05)  # more than one kernel timestamp tick (coarse clocks tick every 4-10 ms)
    with open(path, "r+b") as fh:  # in place: same inode, same size
        fh.write(b"new!" * 1000)
    _os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))  # mtime set back
    after = path.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)
    assert checksums.file_sha256(path, cache=True) == hashlib.sha256(b"new!" * 1000).hexdigest()
