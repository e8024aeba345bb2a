"""T5 encoders (ProtT5, ProstT5, Ankh) from a Hugging Face directory: loading, tokens, policies, memory.

:func:`load_directory` (called by :mod:`embedpipe.model.hf_checkpoint`) reads the encoder's
weights (a ``T5EncoderModel`` or a full ``T5ForConditionalGeneration``: the decoder is
dropped) into an fp32 :class:`T5Model`; its runners are
:class:`~embedpipe.model.t5_forward.T5Forward` (padded batches only: the worker picks the
padded layout for a runner without ``packed``). Shard budgets, planning and pooling follow
its row's token layout (:data:`embedpipe.model.families.FAMILY_TABLE`: no BOS, one ``</s>``; ProstT5's
direction prefix in BOS's place; docs/models.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from embedpipe.core.errors import ModelError
from embedpipe.model import hf_checkpoint as hf
from embedpipe.model import t5_vocab
from embedpipe.model.base import EmbeddingModel, Runner
from embedpipe.model.config_bounds import t5_config
from embedpipe.model.facts import MemoryEstimate, host_bytes
from embedpipe.model.families import Format
from embedpipe.model.layout import TokenLayout
from embedpipe.model.t5_forward import T5Forward, T5Shape
from embedpipe.runtime.precision import Policy

#: ProstT5 stores' ``direction_prefixes``: how each record's prefix was chosen (its stored sequence's case)
PROSTT5_DIRECTIONS = "<AA2fold> for an upper-case record (amino acids), <fold2AA> for a lower-case one (3Di)"

#: Tensors the fp32-island policies keep in fp32 (RMS norm scales, the relative-position bias).
FP32_ISLAND_SUFFIXES = ("ln0", "ln1", "final_ln", "relative_bias")


@dataclass
class T5Model:
    """A ready T5 encoder: fp32 tensors on the CPU (``weights``), plus where it came from."""

    weights: dict[str, torch.Tensor]
    shape: T5Shape
    lut: np.ndarray  # ASCII byte -> token id
    eos_id: int
    pad_id: int
    name: str
    source: str
    sha256: str
    trained: bool
    family: str  # its row's: prot-t5, prostt5 or ankh (the capabilities below are the row's too)
    trained_window: int
    token_layout: TokenLayout
    batch_layouts: tuple[str, ...]  # padded only: no packed runner
    prefix_ids: tuple[int, int] | None = None  # ProstT5's <AA2fold>, <fold2AA> (t5_vocab.direction)
    provenance: Mapping[str, str] = field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        return self.shape.num_layers

    @property
    def embed_dim(self) -> int:
        return self.shape.d_model

    def tokenize(self, sequences: Sequence[str]) -> torch.Tensor:
        """(B, 1 + longest): the residues, ``</s>``, then ``<pad>`` (no BOS); ProstT5: (B, 2 + longest),
        each row's direction prefix first."""
        return torch.from_numpy(t5_vocab.tokenize(list(sequences), self.lut, self.eos_id, self.pad_id,
                                                  self.prefix_ids))

    def prepare(self, policy: Policy, device: torch.device, attention: str = "math", *,
                attention_inputs: str = "fp32") -> T5Forward:
        """A runner for ``policy`` on ``device``: a cast copy of the weights (the fp32 ones stay
        as they are, for the fallback). ``attention`` is accepted for the interface; T5 has one
        attention (explicit scores, fp32 softmax), since its bias is added to every score."""
        return T5Forward(prepare_weights(self.weights, policy, device), self.shape, policy, self.pad_id,
                         attention_inputs=attention_inputs)

    def estimate_memory(self, policy: Policy, *, attention_inputs: str = "fp32") -> MemoryEstimate:
        """Per token: fp32 residual and norm (8D), q/k/v/context (4 x H d_kv, in the dtype
        ``attention_inputs`` resolves to), the feed-forward's hidden layer (1 or 2 x d_ff) in
        the compute dtype, and the attention scores of the longest window the planner cuts
        (``trained_window`` residues and ``</s>``): they are quadratic, H x L per token. An upper
        bound for shorter batches; with ``--long-sequences full`` a longer record costs more, and
        a batch that runs out of memory is split (docs/models.md, "Limits"). Checked against a
        traced forward (tests/runtime/test_cuda_memory.py).

        Bytes per score at the peak of :meth:`T5Forward.attention`: the position bias (held for
        the whole forward, in the stream dtype), plus the largest of three moments: q k^T made
        (attention dtype), cast to the bias dtype and the bias added; the softmax (an fp32 copy,
        fp32 probabilities); the probabilities cast back beside the scores."""
        s = self.shape
        parameters = sum(w.numel() for w in self.weights.values())
        inner = s.d_ff * (2 if s.gated else 1)
        attention, bias, fp32 = policy.attention_dtype(attention_inputs), policy.stream_dtype, torch.float32
        a, b = attention.itemsize, bias.itemsize
        made = a + (b if attention != bias else 0) + b
        softmax = b + (4 if bias != fp32 else 0) + 4
        cast = b + 4 + (a if attention != fp32 else 0)
        window = self.trained_window + self.token_layout.extra_tokens
        scores = s.num_heads * window * (b + max(made, softmax, cast))
        return MemoryEstimate(host_bytes=host_bytes(4 * parameters),
                              weight_bytes=policy.weight_dtype.itemsize * parameters,
                              activation_bytes_per_token=8 * s.d_model + attention.itemsize * 4 * s.num_heads * s.d_kv
                              + policy.compute_dtype.itemsize * inner + scores)


def prepare_weights(weights: Mapping[str, torch.Tensor], policy: Policy, device: torch.device) -> dict[str, torch.Tensor]:
    """``weights`` in the policy's dtypes on ``device`` (the islands in fp32 for mixed policies)."""
    return policy.cast_weights(weights, device, lambda name: name.endswith(FP32_ISLAND_SUFFIXES))


def shape_of(config: Mapping[str, Any], where: str) -> T5Shape:
    """The encoder's shape from ``config.json`` (``where``); every size bounded first
    (:func:`embedpipe.model.config_bounds.t5_config`), one-line errors for what embedpipe cannot run."""
    proj = config.get("feed_forward_proj", "relu")
    if proj not in ("relu", "gated-gelu"):
        raise ModelError(f"{where}: feed_forward_proj {proj!r} is not supported (relu or gated-gelu)")
    return T5Shape(gated=proj == "gated-gelu", **t5_config(config, where))


def _names(shape: T5Shape) -> dict[str, str]:
    """embedpipe's weight names -> transformers' encoder names."""
    names = {"relative_bias": "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
             "final_ln": "encoder.final_layer_norm.weight"}
    ffn = ("wi_0", "wi_1", "wo") if shape.gated else ("wi", "wo")
    for i in range(shape.num_layers):
        block = f"encoder.block.{i}.layer"
        names |= {f"{i}.{n}": f"{block}.0.SelfAttention.{n}.weight" for n in ("q", "k", "v", "o")}
        names |= {f"{i}.ln0": f"{block}.0.layer_norm.weight", f"{i}.ln1": f"{block}.1.layer_norm.weight"}
        names |= {f"{i}.{n}": f"{block}.1.DenseReluDense.{n}.weight" for n in ffn}
    return names


def _expected_shapes(s: T5Shape) -> dict[str, tuple[int, ...]]:
    inner = s.num_heads * s.d_kv
    shapes = {"relative_bias": (s.num_buckets, s.num_heads), "final_ln": (s.d_model,)}
    for i in range(s.num_layers):
        shapes |= {f"{i}.q": (inner, s.d_model), f"{i}.k": (inner, s.d_model), f"{i}.v": (inner, s.d_model),
                   f"{i}.o": (s.d_model, inner), f"{i}.ln0": (s.d_model,), f"{i}.ln1": (s.d_model,),
                   f"{i}.wo": (s.d_model, s.d_ff)}
        shapes |= ({f"{i}.wi_0": (s.d_ff, s.d_model), f"{i}.wi_1": (s.d_ff, s.d_model)} if s.gated
                   else {f"{i}.wi": (s.d_ff, s.d_model)})
    return shapes


def encoder_weights(state: Mapping[str, torch.Tensor], shape: T5Shape, where: str) -> dict[str, torch.Tensor]:
    """The encoder's tensors under embedpipe's names, fp32, checked for shape and finiteness."""
    embed = state.get("shared.weight", state.get("encoder.embed_tokens.weight"))
    other = state.get("encoder.embed_tokens.weight")
    if embed is None:
        raise ModelError(f"{where}: no token embedding (shared.weight or encoder.embed_tokens.weight)")
    if other is not None and not torch.equal(embed, other):
        raise ModelError(f"{where}: shared.weight and encoder.embed_tokens.weight differ, but T5 ties them")
    weights = {"embed": embed}
    for ours, theirs in _names(shape).items():
        if theirs not in state:
            raise ModelError(f"{where} does not match a T5 encoder with {shape.num_layers} layers: missing {theirs}")
        weights[ours] = state[theirs]
    extra = sorted(k for k in state if k.startswith("encoder.block.") and k not in _names(shape).values())
    if extra:
        raise ModelError(f"{where}: unexpected encoder weights {', '.join(extra[:4])} (config says "
                         f"{shape.num_layers} layers, feed_forward_proj {'gated-gelu' if shape.gated else 'relu'})")
    expected = _expected_shapes(shape) | {"embed": (embed.shape[0], shape.d_model)}
    for name, tensor in weights.items():
        if tuple(tensor.shape) != expected[name]:
            raise ModelError(f"{where}: weight for {name} has shape {tuple(tensor.shape)}, config says {expected[name]}")
        if not torch.isfinite(tensor).all():
            raise ModelError(f"{where}: weights for {name} hold NaN or inf")
    return {name: tensor.detach().to(torch.float32).contiguous() for name, tensor in weights.items()}


def load_directory(spec: str, directory: Path, config: Mapping[str, Any], fmt: Format) -> T5Model:
    """A :class:`T5Model` from a Hugging Face T5 directory of format ``fmt`` (its ``config.json`` already read)."""
    where = str(directory)
    shape = shape_of(config, str(directory / "config.json"))
    vocab = t5_vocab.read_vocabulary(directory)
    lut, eos, pad = t5_vocab.residue_table(vocab, str(fmt.hf_style), where=where)
    prefixes = t5_vocab.prefix_ids(vocab, where=where) if fmt.hf_style == t5_vocab.SPACED_3DI else None
    files = hf.weight_files(directory)
    sha = hf.weights_sha256(files)
    weights = encoder_weights(hf.read_state_dict(files), shape, where)
    top = max([int(lut.max()), *(prefixes or ())])
    if top >= weights["embed"].shape[0]:
        raise ModelError(f"{where}: the tokenizer's ids reach {top}, the embedding has "
                         f"{weights['embed'].shape[0]} rows")
    return T5Model(weights=weights, shape=shape, lut=lut, eos_id=eos, pad_id=pad,
                   name=spec if hf.is_model_name(spec) else directory.name, source=where, sha256=sha,
                   trained=hf.is_trained(config), prefix_ids=prefixes,
                   **hf.capabilities(fmt, config).model_fields(),
                   provenance={"model_format": "huggingface-t5"} | ({"direction_prefixes": PROSTT5_DIRECTIONS}
                                                                  if prefixes else {}))


if TYPE_CHECKING:  # mypy checks the family against the interface (docs/architecture.md)
    _model_conforms: type[EmbeddingModel] = T5Model
    _runner_conforms: type[Runner] = T5Forward
