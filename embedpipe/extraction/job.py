"""One embed job: its reuse stores, its model (loaded only when a record must be computed) and
its one resolved run (:mod:`embedpipe.extraction.resolved`).

Why the job owns the loading: the run is resolved here once, either predicted from the model's
files before it loads (``--reuse``: a job whose records are all copies loads no model) or from
the loaded model, through the same :func:`~embedpipe.extraction.resolved.resolve_run`, and the two
are compared; ``embedpipe.extraction.run`` writes the stores (docs/cluster.md, "Release to release").
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from embedpipe.core.cpus import CpuAllocation, use_threads
from embedpipe.core.devices import claim_device, resolve_device
from embedpipe.core.errors import EmbedpipeError
from embedpipe.core.host_memory import keep_freed_memory
from embedpipe.core.options import FASTA_LIMITS, EmbedOptions, FastaLimits
from embedpipe.core.progress import say
from embedpipe.extraction import auto_decision, auto_precision
from embedpipe.extraction.engine import Engine
from embedpipe.extraction.identity import first_difference, ignored
from embedpipe.extraction.resolved import AutoChoice, ResolvedRun, Unpredictable, resolve_run, resolve_threads
from embedpipe.extraction.reuse import Reuse
from embedpipe.inputs.fasta import read_sequences
from embedpipe.model import capabilities, load_model, registry
from embedpipe.model.base import EmbeddingModel
from embedpipe.model.identity import ModelIdentity
from embedpipe.runtime.auto_cache import default_cache_dir
from embedpipe.runtime.engine_override import EngineChoice
from embedpipe.runtime.precision import Policy
from embedpipe.store import EmbeddedRecord


@dataclass
class Work:
    """One store's records split: copies (index -> source, row) and the indices to compute."""

    records: Sequence[tuple[str, str]]
    found: dict[int, tuple[int, int]]
    todo: list[int]
    reuse: Reuse | None

    @property
    def computing(self) -> list[tuple[str, str]]:
        return [self.records[i] for i in self.todo]

    def residue_rows(self, plan_rows: Sequence[int] | None) -> list[int]:
        """Per-residue rows of every record: the copies' from their sources, the plan's for the rest."""
        rows = [0] * len(self.records)
        for j, i in enumerate(self.todo):
            rows[i] = int(plan_rows[j])  # type: ignore[index]
        if self.found:
            for i, n in self.reuse.embedded_rows(self.found).items():  # type: ignore[union-attr]
                rows[i] = n
        return rows

    def copies(self) -> Iterator[tuple[int, EmbeddedRecord]]:
        return self.reuse.copies(self.records, self.found) if self.found else iter(())  # type: ignore[union-attr]

    def counts(self) -> dict[str, Any]:
        return self.reuse.counts(self.found) if self.reuse is not None else {}

    def fallbacks(self) -> int:
        """Copies that carry an fp32 fallback (counted in the store's ``fallback_count``)."""
        return self.reuse.copied_fallbacks if self.reuse is not None else 0


class Job:
    """What one embed job embeds with: the reuse stores, and the model, claimed and loaded on
    ``stack`` only when a record must be computed (:meth:`embedder`)."""

    def __init__(self, model: str, options: EmbedOptions, policy: Policy | None, reuse: Reuse | None, quiet: bool,
                 stack: contextlib.ExitStack, threads: CpuAllocation, inputs: JobInput) -> None:
        self.model, self.options, self.policy, self.reuse, self.quiet = model, options, policy, reuse, quiet
        self._stack = stack
        self._engine: Engine | None = None
        self.threads = threads  # counted once per job (embedpipe.core.cpus), recorded in the run
        self.inputs = inputs  # the job's FASTAs: what --precision auto's probe measures on and may cost
        #: the job's resolved run: predicted without the model when reuse allows, else the loaded one's
        self.run = predict_run(reuse, model, options, policy, threads, inputs.decision)
        #: the identity of every store the job writes
        self.identity = self.run.identity if self.run is not None else None

    def split(self, records: Sequence[tuple[str, str]]) -> Work:
        found = self.reuse.find(records) if self.reuse is not None else {}
        return Work(records, found, [i for i in range(len(records)) if i not in found], self.reuse)

    def engine(self) -> Engine:
        """The job's engine, the model loaded on first use; its run resolved once, its
        identity checked against the reuse stores and the one predicted before loading."""
        if self._engine is None:
            loaded, device = self._stack.enter_context(_model_on(self.model, self.options))
            model = _loaded_identity(self.model, loaded)

            def measure(options: EmbedOptions, engine: EngineChoice) -> AutoChoice:
                """``--precision auto`` measured on this node (extraction/auto_precision.py), asked by resolve_run;
                the run's one decision when the job was given it (extraction/auto_decision.py)."""
                if self.inputs.decision is not None:
                    return auto_decision.chosen(self.inputs.decision, options, engine, device, model)
                records, residues = self.inputs.probe()
                return auto_precision.decide(loaded, options, engine, device, model, records, residues,
                                         auto_cache(options), threads=self.threads, quiet=self.quiet)

            run = resolve_run(self.options, device, num_layers=loaded.num_layers, packs=capabilities.packs(loaded),
                              model=model, policy=self.policy, width=loaded.embed_dim, measure=measure,
                              loaded=loaded, threads=self.threads)
            if run.precision_requested:
                say(f"precision {run.precision_reason}", quiet=self.quiet)
            if self.inputs.decision is not None and (note := auto_decision.other_class(self.inputs.decision, device)):
                say(f"warning: precision auto: {note}", quiet=self.quiet)
            embedder = Engine(loaded, run)
            for note in auto_precision.notes(run, model, auto_cache(self.options), embedder.notes):
                say(f"warning: {note}", quiet=self.quiet)
            if self.identity is not None and self.identity != run.identity:
                key = (first_difference(self.identity, run.identity) or ("?",))[0]
                raise EmbedpipeError(f"--reuse: the loaded model resolves {key} differently than predicted "
                                     "from its files; run without --reuse")
            if self.reuse is not None:
                self.reuse.check(run.identity, ignored(self.options))
            self.identity, self.run, self._engine = run.identity, run, embedder
        return self._engine

    def layout(self) -> tuple[list[int], int, list[str]]:
        """(layers, dim, pooling) of the stores: the embedder's, or the first source's without a model."""
        if self._engine is not None:
            return self._engine.layers, self._engine.loaded.embed_dim, self._engine.pooling
        st = self.reuse.sources[0].store  # type: ignore[union-attr]
        return st.layers, st.dim, st.pooling


@dataclass(frozen=True)
class JobInput:
    """The job's FASTAs, read for ``--precision auto`` only when it measures: records of the
    first to probe on, and every shard's residues (kept ones too, so a rerun decides as the
    first run did) to bound what the probe may cost; or ``records`` held in memory (the Python
    API's first call: embedpipe.api). ``decision``: the run's one decision (``--precision
    auto:FILE``), which the job runs instead of measuring."""

    fastas: tuple[Path, ...] = ()
    limits: FastaLimits = FASTA_LIMITS
    records: tuple[tuple[str, str], ...] | None = None
    decision: auto_decision.Decision | None = None

    def probe(self) -> tuple[list[tuple[str, str]], int]:
        if self.records is not None:
            return list(self.records), sum(len(s) for _, s in self.records)
        records = list(read_sequences(self.fastas[0], self.limits))
        others = sum(len(s) for fasta in self.fastas[1:] for _, s in read_sequences(fasta, self.limits))
        return records, sum(len(s) for _, s in records) + others


@contextlib.contextmanager
def open_job(model: str, options: EmbedOptions, policy: Policy | None, reuse: Sequence[Path], quiet: bool,
             inputs: JobInput) -> Iterator[Job]:
    """The job's reuse stores and its model, claimed and loaded only when a record must be
    computed; ``inputs``: the job's FASTAs, for ``--precision auto``'s probe."""
    # --threads, else the CPUs the job owns (docs/cluster.md, "CPU threads"), counted once per job:
    # before anything is timed (auto and int8's kernels measure at it) and before the model loads
    threads = use_threads(resolve_threads(options), quiet=quiet)
    with contextlib.ExitStack() as stack:
        sources = stack.enter_context(Reuse(reuse, quiet)) if reuse else None
        yield Job(model, options, policy, sources, quiet, stack, threads, inputs)


def auto_cache(options: EmbedOptions) -> Path:
    """Where ``--precision auto``'s measurements are kept (the ``auto_cache`` option, else
    ``EMBEDPIPE_AUTO_CACHE``, else the user's cache)."""
    return Path(options.auto_cache) if options.auto_cache else default_cache_dir()


def predict_run(reuse: Reuse | None, model: str, options: EmbedOptions, policy: Policy | None,
                threads: CpuAllocation, decision: auto_decision.Decision | None = None) -> ResolvedRun | None:
    """The job's run without loading the model (its identity checked against every reuse
    store), or None when it cannot be known so: no reuse store, a family without
    ``file_identity``, ``--precision auto`` with no measurement cached on this node, int8-mixed
    from an index that does not record the model's width (its weight range is measured for it)."""
    if reuse is None or not reuse.sources or reuse.sources[0].num_layers is None:
        return None
    facts = registry.model_identity(model)
    if facts is None:
        return None
    device = resolve_device(options.device)

    def measure(chosen: EmbedOptions, engine: EngineChoice) -> AutoChoice | None:
        if decision is not None:
            return auto_decision.chosen(decision, chosen, engine, device, facts)
        return auto_precision.cached(chosen, engine, device, facts, auto_cache(chosen))

    try:
        run = resolve_run(options, device, num_layers=reuse.sources[0].num_layers, packs=facts.packs, model=facts,
                          policy=policy, width=reuse.sources[0].width, measure=measure, threads=threads)
    except Unpredictable:
        return None
    for source in reuse.sources:
        source.check_model(facts.sha256)
    reuse.check(run.identity, ignored(options))
    return run


@contextlib.contextmanager
def _model_on(model: str, options: EmbedOptions) -> Iterator[tuple[EmbeddingModel, torch.device]]:
    """Claim the device, then load the model (a job waiting for a GPU holds no model in memory)."""
    with claim_device(options.device) as device:
        if device.type == "cpu":
            keep_freed_memory()  # activations live in host memory: reuse it, no fresh pages per batch
        yield load_model(model), device


def _loaded_identity(model: str, loaded: EmbeddingModel) -> ModelIdentity:
    """The loaded model's part of the identity: from its files (the same function ``--reuse``
    predicts with), or only its sha256 for a family that cannot say (docs/cluster.md)."""
    identity = registry.model_identity(model)
    if identity is None:
        return ModelIdentity(loaded.sha256, False, {}, loaded.family)
    if identity.sha256 != loaded.sha256:
        raise EmbedpipeError(f"--model {model}: its weights changed while it was loaded (sha256 "
                             f"{loaded.sha256[:16]}..., now {identity.sha256[:16]}...); run again")
    return identity
