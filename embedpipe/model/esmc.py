"""ESM C from a Hugging Face directory (``model_type: esmc``, or ESM++'s ``ESMplusplus``): loading,
tokens, policies, memory.

:func:`load_directory` (called by :mod:`embedpipe.model.hf_checkpoint`) reads an ``EsmcModel``
(or ``EsmcForMaskedLM``: the head is dropped), or ESM++'s weights under their own names
(:data:`ESM_PLUSPLUS`), into an fp32 :class:`EsmcModel`; its runners are
:class:`~embedpipe.model.esmc_forward.EsmcForward`, padded and packed like ESM-2's. Tokens are
ESM C's fixed vocabulary (:data:`embedpipe.model.esmc_spec.VOCABULARY`): ``<cls>``, the residues,
``<eos>`` (docs/models.md, "ESM C").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from embedpipe.core.errors import ModelError
from embedpipe.core.jsonbounds import load_bounded_json
from embedpipe.model import esmc_spec
from embedpipe.model import hf_checkpoint as hf
from embedpipe.model.base import EmbeddingModel
from embedpipe.model.esmc_forward import EsmcForward, EsmcShape, inverse_frequencies
from embedpipe.model.facts import MemoryEstimate
from embedpipe.model.families import Format
from embedpipe.model.layout import TokenLayout
from embedpipe.runtime.precision import Policy

#: Letters embedpipe lets through (embedpipe.inputs.residue_rules); each has its own ESM C token.
LETTERS = "ACDEFGHIKLMNPQRSTVWYXBUZO"
#: Tensors the fp32-island policies keep in fp32: every layer norm (q/k norms too), rotary frequencies.
FP32_ISLAND_SUFFIXES = ("ln1.weight", "ln1.bias", "ln2.weight", "ln2.bias", "q_norm", "k_norm", "norm", "inv_freq")


@dataclass(frozen=True)
class KeyMap:
    """One published layout of ESM C's weights: embedpipe's name -> the layout's names (several
    are concatenated: q/k/v and gate/up are fused here)."""

    outside: Mapping[str, tuple[str, ...]]  # the token embedding and the final norm
    layer: str  # a layer's prefix, ``{i}`` its index
    per_layer: Mapping[str, tuple[str, ...]]
    heads: tuple[str, ...]  # prefixes of heads embedpipe drops (it never computes logits)


#: transformers' ``EsmcModel`` (``esmc.`` before every name in ``EsmcForMaskedLM``)
TRANSFORMERS = KeyMap(
    outside={"embed": ("embed_tokens.weight",), "norm": ("norm.weight",)}, layer="layers.{i}.",
    per_layer={
        "ln1.weight": ("input_layernorm.weight",), "ln1.bias": ("input_layernorm.bias",),
        "qkv": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        "q_norm": ("self_attn.q_norm.weight",), "k_norm": ("self_attn.k_norm.weight",),
        "o": ("self_attn.o_proj.weight",),
        "ln2.weight": ("post_attention_layernorm.weight",), "ln2.bias": ("post_attention_layernorm.bias",),
        "gate_up": ("mlp.gate_proj.weight", "mlp.up_proj.weight"), "down": ("mlp.down_proj.weight",)},
    heads=("lm_head.",))
#: ESM++ (``Synthyra/ESMplusplus_*``, ``model_type: ESMplusplus``): the original ``esm`` package's
#: names, q/k/v already fused behind their LayerNorm, gate and up in one ``ffn.1`` (gate first)
ESM_PLUSPLUS = KeyMap(
    outside={"embed": ("embed.weight",), "norm": ("transformer.norm.weight",)}, layer="transformer.blocks.{i}.",
    per_layer={
        "ln1.weight": ("attn.layernorm_qkv.0.weight",), "ln1.bias": ("attn.layernorm_qkv.0.bias",),
        "qkv": ("attn.layernorm_qkv.1.weight",), "q_norm": ("attn.q_ln.weight",), "k_norm": ("attn.k_ln.weight",),
        "o": ("attn.out_proj.weight",), "ln2.weight": ("ffn.0.weight",), "ln2.bias": ("ffn.0.bias",),
        "gate_up": ("ffn.1.weight",), "down": ("ffn.3.weight",)},
    heads=("sequence_head.", "lm_head."))
#: Recomputed or unused tensors a directory may hold.
IGNORED_SUFFIXES = ("inv_freq", "original_inv_freq")


@dataclass
class EsmcModel:
    """A ready ESM C: fp32 tensors on the CPU (``weights``), plus where it came from."""

    weights: dict[str, torch.Tensor]
    shape: EsmcShape
    name: str
    source: str
    sha256: str
    trained: bool
    trained_window: int  # its row's capabilities (embedpipe.model.families: EsmcForward takes both layouts)
    token_layout: TokenLayout
    batch_layouts: tuple[str, ...]
    family: str
    provenance: Mapping[str, str] = field(default_factory=lambda: {"model_format": "huggingface-esmc"})
    _lut: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._lut = np.full(256, esmc_spec.UNK, dtype=np.int64)  # ASCII byte -> token
        for letter in LETTERS:
            self._lut[ord(letter)] = esmc_spec.VOCABULARY.index(letter)

    @property
    def num_layers(self) -> int:
        return self.shape.num_layers

    @property
    def embed_dim(self) -> int:
        return self.shape.dim

    def tokenize(self, sequences: Sequence[str]) -> torch.Tensor:
        """(B, 2 + longest): ``<cls>``, the residues, ``<eos>``, then ``<pad>``."""
        width = max(len(seq) for seq in sequences) + 2
        tokens = np.full((len(sequences), width), esmc_spec.PAD, dtype=np.int64)
        for row, seq in enumerate(sequences):
            tokens[row, 0] = esmc_spec.BOS
            tokens[row, 1 : len(seq) + 1] = self._lut[np.frombuffer(seq.encode("ascii"), dtype=np.uint8)]
            tokens[row, len(seq) + 1] = esmc_spec.EOS
        return torch.from_numpy(tokens)

    def prepare(self, policy: Policy, device: torch.device, attention: str = "sdpa", *,
                attention_inputs: str = "fp32") -> EsmcForward:
        """A runner for ``policy`` on ``device`` on the policy's copy of the weights (fp32 ones
        moved, not copied, and still the fallback's)."""
        return EsmcForward(prepare_weights(self.weights, policy, device), self.shape, policy, attention,
                           attention_inputs=attention_inputs)

    def estimate_memory(self, policy: Policy, *, attention_inputs: str = "fp32") -> MemoryEstimate:
        s = self.shape
        return esmc_spec.estimate_memory(s.num_layers, s.dim, s.ffn, policy.weight_dtype.itemsize,
                                         policy.compute_dtype.itemsize, kind=policy.memory_kind(attention_inputs))


def prepare_weights(weights: Mapping[str, torch.Tensor], policy: Policy, device: torch.device) -> dict[str, torch.Tensor]:
    """``weights`` in the policy's dtypes on ``device`` (the islands in fp32 for mixed policies)."""
    return policy.cast_weights(weights, device, lambda name: name.endswith(FP32_ISLAND_SUFFIXES))


def shape_of(sizes: Mapping[str, Any]) -> EsmcShape:
    """The shape from a config's bounded sizes (the family's ``sizes``: :func:`esmc_spec.sizes`)."""
    return EsmcShape(num_layers=sizes["num_layers"], dim=sizes["embed_dim"], heads=sizes["attention_heads"],
                     ffn=sizes["intermediate_size"], rope_theta=sizes["rope_theta"], pad_id=esmc_spec.PAD)


def expected_shapes(s: EsmcShape, vocab: int) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape under embedpipe's names, from the config (the weights must agree)."""
    shapes: dict[str, tuple[int, ...]] = {"embed": (vocab, s.dim), "norm": (s.dim,)}
    for i in range(s.num_layers):
        shapes |= {f"{i}.ln1.weight": (s.dim,), f"{i}.ln1.bias": (s.dim,), f"{i}.qkv": (3 * s.dim, s.dim),
                   f"{i}.q_norm": (s.dim,), f"{i}.k_norm": (s.dim,), f"{i}.o": (s.dim, s.dim),
                   f"{i}.ln2.weight": (s.dim,), f"{i}.ln2.bias": (s.dim,), f"{i}.gate_up": (2 * s.ffn, s.dim),
                   f"{i}.down": (s.dim, s.ffn)}
    return shapes


def esmc_weights(state: Mapping[str, torch.Tensor], shape: EsmcShape, vocab: int, where: str,
                 keys: KeyMap | None = None, sized_by: str = "config") -> dict[str, torch.Tensor]:
    """The model's tensors under embedpipe's names (q/k/v and gate/up fused), fp32, checked for
    missing and unexpected names, shape and finiteness; ``keys``: the layout (default: ESM++'s
    names when the final norm is under them, else transformers'); ``sized_by``: what gave
    ``shape``, as a refusal names it."""
    keys = keys or (ESM_PLUSPLUS if "transformer.norm.weight" in state else TRANSFORMERS)
    prefix = "esmc." if any(k.startswith("esmc.") for k in state) else ""
    names = dict(keys.outside)
    for i in range(shape.num_layers):
        layer = keys.layer.format(i=i)
        names |= {f"{i}.{ours}": tuple(layer + t for t in theirs) for ours, theirs in keys.per_layer.items()}
    wanted = {prefix + t for theirs in names.values() for t in theirs}
    unexpected = sorted(k for k in state if k not in wanted and not k.startswith(keys.heads)
                        and not k.endswith(IGNORED_SUFFIXES))
    if unexpected:
        raise ModelError(f"{where}: unexpected weights {', '.join(unexpected[:4])} for an ESM C with "
                         f"{shape.num_layers} layers")
    weights: dict[str, torch.Tensor] = {}
    expected = expected_shapes(shape, vocab)
    for ours, theirs in names.items():
        missing = [prefix + t for t in theirs if prefix + t not in state]
        if missing:
            raise ModelError(f"{where} does not match an ESM C with {shape.num_layers} layers: missing {missing[0]}")
        tensor = torch.cat([state[prefix + t].detach() for t in theirs]) if len(theirs) > 1 else state[prefix + theirs[0]]
        if tuple(tensor.shape) != expected[ours]:
            raise ModelError(f"{where}: weight for {ours} has shape {tuple(tensor.shape)}, {sized_by} says {expected[ours]}")
        if not torch.isfinite(tensor).all():
            raise ModelError(f"{where}: weights for {ours} hold NaN or inf")
        weights[ours] = tensor.detach().to(torch.float32).contiguous()
    weights["inv_freq"] = inverse_frequencies(shape)
    return weights


def check_vocabulary(directory: Path) -> None:
    """A ``tokenizer.json``, when present, must give every ESM C token its fixed id."""
    path = directory / "tokenizer.json"
    if not path.is_file():
        return
    try:
        data = load_bounded_json(path.read_text(), str(path), ModelError)
        vocab = {str(k): int(v) for k, v in data["model"]["vocab"].items()}
        vocab |= {t["content"]: int(t["id"]) for t in data.get("added_tokens") or []}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ModelError(f"{path} is not a tokenizer file transformers writes ({type(exc).__name__}: {exc})") from None
    wrong = [t for i, t in enumerate(esmc_spec.VOCABULARY) if vocab.get(t) != i]
    if wrong:
        raise ModelError(f"{path}: not ESM C's vocabulary ({wrong[0]!r} is not token "
                         f"{esmc_spec.VOCABULARY.index(wrong[0])})")


def load_directory(spec: str, directory: Path, config: Mapping[str, Any], fmt: Format) -> EsmcModel:
    """An :class:`EsmcModel` from a Hugging Face ESM C directory of format ``fmt`` (ESM C's or ESM++'s:
    its sizes and capabilities; its ``config.json`` already read)."""
    where = str(directory)
    sizes = hf.hf_of(fmt).sizes(config, str(directory / "config.json"))
    shape, vocab = shape_of(sizes), sizes["vocab_size"]
    check_vocabulary(directory)
    files = hf.weight_files(directory)
    sha = hf.weights_sha256(files)
    weights = esmc_weights(hf.read_state_dict(files), shape, vocab, where)
    return EsmcModel(weights=weights, shape=shape, name=spec if hf.is_model_name(spec) else directory.name,
                     source=where, sha256=sha, trained=hf.is_trained(config),
                     **hf.capabilities(fmt, config).model_fields())


if TYPE_CHECKING:  # mypy checks the family against the interface (docs/architecture.md)
    _model_conforms: type[EmbeddingModel] = EsmcModel
