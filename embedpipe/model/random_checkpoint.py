"""Random-weight (untrained) ESM-2 and ESM-1b checkpoints in fair-esm's format, and SaProt's
esm-format checkpoint, for tests and demos.

``embedpipe make-test-model`` and the offline demo write them; the checkpoint carries the
untrained marker (see :mod:`embedpipe.model.checkpoint`), so stores made with it say
``model_trained = false``.
"""

from __future__ import annotations

import argparse
import io
from pathlib import Path
from typing import Any

import esm
import torch
from esm.model.esm2 import ESM2

from embedpipe.core.atomic import atomic_paths, check_output_path
from embedpipe.core.errors import ModelError
from embedpipe.core.output_guard import Output, OutputKind, writing_outputs
from embedpipe.core.version import __version__
from embedpipe.model import esm1b, families
from embedpipe.model.checkpoint import CONTACT_KEYS, MARKER_KEY, load_checkpoint_safely, validate_shape
from embedpipe.model.downloads import companion_path
from embedpipe.model.esm2 import esm2_alphabet
from embedpipe.model.saprot import saprot_alphabet

#: State-dict key prefix of fair-esm's released checkpoints.
KEY_PREFIX = "encoder.sentence_encoder."
#: what the untrained marker's ``created_by`` says (the one kind of file make-test-model replaces)
CREATED_BY = "embedpipe make-test-model"
#: positions of the networks written: ESM-2's trained window, BOS and EOS
MAX_POSITIONS = families.ESM2.window + 2
#: first bytes of a zip file: torch.save's format (a legacy pickle or an HDF5 store is never ours)
_ZIP_MAGIC = b"PK\x03\x04"


def make_test_model(
    out: Path,
    *,
    layers: int = 2,
    dim: int = 32,
    heads: int = 4,
    seed: int = 0,
    token_dropout: bool = True,
    storage_dtype: torch.dtype | None = None,
    companion: bool = True,
    family: str = "esm2",
) -> Path:
    """Write a random-weight (untrained) ESM-2 (``family`` esm1b: an ESM-1b) in fair-esm's
    checkpoint format (``family`` saprot-pt: a SaProt in SaProt's esm format): the ``.pt`` formats
    of :data:`embedpipe.model.families.FAMILY_TABLE`, each written by :func:`write_checkpoint` with
    its row's options.

    SaProt's is the file westlake-repl/SaProt's ``load_esm_saprot`` reads: ``{"model": fair-esm
    ESM2's own state dict over SaProt's 446 tokens, "config": {"num_layers", "embed_dim",
    "attention_heads", "token_dropout"}}`` plus the untrained marker (which SaProt's loader
    ignores); no companion (its contact head is in the state dict).

    ESM-1b's is the released layout: ``{"model": ..., "args": Namespace(arch="roberta_large",
    encoder_layers=, ...)}``, the LM head under ``encoder.``, the rest under
    ``encoder.sentence_encoder.``, a layer norm before the first layer; ``companion=False``
    writes it as ESM-1v is released (no contact-regression file).

    ``out`` gets ``{"model": state dict with fair-esm's key prefix, "cfg": {"model":
    Namespace(...)}, "embedpipe": {"trained": False, "seed": ..., ...}}``; the companion
    ``OUT-without-suffix-contact-regression.pt`` gets the contact head (so fair-esm's own
    ``load_model_and_alphabet_local`` loads the file when its name starts with ``esm2``).
    Both are written before either is renamed into place (the companion first), so a
    failure (a full disk) leaves neither.

    Weights are fair-esm's default init, with the layer-norm scales and the biases that
    init leaves constant drawn at random too, so every parameter matters; deterministic
    in ``seed``. ``storage_dtype`` (e.g. ``torch.float16``) stores the weights in a lower
    dtype, as some releases do.
    """
    fmt = families.format_named(family)
    options = fmt.writer.options if fmt is not None and fmt.writer is not None and fmt.writer.module == __name__ else {}
    return write_checkpoint(out, family=family, layers=layers, dim=dim, heads=heads, seed=seed,
                            token_dropout=token_dropout, storage_dtype=storage_dtype, companion=companion, **options)


def write_checkpoint(out: Path, *, family: str, layers: int, dim: int, heads: int, seed: int, layout: str = "",
                     pairs: bool = False, token_dropout: bool = True, storage_dtype: torch.dtype | None = None,
                     companion: bool = True) -> Path:
    """:func:`make_test_model`'s writer of ``.pt`` format ``family``, as its row says: ``layout``,
    the key its config is under (fair-esm's ESM-2 ``cfg``, ESM-1b's ``args``, SaProt's ``config``,
    which holds its contact head: no companion); ``pairs``: SaProt's pair alphabet."""
    out = Path(out)
    layers, dim, heads = validate_shape(layers, dim, heads, where="make-test-model")
    companion = companion and layout != "config"
    checkpoint, beside = _kinds(out)
    outputs: list[Output] = [("checkpoint", out, checkpoint)]
    if companion:
        outputs.append(("companion", companion_path(out), beside))
    with writing_outputs("make-test-model", outputs):
        families.test_model_format(family, __name__, ".pt family")
        _write(out, layers, dim, heads, seed, token_dropout, storage_dtype, companion, layout, pairs)
    return out


def _written_by_us(path: Path) -> dict[str, object] | None:
    """The untrained marker of ``path`` when make-test-model wrote it (a test model, or since
    it says so too, a companion: ``companion_of``), else None; read memory-mapped, and only for
    a torch zip file (a large legacy file is never read)."""
    try:
        with open(path, "rb") as fh:
            if fh.read(len(_ZIP_MAGIC)) != _ZIP_MAGIC:
                return None
        marker = load_checkpoint_safely(path).get(MARKER_KEY)
    except (OSError, ModelError):
        return None
    return marker if isinstance(marker, dict) and marker.get("created_by") == CREATED_BY else None


def _kinds(out: Path) -> tuple[OutputKind, OutputKind]:
    """What the checkpoint and its companion may replace (embedpipe.core.output_guard): a file
    make-test-model wrote; a companion also beside a test model of ours. A companion says it is
    ours too, so one left by a removed test model, or written for ``OUT`` without ``.pt``, is
    replaced. Why: the command makes throw-away models; ``make-test-model a.h5`` must not
    destroy a store, nor a real model's companion."""

    def test_model() -> bool:
        marker = _written_by_us(out) if out.is_file() else None
        return marker is not None and "companion_of" not in marker

    what = "a test model make-test-model wrote"
    return (OutputKind(what, lambda path: _written_by_us(path) is not None),
            OutputKind(what, lambda path: test_model() or _written_by_us(path) is not None))


def _write(out: Path, layers: int, dim: int, heads: int, seed: int, token_dropout: bool,
           storage_dtype: torch.dtype | None, companion: bool, layout: str, pairs: bool) -> None:
    """The checkpoint (and its companion) of :func:`write_checkpoint`, atomically."""
    check_output_path(out)
    if companion:
        check_output_path(companion_path(out))
    absolute = layout == "args"  # ESM-1b's layout: its network
    args = _args(absolute, layers, dim, heads, token_dropout)
    alphabet = saprot_alphabet() if pairs else None
    state = _storage_cast(random_fair_esm(absolute, layers, dim, heads, seed, token_dropout, alphabet).state_dict(),
                          storage_dtype)
    checkpoint: dict[str, Any] = {MARKER_KEY: _untrained_marker(seed)}
    if layout == "config":  # ESM2's names as they are, and SaProt's config dict (load_esm_saprot)
        checkpoint |= {"model": state, "config": {"num_layers": layers, "embed_dim": dim, "attention_heads": heads,
                                                  "token_dropout": token_dropout}}
    elif layout == "cfg":
        checkpoint |= {"model": {KEY_PREFIX + k: v for k, v in state.items() if k not in CONTACT_KEYS},
                       "cfg": {"model": args}}
    else:  # released ESM-1b: the LM head under "encoder.", the rest under "encoder.sentence_encoder."
        checkpoint |= {"model": {("encoder." if k.startswith("lm_head.") else KEY_PREFIX) + k: v
                                 for k, v in state.items() if k not in CONTACT_KEYS}, "args": args}
    # the companion says whose it is too (fair-esm and embedpipe read only its "model")
    regression = {"model": {k: v.clone() for k, v in state.items() if k in CONTACT_KEYS},
                  MARKER_KEY: {"created_by": CREATED_BY, "companion_of": out.name}}
    if companion:
        # both written before either is renamed into place: a failure leaves neither behind
        with atomic_paths(companion_path(out), out) as (tmp_companion, tmp):
            save(regression, tmp_companion)
            save(checkpoint, tmp)
    else:
        with atomic_paths(out) as (tmp,):
            save(checkpoint, tmp)


def _untrained_marker(seed: int) -> dict[str, object]:
    """What the checkpoint says of itself: untrained (stores say ``model_trained = false``)."""
    return {
        "trained": False,
        "seed": int(seed),
        "created_by": CREATED_BY,
        "embedpipe_version": __version__,
        "torch_version": str(torch.__version__),
        "init": "fair-esm default; constant-initialised layer-norm scales and biases randomised",
    }


def _args(absolute: bool, layers: int, dim: int, heads: int, token_dropout: bool) -> argparse.Namespace:
    """The config fair-esm writes: ESM-2's ``cfg["model"]``, ESM-1b's ``args`` (``absolute``; the same fields)."""
    return argparse.Namespace(
        arch=esm1b.ESM1B_ARCH if absolute else "esm2",
        encoder_layers=layers,
        encoder_embed_dim=dim,
        encoder_ffn_embed_dim=4 * dim,
        encoder_attention_heads=heads,
        token_dropout=token_dropout,
        max_positions=MAX_POSITIONS,
    )


def random_fair_esm(absolute: bool, layers: int, dim: int, heads: int, seed: int,
                    token_dropout: bool = True, alphabet: esm.data.Alphabet | None = None) -> torch.nn.Module:
    """fair-esm's ``ESM2`` (``absolute``: ESM-1b's ``ProteinBertModel``, learned positions and the
    layer norm before the first layer; ``alphabet``: ESM-2's unless given, SaProt's pairs) with
    fair-esm's init, then the constant parameters drawn at random; the global RNG untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if not absolute:
            return _randomise_constants(ESM2(num_layers=layers, embed_dim=dim, attention_heads=heads,
                                             alphabet=alphabet or esm2_alphabet(), token_dropout=token_dropout))
        info = {"num_layers": layers, "embed_dim": dim, "ffn_embed_dim": 4 * dim, "attention_heads": heads,
                "max_positions": MAX_POSITIONS, "norm_before": True, "token_dropout": token_dropout}
        return _randomise_constants(esm1b.construct(info, alphabet or esm2_alphabet()))


def _randomise_constants(model: torch.nn.Module) -> Any:
    """``model`` with every parameter its init leaves constant (layer-norm scales, biases)
    drawn at random too, so that every parameter matters; in eval mode."""
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
    return model.eval()


def _storage_cast(state: dict[str, torch.Tensor], storage_dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """``state`` with its floating-point weights (not ``inv_freq``) in ``storage_dtype``."""
    if storage_dtype is None:
        return state
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
    return state


def save(obj: Any, path: Path) -> None:
    """``torch.save`` through memory, so that a failed write (a full disk) is an ``OSError``
    naming ``path`` (torch's own file writer reports it as a RuntimeError without the cause)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    try:
        with open(path, "wb") as fh:
            fh.write(buffer.getbuffer())
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, str(path)) from None
