"""ESM C (``model_type: esmc``) as a Hugging Face family: names, vocabulary, config bounds and
sizes, what is known without torch or weights.

The loader is :mod:`embedpipe.model.esmc`; this module is the :class:`HfFamily` reading ESM C's
row of :data:`embedpipe.model.families.FAMILY_TABLE` names (ESM C's and ESM++'s), and the memory
arithmetic of ``--tokens-per-batch auto`` (docs/models.md, "ESM C").
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from embedpipe.core.errors import ModelError
from embedpipe.model.config_bounds import MAX_FFN, MAX_POSITIONS, MAX_VOCAB, size_field, validate_shape
from embedpipe.model.facts import MemoryEstimate, host_bytes
from embedpipe.model.hf_families import HfFamily

#: the version of ESM C's forward (esmc_forward.py) and tokens, in every store's identity: bump it
#: when a change moves the numbers (docs/cluster.md, "Resuming, rerunning")
FAMILY_VERSION = 1

#: ESM C's token ids, shared by every checkpoint (transformers' ``EsmcTokenizer``): ``<cls>`` is
#: the BOS; the embedding has 64 rows, the rest unused.
VOCABULARY = ("<cls>", "<pad>", "<eos>", "<unk>", "L", "A", "G", "V", "S", "E", "R", "T", "I", "D", "P", "K",
              "Q", "N", "F", "Y", "M", "H", "W", "C", "X", "B", "U", "Z", "O", ".", "-", "|", "<mask>")
BOS, PAD, EOS, UNK = 0, 1, 2, 3

#: ESM C was trained on 2048 tokens (``max_position_embeddings``): 2046 residues, BOS and EOS.
DEFAULT_POSITIONS = 2048
#: rotary base when config.json gives none (transformers' default ``rope_theta``)
DEFAULT_ROPE_THETA = 10000.0
#: residual branches are divided by sqrt(layers / this) (ESM3's scaling, every ESM C)
RESIDUAL_LAYERS = 36


def sizes(config: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The bounded sizes of an ESM C ``config.json`` (``where``), one-line refusals for what
    embedpipe's forward cannot run (biases, grouped-query attention, another activation or rope)."""
    layers, dim, heads = validate_shape(
        config.get("num_hidden_layers"), config.get("hidden_size"), config.get("num_attention_heads"),
        where=where, fields=("num_hidden_layers", "hidden_size", "num_attention_heads"))
    head_dim = config.get("head_dim") if config.get("head_dim") is not None else dim // heads
    kv_heads = config.get("num_key_value_heads") if config.get("num_key_value_heads") is not None else heads
    rope = config.get("rope_parameters") or {}
    theta = rope.get("rope_theta", config.get("rope_theta", DEFAULT_ROPE_THETA)) if isinstance(rope, Mapping) else None
    checks = [
        (head_dim == dim // heads, f"head_dim {head_dim!r} is not hidden_size / num_attention_heads"),
        (kv_heads == heads, "num_key_value_heads differs from num_attention_heads"),
        (config.get("hidden_act", "silu") == "silu", "hidden_act is not silu"),
        (not config.get("attention_bias") and not config.get("mlp_bias"), "attention_bias or mlp_bias is set"),
        (isinstance(rope, Mapping) and rope.get("rope_type", "default") == "default", "rope_type is not 'default'"),
        (isinstance(theta, (int, float)) and not isinstance(theta, bool) and math.isfinite(theta) and theta > 1,
         f"rope_theta {theta!r} is not a number above 1"),
    ]
    for ok, why in checks:
        if not ok:
            raise ModelError(f"{where}: not an ESM C that embedpipe can run ({why})")
    return {
        "num_layers": layers, "embed_dim": dim, "attention_heads": heads,
        "intermediate_size": size_field(config, "intermediate_size", MAX_FFN, where=where),
        "vocab_size": size_field(config, "vocab_size", MAX_VOCAB, where=where, default=64, lower=len(VOCABULARY)),
        "max_position_embeddings": size_field(config, "max_position_embeddings", MAX_POSITIONS, where=where,
                                              default=DEFAULT_POSITIONS, lower=3),
        "rope_theta": float(theta),  # type: ignore[arg-type]  # checked above
    }


def window(config: Mapping[str, Any]) -> int:
    """Residues per trained window: ``max_position_embeddings`` less BOS and EOS."""
    return int(config.get("max_position_embeddings", DEFAULT_POSITIONS)) - 2


def identity_files(directory: Path, config: Mapping[str, Any]) -> list[str]:
    """``config.json`` and ``tokenizer.json`` (checked against :data:`VOCABULARY` on load)."""
    return ["config.json", "tokenizer.json"]


def swiglu_width(dim: int) -> int:
    """ESM C's SwiGLU width for a model width: 8/3 of it, rounded up to a multiple of 256."""
    return int(((8 / 3 * dim) + 255) // 256 * 256)


def plusplus_sizes(config: Mapping[str, Any], where: str) -> dict[str, Any]:
    """An ESM++ ``config.json``'s sizes: it names the width, heads, layers and vocabulary only;
    the SwiGLU width is ESM C's rule (:func:`swiglu_width`), the rest ESM C's defaults."""
    dim = config.get("hidden_size")
    filled = dict(config)
    if isinstance(dim, int) and not isinstance(dim, bool) and 0 < dim <= MAX_FFN:
        filled.setdefault("intermediate_size", swiglu_width(dim))
    return sizes(filled, where)


HF_ESMC = HfFamily(model_type="esmc", label="ESM C", sizes=sizes, identity_files=identity_files, window=window)


def parameter_count(layers: int, dim: int, ffn: int, vocab: int = 64) -> int:
    """Parameters of ``EsmcModel``: per layer q/k/v/o (4 D^2), q/k norms (2D), SwiGLU (3 D ffn),
    two layer norms with bias (4D); the token embedding and the final norm (no bias) outside."""
    return layers * (4 * dim * dim + 6 * dim + 3 * dim * ffn) + vocab * dim + dim


#: forward working memory per token, in bytes, per kind of policy: the live peak of a traced forward
#: (tests/runtime/test_cuda_memory_esmc.py: the 300M and 600M shapes on a faked GPU, no weights),
#: which includes the hidden state of the layer in flight. Attention: D bytes; the feed-forward:
#: (D bytes, F bytes), F the SwiGLU width; the larger of the two is the layer's peak.
ATTENTION_D_BYTES = {"fp32": 48, "plain": 24, "fp32-islands": 42, "fp32-islands-fp32-attention": 46,
                     "autocast": 38}
FFN_BYTES = {"fp32": (8, 16), "plain": (4, 8), "fp32-islands": (10, 8), "fp32-islands-fp32-attention": (10, 8),
             "autocast": (10, 8)}


def estimate_memory(layers: int, dim: int, ffn: int, weight_itemsize: int, compute_itemsize: int, *,
                    kind: str = "plain") -> MemoryEstimate:
    """Memory of an ESM C under a policy whose weights and matmuls use the given sizes.

    Activations per token (``kind`` as ESM-2's: ``fp32``, ``plain`` 16-bit, ``fp32-islands``,
    ``fp32-islands-fp32-attention``, ``autocast``), the peak of one layer: at attention the
    stream and its norm, fused q/k/v, q and k normed (fp32 under the islands), stacked and
    rotated, v and the output; at the feed-forward the stream, gate and up (2F values), the
    SiLU of the gate and the product (F each), in the compute dtype. Attention scores are not
    counted (SDPA and the varlen kernel on CUDA hold none). The residual stream is fp32 except
    under plain casts; the widest tensor is gate and up, 2F values a token.
    """
    parameters = parameter_count(layers, dim, ffn)
    if compute_itemsize == 4:
        kind = "fp32"
    per_d, per_f = FFN_BYTES[kind]
    return MemoryEstimate(
        host_bytes=host_bytes(4 * parameters),
        weight_bytes=weight_itemsize * parameters,
        activation_bytes_per_token=max(dim * ATTENTION_D_BYTES[kind], dim * per_d + ffn * per_f),
        hidden_itemsize=weight_itemsize if kind == "plain" else 4,
        widest_values_per_token=2 * ffn,
    )

#: ESM++ (Synthyra's port of ESM C, ``model_type: ESMplusplus``): the same model under the original
#: ``esm`` package's weight names (:data:`embedpipe.model.esmc.ESM_PLUSPLUS`), family ``esmc``
HF_ESM_PLUSPLUS = HfFamily(model_type="ESMplusplus", label="ESM++", sizes=plusplus_sizes, identity_files=identity_files,
                           window=window)
