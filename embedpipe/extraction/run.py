"""``embedpipe embed``: one FASTA (a shard) into one store, or a group of shards into one
store each, with the engine and the provenance (:mod:`embedpipe.extraction.provenance`).

A group is one embed job of the workflow (docs/cluster.md, "A UniRef50-sized run"): the model
is loaded once, and a shard whose store is already complete for the same shard content,
model and options is kept, so a retried or rerun job resumes at shard granularity. The
worker itself is :mod:`embedpipe.extraction.engine`; the model comes from :mod:`embedpipe.model`.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import h5py

from embedpipe.core.atomic import check_output_path
from embedpipe.core.checksums import file_sha256
from embedpipe.core.errors import EmbedpipeError
from embedpipe.core.interrupts import telling_progress
from embedpipe.core.locks import lock_path_for
from embedpipe.core.options import AUTO, FASTA_LIMITS, EmbedOptions, FastaLimits
from embedpipe.core.output_guard import STORE, Output, described_by, writing_outputs
from embedpipe.core.progress import say
from embedpipe.extraction.auto_decision import Decision, read_decision
from embedpipe.extraction.combinations import check_embed
from embedpipe.extraction.engine import Engine
from embedpipe.extraction.group_marker import GROUP_FORMAT, write_marker
from embedpipe.extraction.identity import describe_difference, ignored
from embedpipe.extraction.job import Job, JobInput, open_job
from embedpipe.extraction.provenance import batching_attrs, provenance
from embedpipe.extraction.resolved import resolve_policy
from embedpipe.extraction.writer_thread import BackgroundWriter
from embedpipe.inputs.fasta import check_regular_file, read_sequences
from embedpipe.model import inspect
from embedpipe.model.layout import TokenLayout
from embedpipe.model.registry import model_files
from embedpipe.runtime.precision import Policy
from embedpipe.store import StoreWriter, utc_now
from embedpipe.store.format import is_complete, read_root_attrs
from embedpipe.store.reuse_index import is_index
from embedpipe.store.sources import pinned_by
from embedpipe.store.validate import validate_store


@dataclass
class EmbedSummary:
    out: Path
    records: int
    residues: int
    seconds: float
    precision: str
    device: str
    fallback: dict[str, int]
    padding_efficiency: float
    tokens_per_batch: int  # the budget the batches were planned with
    tokens_per_batch_auto: bool  # sized by --tokens-per-batch auto, not given
    reused: int = 0  # records copied from a --reuse store, not computed

    def render(self) -> str:
        if self.reused == self.records:
            return f"reused all {self.records} records (copied from --reuse stores; nothing computed) -> {self.out}"
        rate = self.residues / self.seconds if self.seconds > 0 else float("nan")
        fell = sum(self.fallback.values())
        why = ", ".join(f"{k}: {v}" for k, v in sorted(self.fallback.items())) or "none"
        budget = f"tokens per batch {self.tokens_per_batch}" + (f" ({AUTO})" if self.tokens_per_batch_auto else "")
        speed = f"({rate:,.0f} residues/s)" if not self.reused else "(copies included: no rate)"
        lines = [
            f"{'wrote' if self.reused else 'embedded'} {self.records} records ({self.residues} residues) in "
            f"{self.seconds:.1f}s {speed} with {self.precision} on {self.device} -> {self.out}",
            f"fp32 fallback: {fell} of {self.records} records ({why}); padding efficiency {self.padding_efficiency:.3f}; "
            f"{budget}",
        ]
        if self.reused:
            lines.append(f"reused {self.reused} of {self.records} records (copied from --reuse stores), "
                         f"computed {self.records - self.reused}")
        return "\n".join(lines)


def _writing(outputs: list[Output], fastas: Sequence[Path], model: str,
             reuse: Sequence[Path]) -> contextlib.AbstractContextManager[None]:
    """The guard and the output locks of an embed run (embedpipe.core.output_guard): the
    FASTAs, the model's files and the reuse stores are read (a reuse index: the store it
    indexes too), and the reuse stores' pinned sources are inputs too."""
    stores = [*map(Path, reuse), *filter(None, map(_indexed_store, reuse))]
    return writing_outputs("embed", outputs, [*map(Path, fastas), *model_files(model), *stores], pinned=pinned_by(stores))


def _indexed_store(path: Path) -> Path | None:
    """The store a reuse index was built from (``store_path``): read through it by ``--reuse``."""
    if not is_index(Path(path)):
        return None
    with h5py.File(path, "r") as f:
        value = f.attrs.get("store_path")
    # anything but a path as text is left to the index's own checks (a one-line refusal)
    return Path(value) if isinstance(value, str) and value else None


def _check_group(fastas: Sequence[Path], done: Path | None, limits: FastaLimits = FASTA_LIMITS) -> None:
    """Up front, before the first shard is embedded: ``--done`` can be written, and no shard is
    empty (the outputs are guarded and locked next, by :func:`_writing`)."""
    if done is not None:
        check_output_path(Path(done))
    for fasta in fastas:
        with contextlib.closing(read_sequences(Path(fasta), limits)) as records:
            empty = next(records, None) is None
        if empty:
            raise EmbedpipeError(f"{fasta}: no records to embed")


def start_checks(fastas: Sequence[Path], model: str, options: EmbedOptions, reuse: Sequence[Path],
                 limits: FastaLimits) -> tuple[Policy | None, FastaLimits]:
    """Every check of an embed run before a record is read or the model loads (the options
    checked once, by the workflow's check: extraction/combinations.py), its named policy configured
    (the calibration FASTA read now, so a bad file fails before the model loads; None for
    ``--precision auto``: :func:`~embedpipe.extraction.resolved.resolve_run` decides it in the job,
    once its model is loaded, extraction/auto_precision.py), and ``limits`` as the model's family reads
    records (its case kept where case is input: ProstT5; two characters a residue: SaProt)."""
    facts = inspect(model)
    check_embed(options, facts, reuse, calibration=False)
    limits.check(EmbedpipeError)
    for fasta in fastas:  # a pipe is drained by the first read: the store recorded an empty input's sha256
        check_regular_file(Path(fasta), "embed", "it reads the records, then the file again for the input_sha256 "
                           "its store records")
    policy = None if options.precision == AUTO else resolve_policy(options)
    return policy, family_limits(facts.token_layout, limits)


def family_limits(layout: TokenLayout, limits: FastaLimits = FASTA_LIMITS) -> FastaLimits:
    """``limits`` as a family of token ``layout`` reads records: its case kept where case is
    input (ProstT5), two characters a residue (SaProt). ``embed`` and ``embedpipe.read_fasta``
    read a FASTA by these."""
    return replace(limits, keep_case=layout.keeps_case, chars_per_residue=layout.chars_per_residue)


@contextlib.contextmanager
def _job(fastas: Sequence[Path], model: str, options: EmbedOptions, policy: Policy | None, reuse: Sequence[Path],
         limits: FastaLimits, outputs: list[Output], quiet: bool, decision: Decision | None = None) -> Iterator[Job]:
    """The job of an embed run (one FASTA or a group): its outputs guarded and locked, then its
    threads, reuse stores and model (extraction/job.py); ``decision``: the run's one ``auto`` decision."""
    with _writing(outputs, fastas, model, reuse), \
            open_job(model, options, policy, reuse, quiet,
                     JobInput(tuple(map(Path, fastas)), limits, decision=decision)) as job:
        yield job


def _read_records(fasta: Path, limits: FastaLimits = FASTA_LIMITS) -> list[tuple[str, str]]:
    records = list(read_sequences(Path(fasta), limits))
    if not records:
        raise EmbedpipeError(f"{fasta}: no records to embed")
    return records


def embed_fasta(fasta: Path, *, model: str, out: Path, options: EmbedOptions, quiet: bool = False,
                reuse: Sequence[Path] = (), limits: FastaLimits = FASTA_LIMITS,
                decision: Decision | None = None) -> EmbedSummary:
    """Embed every record of ``fasta`` with ``model`` into the store ``out`` (atomic); a record
    a ``reuse`` store holds is copied (embedpipe.extraction.reuse). The FASTA is read, and held to
    ``limits`` (docs/store-format.md, "Input limits"), before the model loads."""
    policy, limits = start_checks([fasta], model, options, reuse, limits)
    started = time.perf_counter()
    with _job([fasta], model, options, policy, reuse, limits, [("--out", Path(out), STORE)], quiet, decision) as job:
        records = _read_records(fasta, limits)
        check_output_path(Path(out))
        return _embed_records(job, records, Path(fasta), Path(out), started,
                              {"input_sha256": file_sha256(Path(fasta))}, quiet)


def _embed_records(job: Job, records: list[tuple[str, str]], fasta: Path, out: Path, started: float,
                   extra: dict[str, str], quiet: bool) -> EmbedSummary:
    """``records`` (read from ``fasta``) into the store ``out``: copies of what the reuse stores
    hold, the rest computed with the job's embedder (the model loaded when first needed)."""
    work = job.split(records)
    embedder = job.engine() if work.todo or job.identity is None else None
    plan = None
    if embedder is not None:
        embedder.new_input()
        plan = embedder.plan(work.computing)
        attrs = provenance(embedder.loaded, embedder.run, fasta)
    else:
        attrs = job.reuse.provenance(work.found, fasta)  # type: ignore[union-attr]
    options = job.options
    layers, dim, pooling = job.layout()
    with StoreWriter(
        out,
        ids=[r for r, _ in records],
        sequences=[s for _, s in records],
        residue_rows=work.residue_rows(plan.rows if plan else None) if options.per_residue else None,
        layers=layers,
        dim=dim,
        storage_dtype=options.storage_dtype,
        attrs=attrs | extra | (job.run.precision_attrs if job.run else {}) | work.counts() | {"embed_identity": job.identity},
        pooling=pooling,
    ) as writer:
        # HDF5 writes on a thread of their own; it is joined before the writer finalizes or
        # aborts (any failure leaves no store), and the generator is closed either way
        with BackgroundWriter(writer.write) as background:
            for index, record in work.copies():
                background.put(index, record)
            if embedder is not None:
                with contextlib.closing(embedder.embed(work.computing, plan, quiet=quiet)) as results:
                    for j, record in results:
                        background.put(work.todo[j], record)
        fallback = _fallback_counts(embedder, work.fallbacks())
        writer.set_attrs(fallback_count=sum(fallback.values()), fallback_reasons=json.dumps(fallback, sort_keys=True),
                         finished_utc=utc_now(), **(run_attrs(embedder, plan) if embedder is not None else {}))
    return EmbedSummary(
        out=out, records=len(records), residues=sum(len(s) for _, s in records),
        seconds=time.perf_counter() - started, precision=job.run.policy.name if job.run else options.precision,
        device=str(embedder.device) if embedder is not None else "no device (all reused)", fallback=fallback,
        padding_efficiency=plan.padding_efficiency if plan else 1.0,
        tokens_per_batch=embedder.tokens_per_batch if embedder is not None else 0,
        tokens_per_batch_auto=options.tokens_per_batch == AUTO, reused=len(work.found))


def _fallback_counts(embedder: Engine | None, copied: int) -> dict[str, int]:
    """fp32 fallbacks by reason: the computed records' and, as ``reused``, the copies that carry one."""
    fallback = {} if embedder is None else {
        k.split(":", 1)[1]: v for k, v in embedder.stats.items() if k.startswith("fallback:")}
    return fallback | ({"reused": copied} if copied else {})


def run_attrs(embedder: Engine, plan: Any) -> dict[str, Any]:
    """Root attributes of how the computed records ran."""
    return {"padding_efficiency": plan.padding_efficiency, "fallback_device": embedder.fallback_device or "none",
            **batching_attrs(embedder)}


# ------------------------------------------------------------------------------ groups of shards


def store_difference(store: Path, identity: str, input_sha256: str, ignore: Sequence[str] = ()) -> str | None:
    """None for a complete store of the same shard content and identity; else why it is not
    current, in user words (missing, unreadable, incomplete, another shard, or the identity's
    first difference: :func:`embedpipe.extraction.identity.describe_difference`, ``ignore`` left out)."""
    try:
        with h5py.File(store, "r") as f:
            if not is_complete(f):
                return "incomplete (a writer that never finished)"
            attrs = read_root_attrs(f)
    except FileNotFoundError:
        return "missing"
    except (OSError, ValueError):
        return "unreadable"
    if attrs.get("input_sha256") != input_sha256:
        return "written for other shard content (input_sha256)"
    theirs = attrs.get("embed_identity")
    if not isinstance(theirs, str):
        return "records no embed_identity (written by an older embedpipe)"
    return describe_difference(theirs, identity, ignore)


def store_is_current(store: Path, identity: str, input_sha256: str, ignore: Sequence[str] = ()) -> bool:
    """True for a complete store of the same shard content, model and options; False for a
    missing, unreadable, incomplete or different one."""
    return store_difference(store, identity, input_sha256, ignore) is None


@dataclass
class GroupSummary:
    """What one group job did: a store per shard, embedded now or kept from an earlier run."""

    out_dir: Path
    embedded: list[EmbedSummary] = field(default_factory=list)
    kept: list[Path] = field(default_factory=list)
    seconds: float = 0.0
    done: list[str] = field(default_factory=list)  # "STORE (kept)" or "(embedded)", in shard order
    under_way: int | None = None  # the index of the shard being kept or embedded now

    def finished(self, store: Path, how: str) -> None:
        self.done.append(f"{store} ({how})")
        self.under_way = None

    def progress(self, fastas: Sequence[Path], stores: Sequence[Path]) -> str:
        """How far the job got, for the line an interrupt ends it with (docs/cluster.md,
        "Time limits, preemption and requeue"): the shard under way and the shards done."""
        total, k = len(fastas), self.under_way
        if k is not None:
            where = f"during shard {k + 1} of {total} ({fastas[k]} -> {stores[k]}, not finished)"
        elif not self.done:
            where = f"before the first of {total} shard(s)"
        else:
            where = f"after {len(self.done)} of {total} shard(s), before the group's marker"
        return f"{where}; done: {', '.join(self.done) or 'none'}"

    def render(self) -> str:
        lines = [s.render() for s in self.embedded]
        lines.append(f"group of {len(self.embedded) + len(self.kept)} shard(s) -> {self.out_dir}: "
                     f"{len(self.embedded)} embedded, {len(self.kept)} kept (complete for the same shard, "
                     f"model and options) in {self.seconds:.1f}s")
        return "\n".join(lines)


def _group_outputs(fastas: Sequence[Path], out_dir: Path) -> list[Path]:
    """``out_dir/STEM.h5`` per shard: the workflow's ``stores/shard-NNNNN.h5``."""
    stores = [out_dir / f"{Path(f).stem}.h5" for f in fastas]
    if len(set(stores)) != len(stores):
        raise EmbedpipeError("two shards of the group have the same file name; each shard needs a store of its own")
    for store in stores:
        check_output_path(store)
    return stores


def embed_shards(fastas: Sequence[Path], *, model: str, out_dir: Path, options: EmbedOptions,
                 done: Path | None = None, quiet: bool = False, reuse: Sequence[Path] = (),
                 limits: FastaLimits = FASTA_LIMITS, decision: Decision | None = None) -> GroupSummary:
    """Embed each shard into ``out_dir/STEM.h5`` with one model load; keep current stores.

    Each store is locked for the whole job (a second job on the same stores is refused), a
    store is kept only when its checksums and checks pass, and ``done`` (the workflow's output
    of the job) is written last, after every store's identity is checked once more: it exists
    only once every shard of the group has its store (embedpipe.extraction.group_marker). With
    ``reuse``, the model is loaded only when a shard has a record no reuse store holds.
    """
    policy, limits = start_checks(fastas, model, options, reuse, limits)
    started = time.perf_counter()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stores = _group_outputs(fastas, out_dir)
    _check_group(fastas, done, limits)
    digests = [file_sha256(Path(f)) for f in fastas]
    summary = GroupSummary(out_dir=out_dir)
    outputs: list[Output] = [("store", s, STORE) for s in stores]
    if done is not None:
        outputs.append(("--done", Path(done), described_by("an embedpipe group marker", Path(done), "format", GROUP_FORMAT)))
    with telling_progress(lambda: summary.progress(fastas, stores)), \
            _job(fastas, model, options, policy, reuse, limits, outputs, quiet, decision) as job:
        if job.identity is None:  # not known without the model: loaded first, as without --reuse
            job.engine()  # one per group: models prepared once
        for k, (fasta, store, digest) in enumerate(zip(fastas, stores, digests)):
            summary.under_way = k
            if _keep(store, str(job.identity), digest, quiet, ignored(options)):
                summary.kept.append(store)
                summary.finished(store, "kept")
                continue
            summary.embedded.append(_embed_records(
                job, _read_records(Path(fasta), limits), Path(fasta), store, time.perf_counter(),
                {"input_sha256": digest}, quiet))
            summary.finished(store, "embedded")
        if done is not None:
            _check_still_current(stores, digests, str(job.identity), ignored(options))
            write_marker(Path(done), json.loads(str(job.identity)), fastas, stores, digests)
    summary.seconds = time.perf_counter() - started
    return summary


def _lock_path(store: Path) -> Path:
    """The lock of a shard store, the one every writer of it takes (embedpipe.core.locks)."""
    return lock_path_for(store)


def _keep(store: Path, identity: str, digest: str, quiet: bool, ignore: Sequence[str] = ()) -> bool:
    """Keep a store that is current and passes ``validate`` (checksums of every chunk included:
    a store complete but corrupt is embedded again; cost in docs/benchmarks.md); say why a
    store that is there is not kept (the identity's first difference, docs/cluster.md)."""
    why = store_difference(store, identity, digest, ignore)
    if why is not None:
        if why != "missing":
            say(f"{store}: {why}; embedding it again", quiet=quiet)
        return False
    problems = validate_store(store)
    if problems:
        say(f"{store}: complete but fails validation ({problems[0]}); embedding it again", quiet=quiet)
        return False
    say(f"{store}: complete for this shard, model and options, checksums verified; kept", quiet=quiet)
    return True


def _check_still_current(stores: Sequence[Path], digests: Sequence[str], identity: str,
                         ignore: Sequence[str] = ()) -> None:
    """Before the marker: every store still has this job's identity (another writer that
    bypassed the locks would otherwise leave a marker that lies)."""
    for store, digest in zip(stores, digests):
        if not store_is_current(store, identity, digest, ignore):
            raise EmbedpipeError(f"{store}: replaced by another writer during this job (it no longer has this "
                                 f"job's shard, model and options); no marker written, rerun the job")


def embed_command(fastas: Sequence[Path], *, model: str, out: Path | None, out_dir: Path | None,
                  done: Path | None, options: EmbedOptions, quiet: bool = False,
                  reuse: Sequence[Path] = (), limits: FastaLimits = FASTA_LIMITS,
                  decision: Path | None = None) -> EmbedSummary | GroupSummary:
    """`embedpipe embed`: ``--out`` with one FASTA, or ``--out-dir`` (and ``--done``) with any number;
    ``decision``: the run's one ``--precision auto`` decision (``--precision auto:FILE``), read first."""
    if decision is not None and options.precision != AUTO:
        raise EmbedpipeError(f"a precision decision ({decision}) is run by --precision auto:FILE only, "
                             f"not --precision {options.precision}")
    decided = read_decision(decision) if decision is not None else None
    if out_dir is None:
        if out is None or len(fastas) != 1 or done is not None:
            raise EmbedpipeError("give one FASTA with --out STORE.h5, or any number with --out-dir DIR [--done FILE]")
        return embed_fasta(fastas[0], model=model, out=out, options=options, quiet=quiet, reuse=reuse, limits=limits,
                           decision=decided)
    if out is not None:
        raise EmbedpipeError("--out and --out-dir exclude each other: --out names the store of one FASTA")
    return embed_shards(fastas, model=model, out_dir=out_dir, options=options, done=done, quiet=quiet, reuse=reuse,
                        limits=limits, decision=decided)
