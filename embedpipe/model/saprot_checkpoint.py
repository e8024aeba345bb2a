"""SaProt's own esm-format checkpoint: the ``.pt`` its ``load_esm_saprot`` reads.

westlake-repl/SaProt ships each model twice: a Hugging Face directory (:mod:`embedpipe.model.hf_esm`)
and ``SaProt_*.pt``, ``{"model": fair-esm ESM2 state dict (its own names, no prefix), "config":
{"num_layers", "embed_dim", "attention_heads", "token_dropout"}}``, which its
``utils/esm_loader.py`` loads into fair-esm's ``ESM2`` over the alphabet it builds from
``utils/constants.py`` (:func:`embedpipe.model.saprot.saprot_alphabet`). The file is neither of
fair-esm's layouts (ESM-2's ``cfg``, ESM-1b's ``args``): a ``config`` dict without them is
SaProt's, and its embedding must then have SaProt's 446 rows. Read with the same weights-only
load as every checkpoint (:mod:`embedpipe.model.checkpoint`: a plain dict needs no allowlist);
the model is an ordinary SaProt on ESM-2's forward, as a SaProt directory is (its format in
:data:`embedpipe.model.families.FAMILY_TABLE`: ``saprot-pt``, recognised by
:func:`embedpipe.model.saprot_spec.is_pt_layout`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import esm
import torch

from embedpipe.core.errors import ModelError
from embedpipe.model import esm2, families, saprot_spec
from embedpipe.model.checkpoint import MARKER_KEY, check_cfg_against_weights
from embedpipe.model.config_bounds import validate_shape
from embedpipe.model.facts import ModelFacts
from embedpipe.model.saprot import SaProtModel, saprot_alphabet

#: what stores say of the file (``model_format``), as a Hugging Face directory says ``huggingface-esm``
MODEL_FORMAT = "saprot-esm"


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
    return {"family": families.SAPROT.name, "num_layers": layers, "embed_dim": dim, "attention_heads": heads,
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


def load_checkpoint(spec: str, path: Path, sha: str, data: Mapping[str, Any]) -> SaProtModel:
    """A :class:`~embedpipe.model.saprot.SaProtModel` from SaProt's ``.pt`` ``data`` read from ``path``
    (its bytes' sha256 ``sha``), by :mod:`embedpipe.model.pt_checkpoint`; stores say ``model_format = saprot-esm``."""
    where = str(path)
    info = checkpoint_info(data, where=where)
    model, alphabet = esm2.build_model(info, state_dict(data, info), where=where, alphabet=saprot_alphabet())
    made = esm2.from_info(model, alphabet, info, families.SAPROT.capabilities(), name=path.stem, source=where,
                          sha256=sha, kind=SaProtModel,
                          provenance={"fair_esm_version": getattr(esm, "__version__", "unknown"),
                                      "model_format": MODEL_FORMAT})
    assert isinstance(made, SaProtModel)
    return made


def checkpoint_facts(facts: ModelFacts, data: Mapping[str, Any]) -> ModelFacts:
    """A SaProt ``.pt`` path's facts completed from its config (family ``saprot``, SaProt's layout)."""
    info = checkpoint_info(data, where=str(Path(facts.spec).expanduser()))
    shape = (info["num_layers"], info["embed_dim"], info["attention_heads"])
    return replace(facts, **families.SAPROT.capabilities().facts_fields(), num_layers=shape[0], embed_dim=shape[1],
                   attention_heads=shape[2], trained=info["trained"], parameters=saprot_spec.parameter_count(*shape))
