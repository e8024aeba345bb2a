"""Per-piece outputs of one forward batch: pooled sums, BOS vectors, checks, per-residue rows.

Runs on the device, in fp32 (the worker calls it under ``exact_fp32``: autocast off, hidden
states cast to fp32 first, so sums accumulate in fp32 whatever the policy), for either batch
layout: padded (B, T, D) hidden states, or packed (N, D) rows (:mod:`embedpipe.runtime.packed`).
Everything a batch sends back to the host is one summary matrix plus, with per-residue
output, one tensor per stored layer; :class:`HostPooled` reads them per piece.

Token layout of a piece: the model family's (``Piece.layout``): residues from position
``first_residue`` (1 after ESM-2's BOS, 0 for a T5), then EOS when the layout has one; the
BOS row is pooled only for a layout with BOS (the worker refuses ``bos`` pooling otherwise).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from embedpipe.extraction.planning import Piece
from embedpipe.model.base import ForwardOutput
from embedpipe.runtime.cuda import to_device
from embedpipe.runtime.packed import PackedTokens, range_max, range_segments, range_sums, token_max_abs


@dataclass
class DevicePooled:
    """A batch's outputs, still on the device: the (B, K) summary and per-residue tensors."""

    summary: torch.Tensor  # [sums per layer | BOS per layer | stored max per layer | max activation]
    residues: dict[int, torch.Tensor]  # layer -> (B, T', D) padded or (N, D) packed, fp32
    residue_starts: list[int] | None  # packed: row of each piece's residue 1; None when padded


def _kept(piece: Piece) -> tuple[int, int]:
    """Token positions of the residues this piece contributes (window stitching)."""
    first = piece.layout.first_residue
    return piece.keep_start - piece.start + first, piece.keep_end - piece.start + first


def _stored(piece: Piece, bos: bool) -> tuple[int, int]:
    """Token positions whose values are stored: residues, and BOS in a first window with bos pooling."""
    first = piece.layout.first_residue
    return (0 if bos and piece.start == 0 else first), piece.residues + first


def _first_residue(batch: Sequence[Piece]) -> int:
    """The batch's residue offset (one model, so one layout per batch)."""
    return batch[0].layout.first_residue


def pool_padded(out: ForwardOutput, batch: Sequence[Piece], layers: Sequence[int], *, bos: bool,
                per_residue: bool) -> DevicePooled:
    """Pool a padded batch: masks over (B, T) positions for the maxima; the sums as segment
    reductions over each record's own rows, summed in order as the packed layout's are (an
    einsum over the pad length summed a record's rows differently with every batch width;
    docs/precision.md, "Reproducibility")."""
    hidden0 = out.hidden[layers[0]]
    device, width = hidden0.device, hidden0.shape[1]
    longest, first = max(p.residues for p in batch), _first_residue(batch)
    bounds = to_device(torch.tensor([[*_stored(p, bos), *_kept(p)] for p in batch]), device)
    positions = torch.arange(width, device=device)[None, :]
    stored = (positions >= bounds[:, 0:1]) & (positions < bounds[:, 1:2])
    rows = range(0, width * (len(batch) + 1), width)  # each record's row offsets in the flattened batch
    kept = to_device(range_segments(rows, [_kept(p) for p in batch]), device)
    sums, firsts, stored_max, residues = [], [], [], {}
    for layer in layers:
        h = out.hidden[layer]
        stored_max.append(token_max_abs(h).masked_fill(~stored, 0.0).amax(dim=1))
        hf = h.float()  # the one fp32 copy
        sums.append(range_sums(hf.reshape(-1, hf.shape[-1]), kept))
        if bos:
            firsts.append(hf[:, 0])
        if per_residue:
            residues[layer] = hf[:, first : longest + first]
    return DevicePooled(_summary(sums, firsts, stored_max, out.max_abs), residues, None)


def pool_packed(out: ForwardOutput, batch: Sequence[Piece], packed: PackedTokens, layers: Sequence[int], *,
                bos: bool, per_residue: bool) -> DevicePooled:
    """Pool a packed batch: segment reductions over each piece's rows, summed in order."""
    device = out.max_abs.device
    kept = to_device(range_segments(packed.host_offsets, [_kept(p) for p in batch]), device)
    stored = to_device(range_segments(packed.host_offsets, [_stored(p, bos) for p in batch]), device)
    starts = list(packed.host_offsets[:-1])
    # BOS rows: ``packed`` is the host batch, and a host index tensor on a CUDA tensor is
    # copied there with a blocking copy (a stream sync that would defeat the worker's
    # one-batch lookahead), so the index goes over pinned and asynchronously, once
    bos_rows = to_device(packed.offsets[:-1].long(), device) if bos else None
    sums, firsts, stored_max, residues = [], [], [], {}
    for layer in layers:
        h = out.hidden[layer]
        stored_max.append(range_max(token_max_abs(h), stored))
        hf = h.float()
        sums.append(range_sums(hf, kept))
        if bos:
            firsts.append(hf[bos_rows])
        if per_residue:
            residues[layer] = hf
    first = _first_residue(batch)
    return DevicePooled(_summary(sums, firsts, stored_max, out.max_abs), residues, [s + first for s in starts])


def _summary(sums: list[torch.Tensor], firsts: list[torch.Tensor], stored_max: list[torch.Tensor],
             max_abs: torch.Tensor) -> torch.Tensor:
    pooled = [torch.stack(v, 1).flatten(1) for v in (sums, firsts) if v]
    return torch.cat([*pooled, torch.stack(stored_max, 1), max_abs.float()[:, None]], 1)


@dataclass
class HostPooled:
    """A batch's outputs on the host, read per piece (row ``i`` = the batch's piece ``i``)."""

    sums: dict[int, np.ndarray]  # layer -> (B, D)
    bos: dict[int, np.ndarray]  # layer -> (B, D); {} without bos pooling
    stored_max: np.ndarray  # (B,) largest |stored value| over all layers; NaN propagates
    max_abs: np.ndarray  # (B,) largest activation seen by the forward
    residues: dict[int, np.ndarray]
    residue_starts: list[int] | None

    @classmethod
    def unpack(cls, summary: np.ndarray, residues: dict[int, np.ndarray], residue_starts: list[int] | None,
               layers: Sequence[int], dim: int, bos: bool) -> HostPooled:
        n, pooled = len(layers), (2 if bos else 1)
        blocks = [{layer: summary[:, (j * n + i) * dim : (j * n + i + 1) * dim] for i, layer in enumerate(layers)}
                  for j in range(pooled)]
        stored = summary[:, pooled * n * dim : pooled * n * dim + n].max(axis=1)  # NaN propagates
        return cls(blocks[0], blocks[1] if bos else {}, stored, summary[:, -1], residues, residue_starts)

    def residue_rows(self, row: int, lo: int, hi: int) -> dict[int, np.ndarray]:
        """Per-residue vectors of residues ``lo:hi`` (window-relative) of piece ``row``."""
        if self.residue_starts is None:
            return {layer: value[row, lo:hi] for layer, value in self.residues.items()}
        start = self.residue_starts[row]
        return {layer: value[start + lo : start + hi] for layer, value in self.residues.items()}
