"""The embedding engine: batches launched one ahead, read back once each, records streamed out.

The engine sees the model only through :class:`~embedpipe.model.base.EmbeddingModel`. Results
leave the device once per batch (one transfer per stored layer), so memory is bounded by a
batch; a batch that runs out of memory is split in halves. The engine orchestrates; the other
jobs have modules of their own: the prepared models (:mod:`embedpipe.extraction.preparation`), the
checks and the per-record fp32 fallback (:mod:`embedpipe.extraction.fallback`, docs/precision.md),
a record stitched from its windows (:mod:`embedpipe.extraction.stitching`), pooling
(:mod:`embedpipe.extraction.pooling`) and planning (:mod:`embedpipe.extraction.planning`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass

import torch

from embedpipe.core.errors import EmbedpipeError
from embedpipe.core.progress import progress_bar, say
from embedpipe.extraction.budget import batch_overhead_tokens
from embedpipe.extraction.fallback import RecordCheck
from embedpipe.extraction.planning import Piece, padding_efficiency, plan_batches, plan_packed_batches, plan_record
from embedpipe.extraction.pooling import HostPooled, pool_packed, pool_padded
from embedpipe.extraction.preparation import Preparation
from embedpipe.extraction.resolved import ResolvedRun
from embedpipe.extraction.stitching import Assemblies, PieceResult, Results, stitch
from embedpipe.model import capabilities
from embedpipe.model.base import EmbeddingModel, PackedRunner, Runner
from embedpipe.runtime import cuda
from embedpipe.runtime.cuda import BusyTimer, HostCopy
from embedpipe.runtime.packed import PackedTokens
from embedpipe.runtime.precision import (
    FP32,
    Policy,
    check_policy_on_device,
    exact_fp32,
    forward_context,
    true_fp32_matmuls,
)
from embedpipe.store import EmbeddedRecord

Records = Sequence[tuple[str, str]]


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
class _Launched:
    """A batch whose forward has been launched and whose outputs are on their way to the host."""

    batch: list[Piece]
    summary: HostCopy
    residues: dict[int, HostCopy]
    residue_starts: list[int] | None


class Engine:
    """Embeds sequences with one loaded model under one policy; reusable for many inputs.

    ``embed`` yields ``(index, EmbeddedRecord)`` in completion order (not input order).
    Records whose low-precision outputs are unusable are re-run alone in fp32 with an fp32
    model prepared lazily, once.
    """

    def __init__(self, loaded: EmbeddingModel, run: ResolvedRun) -> None:
        """``run``: resolved by the job, or outside one by
        :func:`~embedpipe.extraction.resolved.resolve_loaded` (the cross-check, tests, benchmarks); the
        engine re-derives nothing."""
        if run.tokens_per_batch is None:
            raise TypeError("Engine: the run was resolved without its model (a prediction); resolve it with loaded=")
        self.loaded = loaded
        self.run = run
        self.options = run.options
        self.policy = run.policy  # int8-mixed smoothing: a policy of its own
        self.prepared = Preparation(loaded, run, on_moved=self._fallback_moved)
        self.layers = list(run.layers)
        self.pooling = list(run.pooling)
        capabilities.check_options(loaded, run.options.pooling, run.engine.batch_layout)
        self.check = RecordCheck.for_storage(run.options.storage_dtype, run.options.overflow_margin)
        self.notes = check_policy_on_device(self.policy, run.device)
        #: the token budget of a batch (``--tokens-per-batch``, ``auto`` resolved for the device by the run)
        self.tokens_per_batch: int = run.tokens_per_batch
        self.quiet = True
        self.stats: Counter[str] = Counter()
        self._busy = BusyTimer()
        self._ring = cuda.PinnedRing(keep=1 + len(self.layers) * run.options.per_residue)  # one batch's read-back

    # -- model preparation (once per policy: extraction/preparation.py) ----------------------------
    @property
    def device(self) -> torch.device:
        """The job's device, where the main policy runs."""
        return self.prepared.device

    @device.setter
    def device(self, device: torch.device) -> None:
        self.prepared.device = device

    def runner(self, policy: Policy) -> Runner:
        """The forward for ``policy``, prepared once (:meth:`Preparation.runner`)."""
        return self.prepared.runner(policy)

    def _fallback_moved(self, message: str) -> None:
        say(f"warning: {message}", quiet=self.quiet)
        self.stats["fallback_moved_to_cpu"] += 1

    @property
    def fallback_device(self) -> str:
        """Where fp32 fallback records ran ('' when none did)."""
        if not self.stats["fallback"] or self.policy.is_reference:
            return ""
        return str(self.prepared.devices.get(FP32.name, ""))

    @property
    def busy_seconds(self) -> float:
        """Seconds the device spent in forward passes so far (CUDA events on a GPU); with the
        run's wall time this gives the device's idle fraction (benchmarks/gpu_acceptance.py)."""
        return self._busy.seconds

    @property
    def batch_layout(self) -> str:
        """``packed`` or ``padded``: how the main policy's batches are laid out."""
        return self.prepared.layout(self.policy)

    @property
    def attention_path(self) -> str:
        """The main policy's attention kernel as recorded in the store (docs/precision.md)."""
        return self.run.attention_path

    @property
    def attention_inputs(self) -> str:
        """dtype name of q/k/v at the main policy's attention kernel."""
        return self.run.qkv_dtype

    @property
    def runner_provenance(self) -> dict[str, str]:
        """What the main policy's prepared runner decided, as root attributes (int8-mixed: the
        layers kept fp32, docs/precision.md); empty before it is prepared or for other policies."""
        runner = self.prepared.runners.get(self.policy.name)
        if runner is None:
            return {}
        return self.policy.runner_provenance(runner.fp32_layers)

    # -- public ---------------------------------------------------------------------------------
    def new_input(self) -> None:
        """Start the counters of a new input (a group job's next shard); the prepared models,
        the token budget and the busy time carry on."""
        self.stats = Counter()

    def plan(self, records: Records) -> Plan:
        """Windows and batches for ``records``; raises for long records under --long-sequences error."""
        pieces: list[Piece] = []
        handling: list[str] = []
        rows: list[int] = []
        layout = capabilities.layout_of(self.loaded)
        for index, (rid, seq) in enumerate(records):
            record_pieces, how = plan_record(index, layout.residues(seq), self.options.long_sequences,
                                             window=self.loaded.trained_window, record_id=rid, layout=layout)
            pieces.extend(record_pieces)
            handling.append(how)
            rows.append(sum(p.keep_end - p.keep_start for p in record_pieces))
        if self.batch_layout == "packed":
            return Plan(plan_packed_batches(pieces, self.tokens_per_batch), handling, rows, packed=True)
        overhead = batch_overhead_tokens(self.device)
        return Plan(plan_batches(pieces, self.tokens_per_batch, overhead), handling, rows)

    def embed(self, records: Records, plan: Plan | None = None, *,
              quiet: bool = True) -> Generator[tuple[int, EmbeddedRecord], None, None]:
        plan = plan or self.plan(records)
        self.quiet = quiet
        assemblies = Assemblies(plan.batches)
        layout = capabilities.layout_of(self.loaded)
        total_residues = sum(layout.residues(s) for _, s in records)
        # No TF32 for fp32 work: process-wide flags, so set once per run (not per batch), then restored.
        with progress_bar(quiet=quiet, total=total_residues, unit="res", unit_scale=True, desc="embed") as bar, \
                true_fp32_matmuls():
            for piece, result in self._stream(plan.batches, records):
                results = assemblies.add(piece, result)
                if results is None:
                    continue
                record = self._finish(piece.record, records, plan.handling, results)
                bar.update(layout.residues(records[piece.record][1]))
                bar.set_postfix(records=self.stats["records"], fallback=self.stats["fallback"], refresh=False)
                yield piece.record, record

    # -- batches --------------------------------------------------------------------------------
    def _stream(self, batches: list[list[Piece]], records: Records) -> Iterator[tuple[Piece, PieceResult]]:
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

    def _try_launch(self, policy: Policy, batch: list[Piece], records: Records) -> _Launched | None:
        """``_launch``, or None when the device ran out of memory (the caller splits)."""
        self.runner(policy)  # out of memory while preparing is handled there, not as a batch
        try:
            return self._launch(policy, batch, records)
        except torch.cuda.OutOfMemoryError:
            pass
        if self.prepared.devices[policy.name].type == "cuda":
            torch.cuda.empty_cache()
        return None

    def _run_batch(self, policy: Policy, batch: list[Piece], records: Records) -> Results:
        """Forward one batch now; on CUDA out-of-memory split it in halves and retry.

        The retry happens after leaving the ``except`` block: the exception's traceback holds
        the failed attempt's tensors, which must be freed before the halves run.
        """
        launched = self._try_launch(policy, batch, records)
        if launched is not None:
            return self._collect(launched)
        return self._split_run(policy, batch, records)

    def _split_run(self, policy: Policy, batch: list[Piece], records: Records) -> Results:
        """A batch that ran out of memory: its halves, each through :meth:`_run_batch`; a
        single piece that does not fit is an error naming the record."""
        device = self.prepared.devices[policy.name]
        if len(batch) == 1:
            piece = batch[0]
            rid, seq = records[piece.record]
            residues = capabilities.layout_of(self.loaded).residues(seq)
            raise EmbedpipeError(
                f"record {rid!r} ({residues} residues, window {piece.start}:{piece.end}) does not fit in "
                f"memory on {device} even alone; use --long-sequences chunk, a lower precision or a smaller model"
            )
        self.stats["oom_splits"] += 1
        middle = len(batch) // 2
        return self._run_batch(policy, batch[:middle], records) + self._run_batch(policy, batch[middle:], records)

    def _launch(self, policy: Policy, batch: list[Piece], records: Records) -> _Launched:
        """Tokenize, forward and pool one batch, and start copying its outputs to the host."""
        runner = self.runner(policy)
        device = self.prepared.devices[policy.name]
        packed = self.prepared.layout(policy) == "packed"
        with cuda.host_side():
            layout = capabilities.layout_of(self.loaded)
            tokens = self.loaded.tokenize([layout.residue_slice(records[p.record][1], p.start, p.end) for p in batch])
            host_batch = PackedTokens.from_padded(tokens, [p.tokens for p in batch]) if packed else None
        bos, per_residue = "bos" in self.pooling, self.options.per_residue
        with forward_context(policy, device):
            self._busy.start(device)
            if packed:
                if not isinstance(runner, PackedRunner):
                    raise EmbedpipeError(f"{self.loaded.name} runs padded batches only (EMBEDPIPE_ENGINE batch_layout=packed)")
                assert host_batch is not None  # made above for a packed batch
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

    def _collect(self, launched: _Launched) -> Results:
        """Wait for a launched batch's outputs and split them per piece (the batch's one
        read-back point: host work, see :func:`embedpipe.runtime.cuda.host_side`)."""
        with cuda.host_side():
            dim = self.loaded.embed_dim
            host = HostPooled.unpack(launched.summary.wait().numpy(),
                                     {k: v.wait().numpy() for k, v in launched.residues.items()},
                                     launched.residue_starts, self.layers, dim, "bos" in self.pooling)
            return [(piece, self._piece_result(host, row, piece)) for row, piece in enumerate(launched.batch)]

    def _piece_result(self, host: HostPooled, row: int, piece: Piece) -> PieceResult:
        kept = (piece.keep_start - piece.start, piece.keep_end - piece.start)
        return PieceResult(
            sums={layer: host.sums[layer][row] for layer in self.layers},
            residues=host.residue_rows(row, *kept) if self.options.per_residue else None,
            max_abs=float(host.max_abs[row]),
            stored_max=float(host.stored_max[row]),
            bos={layer: host.bos[layer][row] for layer in self.layers} if host.bos and piece.start == 0 else None,
        )

    # -- records ----------------------------------------------------------------------------------
    def _finish(self, index: int, records: Records, handling: list[str], results: Results) -> EmbeddedRecord:
        """The record ``index`` from its pieces' results: checked, re-run in fp32 when the
        check fails (extraction/fallback.py), stitched (extraction/stitching.py) and counted."""
        rid, seq = records[index]
        low_max_abs = max(res.max_abs for _, res in results)  # what the requested policy saw
        precision_used, fallback_reason = self.policy.name, self.check.reasons(self.policy, results)
        if fallback_reason:
            if self.policy.is_reference:
                raise EmbedpipeError(self.check.failure(rid, results, fallback_reason))
            results = self.check.rerun_fp32(rid, [piece for piece, _ in results],
                                            lambda piece: self._run_batch(FP32, [piece], records))
            precision_used = FP32.name
            self.stats["fallback"] += 1
            self.stats[f"fallback:{fallback_reason}"] += 1
        record = stitch(rid, seq, results, handling[index], self.layers, per_residue=self.options.per_residue,
                        bos="bos" in self.pooling, precision=self.policy.name)
        record.precision_used = precision_used
        record.fallback_reason = fallback_reason
        record.max_abs_activation = low_max_abs
        self.stats["records"] += 1
        self.stats[f"precision:{precision_used}"] += 1
        return record
