"""SaProt's own esm-format checkpoint: the ``.pt`` its ``load_esm_saprot`` reads.

westlake-repl/SaProt ships each model twice: a Hugging Face directory (:mod:`embedpipe.model.hf_esm`)
and ``SaProt_*.pt``, ``{"model": fair-esm ESM2 state dict (its own names, no prefix), "config":
{"num_layers", "embed_dim", "attention_heads", "token_dropout"}}``, which its
``utils/esm_loader.py`` loads into fair-esm's ``ESM2`` over the alphabet it builds from
``utils/constants.py`` (:func:`embedpipe.model.saprot.saprot_alphabet`). The file is neither of
fair-esm's layouts (ESM-2's ``cfg``, ESM-1b's ``args``): a ``config`` dict without them is
SaProt's, and its embedding must then have SaProt's 446 rows. Read with the same weights-only
load as every checkpoint (:mod:`embedpipe.model.checkpoint`: a plain dict needs no allowlist);
the model is an ordinary SaProt on ESM-2's forward, as a SaProt directory is.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from embedpipe.core.errors import ModelError
from embedpipe.model import saprot_spec
from embedpipe.model.checkpoint import MARKER_KEY, check_cfg_against_weights
from embedpipe.model.config_bounds import validate_shape

#: what stores say of the file (``model_format``), as a Hugging Face directory says ``huggingface-esm``
MODEL_FORMAT = "saprot-esm"


def is_saprot_layout(data: Mapping[str, Any]) -> bool:
    """Whether a loaded checkpoint is in SaProt's esm-format layout: ``config``, none of fair-esm's
    ``cfg`` (ESM-2) or ``args`` (ESM-1b)."""
    return "config" in data and "cfg" not in data and "args" not in data


def checkpoint_info(data: Mapping[str, Any], *, where: str) -> dict[str, Any]:
    """The config of SaProt's ``.pt`` (weights unread: shapes only), each field bounded, the
    weights' shapes compared with it; one-line refusals for anything else. ``trained`` is False
    only when make-test-model's marker says so (as for a fair-esm test checkpoint)."""
    state, config = data.get("model"), data.get("config")
    if not isinstance(state, Mapping):
        raise ModelError(f"{where} is not a SaProt checkpoint: no 'model' state dict")
    if not isinstance(config, Mapping):
        raise ModelError(f"{where} is not a SaProt checkpoint: 'config' is a {type(config).__name__}, "
                         f"not a dict of {', '.join(saprot_spec.CONFIG_KEYS)}")
    missing = [key for key in saprot_spec.CONFIG_KEYS if key not in config]
    if missing:
        raise ModelError(f"{where}: SaProt's config lacks {', '.join(missing)}")
    layers, dim, heads = validate_shape(config["num_layers"], config["embed_dim"], config["attention_heads"],
                                        where=where, fields=("num_layers", "embed_dim", "attention_heads"))
    if not isinstance(config["token_dropout"], bool):
        raise ModelError(f"{where}: token_dropout must be true or false, got {config['token_dropout']!r}")
    check_cfg_against_weights(state, layers, dim, where=where, fields=("num_layers", "embed_dim"))
    rows = int(state["embed_tokens.weight"].shape[0])
    if rows != saprot_spec.VOCABULARY_SIZE:
        raise ModelError(f"{where}: not a SaProt checkpoint: embed_tokens.weight has {rows} rows, not SaProt's "
                         f"{saprot_spec.VOCABULARY_SIZE} tokens")
    marker = data.get(MARKER_KEY)
    return {"family": saprot_spec.FAMILY, "num_layers": layers, "embed_dim": dim, "attention_heads": heads,
            "token_dropout": config["token_dropout"],
            "trained": marker is None or (isinstance(marker, Mapping) and marker.get("trained") is True)}


def state_dict(data: Mapping[str, Any], info: Mapping[str, Any]) -> dict[str, Any]:
    """The file's state dict as ``ESM2`` takes it: its names as they are (``load_esm_saprot``
    matches them to ``ESM2.state_dict()`` as written), the rotary ``inv_freq`` buffers fair-esm's
    constructor computes added where the file leaves them out; anything else missing or extra is
    refused by :func:`embedpipe.model.esm2.build_model`."""
    state = dict(data["model"])
    head_dim = info["embed_dim"] // info["attention_heads"]
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))  # fair-esm's RotaryEmbedding
    for i in range(info["num_layers"]):
        state.setdefault(f"layers.{i}.self_attn.rot_emb.inv_freq", inv_freq.clone())
    return state
