"""Dedupe by sequence content, sort by length, cut into token-budget shards, write a manifest.

Two passes, so that memory holds a few fixed-width integers per record and never the
sequences or IDs (docs/benchmarks.md, "Sharding at scale"):

1. Stream every input (:func:`embedpipe.inputs.fasta.iter_fasta`), validate and normalise each
   record, hash its normalised sequence (sha256), and append each valid record to a spool
   file in a temporary directory next to ``out``, as the entry it will have in its shard.
   In memory: per record its length, spool offset, header size, status and normalisations;
   its ID, file, line and digest go to column files beside the spool.
2. Find duplicate IDs and sequences by sorting 64-bit keys, sort the unique sequences by
   length, plan shards greedily under the token budget (residues plus the model family's
   special tokens per record: 2 for ESM-2's BOS and EOS, the default), copy each entry from
   the spool into its shard file, then stream ``manifest.tsv`` (one row per input record, in
   input order) and write ``shards.json``.

Everything is written into the temporary directory and moved into ``out`` only once all of
it is complete, so a failed run leaves no manifest or shard files behind (and never a mix of
an old and a new run).

Pass 1, the per-record index and the manifest rows are :mod:`embedpipe.shard.index` (its
column files :mod:`embedpipe.shard.spill`); the spool directory and background fsync
:mod:`embedpipe.shard.output`. This module plans the shards, writes them and moves the
finished run into ``out``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from embedpipe.core.atomic import check_output_entries, fsync_dir
from embedpipe.core.errors import InputError
from embedpipe.core.options import FASTA_LIMITS, MAX_JOBS, ON_INVALID, ON_INVALID_DEFAULT, FastaLimits, check_choice
from embedpipe.core.output_guard import guard_outputs
from embedpipe.core.paths import display_path, path_text
from embedpipe.core.progress import progress_bar
from embedpipe.inputs.fasta import check_regular_file
from embedpipe.inputs.residue_rules import INVALID_REASONS, NORMALISATION_KINDS
from embedpipe.model.layout import ESM2_LAYOUT
from embedpipe.shard.index import (
    DUPLICATE,
    NORM_BIT,
    OK,
    REASON_CODE,
    SKIP_BASE,
    RecordIndex,
    Unique,
    dedupe,
    read_inputs,
    write_manifest,
)
from embedpipe.shard.manifest import MANIFEST
from embedpipe.shard.output import Syncer, spool_directory

SHARDS_JSON = "shards.json"
SHARDS_FORMAT = "embedpipe.shards"
SHARDS_VERSION = 1
TOKENS_PER_RECORD = ESM2_LAYOUT.extra_tokens  # the default: ESM-2's BOS + EOS (``--model`` picks the family's)


def shard_name(index: int) -> str:
    """File name of shard ``index``: ``shard-00000.fasta``, ..."""
    return f"shard-{index:05d}.fasta"


@dataclass
class ShardInfo:
    """One shard as listed in ``shards.json``."""

    index: int
    path: str
    records: int
    residues: int
    tokens: int
    min_length: int
    max_length: int


@dataclass
class ShardSummary:
    """What a shard run read and wrote; ``render()`` is the one-screen summary."""

    inputs: list[str]
    out: str
    tokens_per_shard: int
    on_invalid: str
    max_jobs: int = MAX_JOBS
    records: int = 0
    unique: int = 0
    duplicates: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    normalised: dict[str, int] = field(default_factory=dict)
    residues: int = 0  # residues of the unique sequences (what gets embedded)
    tokens: int = 0  # residues + tokens_per_record per unique sequence
    tokens_per_record: int = TOKENS_PER_RECORD  # the model family's special tokens per record
    input_residues: int = 0  # residues of all valid input records, duplicates included
    normalised_records: int = 0  # records changed by at least one normalisation
    min_length: int = 0
    max_length: int = 0
    input_bytes: int = 0
    elapsed_s: float = 0.0
    shards: list[ShardInfo] = field(default_factory=list)

    @property
    def n_shards(self) -> int:
        return len(self.shards)

    @property
    def n_skipped(self) -> int:
        return sum(self.skipped.values())

    def counts(self) -> dict[str, object]:
        return {
            "records": self.records,
            "unique": self.unique,
            "duplicates": self.duplicates,
            "skipped": self.n_skipped,
            "skipped_by_reason": dict(self.skipped),
            "normalised": self.normalised_records,
            "normalised_by_kind": dict(self.normalised),
            "shards": self.n_shards,
            "residues": self.residues,
            "tokens": self.tokens,
            "input_residues": self.input_residues,
            "min_length": self.min_length,
            "max_length": self.max_length,
        }

    def render(self) -> str:
        def n(value: int) -> str:
            return f"{value:,}"

        # every count ends in the same column, whatever the longest label (invalid-character)
        width = 4 + max(len(x) for x in ("unique sequences", *INVALID_REASONS, *NORMALISATION_KINDS)) + 2

        def row(label: str, value: int, note: str = "", indent: int = 2) -> str:
            return f"{' ' * indent}{label:<{width - indent}}{n(value):>14}" + (f"  {note}" if note else "")

        files = "1 file" if len(self.inputs) == 1 else f"{len(self.inputs)} files"
        lines = [
            f"embedpipe shard: {n(self.records)} records read from {files} "
            f"({self.input_bytes / 1e6:,.1f} MB) in {self.elapsed_s:.1f} s",
            row("unique sequences", self.unique),
            row("duplicates", self.duplicates, "(same sequence as an earlier record)"),
            row("skipped", self.n_skipped, "" if self.n_skipped else f"(--on-invalid {self.on_invalid})"),
        ]
        lines += [row(reason, count, indent=4) for reason, count in sorted(self.skipped.items())]
        lines.append(row("normalised", self.normalised_records, "(records; by kind:)"))
        lines += [row(kind, self.normalised.get(kind, 0), indent=4) for kind in NORMALISATION_KINDS]
        lines.append(row("shards", self.n_shards, f"(<= {n(self.tokens_per_shard)} tokens each) in {display_path(self.out)}"))
        lines.append(row("embed jobs", min(self.n_shards, self.max_jobs),
                         f"(groups of shards, --max-jobs {n(self.max_jobs)})"))
        lines.append(row("residues", self.residues, f"({n(self.tokens)} tokens)"))
        if self.unique:
            lines.append(row("lengths", self.min_length, f".. {n(self.max_length)}"))
        return "\n".join(lines)


@dataclass
class _Plan:
    """Unique sequences sorted by length (stable: ties in input order) and cut into shards:
    shard k holds ``sorted_rec[bounds[k]:bounds[k+1]]``."""

    sorted_rec: np.ndarray
    sorted_len: np.ndarray
    bounds: list[int]


def plan_shards(lengths: Sequence[int] | np.ndarray, tokens_per_shard: int,
                tokens_per_record: int = TOKENS_PER_RECORD) -> list[int]:
    """Boundaries of greedy shards over lengths already sorted ascending.

    Returns ``bounds`` with ``bounds[0] == 0`` and ``bounds[-1] == len(lengths)``; shard k is
    ``lengths[bounds[k]:bounds[k+1]]``. A shard holds at most ``tokens_per_shard`` tokens
    (residues + ``tokens_per_record`` per record: the family's special tokens), except that
    a record longer than the budget gets a shard of its own. One search over the running
    token total per shard, not a loop per record.
    """
    total = np.cumsum(np.asarray(lengths, dtype=np.int64) + tokens_per_record)
    bounds = [0]
    while bounds[-1] < len(total):
        start = bounds[-1]
        used = int(total[start - 1]) if start else 0
        bounds.append(max(start + 1, int(np.searchsorted(total, used + tokens_per_shard, side="right"))))
    return bounds


def plan_groups(n_shards: int, max_jobs: int) -> list[list[int]]:
    """Shard indices cut into at most ``max_jobs`` runs of consecutive shards, one embed job each.

    Consecutive shards have similar lengths (shards are length-sorted) and nearly equal tokens,
    so groups of equal shard counts (differing by at most one) take about equally long. Every
    shard is in exactly one group, in order. A constant number of jobs keeps Snakemake's
    scheduling, which grows faster than linearly in the number of jobs, bounded
    (docs/benchmarks.md, "Workflow overhead").
    """
    if not isinstance(max_jobs, int) or max_jobs < 1:
        raise InputError(f"--max-jobs must be a positive integer, not {max_jobs!r}")
    n_groups = min(n_shards, max_jobs)
    cuts = [k * n_shards // n_groups for k in range(n_groups + 1)] if n_groups else [0]
    return [list(range(lo, hi)) for lo, hi in zip(cuts, cuts[1:])]


def _check_arguments(inputs: Sequence[Path], out: Path, tokens_per_shard: int, on_invalid: str) -> list[Path]:
    check_choice("--on-invalid", on_invalid, ON_INVALID, InputError)
    if not isinstance(tokens_per_shard, int) or tokens_per_shard < 1:
        raise InputError(f"--tokens-per-shard must be a positive integer, not {tokens_per_shard!r}")
    paths = [Path(p) for p in inputs]
    if not paths:
        raise InputError("no input FASTA files given")
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {display_path(out)}: exists and is not a directory")
    seen: dict[Path, Path] = {}
    for path in paths:
        check_regular_file(path, "shard", "it measures its inputs and may read them twice")
        real = path.resolve()
        if real in seen:
            same = "" if seen[real] == path else f" (as {display_path(seen[real])} and {display_path(path)})"
            raise InputError(f"{display_path(path)}: was given twice{same}; give each input file once")
        seen[real] = path
    replaced = [MANIFEST, SHARDS_JSON, *sorted(p.name for p in out.glob("shard-*.fasta"))]
    guard_outputs("shard", [("--out", out / name) for name in replaced], paths, directories=[("--out", out)])
    return paths


def shard_fasta(
    inputs: Sequence[Path],
    *,
    out: Path,
    tokens_per_shard: int,
    on_invalid: str = ON_INVALID_DEFAULT,
    max_jobs: int = MAX_JOBS,
    quiet: bool = False,
    tokens_per_record: int = TOKENS_PER_RECORD,
    limits: FastaLimits = FASTA_LIMITS,
) -> ShardSummary:
    """Validate, normalise and deduplicate FASTA ``inputs`` and write length-sorted shards to ``out``.

    Writes ``out/shard-00000.fasta`` ..., ``out/manifest.tsv`` and ``out/shards.json``
    (docs/store-format.md, "Shard manifest"); ``shards.json`` also lists the shards' groups
    (:func:`plan_groups`, at most ``max_jobs``). ``on_invalid="error"`` stops at the first invalid record with an
    :class:`InputError`; ``"skip"`` records it in the manifest as ``skipped:<reason>``.
    ``tokens_per_record``: the model family's special tokens per record (its token layout's
    ``extra_tokens``; ESM-2's 2 by default), counted in every shard's token budget.
    ``limits``: the most one record may hold (``--max-record-length``, ``--max-id-length``),
    checked while each input streams (docs/store-format.md, "Input limits").
    """
    started = time.perf_counter()
    out = Path(out)
    paths = _check_arguments(inputs, out, tokens_per_shard, on_invalid)
    limits.check(InputError)
    plan_groups(0, max_jobs)  # refuse a bad --max-jobs before any work
    check_output_entries(out, [MANIFEST, SHARDS_JSON, *sorted(p.name for p in out.glob("shard-*.fasta"))])
    summary = ShardSummary(
        inputs=[path_text(p) for p in paths], out=path_text(out), tokens_per_shard=tokens_per_shard,
        on_invalid=on_invalid, max_jobs=max_jobs, tokens_per_record=tokens_per_record,
    )
    with spool_directory(out) as tmp:
        _run(paths, tmp, summary, tokens_per_shard, on_invalid, quiet, limits)
        _install(tmp, out, [shard_name(s.index) for s in summary.shards])
    summary.elapsed_s = time.perf_counter() - started
    return summary


def _run(paths: list[Path], tmp: Path, summary: ShardSummary, budget: int, on_invalid: str, quiet: bool,
         limits: FastaLimits) -> None:
    """Both passes into ``tmp``: read and index, dedupe, count, plan, write shards, manifest, shards.json.

    The spool and column files live in ``tmp/.work``, removed before ``tmp`` is installed.
    """
    summary.input_bytes = sum(p.stat().st_size for p in paths)
    work = tmp / ".work"
    work.mkdir()
    with Syncer() as syncer:
        index = read_inputs(paths, work, summary.input_bytes, on_invalid == "skip", quiet, limits)
        if not index.n:
            raise InputError(f"no FASTA records found in {', '.join(summary.inputs)}")
        unique = dedupe(index)
        _count(summary, index, unique)
        plan = _plan(summary, index, unique, budget)
        _write_shards(tmp, syncer, summary, index, plan, quiet)
        write_manifest(tmp / MANIFEST, syncer, [path_text(p) for p in paths], index, unique,
                       _shard_of_record(index, unique, plan))
        _write_shards_json(tmp / SHARDS_JSON, syncer, summary, budget, on_invalid)
    shutil.rmtree(work)


def _count(summary: ShardSummary, index: RecordIndex, unique: Unique) -> None:
    """The summary's record counts: unique, duplicates, skipped and normalised by kind."""
    code_counts = np.bincount(unique.status, minlength=SKIP_BASE + len(REASON_CODE))
    norm_counts = np.bincount(index.norm, minlength=1 << len(NORM_BIT))
    summary.records = index.n
    summary.unique = int(code_counts[OK])
    summary.duplicates = int(code_counts[DUPLICATE])
    summary.skipped = {reason: int(code_counts[code]) for reason, code in REASON_CODE.items() if code_counts[code]}
    flags = np.arange(len(norm_counts))
    summary.normalised = {kind: int(norm_counts[(flags & bit) != 0].sum()) for kind, bit in NORM_BIT.items()}
    summary.normalised_records = int(norm_counts[1:].sum())
    summary.input_residues = int(index.residues.sum(where=unique.status < SKIP_BASE, dtype=np.int64))


def _plan(summary: ShardSummary, index: RecordIndex, unique: Unique, budget: int) -> _Plan:
    """Sort the unique sequences by length (stable: ties in input order) and cut by budget."""
    order = np.argsort(index.residues[unique.unique_rec], kind="stable")
    sorted_rec = unique.unique_rec[order]
    del order
    sorted_len = index.residues[sorted_rec]
    bounds = plan_shards(sorted_len, budget, summary.tokens_per_record)
    summary.residues = int(sorted_len.sum(dtype=np.int64))
    summary.tokens = summary.residues + summary.tokens_per_record * len(sorted_rec)
    if len(sorted_rec):
        summary.min_length = int(sorted_len[0])
        summary.max_length = int(sorted_len[-1])
    return _Plan(sorted_rec=sorted_rec, sorted_len=sorted_len, bounds=bounds)


def _shard_of_record(index: RecordIndex, unique: Unique, plan: _Plan) -> np.ndarray:
    """Per input record its shard (that of the record it repeats for a duplicate; -1 when invalid)."""
    shard = np.full(index.n, -1, dtype=np.int32)
    sizes = np.diff(plan.bounds)
    shard[plan.sorted_rec] = np.repeat(np.arange(len(sizes), dtype=np.int32), sizes)
    shard[unique.dup_rec] = shard[unique.dup_first]
    return shard


def _write_shards(tmp: Path, syncer: Syncer, summary: ShardSummary, index: RecordIndex, plan: _Plan,
                  quiet: bool) -> None:
    """Pass 2: write the shards, reading each record's entry back from the spool."""
    sorted_len, bounds = plan.sorted_len, plan.bounds
    # pread, not mmap: faulting in random spool pages maps whole 64 KiB neighbourhoods and
    # would make the page cache look like this process's memory.
    with open(index.spool, "rb") as fh, progress_bar(
        quiet=quiet, total=len(plan.sorted_rec), unit="seq", unit_scale=True, desc="writing shards"
    ) as bar:
        fd = fh.fileno()
        pread = os.pread
        for k in range(len(bounds) - 1):
            lo, hi = bounds[k], bounds[k + 1]
            rows = plan.sorted_rec[lo:hi]
            parts = [pread(fd, size, at) for size, at in zip(index.entry_sizes(rows).tolist(),
                                                             index.offset[rows].tolist())]
            name = shard_name(k)
            syncer.write(tmp / name, b"".join(parts))
            del parts
            residues = int(sorted_len[lo:hi].sum(dtype=np.int64))
            summary.shards.append(
                ShardInfo(index=k, path=name, records=hi - lo, residues=residues,
                          tokens=residues + summary.tokens_per_record * (hi - lo),
                          min_length=int(sorted_len[lo]), max_length=int(sorted_len[hi - 1]))
            )
            bar.update(hi - lo)


def _write_shards_json(path: Path, syncer: Syncer, summary: ShardSummary, budget: int, on_invalid: str) -> None:
    meta = {
        "format": SHARDS_FORMAT,
        "version": SHARDS_VERSION,
        "tokens_per_shard": budget,
        "tokens_per_record": summary.tokens_per_record,
        "inputs": summary.inputs,
        "on_invalid": on_invalid,
        "manifest": MANIFEST,
        "shards": [asdict(s) for s in summary.shards],
        "max_jobs": summary.max_jobs,
        "groups": plan_groups(summary.n_shards, summary.max_jobs),
        "counts": summary.counts(),
    }
    syncer.write(path, (json.dumps(meta, indent=1) + "\n").encode("utf-8"))


def _install(tmp: Path, out: Path, shard_files: list[str]) -> None:
    """Move the finished run from ``tmp`` into ``out``.

    A fresh ``out`` is one directory rename. Over an existing directory, the old
    ``shards.json`` and manifest go first (so a half-replaced directory never looks complete),
    then the shard files, stale shards of the old run are removed, and ``shards.json`` comes
    last. Other files in ``out`` are left alone.
    """
    if not out.exists():
        try:
            os.rename(tmp, out)
        except OSError:
            pass  # appeared meanwhile: fall through to the per-file path
        else:
            fsync_dir(out.parent)
            return
    out.mkdir(parents=True, exist_ok=True)
    for name in (SHARDS_JSON, MANIFEST):
        with contextlib.suppress(FileNotFoundError):
            (out / name).unlink()
    fsync_dir(out)
    keep = set(shard_files)
    for name in shard_files:
        os.replace(tmp / name, out / name)
    for stale in out.glob("shard-*.fasta"):
        if stale.name not in keep:
            stale.unlink()
    os.replace(tmp / MANIFEST, out / MANIFEST)
    fsync_dir(out)
    os.replace(tmp / SHARDS_JSON, out / SHARDS_JSON)
    fsync_dir(out)


__all__ = [
    "ShardInfo",
    "ShardSummary",
    "shard_fasta",
    "plan_groups",
    "plan_shards",
    "shard_name",
    "SHARDS_JSON",
    "TOKENS_PER_RECORD",
]
