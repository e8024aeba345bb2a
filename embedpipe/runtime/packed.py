"""The packed (unpadded) batch layout: every sequence's tokens back to back, no padding.

Why: in a padded batch every projection, layer norm and FFN also runs on the padding, and the
padding mask keeps CUDA's SDPA off its flash kernel. Packed, those run on real tokens only
(total_tokens x D) and attention runs within each sequence through cumulative offsets: the
varlen flash kernel on CUDA (:mod:`embedpipe.runtime.cuda`), and elsewhere
:func:`per_sequence_attention`, a stand-in that gives each sequence SDPA of its own rows.
Per-record reductions (pooled sums, largest activation) are segment reductions over rows,
each segment summed in order, so a record's result does not depend on its neighbours.
Device-agnostic: every function here runs, and is tested, on the CPU (docs/precision.md,
"Batch layout"). Nothing here reads a device tensor back: the offsets are kept on the host,
and segment reductions run with ``unsafe=True`` (their own check of the lengths would sync
the host with the device; the lengths are checked here, on the host, instead).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from embedpipe.runtime import cuda


@dataclass(frozen=True)
class PackedTokens:
    """A batch of N tokens from B sequences: each sequence's BOS, residues and EOS, back to back.

    ``offsets`` are the cumulative sequence starts (B + 1, int32: the ``cu_seqlens`` of varlen
    kernels), ``host_offsets`` the same numbers on the host, so nothing has to be read back
    from the device to slice a sequence; ``positions`` are each token's position in its own
    sequence (the rotary position).
    """

    tokens: torch.Tensor  # (N,) int64
    positions: torch.Tensor  # (N,) int64
    offsets: torch.Tensor  # (B + 1,) int32
    lengths: torch.Tensor  # (B,) int64, tokens per sequence
    host_offsets: tuple[int, ...]
    max_len: int

    @classmethod
    def from_padded(cls, tokens: torch.Tensor, lengths: Sequence[int]) -> PackedTokens:
        """Pack a padded (B, T) host batch whose row ``i`` holds ``lengths[i]`` real tokens first."""
        width = tokens.shape[1]
        counts = torch.as_tensor(list(lengths), dtype=torch.int64)
        if counts.numel() != tokens.shape[0] or int(counts.max()) > width or int(counts.min()) < 1:
            raise ValueError(f"lengths {list(lengths)} do not fit a batch of shape {tuple(tokens.shape)}")
        real = torch.arange(width)[None, :] < counts[:, None]
        offsets = torch.zeros(len(counts) + 1, dtype=torch.int64)
        torch.cumsum(counts, 0, out=offsets[1:])
        return cls(
            tokens=tokens[real],
            positions=torch.arange(width).expand(tokens.shape)[real],
            offsets=offsets.to(torch.int32),
            lengths=counts,
            host_offsets=tuple(offsets.tolist()),
            max_len=int(counts.max()),
        )

    @property
    def batch_size(self) -> int:
        return len(self.host_offsets) - 1

    def to(self, device: torch.device,
           move: Callable[[torch.Tensor, torch.device], torch.Tensor] | None = None) -> PackedTokens:
        """The same batch on ``device`` (``move(tensor, device)`` copies, e.g. from pinned memory)."""
        move = move or (lambda tensor, where: tensor.to(where))
        return PackedTokens(move(self.tokens, device), move(self.positions, device), move(self.offsets, device),
                            move(self.lengths, device), self.host_offsets, self.max_len)

    def rows(self, table: torch.Tensor) -> torch.Tensor:
        """A (T, ...) per-position table (rotary) as rows of this batch: (N, ...)."""
        return table[self.positions]

    def mask_ratio(self, masked: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """(N,) share of <mask> tokens in each token's sequence (fair-esm's token dropout)."""
        counts = torch.segment_reduce(masked.to(dtype), "sum", lengths=self.lengths, axis=0, unsafe=True)
        return (counts / self.lengths).repeat_interleave(self.lengths, output_size=masked.shape[0])

    def zero_padding(self, x: torch.Tensor) -> torch.Tensor:
        """Nothing to zero: a packed batch has no padding."""
        return x

    def segment_max(self, per_token: torch.Tensor) -> torch.Tensor:
        """(B,) max of ``per_token`` (N,) over each sequence's rows; NaN propagates."""
        return torch.segment_reduce(per_token, "max", lengths=self.lengths, axis=0, initial=0.0, unsafe=True)

    def row_max_abs(self, x: torch.Tensor) -> torch.Tensor:
        """Per-record max |x| over all its tokens, fp32: the packed twin of ``masked_max_abs``."""
        return self.segment_max(token_max_abs(x))


def token_max_abs(x: torch.Tensor) -> torch.Tensor:
    """(...,) fp32 max |x| over the last dim; NaN propagates.

    Off the CPU one fused min/max reduction reads ``x`` once: ``abs`` first would write and
    read back a full copy of ``x`` every layer (the traffic model: 8.5 D bytes a token
    a layer). On the CPU ``abs`` then ``amax`` is the faster of the two (11 ms against 19 ms
    for 8192 x 480 fp32 on 2 cores), so it stays.
    """
    x = x.detach()
    if x.device.type == "cpu":
        return x.abs().amax(dim=-1).float()
    low, high = torch.aminmax(x, dim=-1)
    return torch.maximum(high, low.neg()).float()


def range_segments(host_offsets: Sequence[int], ranges: Sequence[tuple[int, int]]) -> torch.Tensor:
    """Segment lengths that cut N packed rows into (lead, chosen, rest) per sequence, where
    ``ranges[i] = (lo, hi)`` picks rows ``lo:hi`` of sequence ``i`` (0 <= lo <= hi <= its length).
    Every third segment, starting at 1, is a chosen range (see :func:`range_sums`)."""
    lengths = []
    for (start, end), (lo, hi) in zip(zip(host_offsets[:-1], host_offsets[1:]), ranges):
        if not 0 <= lo <= hi <= end - start:
            raise ValueError(f"rows {lo}:{hi} are outside a sequence of {end - start} tokens")
        lengths += [lo, hi - lo, end - start - hi]
    return torch.tensor(lengths, dtype=torch.int64)


def range_sums(x: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
    """(B, ...) sums of each sequence's chosen rows of ``x`` (N, ...), from :func:`range_segments`
    (on ``x``'s device)."""
    return torch.segment_reduce(x, "sum", lengths=segments, axis=0, unsafe=True)[1::3]


def range_max(per_token: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
    """(B,) max of ``per_token`` over each sequence's chosen rows (0 for an empty range); NaN propagates."""
    return torch.segment_reduce(per_token, "max", lengths=segments, axis=0, initial=0.0, unsafe=True)[1::3]


def per_sequence_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           host_offsets: Sequence[int]) -> torch.Tensor:
    """Attention of packed (N, H, head_dim) q/k/v within each sequence, q pre-scaled: the
    stand-in for the varlen kernel where it does not run (CPU, fp32 inputs, pre-Ampere GPUs)."""
    out = torch.empty(q.shape, dtype=v.dtype, device=q.device)
    for lo, hi in zip(host_offsets[:-1], host_offsets[1:]):
        # (T, H, d) -> (1, H, T, d) views, four dimensions: with three, SDPA's CPU dispatch skips
        # its flash kernel for the math path (scores materialised, 2x slower; docs/benchmarks.md,
        # "Batch invariance"); the output is written back into the packed rows
        out[lo:hi] = F.scaled_dot_product_attention(
            q[None, lo:hi].transpose(1, 2), k[None, lo:hi].transpose(1, 2), v[None, lo:hi].transpose(1, 2), scale=1.0
        )[0].transpose(0, 1)
    return out


def padded_per_sequence_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                  lengths: Sequence[int]) -> torch.Tensor:
    """Attention of padded (B, H, T, head_dim) q/k/v, each record at its own length (its
    first ``lengths[i]`` positions, no mask), q pre-scaled; the padding's output rows are 0.

    Why: a masked kernel over the batch's pad length blocks and sums each record's keys by
    that length, so its numbers changed with the longest record beside it; at its own length
    they are the same in every batch, and the same as the packed layout's stand-in
    (:func:`per_sequence_attention`; docs/precision.md, "Reproducibility"). Returns a
    (B, H, T, d) view of a (B, T, H, d) buffer, the layout the out projection reads."""
    b, h, t, d = q.shape
    out = torch.zeros((b, t, h, d), dtype=v.dtype, device=q.device)
    for row, length in enumerate(lengths):
        # four dimensions, as per_sequence_attention: SDPA's CPU flash kernel, not its math path
        out[row, :length] = F.scaled_dot_product_attention(
            q[row:row + 1, :, :length], k[row:row + 1, :, :length], v[row:row + 1, :, :length], scale=1.0
        )[0].transpose(0, 1)
    return out.transpose(1, 2)


def padded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None,
                     lengths: Sequence[int] | None, attention: str) -> torch.Tensor:
    """(B, H, T, d) attention of a padded batch, q pre-scaled, ``attn_mask`` True = attend; the one
    padded attention every family with ``sdpa``/``math`` uses. SDPA with ``lengths`` (the CPU):
    each record at its own length (:func:`padded_per_sequence_attention`, batch-invariant); ``math``:
    explicit scores and an fp32 softmax, as fair-esm computes them."""
    if attention == "sdpa" and lengths is not None:
        return padded_per_sequence_attention(q, k, v, lengths)
    if attention == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=1.0)
    scores = torch.matmul(q, k.transpose(-1, -2))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).type_as(scores)
    return torch.matmul(probs, v.to(probs.dtype))


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: PackedTokens, kernel: str) -> torch.Tensor:
    """(N, H, d) attention within each sequence of ``batch``, q pre-scaled: CUDA's flash varlen
    kernel (``kernel == "varlen-flash"``) or each sequence alone; both batch-invariant."""
    if kernel == "varlen-flash":  # flash needs only the last dim contiguous
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        return cuda.varlen_attention(q, k, v, batch.offsets, batch.max_len)
    return per_sequence_attention(q, k, v, batch.host_offsets)
