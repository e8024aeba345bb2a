"""ESM C's forward pass (transformers' ``EsmcModel`` written out), on ESM-2's runtime pieces.

Why our own loop: transformers is the reference in tests, not the runtime. Its rotary tables are
cast to the compute dtype (the drift FastPLMs#27 measured) and its layer norms return their
input's dtype; here every linear goes through the policy (:meth:`Policy.linear`, prepacked or
int8 on the CPU, exactly as ESM-2's), batches are padded or packed (varlen flash on CUDA), and
under the mixed policies the residual stream, every layer norm (q/k norms included), the rotary
tables and softmax stay fp32 islands. Each record's largest residual is watched every layer.

The computation (tests/model/test_esmc.py checks it against ``EsmcModel`` on every layer):
pre-LN blocks; q, k, v without bias, LayerNorm (weight only) on q and k over the full width;
rotary (NeoX halves, base ``rope_theta``); SwiGLU feed-forward; each residual branch divided
by sqrt(layers / 36); a final LayerNorm without bias. Layer 0 is the token embedding, layer N
the final norm's output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from embedpipe.core.errors import ModelError
from embedpipe.model.base import ForwardOutput, PackedRunner
from embedpipe.model.esm2_forward import RotaryTables, _PaddedBatch, rotate_into
from embedpipe.runtime.attention import packed_kernel
from embedpipe.runtime.packed import PackedTokens, packed_attention, padded_attention
from embedpipe.runtime.precision import Packed, Policy

#: the linear layers of a block, by embedpipe's weight name (``{layer}.{name}``)
LINEARS = ("qkv", "o", "gate_up", "down")
#: the forwards ESM C offers (the attention kernel, ``EMBEDPIPE_ENGINE``); it has no fair-esm implementation
ATTENTIONS = ("sdpa", "math")
#: layer-norm epsilon of every ESM C norm (``nn.LayerNorm``'s default, not in config.json)
EPS = 1e-5


@dataclass(frozen=True)
class EsmcShape:
    """What config.json says about an ESM C."""

    num_layers: int
    dim: int
    heads: int
    ffn: int  # intermediate_size (the SwiGLU width)
    rope_theta: float
    pad_id: int

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    @property
    def residual_scale(self) -> float:
        """Each residual branch is divided by this: sqrt(layers / 36)."""
        return math.sqrt(self.num_layers / 36)


def inverse_frequencies(shape: EsmcShape) -> torch.Tensor:
    """Rotary inverse frequencies in fp32, as transformers' default rope computes them."""
    return 1.0 / (shape.rope_theta ** (torch.arange(0, shape.head_dim, 2, dtype=torch.float) / shape.head_dim))


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """LayerNorm in the norm weights' dtype: fp32 under the islands (the weights were kept fp32),
    the cast's dtype under a plain cast; under autocast PyTorch runs it in fp32."""
    return F.layer_norm(x.to(weight.dtype), weight.shape, weight, bias, EPS)


class EsmcForward:
    """An ESM C prepared for one policy on one device: padded and packed batches."""

    def __init__(self, weights: dict[str, torch.Tensor], shape: EsmcShape, policy: Policy, attention: str = "sdpa",
                 *, prepack: bool = True, attention_inputs: str = "fp32") -> None:
        """``weights``: the policy's copy (:func:`embedpipe.model.esmc.prepare_weights`);
        ``prepack``: on the CPU, the linears as the policy prepares them once (as ESM-2's)."""
        if attention not in ATTENTIONS:
            raise ModelError(f"EMBEDPIPE_ENGINE attention={attention}: the esmc family runs {' or '.join(ATTENTIONS)}")
        if attention_inputs not in ("fp32", "compute"):
            raise ValueError(f"attention_inputs must be fp32 or compute, not {attention_inputs!r}")
        self.w, self.shape, self.policy = weights, shape, policy
        self.attention, self.attention_inputs = attention, attention_inputs
        self.device = weights["embed"].device
        self.packed_attention = packed_kernel(self.device, self.attention_dtype)
        self.rotary = RotaryTables()
        self._packed: dict[str, Packed] = {}
        if self.device.type == "cpu" and policy.packs(prepack):
            self._prepack()

    def _prepack(self) -> None:
        """Every linear packed once; if one cannot be, none is (``F.linear`` for all, as ESM-2)."""
        for i in range(self.shape.num_layers):
            for name in LINEARS:
                packed = self.policy.pack(self.w[f"{i}.{name}"], None)
                if packed is None:
                    self._packed.clear()
                    return
                self._packed[f"{i}.{name}"] = packed

    @property
    def attention_dtype(self) -> torch.dtype:
        """dtype of q, k and v at the attention kernel."""
        return self.policy.attention_dtype(self.attention_inputs)

    @property
    def prepacked(self) -> bool:
        return bool(self._packed)

    @property
    def fp32_layers(self) -> dict[str, str]:
        """Linear layers the policy packed but keeps fp32, name -> why (int8-mixed)."""
        return {f"layers.{name}": why for name, packed in self._packed.items()
                if (why := getattr(packed, "fp32_reason", ""))}

    def __call__(self, tokens: torch.Tensor, layers: list[int]) -> ForwardOutput:
        """A padded (B, T) batch: hidden states (B, T, D)."""
        return self._forward(_PaddedBatch(tokens.to(self.device), self.shape.pad_id), layers)

    def packed(self, batch: PackedTokens, layers: list[int]) -> ForwardOutput:
        """A packed batch (on this runner's device): hidden states (N, D), one row per token."""
        if self.attention != "sdpa":
            raise ValueError(f"packed batches run with attention 'sdpa', not {self.attention!r}")
        return self._forward(batch, layers)

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return self.policy.linear(x, self.w[name], None, self._packed.get(name))

    def _forward(self, batch: _PaddedBatch | PackedTokens, layers: list[int]) -> ForwardOutput:
        wanted, last = set(layers), self.shape.num_layers
        x = batch.zero_padding(F.embedding(batch.tokens, self.w["embed"]).to(self.policy.stream_dtype))
        hidden: dict[int, torch.Tensor] = {0: x} if 0 in wanted else {}
        max_abs = batch.row_max_abs(x)
        for i in range(last):
            x = self._block(i, x, batch)
            # the stream before the final norm too: the norm would hide a huge last layer
            max_abs = torch.maximum(max_abs, batch.row_max_abs(x))
            if i + 1 in wanted and i + 1 < last:
                hidden[i + 1] = x
        if last in wanted:
            hidden[last] = layer_norm(x, self.w["norm"], None)
        return ForwardOutput(hidden=hidden, max_abs=max_abs)

    def _block(self, i: int, x: torch.Tensor, batch: _PaddedBatch | PackedTokens) -> torch.Tensor:
        """One pre-LN block; the branches added to the stream in its dtype (fp32 under the islands)."""
        w, scale = self.w, 1.0 / self.shape.residual_scale
        h = self._attention(i, layer_norm(x, w[f"{i}.ln1.weight"], w[f"{i}.ln1.bias"]), batch)
        x = torch.add(x, h.to(x.dtype), alpha=scale) if scale != 1.0 else x + h.to(x.dtype)
        h = self._linear(layer_norm(x, w[f"{i}.ln2.weight"], w[f"{i}.ln2.bias"]), f"{i}.gate_up")
        gate, up = h.chunk(2, dim=-1)
        h = self._linear(F.silu(gate) * up, f"{i}.down")
        return torch.add(x, h.to(x.dtype), alpha=scale) if scale != 1.0 else x + h.to(x.dtype)

    def _attention(self, i: int, x: torch.Tensor, batch: _PaddedBatch | PackedTokens) -> torch.Tensor:
        s, lead = self.shape, x.shape[:-1]  # (B, T) padded, (N,) packed
        qkv = self._linear(x, f"{i}.qkv")
        q = layer_norm(qkv[..., : s.dim], self.w[f"{i}.q_norm"], None)  # full width, fp32 under the islands
        k = layer_norm(qkv[..., s.dim : 2 * s.dim], self.w[f"{i}.k_norm"], None)
        table_dtype = self.policy.table_dtype(self.w["inv_freq"].dtype)
        work = torch.promote_types(q.dtype, table_dtype)
        qk = torch.stack((q, k), dim=-2).view(*lead, 2, s.heads, s.head_dim).to(work)
        cos, sin = self.rotary.get(self.w["inv_freq"], batch.max_len, table_dtype, s.head_dim ** -0.5)
        rotated = torch.empty_like(qk)
        rotate_into(qk, batch.rows(cos), batch.rows(sin), out=rotated)  # q scaled by 1/sqrt(d) in its table
        q, k = self.policy.attention_qk(rotated[..., 0, :, :], rotated[..., 1, :, :], self.attention_inputs)
        v = qkv[..., 2 * s.dim :].reshape(*lead, s.heads, s.head_dim).to(self.attention_dtype)
        if isinstance(batch, PackedTokens):
            out = self._attend_packed(q, k, v, batch)
        else:
            out = self._attend_padded(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), batch)
            out = out.transpose(1, 2)
        return self._linear(out.reshape(*lead, s.dim), f"{i}.o")

    def _attend_padded(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: _PaddedBatch) -> torch.Tensor:
        """(B, H, T, d) attention, q pre-scaled: ESM-2's padded attention (each record at its own
        length on the CPU, batch-invariant; ``math``: explicit scores with an fp32 softmax)."""
        return padded_attention(q, k, v, batch.attn_mask, batch.lengths, self.attention)

    def _attend_packed(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: PackedTokens) -> torch.Tensor:
        """(N, H, d) attention within each sequence (ESM-2's kernels: varlen flash or per sequence)."""
        q, k, v = self.policy.kernel_inputs(q, k, v)
        return packed_attention(q, k, v, batch, self.packed_attention)


if TYPE_CHECKING:  # mypy checks the runner against the interface (docs/architecture.md)
    _runner_conforms: type[PackedRunner] = EsmcForward
