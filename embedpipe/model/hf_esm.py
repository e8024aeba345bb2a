"""Hugging Face ESM directories (``model_type: esm``) into embedpipe's ESM-2 runner.

ESM-2 (rotary positions) and ESM-1b / ESM-1v (``position_embedding_type: absolute``, usually
with ``emb_layer_norm_before``: ``facebook/esm1b_t33_650M_UR50S``) share the type, and so does
SaProt (an ESM-2 over amino-acid x 3Di pair tokens, whose own loader :mod:`embedpipe.model.saprot`
calls :func:`load_esm` with its tokens, model class and refusals); which one a directory is,
:func:`embedpipe.model.hf_checkpoint.format_for` says. The weights
(``EsmModel`` or ``EsmForMaskedLM``) are renamed to fair-esm's ``ESM2`` (or ESM-1b
``ProteinBertModel``) state dict and built by :func:`embedpipe.model.esm2.build_model`, so the model is an ordinary
:class:`~embedpipe.model.esm2.Esm2Model`: every policy, the packed layout and the fp32
fallback are the ones fair-esm checkpoints get. The mapping is transformers' own
``convert_esm.py`` read backwards; :func:`to_hf` is the forward direction (make-test-model).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import esm
import torch

from embedpipe.core.errors import ModelError
from embedpipe.model import esm1b_spec, families
from embedpipe.model import hf_checkpoint as hf
from embedpipe.model.checkpoint import CONTACT_KEYS, check_cfg_against_weights
from embedpipe.model.esm1b import check_weights, sizes
from embedpipe.model.esm2 import Esm2Model, build_model, esm2_alphabet, from_info
from embedpipe.model.families import Format

#: fair-esm per-layer module -> transformers' ``EsmLayer`` module.
PER_LAYER = {
    "self_attn.q_proj": "attention.self.query",
    "self_attn.k_proj": "attention.self.key",
    "self_attn.v_proj": "attention.self.value",
    "self_attn.out_proj": "attention.output.dense",
    "self_attn_layer_norm": "attention.LayerNorm",
    "fc1": "intermediate.dense",
    "fc2": "output.dense",
    "final_layer_norm": "LayerNorm",
}
#: fair-esm name -> transformers name, outside the layers (``EsmModel`` names, no ``esm.`` prefix).
OUTSIDE = {
    "embed_tokens.weight": "embeddings.word_embeddings.weight",
    "emb_layer_norm_after.weight": "encoder.emb_layer_norm_after.weight",
    "emb_layer_norm_after.bias": "encoder.emb_layer_norm_after.bias",
    **{k: k for k in CONTACT_KEYS},
}
#: ``EsmForMaskedLM``'s head (``lm_head.decoder.weight`` is the tied embedding).
LM_HEAD = ("lm_head.dense.weight", "lm_head.dense.bias", "lm_head.layer_norm.weight",
           "lm_head.layer_norm.bias", "lm_head.bias")
#: ESM-1b's learned positions and first layer norm: fair-esm name -> transformers name.
ABSOLUTE = {
    "embed_positions.weight": "embeddings.position_embeddings.weight",
    "emb_layer_norm_before.weight": "embeddings.layer_norm.weight",
    "emb_layer_norm_before.bias": "embeddings.layer_norm.bias",
}
#: Recomputed or unused tensors a directory may hold.
IGNORED_SUFFIXES = ("inv_freq", "position_ids")


def fair_to_hf_names(num_layers: int, absolute: bool = False) -> dict[str, str]:
    """Every fair-esm name (LM head included) -> its ``EsmModel``/``EsmForMaskedLM`` name
    (``absolute``: ESM-1b's position table and first layer norm too)."""
    names = dict(OUTSIDE) | {k: k for k in LM_HEAD} | (dict(ABSOLUTE) if absolute else {})
    for i in range(num_layers):
        for src, dst in PER_LAYER.items():
            for kind in ("weight", "bias"):
                names[f"layers.{i}.{src}.{kind}"] = f"encoder.layer.{i}.{dst}.{kind}"
    return names


#: why a ``position_embedding_type`` is refused, when another variant's would have taken it
POSITIONS = "position_embedding_type is neither 'rotary' (ESM-2) nor 'absolute' (ESM-1b)"
#: why a ``pad_token_id`` is refused, for fair-esm's alphabet
PADDING = f"pad_token_id is not fair-esm's {esm1b_spec.PADDING_IDX}"


def check_config(config: Mapping[str, Any], where: str, fmt: Format, alphabet: esm.data.Alphabet, *,
                 positions: str = POSITIONS, padding: str = PADDING) -> dict[str, Any]:
    """fair-esm's ESM-2 cfg (or ESM-1b args: a format of ESM-1b's row) from an ``EsmConfig``
    (``where``: its config.json; ``fmt``: the format its directory is; ``alphabet``: the tokens it
    embeds); every size bounded first (the format's ``sizes``, built on
    :func:`embedpipe.model.config_bounds.esm_config`), then one-line refusals for what fair-esm's
    ESM2 (ProteinBertModel) cannot be, or for a vocabulary size that is not the family's
    (``positions``, ``padding``: why a position type or a padding id is refused)."""
    kind = hf.hf_of(fmt)
    bounded = kind.sizes(config, where)
    dim = bounded["embed_dim"]
    token_dropout = config.get("token_dropout", False)
    norm_before = config.get("emb_layer_norm_before", False)
    for field, value in (("token_dropout", token_dropout), ("emb_layer_norm_before", norm_before)):
        if not isinstance(value, bool):
            raise ModelError(f"{where}: {field} must be true or false, got {value!r}")
    absolute = families.row_of(fmt) is families.ESM1B
    label, network = ("ESM-1b", "ProteinBertModel") if absolute else (kind.label, "ESM2")
    vocabulary = len(alphabet.all_toks)
    checks = [
        (absolute or bounded["position_embedding_type"] == "rotary", positions),
        (absolute or not norm_before, "emb_layer_norm_before is set with rotary positions"),
        (absolute or bounded["intermediate_size"] == 4 * dim, f"intermediate_size is not 4 x {dim}"),
        (bounded["vocab_size"] == vocabulary, f"vocab_size is not {label}'s {vocabulary}"),
        (config.get("pad_token_id", alphabet.padding_idx) == alphabet.padding_idx, padding),
        (abs(bounded["layer_norm_eps"] - 1e-5) < 1e-12, "layer_norm_eps is not 1e-5"),
        (config.get("hidden_act", "gelu") == "gelu", "hidden_act is not gelu"),
    ]
    for ok, why in checks:
        if not ok:
            article = "an" if label[0] in "AEIOU" else "a"
            raise ModelError(f"{where}: not {article} {label} that fair-esm's {network} can run ({why})")
    info = {"num_layers": bounded["num_layers"], "embed_dim": dim, "attention_heads": bounded["attention_heads"],
            "token_dropout": token_dropout, "trained": hf.is_trained(config)}
    if absolute:
        info = sizes(info["num_layers"], dim, info["attention_heads"], bounded["intermediate_size"],
                     esm1b_spec.hf_max_positions(config), token_dropout, where=where,
                     fields=("num_layers", "hidden_size", "num_attention_heads", "intermediate_size",
                             "max_position_embeddings", "token_dropout")) | {
            "trained": info["trained"], "norm_before": norm_before}
    return info


def check_vocabulary(directory: Path, expected: list[str], label: str) -> None:
    """A ``vocab.txt``, when present, must be ``expected`` in its order (``label``: whose)."""
    vocab = directory / "vocab.txt"
    if vocab.is_file():
        tokens = vocab.read_text(errors="replace").split()
        if tokens != expected:
            raise ModelError(f"{vocab}: not {label}'s vocabulary (its tokens, in its order)")


def to_fair(state: Mapping[str, torch.Tensor], info: Mapping[str, Any], where: str) -> dict[str, torch.Tensor]:
    """A transformers ESM state dict as fair-esm's ``ESM2`` state dict (LM head zero if absent)."""
    prefix = "esm." if any(k.startswith("esm.") for k in state) else ""
    absolute = info.get("family") == families.ESM1B.name
    hf_names = fair_to_hf_names(info["num_layers"], absolute)
    wanted = {(v if v.startswith("lm_head.") else prefix + v): k for k, v in hf_names.items()}
    out, unexpected = {}, []
    for name, tensor in state.items():
        if name in wanted:
            out[wanted[name]] = tensor
        elif not (name.endswith(IGNORED_SUFFIXES) or name.startswith(("pooler.", "esm.pooler."))
                  or name == "lm_head.decoder.weight"):
            unexpected.append(name)
    if unexpected:
        raise ModelError(f"{where}: unexpected weights {', '.join(sorted(unexpected)[:4])} for an "
                         f"{'ESM-1b' if absolute else 'ESM-2'}")
    if absolute:
        check_weights(out, info, where, ("max_position_embeddings", "intermediate_size"))
    else:
        check_cfg_against_weights(out, info["num_layers"], info["embed_dim"], where=where)
    decoder = state.get("lm_head.decoder.weight")
    if decoder is not None and not torch.equal(decoder, out["embed_tokens.weight"]):
        raise ModelError(f"{where}: lm_head.decoder.weight differs from the token embedding, but ESM-2 ties them")
    dim, vocab = info["embed_dim"], out["embed_tokens.weight"].shape[0]
    if not any(k.startswith("lm_head.") for k in out):  # EsmModel: no head; embedpipe never computes logits
        out |= {"lm_head.dense.weight": torch.zeros(dim, dim), "lm_head.dense.bias": torch.zeros(dim),
                "lm_head.layer_norm.weight": torch.ones(dim), "lm_head.layer_norm.bias": torch.zeros(dim),
                "lm_head.bias": torch.zeros(vocab)}
    head_dim = dim // info["attention_heads"]
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))  # fair-esm's
    for i in range(0 if absolute else info["num_layers"]):
        out[f"layers.{i}.self_attn.rot_emb.inv_freq"] = inv_freq.clone()
    out["lm_head.weight"] = out["embed_tokens.weight"]
    return {k: (v.float() if v.is_floating_point() else v) for k, v in out.items()}


def load_directory(spec: str, directory: Path, config: Mapping[str, Any], fmt: Format) -> Esm2Model:
    """An :class:`Esm2Model` from a Hugging Face ESM-2 or ESM-1b directory of format ``fmt``
    (``config.json`` already read): fair-esm's 33 tokens (a ``vocab.txt`` must list them in fair-esm's order)."""
    alphabet = esm2_alphabet()
    check_vocabulary(directory, list(alphabet.all_toks), hf.hf_of(fmt).label)
    return load_esm(spec, directory, config, fmt, alphabet)


def load_esm(spec: str, directory: Path, config: Mapping[str, Any], fmt: Format, alphabet: esm.data.Alphabet, *,
             model: type[Esm2Model] = Esm2Model, positions: str = POSITIONS, padding: str = PADDING) -> Esm2Model:
    """A ``model`` of format ``fmt`` from a Hugging Face ``model_type: esm`` directory over ``alphabet``
    (what a variant's loader gives: :func:`load_directory`'s, SaProt's), with its row's capabilities."""
    where = str(directory)
    info = check_config(config, str(directory / "config.json"), fmt, alphabet, positions=positions, padding=padding)
    files = hf.weight_files(directory)
    sha = hf.weights_sha256(files)
    state = to_fair(hf.read_state_dict(files), info, where)
    built, alphabet = build_model(info, state, where=where, alphabet=alphabet)
    return from_info(built, alphabet, info, hf.capabilities(fmt, config),
                     name=spec if hf.is_model_name(spec) else directory.name, source=where, sha256=sha,
                     provenance={"fair_esm_version": getattr(esm, "__version__", "unknown"),
                                 "model_format": "huggingface-esm"}, kind=model)
