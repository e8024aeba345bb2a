"""The embedding worker: batch, forward under a precision policy, check, fall back, pool.

The worker sees the model only through :class:`~embedpipe.model.base.EmbeddingModel`. The
model is prepared once per policy; results leave the device once per batch (one transfer
per stored layer), so memory is bounded by a batch. Every record's stored outputs are
checked for NaN/inf and for values the storage dtype cannot hold; such records are re-run
alone in fp32 and tagged (docs/precision.md).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from embedpipe.embed.budget import batch_overhead_tokens, resolve_tokens_per_batch
from embedpipe.runtime import attention as attention_choice, cuda
from embedpipe.runtime.cuda import BusyTimer, HostCopy
from embedpipe.core.errors import EmbedpipeError
from embedpipe.model.base import EmbeddingModel, Runner
from embedpipe.model import capabilities
from embedpipe.model.layers import resolve_layers  # noqa: F401 - re-exported (tests, crosscheck)
from embedpipe.runtime.packed import PackedTokens
from embedpipe.embed.planning import Piece, padding_efficiency, plan_batches, plan_packed_batches, plan_record
from embedpipe.embed.pooling import HostPooled, pool_packed, pool_padded
from embedpipe.runtime.precision import (FP32, Policy, check_policy_on_device, dtype_name, exact_fp32, forward_context,
                                 get_policy, resolve_attention_inputs, true_fp32_matmuls)
from embedpipe.core.options import EmbedOptions
from embedpipe.core.progress import progress_bar, say
from embedpipe.store import EmbeddedRecord
from embedpipe.store.format import stored_poolings


@dataclass
class Plan:
    """How a list of records will be run: batches of pieces, per-record handling and row counts."""

    batches: list[list[Piece]]
    handling: list[str]  # none | chunked | truncated | full
    rows: list[int]  # residues embedded per record (the per-residue rows the store will hold)
    packed: bool = False  # batches cut for the packed layout (real tokens, no padding)

    @property
    def padding_efficiency(self) -> float:
        return padding_efficiency(self.batches, self.packed)


@dataclass
class _PieceResult:
    sums: dict[int, np.ndarray]  # layer -> (D,) float32 sum over the kept residues
    residues: dict[int, np.ndarray] | None  # layer -> (keep_len, D) float32, when needed
    max_abs: float
    stored_max: float  # largest |value| over the stored outputs (NaN/inf propagate)
    bos: dict[int, np.ndarray] | None = None  # layer -> (D,) float32 at BOS, for a first window with bos pooling


@dataclass
class _Launched:
    """A batch whose forward has been launched and whose outputs are on their way to the host."""

    batch: list[Piece]
    summary: HostCopy
    residues: dict[int, HostCopy]
    residue_starts: list[int] | None


@dataclass
class _Assembly:
    """A record whose pieces are being collected."""

    pieces_left: int
    results: list[tuple[Piece, _PieceResult]] = field(default_factory=list)


class Embedder:
    """Embeds sequences with one loaded model under one policy; reusable for many inputs.

    ``embed`` yields ``(index, EmbeddedRecord)`` in completion order (not input order).
    Records whose low-precision outputs are unusable are re-run alone in fp32 with an fp32
    model prepared lazily, once.
    """

    def __init__(self, loaded: EmbeddingModel, options: EmbedOptions, device: torch.device) -> None:
        options.validate()
        self.loaded = loaded
        self.options = options
        self.device = device
        self.policy = get_policy(options.precision)
        self.layers = resolve_layers(options.layers, loaded.num_layers)
        self.pooling = stored_poolings(options.pooling)
        capabilities.check_options(loaded, options.pooling, options.batch_layout)
        self.storage_max = float(np.finfo(np.dtype(options.storage_dtype)).max)
        self.notes = check_policy_on_device(self.policy, device)
        #: the token budget of a batch (``--tokens-per-batch``, ``auto`` resolved for ``device``)
        self.tokens_per_batch = resolve_tokens_per_batch(options, loaded, self.policy, device, self.layers)
        self._runners: dict[str, Runner] = {}
        self._devices: dict[str, torch.device] = {}  # policy name -> where its runner lives
        self.quiet = True
        self.stats = Counter()
        self._busy = BusyTimer()
        self._ring = cuda.PinnedRing(keep=1 + len(self.layers) * options.per_residue)  # one batch's read-back

    # -- model preparation (once per policy) --------------------------------------------------
    def runner(self, policy: Policy) -> Runner:
        """The forward for ``policy``, prepared once, on the device it runs on (``self._devices``).

        Out of memory while preparing is not a batch that is too big: for the fp32 fallback
        under ``--fallback-device auto`` it moves the fallback to the CPU, otherwise it fails
        with what to do. The retry runs after the ``except`` block, so the failed attempt's
        tensors are freed first.
        """
        if policy.name in self._runners:
            return self._runners[policy.name]
        device = self._planned_device(policy)
        try:
            return self._prepare(policy, device)
        except torch.cuda.OutOfMemoryError:
            pass
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if not self._is_fallback(policy) or self.options.fallback_device != "auto" or device.type == "cpu":
            raise EmbedpipeError(self._prepare_oom_message(policy, device))
        cpu = torch.device("cpu")
        say(f"warning: the fp32 fallback model of {self.loaded.name} does not fit on {device} beside the "
            f"{self.policy.name} model; fallback records run on the CPU (slower; see docs/precision.md)",
            quiet=self.quiet)
        self.stats["fallback_moved_to_cpu"] += 1
        return self._prepare(policy, cpu)

    def _is_fallback(self, policy: Policy) -> bool:
        return policy.name != self.policy.name

    def _planned_device(self, policy: Policy) -> torch.device:
        if self._is_fallback(policy) and self.options.fallback_device == "cpu":
            return torch.device("cpu")
        return self.device

    def _prepare(self, policy: Policy, device: torch.device) -> Runner:
        self._runners[policy.name] = self.loaded.prepare(
            policy, device, self.options.attention,
            attention_inputs=resolve_attention_inputs(self.options.attention_inputs, device))
        self._devices[policy.name] = device
        return self._runners[policy.name]

    def _prepare_oom_message(self, policy: Policy, device: torch.device) -> str:
        if self._is_fallback(policy):
            return (
                f"the fp32 fallback model of {self.loaded.name} does not fit in memory on {device} beside the "
                f"{self.policy.name} model; use --fallback-device cpu (or auto) to re-run fallback records on "
                "the CPU, or a GPU with more memory"
            )
        return (
            f"the {policy.name} model of {self.loaded.name} does not fit in memory on {device} (before any "
            "batch ran); use a lower precision, a smaller model or a GPU with more memory"
        )

    @property
    def fallback_device(self) -> str:
        """Where fp32 fallback records ran ('' when none did)."""
        if not self.stats["fallback"] or self.policy.is_reference:
            return ""
        return str(self._devices.get(FP32.name, ""))

    @property
    def busy_seconds(self) -> float:
        """Seconds the device spent in forward passes so far (CUDA events on a GPU); with the
        run's wall time this gives the device's idle fraction (benchmarks/gpu_acceptance.py)."""
        return self._busy.seconds

    @property
    def batch_layout(self) -> str:
        """``packed`` or ``padded``: how the main policy's batches are laid out."""
        return self._layout(self.policy)

    @property
    def attention_path(self) -> str:
        """The main policy's attention kernel as recorded in the store (docs/precision.md)."""
        if self.batch_layout == "padded":
            return f"padded-{self.options.attention}"
        return attention_choice.attention_path(self.options, self.policy, self.device)

    @property
    def attention_inputs(self) -> str:
        """dtype name of q/k/v at the main policy's attention kernel."""
        return dtype_name(attention_choice.qkv_dtype(self.options, self.policy, self.device))

    @property
    def computed_as(self) -> dict[str, str]:
        """What the run's ``auto`` options resolved to on its device: part of a store's
        identity for resuming (:func:`embedpipe.embed.run.embed_identity`)."""
        return {"device_type": self.device.type, "batch_layout": self.batch_layout,
                "attention_inputs": self.attention_inputs}

    def _layout(self, policy: Policy) -> str:
        """``--batch-layout`` for ``policy`` on the device its runner lives on."""
        device = self._devices.get(policy.name) or self._planned_device(policy)
        if not capabilities.packs(self.loaded):  # no packed runner (T5); explicit packed is refused
            return "padded"
        return attention_choice.batch_layout(self.options, policy, device)

    # -- public ---------------------------------------------------------------------------------
    def new_input(self) -> None:
        """Start the counters of a new input (a group job's next shard); the prepared models,
        the token budget and the busy time carry on."""
        self.stats = Counter()

    def plan(self, records: Sequence[tuple[str, str]]) -> Plan:
        """Windows and batches for ``records``; raises for long records under --long-sequences error."""
        pieces: list[Piece] = []
        handling: list[str] = []
        rows: list[int] = []
        for index, (rid, seq) in enumerate(records):
            record_pieces, how = plan_record(index, len(seq), self.options.long_sequences,
                                             window=self.loaded.trained_window, record_id=rid,
                                             layout=capabilities.layout_of(self.loaded))
            pieces.extend(record_pieces)
            handling.append(how)
            rows.append(sum(p.keep_end - p.keep_start for p in record_pieces))
        if self.batch_layout == "packed":
            return Plan(plan_packed_batches(pieces, self.tokens_per_batch), handling, rows, packed=True)
        overhead = batch_overhead_tokens(self.device)
        return Plan(plan_batches(pieces, self.tokens_per_batch, overhead), handling, rows)

    def embed(self, records: Sequence[tuple[str, str]], plan: Plan | None = None, *,
              quiet: bool = True) -> Iterator[tuple[int, EmbeddedRecord]]:
        plan = plan or self.plan(records)
        self.quiet = quiet
        batches, handling = plan.batches, plan.handling
        pending: dict[int, _Assembly] = {}
        for batch in batches:
            for piece in batch:
                pending.setdefault(piece.record, _Assembly(pieces_left=0)).pieces_left += 1
        total_residues = sum(len(s) for _, s in records)
        # No TF32 for fp32 work: process-wide flags, so set once per run (not per batch), then restored.
        with progress_bar(quiet=quiet, total=total_residues, unit="res", unit_scale=True, desc="embed") as bar, \
                true_fp32_matmuls():
            for piece, result in self._stream(batches, records):
                assembly = pending[piece.record]
                assembly.results.append((piece, result))
                assembly.pieces_left -= 1
                if assembly.pieces_left == 0:
                    del pending[piece.record]
                    record = self._finish(piece.record, records, handling, assembly.results)
                    bar.update(len(records[piece.record][1]))
                    bar.set_postfix(records=self.stats["records"], fallback=self.stats["fallback"], refresh=False)
                    yield piece.record, record

    # -- batches --------------------------------------------------------------------------------
    def _stream(self, batches: list[list[Piece]], records: Sequence[tuple[str, str]]) -> Iterator[tuple[Piece, _PieceResult]]:
        """Every piece's result, one batch behind: batch i + 1 is tokenized and launched
        before batch i's results are read back, so on a GPU the host work (tokens, checks,
        fallback, the writer's queue) overlaps device work. A batch that runs out of memory
        at launch is run through :meth:`_run_batch`, which splits it."""
        pending: _Launched | None = None
        for batch in batches:
            launched = self._try_launch(self.policy, batch, records)
            if pending is not None:
                yield from self._collect(pending)
                pending = None
            if launched is None:
                yield from self._split_run(self.policy, batch, records)
            else:
                pending = launched
        if pending is not None:
            yield from self._collect(pending)

    def _try_launch(self, policy: Policy, batch: list[Piece], records: Sequence[tuple[str, str]]) -> _Launched | None:
        """``_launch``, or None when the device ran out of memory (the caller splits)."""
        self.runner(policy)  # out of memory while preparing is handled there, not as a batch
        try:
            return self._launch(policy, batch, records)
        except torch.cuda.OutOfMemoryError:
            pass
        if self._devices[policy.name].type == "cuda":
            torch.cuda.empty_cache()
        return None

    def _run_batch(self, policy: Policy, batch: list[Piece], records: Sequence[tuple[str, str]]) -> list[tuple[Piece, _PieceResult]]:
        """Forward one batch now; on CUDA out-of-memory split it in halves and retry.

        The retry happens after leaving the ``except`` block: the exception's traceback holds
        the failed attempt's tensors, which must be freed before the halves run.
        """
        launched = self._try_launch(policy, batch, records)
        if launched is not None:
            return self._collect(launched)
        return self._split_run(policy, batch, records)

    def _split_run(self, policy: Policy, batch: list[Piece], records: Sequence[tuple[str, str]]) -> list[tuple[Piece, _PieceResult]]:
        """A batch that ran out of memory: its halves, each through :meth:`_run_batch`; a
        single piece that does not fit is an error naming the record."""
        device = self._devices[policy.name]
        if len(batch) == 1:
            piece = batch[0]
            rid, seq = records[piece.record]
            raise EmbedpipeError(
                f"record {rid!r} ({len(seq)} residues, window {piece.start}:{piece.end}) does not fit in "
                f"memory on {device} even alone; use --long-sequences chunk, a lower precision or a smaller model"
                + (", or --fallback-device cpu for the fp32 re-run" if self._is_fallback(policy) and device.type == "cuda" else "")
            )
        self.stats["oom_splits"] += 1
        middle = len(batch) // 2
        return self._run_batch(policy, batch[:middle], records) + self._run_batch(policy, batch[middle:], records)

    def _launch(self, policy: Policy, batch: list[Piece], records: Sequence[tuple[str, str]]) -> _Launched:
        """Tokenize, forward and pool one batch, and start copying its outputs to the host."""
        runner = self.runner(policy)
        device = self._devices[policy.name]
        packed = self._layout(policy) == "packed"
        with cuda.host_side():
            tokens = self.loaded.tokenize([records[p.record][1][p.start : p.end] for p in batch])
            host_batch = PackedTokens.from_padded(tokens, [p.tokens for p in batch]) if packed else None
        bos, per_residue = "bos" in self.pooling, self.options.per_residue
        with forward_context(policy, device):
            self._busy.start(device)
            if packed:
                if not hasattr(runner, "packed"):
                    raise EmbedpipeError(f"{self.loaded.name} runs padded batches only; use --batch-layout padded or auto")
                out = runner.packed(host_batch.to(device, cuda.to_device), self.layers)
                with exact_fp32(device):
                    pooled = pool_packed(out, batch, host_batch, self.layers, bos=bos, per_residue=per_residue)
            else:
                out = runner(cuda.to_device(tokens, device), self.layers)
                with exact_fp32(device):
                    pooled = pool_padded(out, batch, self.layers, bos=bos, per_residue=per_residue)
            self._busy.stop(device)
        del out
        real = sum(p.tokens for p in batch)
        self.stats.update(batches=1, computed_tokens=real if packed else tokens.numel(), real_tokens=real)
        return _Launched(batch, HostCopy(pooled.summary, self._ring),
                         {k: HostCopy(v, self._ring) for k, v in pooled.residues.items()}, pooled.residue_starts)

    def _collect(self, launched: _Launched) -> list[tuple[Piece, _PieceResult]]:
        """Wait for a launched batch's outputs and split them per piece (the batch's one
        read-back point: host work, see :func:`embedpipe.runtime.cuda.host_side`)."""
        with cuda.host_side():
            dim = self.loaded.embed_dim
            host = HostPooled.unpack(launched.summary.wait().numpy(),
                                     {k: v.wait().numpy() for k, v in launched.residues.items()},
                                     launched.residue_starts, self.layers, dim, "bos" in self.pooling)
            return [(piece, self._piece_result(host, row, piece)) for row, piece in enumerate(launched.batch)]

    def _piece_result(self, host: HostPooled, row: int, piece: Piece) -> _PieceResult:
        kept = (piece.keep_start - piece.start, piece.keep_end - piece.start)
        return _PieceResult(
            sums={layer: host.sums[layer][row] for layer in self.layers},
            residues=host.residue_rows(row, *kept) if self.options.per_residue else None,
            max_abs=float(host.max_abs[row]),
            stored_max=float(host.stored_max[row]),
            bos={layer: host.bos[layer][row] for layer in self.layers} if host.bos and piece.start == 0 else None,
        )

    # -- records ----------------------------------------------------------------------------------
    def _reason(self, policy: Policy, result: _PieceResult) -> str:
        """Why a piece's outputs cannot be stored as computed ('' when they can)."""
        # stored_max covers every stored output, BOS included (a NaN/inf there propagates)
        if not math.isfinite(result.stored_max) or not math.isfinite(result.max_abs):
            return "nonfinite"
        if not all(np.isfinite(total).all() for total in result.sums.values()):
            return "nonfinite"  # e.g. inf in a padding position reaching the masked sum as 0 * inf
        if result.stored_max > self.storage_max:
            return "overflow"
        margin = self.options.overflow_margin
        if margin is not None and not policy.is_reference:
            limit = margin * policy.overflow_limit
            if result.max_abs > limit:
                return "overflow-margin"
        return ""

    def _reasons(self, policy: Policy, results: list[tuple[Piece, _PieceResult]]) -> str:
        """Every reason the record's pieces cannot be stored as computed, '+'-joined ('' if none)."""
        return "+".join(sorted({r for r in (self._reason(policy, res) for _, res in results) if r}))

    def _finish(self, index: int, records: Sequence[tuple[str, str]], handling: list[str],
                results: list[tuple[Piece, _PieceResult]]) -> EmbeddedRecord:
        rid, seq = records[index]
        low_max_abs = max(res.max_abs for _, res in results)  # what the requested policy saw
        precision_used, fallback_reason = self.policy.name, self._reasons(self.policy, results)
        if fallback_reason:
            if self.policy.is_reference:
                raise EmbedpipeError(self._fp32_failure(rid, results, fallback_reason))
            results = self._rerun_fp32([piece for piece, _ in results], records, rid)
            precision_used = FP32.name
            self.stats["fallback"] += 1
            self.stats[f"fallback:{fallback_reason}"] += 1
        record = self._assemble(rid, seq, results, handling[index])
        record.precision_used = precision_used
        record.fallback_reason = fallback_reason
        record.max_abs_activation = low_max_abs
        self.stats["records"] += 1
        self.stats[f"precision:{precision_used}"] += 1
        return record

    def _rerun_fp32(self, pieces: list[Piece], records: Sequence[tuple[str, str]], rid: str) -> list[tuple[Piece, _PieceResult]]:
        """The record's own windows again, each alone, with the fp32 model."""
        results = []
        for piece in pieces:
            results.extend(self._run_batch(FP32, [piece], records))
        problems = self._reasons(FP32, results)
        if problems:
            raise EmbedpipeError(self._fp32_failure(rid, results, problems))
        return results

    def _fp32_failure(self, rid: str, results: list[tuple[Piece, _PieceResult]], reason: str) -> str:
        largest = max(res.stored_max for _, res in results)
        if reason == "overflow":
            return (
                f"record {rid!r}: fp32 values up to {largest:.4g} do not fit --storage-dtype "
                f"{self.options.storage_dtype}; use --storage-dtype float32"
            )
        return f"record {rid!r}: the fp32 forward itself produced non-finite values ({reason}); nothing was written for it"

    def _assemble(self, rid: str, seq: str, results: list[tuple[Piece, _PieceResult]], how: str) -> EmbeddedRecord:
        results = sorted(results, key=lambda item: item[0].keep_start)
        embedded = sum(p.keep_end - p.keep_start for p, _ in results)
        mean = {}
        for layer in self.layers:
            total = np.sum([res.sums[layer] for _, res in results], axis=0, dtype=np.float64)
            mean[layer] = (total / embedded).astype(np.float32)
        per_residue = None
        if self.options.per_residue:
            per_residue = {
                layer: np.concatenate([res.residues[layer] for _, res in results], axis=0)
                for layer in self.layers
            }
        # BOS: the hidden state at token 0 of the window that starts at residue 0 (docs/store-format.md)
        first = results[0][1]
        return EmbeddedRecord(
            id=rid,
            sequence=seq,
            precision_used=self.policy.name,
            mean=mean,
            per_residue=per_residue,
            bos=first.bos if "bos" in self.pooling else None,
            long_handling=how,
            embedded_length=embedded,
            windows=len(results),
        )
