"""The T5 encoder forward (ProtT5, Ankh), written out so that fp16 overflow stays visible.

Why our own loop instead of transformers' ``T5EncoderModel``: in fp16, transformers clamps
every hidden value to ``finfo(fp16).max - 1000`` after attention and after the feed-forward
whenever ``isinf`` holds anywhere in the batch. At inference that silently changes values,
a NaN/inf check never sees it, and whether a record is clamped depends on its batch-mates.
Here nothing is clamped: an overflow is inf/NaN (or a residual past 65504 under the mixed
policies, whose residual stream is fp32), and each record's ``max_abs`` says so.

The computation is transformers' (tests/model/test_t5.py checks fp32 equality on every layer):
RMS norm with an fp32 variance, no attention scaling, a bidirectional relative-position
bias computed by block 0 and shared by every layer, softmax in fp32, ``relu`` or gated
``gelu_new`` feed-forward. Layer 0 is the embedding, layer N the final norm's output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from embedpipe.model.base import ForwardOutput, masked_max_abs
from embedpipe.runtime.precision import Policy

#: names of the bias-free linear layers in a block (attention, feed-forward)
LINEARS = ("q", "k", "v", "o", "wi", "wi_0", "wi_1", "wo")


@dataclass(frozen=True)
class T5Shape:
    """What config.json says about a T5 encoder."""

    num_layers: int
    d_model: int
    d_kv: int
    num_heads: int
    d_ff: int
    gated: bool  # feed_forward_proj "gated-gelu" (Ankh, T5 v1.1) or "relu" (ProtT5)
    num_buckets: int = 32
    max_distance: int = 128
    eps: float = 1e-6


def relative_buckets(length: int, num_buckets: int, max_distance: int, device: torch.device) -> torch.Tensor:
    """(L, L) bucket of key position minus query position, bidirectional, as T5 computes it."""
    position = torch.arange(length, device=device)
    relative = position[None, :] - position[:, None]
    half = num_buckets // 2
    buckets = (relative > 0).long() * half
    distance = relative.abs()
    exact = half // 2
    large = exact + (torch.log(distance.float() / exact) / math.log(max_distance / exact) * (half - exact)).long()
    large = torch.clamp(large, max=half - 1)
    return buckets + torch.where(distance < exact, distance, large)


class T5Forward:
    """A T5 encoder prepared for one policy on one device (embedpipe's padded-layout Runner)."""

    def __init__(self, weights: dict[str, torch.Tensor], shape: T5Shape, policy: Policy, pad_id: int,
                 attention_inputs: str = "fp32") -> None:
        self.w, self.shape, self.policy, self.pad_id = weights, shape, policy, pad_id
        self.device = weights["embed"].device
        # the policy decides: fp32 under autocast and the islands, the weights' dtype under a plain cast
        self.residual_dtype = self.bias_dtype = policy.stream_dtype
        self.attn_dtype = policy.attention_dtype(attention_inputs)
        #: linear layers the policy prepares its own way (int8-mixed: int8 copies); none otherwise
        self.packed_weights = {name: policy.pack(w, None) for name, w in weights.items()
                       if name.rsplit(".", 1)[-1] in LINEARS} if policy.packs(False) else {}

    @property
    def fp32_layers(self) -> dict[str, str]:
        """Linear layers the policy packed but keeps fp32, name -> why (int8-mixed: weights too
        small for int8, docs/precision.md "int8-mixed"); read after calibration, for provenance."""
        return {name: why for name, packed in self.packed_weights.items() if (why := getattr(packed, "fp32_reason", ""))}

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """A bias-free projection as the policy runs a linear (the input cast to the weights'
        dtype; under autocast, PyTorch picks per op)."""
        return self.policy.linear(x, self.w[name], None, self.packed_weights.get(name))

    def rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """T5's RMS norm: fp32 variance; cast to the weight's dtype when that is 16-bit."""
        variance = x.float().pow(2).mean(-1, keepdim=True)
        normed = x * torch.rsqrt(variance + self.shape.eps)
        if weight.dtype in (torch.float16, torch.bfloat16):
            normed = normed.to(weight.dtype)
        return weight * normed

    def position_bias(self, length: int, keep: torch.Tensor | None) -> torch.Tensor:
        """(B, H, L, L) relative-position bias with padded keys at -inf; (1, H, L, L) unmasked
        when ``keep`` is None (each record attended at its own length)."""
        buckets = relative_buckets(length, self.shape.num_buckets, self.shape.max_distance, self.device)
        bias = F.embedding(buckets, self.w["relative_bias"]).permute(2, 0, 1)[None].to(self.bias_dtype)
        return bias if keep is None else bias.masked_fill(~keep[:, None, None, :], float("-inf"))

    def attention(self, h: torch.Tensor, i: int, bias: torch.Tensor, lengths: list[int] | None = None) -> torch.Tensor:
        """Self-attention of block ``i``: no 1/sqrt(d) scaling (T5 folds it into the weights).
        ``lengths``: each record attended at its own length, so its keys are summed the same
        way whatever the batch's pad length (docs/precision.md, "Reproducibility"); None: one
        masked attention over the batch."""
        b, t, _ = h.shape
        heads, d_kv = self.shape.num_heads, self.shape.d_kv
        q, k, v = (self._linear(h, f"{i}.{n}").view(b, t, heads, d_kv).transpose(1, 2) for n in ("q", "k", "v"))
        q, k, v = q.to(self.attn_dtype), k.to(self.attn_dtype), v.to(self.attn_dtype)
        if lengths is None:
            context = _attend(q, k, v, bias).transpose(1, 2)
        else:  # padding rows stay 0: nothing reads them
            context = torch.zeros((b, t, heads, d_kv), dtype=v.dtype, device=v.device)
            for row, n in enumerate(lengths):
                context[row, :n] = _attend(q[row, :, :n], k[row, :, :n], v[row, :, :n], bias[0, :, :n, :n]).transpose(0, 1)
        return self._linear(context.reshape(b, t, heads * d_kv), f"{i}.o")

    def feed_forward(self, h: torch.Tensor, i: int) -> torch.Tensor:
        if self.shape.gated:
            inner = F.gelu(self._linear(h, f"{i}.wi_0"), approximate="tanh") * self._linear(h, f"{i}.wi_1")
        else:
            inner = F.relu(self._linear(h, f"{i}.wi"))
        return self._linear(inner, f"{i}.wo")

    def __call__(self, tokens: torch.Tensor, layers: list[int]) -> ForwardOutput:
        """Hidden states of ``layers`` (0 = embeddings, N = after the final norm), (B, T, D), and
        each record's largest |residual| over its own tokens entering every block and leaving
        the last one (inf/NaN kept)."""
        # each record's length from the host tokens (no device read-back)
        lengths = tokens.ne(self.pad_id).sum(1).tolist() if tokens.device.type == "cpu" else None
        tokens = tokens.to(self.device)
        keep = tokens.ne(self.pad_id)
        wanted, last = set(layers), self.shape.num_layers
        x = F.embedding(tokens, self.w["embed"]).to(self.residual_dtype)
        hidden: dict[int, torch.Tensor] = {0: x} if 0 in wanted else {}
        bias = self.position_bias(tokens.shape[1], None if lengths is not None else keep)
        max_abs = torch.zeros(tokens.shape[0], device=self.device)
        for i in range(last):
            max_abs = torch.maximum(max_abs, masked_max_abs(x, keep))
            x = x + self.attention(self.rms(x, self.w[f"{i}.ln0"]), i, bias, lengths).to(self.residual_dtype)
            x = x + self.feed_forward(self.rms(x, self.w[f"{i}.ln1"]), i).to(self.residual_dtype)
            if i + 1 in wanted and i + 1 < last:
                hidden[i + 1] = x
        max_abs = torch.maximum(max_abs, masked_max_abs(x, keep))
        if last in wanted:
            hidden[last] = self.rms(x, self.w["final_ln"])
        return ForwardOutput(hidden=hidden, max_abs=max_abs)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """T5's attention of (..., L, d) q/k/v with an additive (..., L, L) bias: scores in the bias's
    dtype, softmax in fp32, the context in v's dtype."""
    scores = torch.matmul(q, k.transpose(-1, -2)).to(bias.dtype) + bias
    probs = F.softmax(scores.float(), dim=-1).to(v.dtype)
    return torch.matmul(probs, v)
