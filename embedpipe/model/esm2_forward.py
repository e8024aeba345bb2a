"""ESM-2 forward pass on fair-esm's own modules and weights, without the parts nobody asked for.

Why our own loop instead of ``ESM2.forward``: it skips the logits head, contact head and
averaged attention maps that fair-esm always computes, runs attention through
``torch.nn.functional.scaled_dot_product_attention`` (fused, no LxL matrix on CUDA), keeps
the mixed policies' fp32 islands, and reports each record's largest activation. It uses the
model's parameters as they are (no patching), so fair-esm's own forward stays the reference
it is tested against (``attention="fair-esm"`` calls that forward directly).

ESM-1b and ESM-1v (fair-esm's ``ProteinBertModel``) run through the same loop: the runner reads
off the module what differs (learned absolute positions instead of rotary ones, a layer norm
before the first layer, token dropout in ``args``) and runs those parts only where present.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from embedpipe.model.base import ForwardOutput, PackedRunner, masked_max_abs
from embedpipe.runtime.attention import packed_kernel
from embedpipe.runtime.engine_override import ATTENTION_KERNELS
from embedpipe.runtime.packed import PackedTokens, packed_attention, padded_attention, token_max_abs
from embedpipe.runtime.precision import Packed, Policy

#: fair-esm's ``ESM2`` and its submodules: their attributes (``layers``, ``q_proj``, ``rot_emb``, ...)
#: exist at run time only, so the forward reads them untyped
FairEsmModule = Any


class RotaryTables:
    """cos/sin tables keyed by (device, dtypes, q scale): never reused across dtypes.

    One table per key, as long as the longest batch seen, sliced for shorter ones (the
    prefix of a longer table is exactly the shorter table), so memory stays bounded.
    """

    def __init__(self) -> None:
        self._cache: dict[tuple, tuple[torch.Tensor, ...]] = {}

    def get(self, inv_freq: torch.Tensor, length: int, table_dtype: torch.dtype,
            q_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each (length, 2, 1, head_dim / 2): row 0 of dim 1 for q, row 1 for k.

        Built the way fair-esm builds them (positions and frequencies in ``table_dtype``),
        keeping one half: fair-esm's tables are ``cat((t, t))``, two equal halves. ``q_scale``
        folds the attention scaling of q into q's tables (rotation is linear, so scaling
        before or after it is the same), saving one pass over q.
        """
        key = (str(inv_freq.device), inv_freq.dtype, table_dtype, q_scale)
        cached = self._cache.get(key)
        if cached is None or cached[0].shape[0] < length:
            freq = inv_freq.to(table_dtype)
            positions = torch.arange(length, device=inv_freq.device).to(table_dtype)
            freqs = torch.outer(positions, freq)  # (T, head_dim / 2)
            cos, sin = freqs.cos(), freqs.sin()
            cached = self._cache[key] = (
                torch.stack((cos * q_scale if q_scale != 1.0 else cos, cos), 1)[:, :, None, :],
                torch.stack((sin * q_scale if q_scale != 1.0 else sin, sin), 1)[:, :, None, :],
            )
        return cached[0][:length], cached[1][:length]

    def complex(self, inv_freq: torch.Tensor, length: int, q_scale: float = 1.0) -> torch.Tensor:
        """fp32 tables as complex64 ``cos + i sin``, (length, 2, 1, head_dim / 2), for
        :func:`rotate_pairs_`; built from :meth:`get`'s fp32 tables and cached the same way."""
        key = ("complex", str(inv_freq.device), inv_freq.dtype, q_scale)
        cached = self._cache.get(key)
        if cached is None or cached[0].shape[0] < length:
            cos, sin = self.get(inv_freq, length, torch.float32, q_scale)
            cached = self._cache[key] = (torch.complex(cos, sin),)
        return cached[0][:length]


def interleave_rotary_rows(weight: torch.Tensor, bias: torch.Tensor, heads: int,
                           head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused q/k/v weight and bias with q's and k's rows reordered per head so that rotary
    pairs ``(i, i + head_dim / 2)`` sit side by side: ``(x1_0, x2_0, x1_1, x2_1, ...)``.

    Why: the projection then yields each pair as one complex number, and rotation becomes
    one in-place complex multiply (:func:`rotate_pairs_`) instead of four half-width passes.
    q.k dot products do not depend on the order of a head's dimensions as long as q and k
    share it, so attention is unchanged; v keeps its order, so the output is unchanged.
    """
    half = head_dim // 2
    within = torch.stack((torch.arange(half), torch.arange(half) + half), dim=-1).flatten()
    rows = (torch.arange(2 * heads)[:, None] * head_dim + within[None, :]).flatten()
    order = torch.cat((rows, torch.arange(2 * heads * head_dim, 3 * heads * head_dim))).to(weight.device)
    return weight[order], bias[order]


def rotate_pairs_(qk: torch.Tensor, table: torch.Tensor) -> None:
    """Rotate fp32 q and k in place, (B, T, 2, H, head_dim) in interleaved pair order (see
    :func:`interleave_rotary_rows`), by complex ``table`` from :meth:`RotaryTables.complex`:
    ``(x1 + i x2)(c + i s) = (x1 c - x2 s) + i (x2 c + x1 s)``, fair-esm's rotation."""
    torch.view_as_complex(qk.unflatten(-1, (qk.shape[-1] // 2, 2))).mul_(table)


def rotate_into(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor) -> None:
    """fair-esm's ``x * cos + rotate_half(x) * sin`` written into ``out``, half by half.

    With ``x = (x1, x2)`` that is ``(x1 c - x2 s, x2 c + x1 s)``: four kernels over half the
    data and no temporaries (no negated copy, no concatenation). ``out`` may have any
    layout and a wider dtype than ``x`` (mixed policies: bf16 projections, fp32 rotation).
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    o1, o2 = out[..., :half], out[..., half:]
    torch.mul(x1, cos, out=o1)
    o1.addcmul_(x2, sin, value=-1)
    torch.mul(x2, cos, out=o2)
    o2.addcmul_(x1, sin)


def fuse_qkv(attn: FairEsmModule) -> None:
    """Make q/k/v projection weights views of one (3D, D) tensor, so one GEMM computes all three.

    The modules keep their parameters (now views), so fair-esm's own forward and anything
    else that reads them see the same values; no weights are duplicated.
    """
    projections = (attn.q_proj, attn.k_proj, attn.v_proj)
    cached = getattr(attn, "_embedpipe_qkv", None)
    if cached is not None and _still_views(cached, projections):
        return
    weight = torch.cat([p.weight.detach() for p in projections])
    bias = torch.cat([p.bias.detach() for p in projections])
    dim = attn.q_proj.weight.shape[0]
    for index, proj in enumerate(projections):
        proj.weight.data = weight[index * dim : (index + 1) * dim]
        proj.bias.data = bias[index * dim : (index + 1) * dim]
    attn._embedpipe_qkv = (weight, bias)


def _still_views(cached: tuple[torch.Tensor, torch.Tensor], projections: tuple) -> bool:
    """False once ``.to(dtype/device)`` or a copy replaced the parameters (views are not kept)."""
    weight, bias = cached
    dim = projections[0].weight.shape[0]
    return all(
        p.weight.data_ptr() == weight[i * dim].data_ptr() and p.bias.data_ptr() == bias[i * dim :].data_ptr()
        and p.weight.dtype == weight.dtype and p.weight.device == weight.device
        for i, p in enumerate(projections)
    )


class EsmForward:
    """Runs one prepared ESM-2 model (see :func:`embedpipe.model.esm2.prepare_model`) under one policy."""

    def __init__(self, model: FairEsmModule, policy: Policy, attention: str = "sdpa", *, prepack: bool = True,
                 attention_inputs: str = "fp32") -> None:
        """``prepack``: on CPU, run the projections and FFN with weights the policy prepares once
        (:meth:`Policy.pack`: oneDNN-prepacked, see :mod:`embedpipe.runtime.packed_linear`); ignored
        elsewhere and where the policy does not pack (autocast).
        ``attention_inputs``: under the fp32-island policies, ``fp32`` attends with fp32 q/k/v,
        ``compute`` casts them (after the fp32 rotation) to the policy's compute dtype."""
        if attention not in ATTENTION_KERNELS:
            raise ValueError(f"attention must be one of {ATTENTION_KERNELS}, not {attention!r}")
        if attention_inputs not in ("fp32", "compute"):
            raise ValueError(f"attention_inputs must be fp32 or compute, not {attention_inputs!r}")
        self.model = model
        self.policy = policy
        self.attention = attention
        self.attention_inputs = attention_inputs
        self.device = model.embed_tokens.weight.device
        #: the kernel packed batches attend with: ``varlen-flash`` where it runs, else the
        #: per-sequence SDPA stand-in (docs/precision.md, "Batch layout"); decided once, not per layer
        self.packed_attention = packed_kernel(self.device, self.attention_dtype)
        self.rotary = RotaryTables()
        self.padding_idx = model.padding_idx
        self.num_layers = model.num_layers
        # what sets fair-esm's ESM-1b (``ProteinBertModel``) apart from ESM-2, read off the module:
        # learned absolute positions instead of rotary ones, an optional layer norm before the
        # first layer, token dropout in its ``args`` (ESM-2: an attribute)
        self.positions: torch.nn.Embedding | None = getattr(model, "embed_positions", None)
        self.norm_before: torch.nn.LayerNorm | None = getattr(model, "emb_layer_norm_before", None) or None
        args = getattr(model, "args", None)
        self.token_dropout = bool(model.token_dropout if args is None else getattr(args, "token_dropout", False))
        self._packed: dict[int, Packed] = {}  # id(module) -> packed weights (qkv: id(attn))
        self._interleaved: set[int] = set()  # id(attn) whose packed q/k rows are in pair order
        if attention != "fair-esm":
            for layer in model.layers:
                fuse_qkv(layer.self_attn)
            if policy.packs(prepack):
                self._prepack()

    def _prepack(self) -> None:
        """Pack every projection once; any layer that cannot be packed keeps ``F.linear``.

        Where q and k are rotated in fp32 (fp32 and the mixed policies), the packed q/k rows
        are interleaved (see :func:`interleave_rotary_rows`), so rotation is one complex
        multiply. The module's own weights are left as they are. Off the CPU there is nothing
        to pack: it returns before reordering any rows (a copy of every layer's q/k/v).
        """
        if self.device.type != "cpu":
            return
        for layer in self.model.layers:
            attn = layer.self_attn
            weight, bias = attn._embedpipe_qkv
            interleave = attn.rot_emb is not None and self._rotation_dtype(attn, weight.dtype) == torch.float32
            if interleave:
                weight, bias = interleave_rotary_rows(weight, bias, attn.num_heads, attn.head_dim)
            targets = [(attn, weight, bias)]
            targets += [(linear, linear.weight, linear.bias) for linear in (attn.out_proj, layer.fc1, layer.fc2)]
            for module, w, b in targets:
                packed = self.policy.pack(w, b)
                if packed is None:
                    self._packed.clear()
                    self._interleaved.clear()
                    return  # unsupported here: the same answer for every layer, stop probing
                self._packed[id(module)] = packed
            if interleave:
                self._interleaved.add(id(attn))

    @property
    def prepacked(self) -> bool:
        """Whether the projections run with weights the policy prepared (oneDNN-prepacked)."""
        return bool(self._packed)

    @property
    def attention_dtype(self) -> torch.dtype:
        """dtype of q, k and v at the attention kernel (under autocast: the dtype it casts to)."""
        return self.policy.attention_dtype(self.attention_inputs)

    @property
    def fp32_layers(self) -> dict[str, str]:
        """Linear layers the policy packed but keeps fp32, name -> why (int8-mixed: weights too
        small for int8, docs/precision.md "int8-mixed"); read after calibration, for provenance."""
        kept: dict[str, str] = {}
        for i, layer in enumerate(self.model.layers):
            attn = layer.self_attn
            for name, module in (("self_attn.qkv", attn), ("self_attn.out_proj", attn.out_proj),
                                 ("fc1", layer.fc1), ("fc2", layer.fc2)):
                reason = getattr(self._packed.get(id(module)), "fp32_reason", "")
                if reason:
                    kept[f"layers.{i}.{name}"] = reason
        return kept

    def __call__(self, tokens: torch.Tensor, layers: list[int]) -> ForwardOutput:
        """A padded (B, T) batch: hidden states (B, T, D)."""
        if self.attention == "fair-esm":
            return self._fair_esm_forward(tokens, layers)
        return self._own_forward(_PaddedBatch(tokens, self.padding_idx), layers)

    def packed(self, batch: PackedTokens, layers: list[int]) -> ForwardOutput:
        """A packed batch (on this runner's device): hidden states (N, D), one row per token."""
        if self.attention != "sdpa":
            raise ValueError(f"packed batches run with attention 'sdpa', not {self.attention!r}")
        return self._own_forward(batch, layers)

    # -- fair-esm's own forward (reference path) -------------------------------------------
    def _fair_esm_forward(self, tokens: torch.Tensor, layers: list[int]) -> ForwardOutput:
        out = self.model(tokens, repr_layers=layers)
        hidden = out["representations"]
        keep = tokens.ne(self.padding_idx)
        max_abs = torch.stack([masked_max_abs(hidden[k], keep) for k in layers]).amax(0)
        return ForwardOutput(hidden=hidden, max_abs=max_abs)

    # -- embedpipe's forward ----------------------------------------------------------------
    def _own_forward(self, batch: _PaddedBatch | PackedTokens, layers: list[int]) -> ForwardOutput:
        model = self.model
        tokens = batch.tokens
        # Residual stream dtype: fp32 for the mixed policies, otherwise the weights' dtype
        # (under autocast the weights are fp32 and PyTorch decides per op).
        stream_dtype = self.policy.stream_dtype
        wanted = set(layers)
        hidden: dict[int, torch.Tensor] = {}

        x = model.embed_scale * model.embed_tokens(tokens)
        x = x.to(stream_dtype)
        if self.token_dropout:
            masked = tokens == model.mask_idx
            x = x.masked_fill(masked.unsqueeze(-1), 0.0)
            mask_ratio_train = 0.15 * 0.8
            x = x * (1 - mask_ratio_train) / (1 - batch.mask_ratio(masked, x.dtype)).unsqueeze(-1)
        if self.positions is not None:  # ESM-1b: learned absolute positions, restarting per sequence
            first = self.padding_idx + 1  # fair-esm's positions count from padding_idx + 1
            if first + batch.max_len > self.positions.num_embeddings:
                raise ValueError(f"{batch.max_len} tokens exceed the model's "
                                 f"{self.positions.num_embeddings - first} learned positions")
            x = x + batch.rows(self.positions.weight[first : first + batch.max_len])
        if self.norm_before is not None:  # ESM-1b: a layer norm before the first layer
            x = self._layer_norm(self.norm_before, x)
        x = batch.zero_padding(x)

        max_abs = batch.row_max_abs(x)
        if 0 in wanted:
            hidden[0] = x
        for index, layer in enumerate(model.layers, start=1):
            x = self._layer(layer, x, batch)
            # the residual stream before any norm, every layer, the last included: the final
            # layer norm would hide a huge activation of the last layer (--overflow-margin)
            max_abs = torch.maximum(max_abs, batch.row_max_abs(x))
            if index == self.num_layers:
                x = self._layer_norm(model.emb_layer_norm_after, x)
            if index in wanted:
                hidden[index] = x
        return ForwardOutput(hidden=hidden, max_abs=max_abs)

    def _layer_norm(self, norm: torch.nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
        return self.policy.layer_norm(norm, x)

    def _linear(self, linear: FairEsmModule, x: torch.Tensor, weight: torch.Tensor | None = None,
                bias: torch.Tensor | None = None, *, gelu: bool = False) -> torch.Tensor:
        """``linear``'s projection (or ``weight``/``bias`` stored under ``linear``, as the fused
        q/k/v are), GELU'd when asked, as the policy runs a linear (:meth:`Policy.linear`)."""
        if weight is None:
            weight, bias = linear.weight, linear.bias
        return self.policy.linear(x, weight, bias, self._packed.get(id(linear)), gelu=gelu)

    def _layer(self, layer: FairEsmModule, x: torch.Tensor, batch: _PaddedBatch | PackedTokens) -> torch.Tensor:
        residual = x
        h = self._layer_norm(layer.self_attn_layer_norm, x)
        h = self._attention(layer.self_attn, h, batch)
        x = residual + h  # a bf16/fp16 h is promoted inside the add (no separate cast)

        residual = x
        h = self._layer_norm(layer.final_layer_norm, x)
        h = self._linear(layer.fc1, h, gelu=True)
        h = self._linear(layer.fc2, h)
        return residual + h

    def _table_dtype(self, attn: FairEsmModule) -> torch.dtype:
        """Mixed policies: rotary tables built in fp32 (scores and softmax in fp32 too). A
        plain cast builds them in the weights' dtype, as fair-esm does after ``.half()``."""
        return self.policy.table_dtype(attn.rot_emb.inv_freq.dtype)

    def _rotation_dtype(self, attn: FairEsmModule, projection_dtype: torch.dtype) -> torch.dtype:
        """The dtype q, k and v are rotated and attended in; under autocast the fp32 tables
        promote q and k, and SDPA casts as autocast decides."""
        return torch.promote_types(projection_dtype, self._table_dtype(attn))

    def _attention(self, attn: FairEsmModule, x: torch.Tensor, batch: _PaddedBatch | PackedTokens) -> torch.Tensor:
        heads, head_dim = attn.num_heads, attn.head_dim
        lead = x.shape[:-1]  # (B, T) padded, (N,) packed
        qkv = self._linear(attn, x, *attn._embedpipe_qkv).view(*lead, 3, heads, head_dim)
        if attn.rot_emb is None:  # absolute positions (ESM-1b): q scaled as fair-esm scales it
            qk = qkv[..., :2, :, :].to(self.policy.table_dtype(qkv.dtype))  # mixed: fp32, as q/k after rotation
            qk[..., 0, :, :] *= attn.scaling
            return self._attend(attn, qk, qkv[..., 2, :, :].to(self.attention_dtype), batch, lead)
        table_dtype = self._table_dtype(attn)
        work_dtype = self._rotation_dtype(attn, qkv.dtype)
        # q and k rotated together, in one cast (mixed-dtype kernels would each cast again);
        # SDPA takes the (B, H, T, head_dim) views as they are: making them contiguous first
        # costs more than SDPA's CPU kernel gains from it.
        rotated = qkv[..., :2, :, :]
        interleaved = id(attn) in self._interleaved
        if rotated.dtype != work_dtype and (interleaved or x.device.type == "cpu"):
            # in place needs the wide dtype; on the CPU one cast and then one-dtype kernels beat
            # mixed-dtype ones 2x (130-170 ms against 265 ms at 8192 x 20 heads, 2 cores).
            # Elsewhere the rotation reads the projection's dtype and writes the wider one
            # (one pass over q and k less)
            rotated = rotated.to(work_dtype)
        if interleaved:  # pair order, fp32: one complex multiply, in place (CPU)
            rotate_pairs_(rotated, batch.rows(self.rotary.complex(attn.rot_emb.inv_freq, batch.max_len, attn.scaling)))
            qk = rotated
        else:
            cos, sin = self.rotary.get(attn.rot_emb.inv_freq, batch.max_len, table_dtype, attn.scaling)
            qk = torch.empty((*lead, 2, heads, head_dim), dtype=work_dtype, device=x.device)
            rotate_into(rotated, batch.rows(cos), batch.rows(sin), out=qk)
        # v goes straight to the dtype it is attended in (one cast at most, none under the
        # plain policies or with compute-dtype inputs): it is never rotated
        return self._attend(attn, qk, qkv[..., 2, :, :].to(self.attention_dtype), batch, lead)

    def _attend(self, attn: FairEsmModule, qk: torch.Tensor, v: torch.Tensor, batch: _PaddedBatch | PackedTokens,
                lead: torch.Size) -> torch.Tensor:
        """Attention of rotated ``qk`` (..., 2, H, d) and ``v``, then the output projection."""
        heads, head_dim = attn.num_heads, attn.head_dim
        q, k = qk[..., 0, :, :], qk[..., 1, :, :]
        q, k = self.policy.attention_qk(q, k, self.attention_inputs)  # mixed, compute inputs: cast
        if isinstance(batch, PackedTokens):
            out = self._attend_packed(q, k, v, batch)
        else:
            out = self._attend_padded(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), batch)
            out = out.transpose(1, 2)  # SDPA's CPU output is laid out (B, T, H, d) here: a view, no copy
        return self._linear(attn.out_proj, out.reshape(*lead, heads * head_dim))

    def _attend_padded(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: _PaddedBatch) -> torch.Tensor:
        """(B, H, T, d) attention with q pre-scaled; on the CPU each record at its own length
        (batch-invariant; docs/precision.md, "Reproducibility")."""
        return padded_attention(q, k, v, batch.attn_mask, batch.lengths, self.attention)

    def _attend_packed(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: PackedTokens) -> torch.Tensor:
        """(N, H, d) attention within each sequence of ``batch``, q pre-scaled."""
        q, k, v = self.policy.kernel_inputs(q, k, v)  # autocast: cast, as SDPA would under it
        return packed_attention(q, k, v, batch, self.packed_attention)


class _PaddedBatch:
    """A padded (B, T) batch as the forward sees it: the twin of :class:`PackedTokens`."""

    def __init__(self, tokens: torch.Tensor, padding_idx: int) -> None:
        self.tokens = tokens
        self.padding = tokens.eq(padding_idx)
        self.keep = ~self.padding
        self.max_len = tokens.shape[1]
        # (B, 1, 1, T), True = attend. Off the CPU always a mask: the same kernel for every
        # batch, and no host sync to ask whether there is padding (docs/precision.md).
        mask = self.keep[:, None, None, :]
        self.attn_mask = mask if tokens.device.type != "cpu" or self.padding.any() else None
        #: each record's token count, on the CPU only (read back from a device it would sync;
        #: CUDA's batch-invariant layout is the packed one)
        self.lengths: list[int] | None = self.keep.sum(1).tolist() if tokens.device.type == "cpu" else None

    def rows(self, table: torch.Tensor) -> torch.Tensor:
        """A (T, ...) per-position table as it broadcasts over (B, T, ...)."""
        return table

    def mask_ratio(self, masked: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """(B, 1) share of each record's tokens that are <mask> (fair-esm's token dropout)."""
        return (masked.sum(-1).to(dtype) / self.keep.sum(-1))[:, None]

    def zero_padding(self, x: torch.Tensor) -> torch.Tensor:
        return x * (1 - self.padding.unsqueeze(-1).type_as(x))

    def row_max_abs(self, x: torch.Tensor) -> torch.Tensor:
        """(B,) max |x| over each record's own tokens (padding masked out), fp32."""
        return token_max_abs(x).masked_fill(self.padding, 0.0).amax(dim=1)


if TYPE_CHECKING:  # mypy checks the runner against the interface (docs/architecture.md)
    _runner_conforms: type[PackedRunner] = EsmForward
