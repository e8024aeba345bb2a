"""Model specs, safe checkpoint loading, checksums, downloads and random-weight test models.

A model spec (``--model``) is either

* a fair-esm ESM-2 name (see :data:`ESM2_MODELS`), resolved through the torch hub cache
  (``torch.hub.get_dir()/checkpoints/NAME.pt``, the file fair-esm itself uses) and
  downloaded from fair-esm's URL when it is not there yet, or
* a path to a checkpoint in fair-esm's ESM-2 format: a dict with ``"model"`` (state dict,
  keys prefixed ``encoder.sentence_encoder.`` or ``encoder.``) and ``"cfg": {"model":
  Namespace(encoder_layers=, encoder_embed_dim=, encoder_attention_heads=, token_dropout=)}``.
  The ``NAME-contact-regression.pt`` companion is loaded when present and never required.

Checkpoints are read with ``torch.load(weights_only=True)`` and an allowlist that holds
only ``argparse.Namespace`` (the type of real checkpoints' config). A pickle that would
call anything else is refused before any of it runs. fair-esm 2.0.0's own loader calls
``torch.load`` without ``weights_only`` and fails on torch >= 2.6, so the model is built
here from the checkpoint's config (not from its file name) with fair-esm's ``ESM2`` class.

Untrained weights are marked inside the checkpoint with a top-level ``"embedpipe"`` dict
(``{"trained": False, ...}``), written by :func:`make_test_model`; fair-esm ignores it. A
checkpoint without the marker holds real (trained) weights.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import pickle
import re
import socket
import urllib.error
import urllib.request
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from embedpipe.atomic import atomic_path, atomic_paths, check_output_path
from embedpipe.batching import TRAINED_RESIDUES
from embedpipe.errors import ModelError

if TYPE_CHECKING:  # pragma: no cover
    import esm
    import torch

__all__ = [
    "ESM2_MODELS",
    "MODEL_URL",
    "REGRESSION_URL",
    "TRAINED_CONTEXT",
    "LoadedModel",
    "checkpoint_info",
    "companion_path",
    "fetch_model",
    "file_sha256",
    "hub_checkpoint_path",
    "is_model_name",
    "load_checkpoint_safely",
    "load_model",
    "make_test_model",
    "resolve_checkpoint",
]

#: fair-esm ESM-2 names -> (layers, embedding dim, attention heads).
ESM2_MODELS: dict[str, tuple[int, int, int]] = {
    "esm2_t6_8M_UR50D": (6, 320, 20),
    "esm2_t12_35M_UR50D": (12, 480, 20),
    "esm2_t30_150M_UR50D": (30, 640, 20),
    "esm2_t33_650M_UR50D": (33, 1280, 20),
    "esm2_t36_3B_UR50D": (36, 2560, 40),
    "esm2_t48_15B_UR50D": (48, 5120, 40),
}

#: ESM-2's trained maximum residues per forward window (1024 tokens including BOS and EOS).
TRAINED_CONTEXT = TRAINED_RESIDUES  # one definition, in batching (torch-free)

#: Same URL scheme as fair-esm's ``esm/pretrained.py``.
MODEL_URL = "https://dl.fbaipublicfiles.com/fair-esm/models/{name}.pt"
REGRESSION_URL = "https://dl.fbaipublicfiles.com/fair-esm/regression/{name}-contact-regression.pt"

#: Socket timeout (seconds) for downloads: a node without internet fails fast.
DOWNLOAD_TIMEOUT_S = 30.0

#: Set to 1/true/yes to never attempt a download while resolving a name (``fetch_model``
#: still downloads when called explicitly).
OFFLINE_ENV = "EMBEDPIPE_OFFLINE"

#: The only non-tensor type a checkpoint may contain (real checkpoints' ``cfg["model"]``).
SAFE_GLOBALS: tuple[type, ...] = (argparse.Namespace,)

#: State-dict prefixes fair-esm's ``upgrade_state_dict`` removes (first match wins).
STATE_DICT_PREFIXES = ("encoder.sentence_encoder.", "encoder.")
_PREFIX_RE = re.compile("^(?:" + "|".join(re.escape(p) for p in STATE_DICT_PREFIXES) + ")")

#: Keys a checkpoint may lack: the contact head lives in the optional companion file.
CONTACT_KEYS = frozenset({"contact_head.regression.weight", "contact_head.regression.bias"})

#: Top-level key of the untrained-weights marker written by :func:`make_test_model`.
MARKER_KEY = "embedpipe"



# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class LoadedModel:
    """A ready ESM-2: eval mode, fp32, on CPU, no gradients; plus where it came from."""

    model: "esm.model.esm2.ESM2"
    alphabet: "esm.data.Alphabet"
    name: str  # fair-esm name, or the checkpoint file's stem for a path
    source: str  # resolved checkpoint path
    sha256: str  # of the checkpoint file's bytes
    trained: bool  # False for random-weight test models (never present them as real)
    num_layers: int
    embed_dim: int
    attention_heads: int


# --------------------------------------------------------------------------- small helpers


def is_model_name(spec: str) -> bool:
    """Whether ``spec`` is one of fair-esm's ESM-2 names."""
    return spec in ESM2_MODELS


def _valid_names() -> str:
    return ", ".join(ESM2_MODELS)


def hub_checkpoint_path(name: str) -> Path:
    """Where fair-esm (torch hub) keeps ``name``: ``torch.hub.get_dir()/checkpoints/NAME.pt``.

    ``torch.hub.get_dir()`` follows ``TORCH_HOME`` (default ``~/.cache/torch``).
    """
    import torch

    return Path(torch.hub.get_dir()) / "checkpoints" / f"{name}.pt"


def companion_path(path: Path) -> Path:
    """The contact-regression companion of a checkpoint, named as fair-esm expects it."""
    path = Path(path)
    return Path(str(path.with_suffix("")) + "-contact-regression.pt")


def file_sha256(path: Path) -> str:
    """sha256 of a checkpoint's bytes (cached per unchanged file: checkpoints are gigabytes)."""
    from embedpipe.checksums import file_sha256 as _sha256

    try:
        return _sha256(path, cache=True)
    except OSError as exc:
        raise ModelError(f"cannot read checkpoint {path}: {exc.strerror or exc}") from None


def _offline() -> bool:
    return os.environ.get(OFFLINE_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


# --------------------------------------------------------------------------- safe loading


@contextlib.contextmanager
def _allowlisted() -> Iterator[None]:
    import torch.serialization as ts

    if hasattr(ts, "safe_globals"):  # torch >= 2.5: scoped, leaves global state alone
        with ts.safe_globals(list(SAFE_GLOBALS)):
            yield
    else:  # pragma: no cover - torch 2.4
        ts.add_safe_globals(list(SAFE_GLOBALS))
        yield


def _unsafe_globals(path: Path, message: str) -> list[str]:
    """Names of the globals that made a weights-only load fail (found without running anything)."""
    found: list[str] = []
    try:
        import torch.serialization as ts

        allowed = {f"{g.__module__}.{g.__qualname__}" for g in SAFE_GLOBALS}
        found = [g for g in ts.get_unsafe_globals_in_checkpoint(str(path)) if g not in allowed]
    except Exception:  # legacy (non-zip) files, or older torch: fall back to the message
        found = []
    if not found:
        found = re.findall(r"GLOBAL ([\w.]+)", message)
    return list(dict.fromkeys(found))


def _unpickler_detail(message: str) -> str:
    match = re.search(r"WeightsUnpickler error:\s*(.+?)(?:\n\n|$)", message, flags=re.S)
    return _one_line(match.group(1))[:200] if match else _one_line(message)[:200]


def _load_weights_only(path: Path) -> Any:
    """``torch.load(weights_only=True)``, memory-mapped where the file format allows.

    Why mmap: tensors are read on first use instead of all up front (0.26 s less start-up
    per job for a 35M model; for 15B, no 60 GB read into private memory before the cast).
    Files in the legacy (pre-zip) format cannot be mapped and are read whole.
    """
    import torch

    try:
        return torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as exc:
        if "mmap" not in str(exc):
            raise
        return torch.load(str(path), map_location="cpu", weights_only=True)


def load_checkpoint_safely(path: Path) -> dict:
    """``torch.load(path, weights_only=True)`` with only ``argparse.Namespace`` allowlisted.

    A pickle that references any other global (``os.system``, ``builtins.eval``, a class of
    some package, ...) is refused with a :class:`ModelError` naming the file and the global;
    nothing the file holds is executed. Unreadable or corrupt files are a ``ModelError`` too.
    """
    path = Path(path)
    if not path.is_file():
        raise ModelError(f"checkpoint not found: {path}")
    try:
        with _allowlisted():
            data = _load_weights_only(path)
    except pickle.UnpicklingError as exc:
        message = str(exc)
        names = _unsafe_globals(path, message)
        if names:
            raise ModelError(
                f"refusing to load {path}: its pickle references {', '.join(names)}, which a "
                f"weights-only load does not allow (a fair-esm checkpoint holds only tensors and "
                f"an argparse.Namespace); nothing in the file was executed"
            ) from None
        raise ModelError(
            f"cannot read checkpoint {path}: not a weights-only torch file "
            f"({_unpickler_detail(message)}); nothing in the file was executed"
        ) from None
    except MemoryError:
        raise
    except Exception as exc:  # corrupt zip, truncated file, not a torch file at all
        reason = _one_line(exc).split(". ")[0][:200] or type(exc).__name__
        raise ModelError(
            f"cannot read checkpoint {path}: {reason} (corrupt, truncated, or not a torch file)"
        ) from None
    if not isinstance(data, dict):
        raise ModelError(
            f"{path} is not a fair-esm checkpoint: expected a dict, found {type(data).__name__}"
        )
    return data


# --------------------------------------------------------------------------- checkpoint layout


def _cfg_get(cfg: Any, key: str, default: Any = None) -> Any:
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def _validate_shape(layers: Any, dim: Any, heads: Any, *, where: str) -> tuple[int, int, int]:
    for label, value in (("layers", layers), ("dim", dim), ("heads", heads)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ModelError(f"{where}: {label} must be a positive integer, got {value!r}")
    if dim % heads:
        raise ModelError(f"{where}: dim {dim} is not divisible by heads {heads}")
    if (dim // heads) % 2:
        raise ModelError(
            f"{where}: head dimension dim/heads = {dim}/{heads} = {dim // heads} must be even "
            f"(rotary embeddings rotate pairs of channels)"
        )
    return layers, dim, heads


def checkpoint_info(data: Mapping[str, Any], *, where: str = "checkpoint") -> dict[str, Any]:
    """Architecture and training marker of a loaded checkpoint dict (no model built).

    Returns ``{"num_layers", "embed_dim", "attention_heads", "token_dropout", "trained",
    "marker"}``. ``ModelError`` when the dict is not in fair-esm's ESM-2 layout.
    """
    if "model" not in data or not isinstance(data["model"], Mapping):
        raise ModelError(f"{where} is not a fair-esm checkpoint: no 'model' state dict")
    cfg_root = data.get("cfg")
    if cfg_root is None:
        if "args" in data:
            raise ModelError(
                f"{where} looks like an ESM-1/ESM-1b checkpoint ('args', no 'cfg'); embedpipe "
                f"supports ESM-2 only ({_valid_names()})"
            )
        raise ModelError(f"{where} is not a fair-esm ESM-2 checkpoint: no 'cfg'")
    cfg = _cfg_get(cfg_root, "model")
    if cfg is None:
        raise ModelError(f"{where} is not a fair-esm ESM-2 checkpoint: no cfg['model']")
    layers = _cfg_get(cfg, "encoder_layers")
    dim = _cfg_get(cfg, "encoder_embed_dim")
    heads = _cfg_get(cfg, "encoder_attention_heads")
    if layers is None or dim is None or heads is None:
        raise ModelError(
            f"{where}: cfg['model'] lacks encoder_layers / encoder_embed_dim / "
            f"encoder_attention_heads"
        )
    layers, dim, heads = _validate_shape(layers, dim, heads, where=where)
    token_dropout = bool(_cfg_get(cfg, "token_dropout", True))
    marker = data.get(MARKER_KEY)
    if marker is None:
        trained = True
    else:
        # Anything other than an explicit trained=True in a marker means "not real weights".
        trained = isinstance(marker, Mapping) and marker.get("trained") is True
    return {
        "num_layers": layers,
        "embed_dim": dim,
        "attention_heads": heads,
        "token_dropout": token_dropout,
        "trained": trained,
        "marker": dict(marker) if isinstance(marker, Mapping) else marker,
    }


def _upgrade_state_dict(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """fair-esm's ``upgrade_state_dict``: drop ``encoder.sentence_encoder.`` / ``encoder.``."""
    return {_PREFIX_RE.sub("", name): value for name, value in state_dict.items()}


# --------------------------------------------------------------------------- resolving


def _offline_message(name: str, target: Path, reason: str) -> str:
    return (
        f"model {name!r} is not in the local cache ({target}) and could not be downloaded "
        f"from {MODEL_URL.format(name=name)} ({reason}). On a machine with internet run "
        f"`embedpipe fetch-model {name}` (it fills the torch hub cache; point TORCH_HOME at a "
        f"shared directory, or use --dest DIR and pass that file), or pass a local fair-esm "
        f".pt checkpoint path as the model; configs/offline-demo.yaml runs without downloads"
    )


def resolve_checkpoint(spec: str) -> Path:
    """The checkpoint file for a model spec.

    A fair-esm name resolves to the torch hub cache and is downloaded when missing (unless
    ``EMBEDPIPE_OFFLINE`` is set); offline, a ``ModelError`` says how to pre-fetch it. Any
    other spec is a path that must exist.
    """
    spec = str(spec)
    if is_model_name(spec):
        target = hub_checkpoint_path(spec)
        if target.is_file():
            return target
        if _offline():
            raise ModelError(_offline_message(spec, target, f"{OFFLINE_ENV} is set"))
        return fetch_model(spec)
    path = Path(spec).expanduser()
    if path.is_file():
        return path.resolve()
    if path.exists():
        raise ModelError(f"model path {spec} is not a file (expected a fair-esm .pt checkpoint)")
    looks_like_path = spec.endswith(".pt") or os.sep in spec or "/" in spec
    if looks_like_path:
        raise ModelError(f"model checkpoint not found: {spec}")
    raise ModelError(
        f"unknown model {spec!r}: use a fair-esm ESM-2 name ({_valid_names()}) or a path to a "
        f"checkpoint in fair-esm's format (e.g. one written by `embedpipe make-test-model`)"
    )


# --------------------------------------------------------------------------- loading


# The in-place initialisers that torch.nn modules' reset_parameters call.
_INIT_FUNCTIONS = (
    "uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
    "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_",
)


@contextlib.contextmanager
def _skip_random_init() -> Iterator[None]:
    """Module constructors skip their random init: every parameter is then assigned from the
    checkpoint (the key check refuses a checkpoint that leaves one out), so the init is work
    thrown away (seconds for a 650M model, minutes for 15B). Restored on exit, also after an
    error.
    """
    import torch.nn.init as init

    saved = {name: getattr(init, name) for name in _INIT_FUNCTIONS if hasattr(init, name)}

    def keep(tensor, *args, **kwargs):
        return tensor

    try:
        for name in saved:
            setattr(init, name, keep)
        yield
    finally:
        for name, function in saved.items():
            setattr(init, name, function)


def _build_model(info: Mapping[str, Any], state_dict: dict[str, Any], *, where: str):
    """An ``ESM2`` from the cfg with ``state_dict`` assigned (no second copy of the weights)."""
    import esm
    import torch
    from esm.model.esm2 import ESM2

    alphabet = esm.data.Alphabet.from_architecture("ESM-1b")
    # Built without random init: the parameters are allocated but never written (pages
    # untouched), and the loaded tensors replace them (assign=True), so a 15B model's init
    # never runs. Not on the meta device: fair-esm computes rotary frequencies in its
    # constructor, and meta ops run through Python reference kernels that import
    # torch._dynamo (1.5 s per process).
    with _skip_random_init():
        model = ESM2(
            num_layers=info["num_layers"],
            embed_dim=info["embed_dim"],
            attention_heads=info["attention_heads"],
            alphabet=alphabet,
            token_dropout=info["token_dropout"],
        )
    expected = set(model.state_dict().keys())
    found = set(state_dict.keys())
    missing = sorted((expected - found) - CONTACT_KEYS)
    unexpected = sorted(found - expected)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}")
        if unexpected:
            parts.append(
                f"unexpected {', '.join(unexpected[:6])}{' ...' if len(unexpected) > 6 else ''}"
            )
        raise ModelError(
            f"{where} does not match an ESM-2 with {info['num_layers']} layers, dim "
            f"{info['embed_dim']}, {info['attention_heads']} heads: {'; '.join(parts)}"
        )
    for key, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            raise ModelError(f"{where}: state dict entry {key} is not a tensor")
        if value.is_floating_point() and not torch.isfinite(value).all():
            raise ModelError(f"{where}: weights {key} hold NaN or inf")

    # ESM-2 ties the LM head to the token embedding. fair-esm's copy-loading leaves both
    # equal to lm_head.weight; a checkpoint where the two differ was edited inconsistently.
    emb, head = state_dict.get("embed_tokens.weight"), state_dict.get("lm_head.weight")
    if emb is not None and head is not None and not torch.equal(emb, head):
        raise ModelError(
            f"{where}: embed_tokens.weight and lm_head.weight differ, but ESM-2 ties them "
            f"(fair-esm would silently use lm_head.weight); edit both or neither"
        )
    try:
        model.load_state_dict(state_dict, strict=False, assign=True)
    except RuntimeError as exc:  # shape mismatches
        raise ModelError(f"{where}: weights do not fit the configured ESM-2: {_one_line(exc)[:400]}") from None
    model.lm_head.weight = model.embed_tokens.weight  # re-tie

    if not (CONTACT_KEYS <= found):
        # No companion: a real (zeroed) contact head, so that no parameter stays uninitialised.
        # embedpipe never predicts contacts.
        in_features = model.contact_head.regression.in_features
        model.contact_head.regression = torch.nn.Linear(in_features, 1, bias=True)
        torch.nn.init.zeros_(model.contact_head.regression.weight)
        torch.nn.init.zeros_(model.contact_head.regression.bias)

    model = model.float().eval()
    model.requires_grad_(False)
    return model, alphabet


def load_model(spec: str) -> LoadedModel:
    """Resolve, checksum and safely load a model spec into a fresh fp32 CPU ``ESM2``.

    Each call returns a new model. The contact-regression companion is loaded (safely)
    when it sits next to the checkpoint, and is otherwise not needed.
    """
    path = resolve_checkpoint(spec)
    sha = file_sha256(path)
    data = load_checkpoint_safely(path)
    info = checkpoint_info(data, where=str(path))
    state_dict = _upgrade_state_dict(data["model"])
    del data

    companion = companion_path(path)
    if companion.is_file():
        regression = load_checkpoint_safely(companion)
        reg_state = regression.get("model", regression)
        if not isinstance(reg_state, Mapping):
            raise ModelError(f"{companion} is not a contact-regression checkpoint")
        reg_state = _upgrade_state_dict(reg_state)
        extra = set(reg_state) - CONTACT_KEYS
        if extra:
            raise ModelError(
                f"{companion}: unexpected keys {', '.join(sorted(extra)[:6])} in a "
                f"contact-regression file"
            )
        state_dict.update(reg_state)

    model, alphabet = _build_model(info, state_dict, where=str(path))
    name = spec if is_model_name(spec) else path.stem
    return LoadedModel(
        model=model,
        alphabet=alphabet,
        name=name,
        source=str(path),
        sha256=sha,
        trained=info["trained"],
        num_layers=info["num_layers"],
        embed_dim=info["embed_dim"],
        attention_heads=info["attention_heads"],
    )


# --------------------------------------------------------------------------- downloading


def _download(url: str, dest: Path, *, timeout: float = DOWNLOAD_TIMEOUT_S) -> None:
    """Stream ``url`` into ``dest`` (a temporary file the caller renames). Raises on failure,
    including a short read (fewer bytes than Content-Length)."""
    from embedpipe.progress import progress_bar

    request = urllib.request.Request(url, headers={"User-Agent": "embedpipe"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        length = response.headers.get("Content-Length")
        total = int(length) if length and length.isdigit() else None
        received = 0
        with open(dest, "wb") as fh, progress_bar(
            total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=Path(url).name
        ) as bar:
            while chunk := response.read(1024 * 1024):
                fh.write(chunk)
                received += len(chunk)
                bar.update(len(chunk))
    if total is not None and received != total:
        raise OSError(f"download truncated: {received} of {total} bytes")


def _fetch_one(url: str, target: Path) -> None:
    with atomic_path(target) as tmp:
        _download(url, tmp)
        if tmp.stat().st_size == 0:
            raise OSError("empty download")


def _network_reason(exc: BaseException) -> str:
    if isinstance(exc, urllib.error.HTTPError):
        return f"HTTP {exc.code} {exc.reason}"
    if isinstance(exc, urllib.error.URLError):
        return f"network error: {_one_line(exc.reason)}"
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return "network timeout"
    return _one_line(exc) or type(exc).__name__


def fetch_model(name: str, dest: Path | None = None) -> Path:
    """Download fair-esm model ``name`` (and its small contact-regression companion) into
    ``dest`` (a directory) or the torch hub cache; return the checkpoint path.

    Files are written under a temporary name and renamed, so an interrupted download never
    leaves a partial checkpoint. An already present checkpoint is not downloaded again.
    """
    if not is_model_name(name):
        raise ModelError(f"unknown model {name!r}: fetch-model takes one of {_valid_names()}")
    if dest is None:
        target = hub_checkpoint_path(name)
    else:
        dest = Path(dest).expanduser()
        if dest.exists() and not dest.is_dir():
            raise ModelError(f"--dest {dest} exists and is not a directory")
        target = dest / f"{name}.pt"
    if not target.is_file():
        if _offline():
            raise ModelError(_offline_message(name, target, f"{OFFLINE_ENV} is set"))
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ModelError(f"cannot create {target.parent}: {exc.strerror or exc}") from None
        try:
            _fetch_one(MODEL_URL.format(name=name), target)
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise ModelError(_offline_message(name, target, _network_reason(exc))) from None
    companion = companion_path(target)
    if not companion.is_file():
        try:
            _fetch_one(REGRESSION_URL.format(name=name), companion)
        except (urllib.error.URLError, OSError, ValueError) as exc:
            # Only fair-esm's contact prediction needs it; embeddings do not.
            warnings.warn(
                f"could not download the contact-regression companion of {name} "
                f"({_network_reason(exc)}); embeddings do not need it",
                stacklevel=2,
            )
    return target


# --------------------------------------------------------------------------- test models


def make_test_model(
    out: Path,
    *,
    layers: int = 2,
    dim: int = 32,
    heads: int = 4,
    seed: int = 0,
    token_dropout: bool = True,
    key_prefix: str = "encoder.sentence_encoder.",
    storage_dtype: "torch.dtype | None" = None,
    token_row_overrides: Mapping[str, float] | None = None,
    edit: Callable[[dict[str, "torch.Tensor"]], None] | None = None,
    companion: bool = True,
) -> Path:
    """Write a random-weight (untrained) ESM-2 in fair-esm's checkpoint format.

    ``out`` gets ``{"model": state dict with key_prefix, "cfg": {"model": Namespace(...)},
    "embedpipe": {"trained": False, "seed": ..., ...}}``; the companion
    ``OUT-without-suffix-contact-regression.pt`` gets the contact head (so fair-esm's own
    ``load_model_and_alphabet_local`` loads the file when its name starts with ``esm2``).
    Both are written before either is renamed into place (the companion first), so a
    failure (a full disk) leaves neither.

    Weights are fair-esm's default init, with the layer-norm scales and the biases that
    init leaves constant drawn at random too, so every parameter matters; deterministic
    in ``seed``. ``token_row_overrides`` sets whole rows of ``embed_tokens.weight``
    (e.g. ``{"C": 7e4}``); ``edit`` gets the unprefixed state dict (tensors aliasing the
    model's, embed and LM head tied) to change in place or replace entries. ``storage_dtype``
    (e.g. ``torch.float16``) stores the weights in a lower dtype, as some releases do.
    """
    import esm
    import torch
    from esm.model.esm2 import ESM2

    out = Path(out)
    layers, dim, heads = _validate_shape(layers, dim, heads, where="make-test-model")
    check_output_path(out)
    if companion:
        check_output_path(companion_path(out))

    alphabet = esm.data.Alphabet.from_architecture("ESM-1b")
    overrides = dict(token_row_overrides or {})
    for token in overrides:
        if token not in alphabet.tok_to_idx:
            raise ModelError(f"make-test-model: {token!r} is not a token of the ESM-2 alphabet")

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = ESM2(
            num_layers=layers,
            embed_dim=dim,
            attention_heads=heads,
            alphabet=alphabet,
            token_dropout=token_dropout,
        )
        with torch.no_grad():
            for pname, param in model.named_parameters():
                flat = param.detach().flatten()
                if flat.numel() < 2 or not bool((flat == flat[0]).all()):
                    continue
                noise = torch.randn(param.shape)
                if pname.endswith(".weight"):  # layer-norm scales around 1
                    param.copy_(1.0 + 0.1 * noise)
                else:  # biases around 0
                    param.copy_(0.05 * noise)
    model.eval()

    state = model.state_dict()  # detached tensors sharing the model's storage
    with torch.no_grad():
        for token, value in overrides.items():
            state["embed_tokens.weight"][alphabet.get_idx(token)].fill_(float(value))
        if edit is not None:
            edit(state)
            # Entries the hook replaced go back into the model; the tie keeps embed == LM head.
            model.load_state_dict(state, strict=True)
    state = model.state_dict()
    if storage_dtype is not None:
        if not storage_dtype.is_floating_point:
            raise ModelError(f"make-test-model: storage dtype {storage_dtype} is not floating point")
        # Cast the shared tensor once so that embed and LM head stay one storage in the file.
        cast: dict[int, torch.Tensor] = {}
        for key, value in list(state.items()):
            if value.is_floating_point() and not key.endswith("inv_freq"):
                ptr = value.data_ptr()
                if ptr not in cast:
                    cast[ptr] = value.to(storage_dtype)
                state[key] = cast[ptr]

    main_state = {key_prefix + k: v for k, v in state.items() if k not in CONTACT_KEYS}
    regression_state = {k: v.clone() for k, v in state.items() if k in CONTACT_KEYS}
    cfg = argparse.Namespace(
        arch="esm2",
        encoder_layers=layers,
        encoder_embed_dim=dim,
        encoder_ffn_embed_dim=4 * dim,
        encoder_attention_heads=heads,
        token_dropout=token_dropout,
        max_positions=TRAINED_CONTEXT + 2,
    )
    from embedpipe import __version__

    marker = {
        "trained": False,
        "seed": int(seed),
        "created_by": "embedpipe make-test-model",
        "embedpipe_version": __version__,
        "torch_version": str(torch.__version__),
        "init": "fair-esm default; constant-initialised layer-norm scales and biases randomised",
        "token_row_overrides": {k: float(v) for k, v in overrides.items()},
        "edited": edit is not None,
    }
    checkpoint = {"model": main_state, "cfg": {"model": cfg}, MARKER_KEY: marker}
    if companion:
        # both written before either is renamed into place: a failure leaves neither behind
        with atomic_paths(companion_path(out), out) as (tmp_companion, tmp):
            _save(torch, {"model": regression_state}, tmp_companion)
            _save(torch, checkpoint, tmp)
    else:
        with atomic_paths(out) as (tmp,):
            _save(torch, checkpoint, tmp)
    return out


def _save(torch: Any, obj: Any, path: Path) -> None:
    """``torch.save`` through memory, so that a failed write (a full disk) is an ``OSError``
    naming ``path`` (torch's own file writer reports it as a RuntimeError without the cause)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    try:
        with open(path, "wb") as fh:
            fh.write(buffer.getbuffer())
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, str(path)) from None
