"""Bounds on a model config's fields, checked before anything is sized by them: a fair-esm
checkpoint's ``cfg['model']`` and a Hugging Face ``config.json`` (ESM-2, T5) go through the
same functions (docs/models.md, "Limits").

Why: a crafted config is untrusted input. ``num_hidden_layers: 10000000`` once built a name
table per layer until MemoryError, ``relative_attention_max_distance: 8`` raised IndexError
in the bucket lookup, ``"d_model": 12.7`` was truncated to 12. Each field is refused in one
line naming the file and the field before a tensor, a name table or a layer is made; the
weights' own shapes are compared with the config afterwards (``check_cfg_against_weights``
for ESM-2, ``t5.encoder_weights``). Torch-free: ``model-info`` (the workflow's ``mem_mb``)
reads configs through it too.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from embedpipe.core.errors import ModelError

#: upper bounds, far above any published protein language model (ESM-2 15B: 48 layers, width
#: 5120, 40 heads; ProtT5-XL: 24 layers, d_ff 16384; T5-XXL: d_model 4096, d_ff 10240), and
#: small enough that nothing sized by them is a runaway allocation before the weights are read
MAX_LAYERS = 1024
MAX_WIDTH = 65536  # hidden_size, d_model, d_kv, encoder_embed_dim
MAX_HEADS = 1024
MAX_FFN = 4 * MAX_WIDTH  # intermediate_size, d_ff
MAX_VOCAB = 1 << 20
MAX_POSITIONS = 1 << 20
MAX_BUCKETS = 4096  # relative_attention_num_buckets
MAX_DISTANCE = 1 << 20  # relative_attention_max_distance
#: layer-norm epsilon: positive, finite, and no larger than this (published models: 1e-5, 1e-6)
MAX_EPSILON = 1e-2
#: position_embedding_type values transformers' EsmConfig knows; ESM-2 is ``rotary``
ESM_POSITION_TYPES = ("absolute", "relative_key", "relative_key_query", "rotary")

_REQUIRED = object()


def size_field(config: Mapping[str, Any], field: str, upper: int, *, where: str, default: Any = _REQUIRED,
               lower: int = 1) -> int:
    """``config[field]`` as an int in ``lower..upper``; a one-line error naming ``where`` and ``field``
    when it is missing (and has no default), not an integer (bools, floats, strings), or out of range."""
    value = config.get(field, default) if isinstance(config, Mapping) else getattr(config, field, default)
    return bounded_int(value, field, upper, where=where, lower=lower)


def bounded_int(value: Any, field: str, upper: int, *, where: str, lower: int = 1) -> int:
    """``value`` itself, checked as :func:`size_field` checks a field."""
    if value is _REQUIRED or value is None:
        raise ModelError(f"{where}: {field} is missing (a positive integer, at most {upper})")
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelError(f"{where}: {field} must be a positive integer, got {_shown(value)}")
    if value < lower or value > upper:
        kind = "a positive integer" if lower == 1 else f"an integer from {lower}"
        raise ModelError(f"{where}: {field} must be {kind} no larger than {upper}, got {value}")
    return value


def epsilon_field(config: Mapping[str, Any], field: str, *, where: str, default: float) -> float:
    """A layer norm's epsilon: a finite number in (0, :data:`MAX_EPSILON`]; one line otherwise."""
    value = config.get(field, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not 0 < value <= MAX_EPSILON:
        raise ModelError(f"{where}: {field} must be a finite number in (0, {MAX_EPSILON:g}], got {_shown(value)}")
    return float(value)


def check_heads(dim: int, heads: int, *, where: str, fields: tuple[str, str] = ("dim", "heads"),
                even: bool = True) -> None:
    """Heads must divide the width; with rotary embeddings (``even``) the head dimension is even."""
    if dim % heads:
        raise ModelError(f"{where}: {fields[0]} {dim} is not divisible by {fields[1]} {heads}")
    if even and (dim // heads) % 2:
        raise ModelError(
            f"{where}: head dimension {fields[0]}/{fields[1]} = {dim}/{heads} = {dim // heads} must be even "
            f"(rotary embeddings rotate pairs of channels)"
        )


def validate_shape(layers: Any, dim: Any, heads: Any, *, where: str,
                   fields: tuple[str, str, str] = ("layers", "dim", "heads")) -> tuple[int, int, int]:
    """An ESM-2's (layers, width, heads), each bounded, heads dividing the width into even
    head dimensions: fair-esm's cfg (``encoder_layers``, ...), config.json, make-test-model."""
    layers = bounded_int(layers, fields[0], MAX_LAYERS, where=where)
    dim = bounded_int(dim, fields[1], MAX_WIDTH, where=where)
    heads = bounded_int(heads, fields[2], MAX_HEADS, where=where)
    check_heads(dim, heads, where=where, fields=(fields[1], fields[2]))
    return layers, dim, heads


def esm_config(config: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The sizes of a Hugging Face ESM ``config.json`` (``where``), bounded: layers, width, heads,
    intermediate size, vocabulary, positions, layer-norm epsilon, position embedding type."""
    layers, dim, heads = validate_shape(
        config.get("num_hidden_layers"), config.get("hidden_size"), config.get("num_attention_heads"),
        where=where, fields=("num_hidden_layers", "hidden_size", "num_attention_heads"))
    kind = config.get("position_embedding_type", "absolute")
    if kind not in ESM_POSITION_TYPES:
        raise ModelError(f"{where}: position_embedding_type {_shown(kind)} is not one of "
                         f"{', '.join(ESM_POSITION_TYPES)} (ESM-2's is 'rotary')")
    return {
        "num_layers": layers, "embed_dim": dim, "attention_heads": heads,
        "intermediate_size": size_field(config, "intermediate_size", MAX_FFN, where=where, default=4 * dim),
        "vocab_size": size_field(config, "vocab_size", MAX_VOCAB, where=where),
        "max_position_embeddings": size_field(config, "max_position_embeddings", MAX_POSITIONS, where=where,
                                              default=1026),
        "layer_norm_eps": epsilon_field(config, "layer_norm_eps", where=where, default=1e-5),
        "position_embedding_type": kind,
    }


def t5_config(config: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The sizes of a T5 ``config.json`` (``where``), bounded. The relative-position buckets
    must leave T5's logarithmic range non-empty: ``max_distance`` above ``num_buckets // 4``
    (the exact buckets), or the bucket of a long distance is log(1)/log(1) (transformers'
    IndexError too)."""
    sizes = {
        "num_layers": size_field(config, "num_layers", MAX_LAYERS, where=where),
        "d_model": size_field(config, "d_model", MAX_WIDTH, where=where),
        "d_kv": size_field(config, "d_kv", MAX_WIDTH, where=where),
        "num_heads": size_field(config, "num_heads", MAX_HEADS, where=where),
        "d_ff": size_field(config, "d_ff", MAX_FFN, where=where),
        "num_buckets": size_field(config, "relative_attention_num_buckets", MAX_BUCKETS, where=where,
                                  default=32, lower=4),
        "eps": epsilon_field(config, "layer_norm_epsilon", where=where, default=1e-6),
    }
    if "vocab_size" in config:
        size_field(config, "vocab_size", MAX_VOCAB, where=where)
    exact = sizes["num_buckets"] // 4
    distance = size_field(config, "relative_attention_max_distance", MAX_DISTANCE, where=where, default=128)
    if distance <= exact:
        raise ModelError(f"{where}: relative_attention_max_distance {distance} must be larger than "
                         f"relative_attention_num_buckets // 4 = {exact}, where T5's logarithmic buckets start")
    sizes["max_distance"] = distance
    if sizes["num_heads"] * sizes["d_kv"] > MAX_WIDTH:
        raise ModelError(f"{where}: num_heads x d_kv = {sizes['num_heads']} x {sizes['d_kv']} is wider than "
                         f"{MAX_WIDTH}")
    return sizes


def _shown(value: Any) -> str:
    """A config value as an error shows it: its repr, cut at 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
