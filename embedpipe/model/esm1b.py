"""ESM-1b and ESM-1v checkpoints in fair-esm's released layout: their ``args``, and the
``ProteinBertModel`` they describe.

A released ESM-1b / ESM-1v ``.pt`` is ``{"model": state dict (``encoder.sentence_encoder.*``,
``encoder.lm_head.*``), "args": Namespace(arch="roberta_large", encoder_layers=,
encoder_embed_dim=, encoder_ffn_embed_dim=, encoder_attention_heads=, max_positions=, ...)}``
(no ``cfg``: that is ESM-2's). ``args`` is an ``argparse.Namespace``, the one global the
weights-only load allows (:mod:`embedpipe.model.checkpoint`). Every field is bounded and the
weights' shapes compared with it before anything is sized by it (docs/models.md, "Limits").

:mod:`embedpipe.model.esm2` loads the file and builds the model through :func:`construct`, so
an ESM-1b is an ordinary :class:`~embedpipe.model.esm2.Esm2Model` run by ESM-2's forward with
learned positions and the first layer norm as parameters (:mod:`embedpipe.model.esm2_forward`).
fair-esm also zeroes the ``<mask>`` row of the token embedding on load; embedpipe never
tokenizes ``<mask>`` (:data:`embedpipe.model.esm2.PROTEIN_LETTERS`), so it is left as stored.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

import esm
from esm.model.esm1 import ProteinBertModel

from embedpipe.core.errors import ModelError
from embedpipe.model import esm1b_spec, families
from embedpipe.model.checkpoint import MARKER_KEY, check_cfg_against_weights, upgrade_state_dict
from embedpipe.model.config_bounds import MAX_FFN, MAX_HEADS, MAX_LAYERS, MAX_POSITIONS, MAX_WIDTH, bounded_int, check_heads

#: ``args.arch`` of ESM-1b and ESM-1v; ESM-1 (``protein_bert_base``) is another network
ESM1B_ARCH = "roberta_large"


def _shape(state: Mapping[str, Any], key: str) -> tuple[int, ...] | None:
    shape = getattr(state.get(key), "shape", None)
    return tuple(int(n) for n in shape) if shape is not None else None


def _require_shape(state: Mapping[str, Any], key: str, expected: tuple[int, ...], field: str, where: str) -> None:
    found = _shape(state, key)
    if found != expected:
        raise ModelError(f"{where}: weights do not fit the config: {field} says {key} is {expected}, "
                         f"found {found if found is not None else 'none'}")


def sizes(layers: Any, dim: Any, heads: Any, ffn: Any, max_positions: Any, token_dropout: Any, *,
          where: str, fields: tuple[str, ...]) -> dict[str, Any]:
    """ESM-1b's sizes, each bounded (``fields``: their names in the file, for the one-line refusals);
    heads divide the width (no rotary: the head dimension may be odd)."""
    layers = bounded_int(layers, fields[0], MAX_LAYERS, where=where)
    dim = bounded_int(dim, fields[1], MAX_WIDTH, where=where)
    heads = bounded_int(heads, fields[2], MAX_HEADS, where=where)
    check_heads(dim, heads, where=where, fields=(fields[1], fields[2]), even=False)
    ffn = bounded_int(ffn, fields[3], MAX_FFN, where=where)
    max_positions = bounded_int(max_positions, fields[4], MAX_POSITIONS, where=where, lower=3)
    if not isinstance(token_dropout, bool):
        raise ModelError(f"{where}: {fields[5]} must be true or false, got {token_dropout!r}")
    return {"num_layers": layers, "embed_dim": dim, "attention_heads": heads, "ffn_embed_dim": ffn,
            "max_positions": max_positions, "token_dropout": token_dropout, "family": families.ESM1B.name}


def check_weights(state: Mapping[str, Any], info: Mapping[str, Any], where: str,
                  fields: tuple[str, str] = ("args.max_positions", "args.encoder_ffn_embed_dim")) -> None:
    """The weights' shapes against the sizes, before a table or layer is allocated from them
    (``fields``: the position count's and FFN width's names in the file)."""
    layers, dim = info["num_layers"], info["embed_dim"]
    check_cfg_against_weights(state, layers, dim, where=where)
    rows = info["max_positions"] + esm1b_spec.PADDING_IDX + 1
    _require_shape(state, "embed_positions.weight", (rows, dim), fields[0], where)
    for i in range(layers):
        _require_shape(state, f"layers.{i}.fc1.weight", (info["ffn_embed_dim"], dim), fields[1], where)


def checkpoint_info(data: Mapping[str, Any], *, where: str) -> dict[str, Any]:
    """What an ESM-1b / ESM-1v checkpoint's ``args`` say, bounded and checked against its weights:
    :func:`embedpipe.model.checkpoint.checkpoint_info`'s keys plus ``family``, ``ffn_embed_dim``,
    ``max_positions`` and ``norm_before``. One line naming the file and field otherwise."""
    if not isinstance(data.get("model"), Mapping):
        raise ModelError(f"{where} is not a fair-esm checkpoint: no 'model' state dict")
    args = data["args"]
    if not isinstance(args, argparse.Namespace):
        raise ModelError(f"{where}: 'args' must be an argparse.Namespace (fair-esm's ESM-1b layout), "
                         f"found {type(args).__name__}")
    arch = getattr(args, "arch", None)
    if arch != ESM1B_ARCH:
        raise ModelError(f"{where}: args.arch is {arch!r}; embedpipe reads fair-esm's ESM-1b and ESM-1v "
                         f"({ESM1B_ARCH!r}) and ESM-2 checkpoints, not ESM-1 or the MSA Transformer")
    field = vars(args).get
    info = sizes(field("encoder_layers"), field("encoder_embed_dim"), field("encoder_attention_heads"),
                 field("encoder_ffn_embed_dim"), field("max_positions"), field("token_dropout", False), where=where,
                 fields=("args.encoder_layers", "args.encoder_embed_dim", "args.encoder_attention_heads",
                         "args.encoder_ffn_embed_dim", "args.max_positions", "args.token_dropout"))
    state = upgrade_state_dict(data["model"])
    check_weights(state, info, where)
    marker = data.get(MARKER_KEY)
    info["norm_before"] = any(k.startswith("emb_layer_norm_before") for k in state)  # as fair-esm decides
    info["trained"] = marker is None or (isinstance(marker, Mapping) and marker.get("trained") is True)
    info["marker"] = dict(marker) if isinstance(marker, Mapping) else marker
    return info


def construct(info: Mapping[str, Any], alphabet: esm.data.Alphabet) -> ProteinBertModel:
    """fair-esm's ``ProteinBertModel`` with the args fair-esm's loader would give it (``encoder_``
    stripped, ``emb_layer_norm_before`` from the weights), from the checked sizes only."""
    args = argparse.Namespace(
        arch=ESM1B_ARCH, layers=info["num_layers"], embed_dim=info["embed_dim"],
        ffn_embed_dim=info["ffn_embed_dim"], attention_heads=info["attention_heads"],
        max_positions=info["max_positions"], emb_layer_norm_before=info["norm_before"],
        token_dropout=info["token_dropout"],
    )
    return ProteinBertModel(args, alphabet)
