"""Reading fair-esm ESM-2 checkpoints safely, and what their config says.

A checkpoint in fair-esm's ESM-2 format (ESM-1b's: :mod:`embedpipe.model.esm1b`) is a dict with ``"model"`` (state dict, keys
prefixed ``encoder.sentence_encoder.`` or ``encoder.``) and ``"cfg": {"model":
Namespace(encoder_layers=, encoder_embed_dim=, encoder_attention_heads=, token_dropout=)}``.

Checkpoints are read with ``torch.load(weights_only=True)`` and an allowlist that holds
only ``argparse.Namespace`` (the type of real checkpoints' config). A pickle that would
call anything else is refused before any of it runs. fair-esm 2.0.0's own loader calls
``torch.load`` without ``weights_only`` and fails on torch >= 2.6, so the model is built
from the checkpoint's config (not from its file name) by :mod:`embedpipe.model.esm2`.

Untrained weights are marked inside the checkpoint with a top-level ``"embedpipe"`` dict
(``{"trained": False, ...}``), written by :func:`embedpipe.model.random_checkpoint.make_test_model`;
fair-esm ignores it. A checkpoint without the marker holds real (trained) weights.
"""

from __future__ import annotations

import argparse
import contextlib
import pickle
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.serialization as ts

from embedpipe.core.errors import ModelError, one_line, out_of_memory
from embedpipe.model.config_bounds import validate_shape  # re-exported: make-test-model, hf_esm

#: The only non-tensor type a checkpoint may contain (real checkpoints' ``cfg["model"]``).
SAFE_GLOBALS: tuple[type, ...] = (argparse.Namespace,)

#: State-dict prefixes fair-esm's ``upgrade_state_dict`` removes (first match wins).
STATE_DICT_PREFIXES = ("encoder.sentence_encoder.", "encoder.")
_PREFIX_RE = re.compile("^(?:" + "|".join(re.escape(p) for p in STATE_DICT_PREFIXES) + ")")

#: Keys a checkpoint may lack: the contact head lives in the optional companion file.
CONTACT_KEYS = frozenset({"contact_head.regression.weight", "contact_head.regression.bias"})

#: Top-level key of the untrained-weights marker written by ``make_test_model``.
MARKER_KEY = "embedpipe"


@contextlib.contextmanager
def _allowlisted() -> Iterator[None]:
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
        allowed = {f"{g.__module__}.{g.__qualname__}" for g in SAFE_GLOBALS}
        found = [g for g in ts.get_unsafe_globals_in_checkpoint(str(path)) if g not in allowed]
    except Exception:  # legacy (non-zip) files, or older torch: fall back to the message
        found = []
    if not found:
        found = re.findall(r"GLOBAL ([\w.]+)", message)
    return list(dict.fromkeys(found))


def _unpickler_detail(message: str) -> str:
    match = re.search(r"WeightsUnpickler error:\s*(.+?)(?:\n\n|$)", message, flags=re.S)
    return one_line(match.group(1))[:200] if match else one_line(message)[:200]


def _load_weights_only(path: Path) -> Any:
    """``torch.load(weights_only=True)``, memory-mapped where the file format allows.

    Why mmap: tensors are read on first use instead of all up front (0.26 s less start-up
    per job for a 35M model; for 15B, no 60 GB read into private memory before the cast).
    Files in the legacy (pre-zip) format cannot be mapped and are read whole.
    """
    try:
        return torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as exc:
        if "mmap" not in str(exc):
            raise
        return torch.load(str(path), map_location="cpu", weights_only=True)


@dataclass(frozen=True)
class FileRole:
    """What a torch file is to the caller, as its one-line errors name it: a refusal says what
    the file should have held, not "a fair-esm checkpoint" for a Hugging Face weights file."""

    noun: str  # "checkpoint", "Hugging Face weights file"
    article: str  # "a fair-esm checkpoint", "a Hugging Face weights file"
    holds: str  # what it holds when it is what it says it is


FAIR_ESM = FileRole("checkpoint", "a fair-esm checkpoint", "only tensors and an argparse.Namespace")
HF_WEIGHTS = FileRole("Hugging Face weights file", "a Hugging Face weights file", "only tensors")


def load_checkpoint_safely(path: Path, role: FileRole = FAIR_ESM) -> dict:
    """``torch.load(path, weights_only=True)`` with only ``argparse.Namespace`` allowlisted.

    A pickle that references any other global (``os.system``, ``builtins.eval``, a class of
    some package, ...) is refused with a :class:`ModelError` naming the file, its ``role``
    and the global; nothing the file holds is executed. Unreadable or corrupt files are a
    ``ModelError`` too.
    """
    path = Path(path)
    if not path.is_file():
        raise ModelError(f"{role.noun} not found: {path}")
    try:
        with _allowlisted():
            data = _load_weights_only(path)
    except pickle.UnpicklingError as exc:
        message = str(exc)
        names = _unsafe_globals(path, message)
        if names:
            raise ModelError(
                f"refusing to load {path}: its pickle references {', '.join(names)}, which a "
                f"weights-only load does not allow ({role.article} holds {role.holds}); nothing in "
                f"the file was executed"
            ) from None
        raise ModelError(
            f"cannot read {role.noun} {path}: not a weights-only torch file "
            f"({_unpickler_detail(message)}); nothing in the file was executed"
        ) from None
    except Exception as exc:  # corrupt zip, truncated file, not a torch file at all
        if out_of_memory(exc):  # no refusal: more memory may load it (embedpipe.workflow.jobs)
            raise
        reason = one_line(exc).split(". ")[0][:200] or type(exc).__name__
        raise ModelError(
            f"cannot read {role.noun} {path}: {reason} (corrupt, truncated, or not a torch file)"
        ) from None
    if not isinstance(data, dict):
        raise ModelError(
            f"{path} is not {role.article}: expected a dict, found {type(data).__name__}"
        )
    return data


# --------------------------------------------------------------------------- checkpoint layout


def _cfg_get(cfg: Any, key: str, default: Any = None) -> Any:
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def checkpoint_info(data: Mapping[str, Any], *, where: str = "checkpoint") -> dict[str, Any]:
    """Architecture and training marker of a loaded checkpoint dict (no model built).

    Returns ``{"num_layers", "embed_dim", "attention_heads", "token_dropout", "trained",
    "marker"}``. ``ModelError`` when the dict is not in fair-esm's ESM-2 layout.
    """
    if "model" not in data or not isinstance(data["model"], Mapping):
        raise ModelError(f"{where} is not a fair-esm checkpoint: no 'model' state dict")
    cfg_root = data.get("cfg")
    if cfg_root is None:  # ESM-1b's layout ('args') is read by embedpipe.model.esm1b
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
    layers, dim, heads = validate_shape(layers, dim, heads, where=where,
                                        fields=("encoder_layers", "encoder_embed_dim", "encoder_attention_heads"))
    check_cfg_against_weights(upgrade_state_dict(data["model"]), layers, dim, where=where)
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


_LAYER_KEY = re.compile(r"^layers\.(\d+)\.")


def _shape(value: Any) -> tuple[int, ...] | None:
    shape = getattr(value, "shape", None)
    return tuple(int(n) for n in shape) if shape is not None else None


def check_cfg_against_weights(state_dict: Mapping[str, Any], layers: int, dim: int, *, where: str,
                              fields: tuple[str, str] = ("encoder_layers", "encoder_embed_dim")) -> None:
    """Refuse a cfg that the weights contradict before anything is built from it: a cfg saying
    ``encoder_embed_dim=1000000`` would allocate terabytes, ``encoder_layers=1000000`` build
    layers for minutes (``fields``: the two as the file names them). Only shapes are read (the
    file is memory-mapped): cheap."""
    emb = _shape(state_dict.get("embed_tokens.weight"))
    if emb is None or len(emb) != 2:
        raise ModelError(f"{where}: weights do not fit the cfg: missing a 2-D embed_tokens.weight")
    if emb[1] != dim:
        raise ModelError(f"{where}: weights do not fit the cfg: {fields[1]}={dim}, but embed_tokens.weight "
                         f"has shape {emb} (dim {emb[1]})")
    found = {int(m[1]) for name in state_dict if (m := _LAYER_KEY.match(name))}
    if found != set(range(layers)):
        held = f"layers 0..{max(found)} ({len(found)} distinct)" if found else "no layers"
        missing = sorted(set(range(min(layers, max(found, default=0) + 2))) - found)[:3]
        extra = sorted(found - set(range(layers)))[:3]
        what = "; ".join(([f"missing layers.{', layers.'.join(map(str, missing))}"] if missing else [])
                         + ([f"unexpected layers.{', layers.'.join(map(str, extra))}"] if extra else []))
        raise ModelError(f"{where}: weights do not fit the cfg: {fields[0]}={layers}, but the state dict "
                         f"holds {held} ({what})")


def upgrade_state_dict(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """fair-esm's ``upgrade_state_dict``: drop ``encoder.sentence_encoder.`` / ``encoder.``."""
    return {_PREFIX_RE.sub("", name): value for name, value in state_dict.items()}
