"""Hugging Face ESM-2 directories (``model_type: esm``) into embedpipe's ESM-2 runner.

The weights (``EsmModel`` or ``EsmForMaskedLM``) are renamed to fair-esm's ``ESM2`` state
dict and built by :func:`embedpipe.model.esm2.build_model`, so the model is an ordinary
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
from embedpipe.model import esm2_spec, saprot_spec
from embedpipe.model import hf_checkpoint as hf
from embedpipe.model.checkpoint import CONTACT_KEYS, check_cfg_against_weights
from embedpipe.model.config_bounds import esm_config
from embedpipe.model.esm2 import Esm2Model, build_model, esm2_alphabet
from embedpipe.model.saprot import SaProtModel, saprot_alphabet

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
#: Recomputed or unused tensors a directory may hold.
IGNORED_SUFFIXES = ("inv_freq", "position_ids")


def fair_to_hf_names(num_layers: int) -> dict[str, str]:
    """Every fair-esm name (LM head included) -> its ``EsmModel``/``EsmForMaskedLM`` name."""
    names = dict(OUTSIDE) | {k: k for k in LM_HEAD}
    for i in range(num_layers):
        for src, dst in PER_LAYER.items():
            for kind in ("weight", "bias"):
                names[f"layers.{i}.{src}.{kind}"] = f"encoder.layer.{i}.{dst}.{kind}"
    return names


def check_config(config: Mapping[str, Any], where: str, vocabulary: int = esm2_spec.VOCABULARY_SIZE) -> dict[str, Any]:
    """fair-esm's ESM-2 cfg from an ``EsmConfig`` (``where``: its config.json); every size
    bounded first (:func:`embedpipe.model.config_bounds.esm_config`), then one-line refusals
    for what ESM2 cannot be (``vocabulary``: the tokens it must embed, SaProt's 446)."""
    sizes = esm_config(config, where)
    dim = sizes["embed_dim"]
    token_dropout = config.get("token_dropout", False)
    if not isinstance(token_dropout, bool):
        raise ModelError(f"{where}: token_dropout must be true or false, got {token_dropout!r}")
    checks = [
        (sizes["position_embedding_type"] == "rotary", "position_embedding_type is not 'rotary'"),
        (not config.get("emb_layer_norm_before"), "emb_layer_norm_before is set"),
        (sizes["intermediate_size"] == 4 * dim, f"intermediate_size is not 4 x {dim}"),
        (sizes["vocab_size"] == vocabulary, f"vocab_size is not {vocabulary}, its vocabulary's"),
        (abs(sizes["layer_norm_eps"] - 1e-5) < 1e-12, "layer_norm_eps is not 1e-5"),
        (config.get("hidden_act", "gelu") == "gelu", "hidden_act is not gelu"),
    ]
    for ok, why in checks:
        if not ok:
            raise ModelError(f"{where}: not an ESM-2 that fair-esm's ESM2 can run ({why})")
    return {"num_layers": sizes["num_layers"], "embed_dim": dim, "attention_heads": sizes["attention_heads"],
            "token_dropout": token_dropout, "trained": hf.is_trained(config)}


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
    hf_names = fair_to_hf_names(info["num_layers"])
    wanted = {(v if v.startswith("lm_head.") else prefix + v): k for k, v in hf_names.items()}
    out, unexpected = {}, []
    for name, tensor in state.items():
        if name in wanted:
            out[wanted[name]] = tensor
        elif not (name.endswith(IGNORED_SUFFIXES) or name.startswith(("pooler.", "esm.pooler."))
                  or name == "lm_head.decoder.weight"):
            unexpected.append(name)
    if unexpected:
        raise ModelError(f"{where}: unexpected weights {', '.join(sorted(unexpected)[:4])} for an ESM-2")
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
    for i in range(info["num_layers"]):
        out[f"layers.{i}.self_attn.rot_emb.inv_freq"] = inv_freq.clone()
    out["lm_head.weight"] = out["embed_tokens.weight"]
    return {k: (v.float() if v.is_floating_point() else v) for k, v in out.items()}


def load_directory(spec: str, directory: Path, config: Mapping[str, Any]) -> Esm2Model:
    """An :class:`Esm2Model` from a Hugging Face ESM-2 directory (``config.json`` already read)."""
    where = str(directory)
    saprot = hf.family_of(spec, directory, config) == saprot_spec.FAMILY
    alphabet = saprot_alphabet() if saprot else esm2_alphabet()
    info = check_config(config, str(directory / "config.json"), len(alphabet.all_toks))
    check_vocabulary(directory, list(alphabet.all_toks), "SaProt" if saprot else "ESM-2")
    files = hf.weight_files(directory)
    sha = hf.weights_sha256(files)
    state = to_fair(hf.read_state_dict(files), info, where)
    model, alphabet = build_model(info, state, where=where, alphabet=alphabet)
    kind = SaProtModel if saprot else Esm2Model
    return kind(model=model, alphabet=alphabet, name=spec if hf.is_model_name(spec) else directory.name,
                source=where, sha256=sha, trained=info["trained"], num_layers=info["num_layers"],
                embed_dim=info["embed_dim"], attention_heads=info["attention_heads"],
                provenance={"fair_esm_version": getattr(esm, "__version__", "unknown"),
                            "model_format": "huggingface-esm"})
