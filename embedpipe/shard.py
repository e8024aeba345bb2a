"""Dedupe by sequence content, sort by length, cut into token-budget shards, write a manifest.

Two passes, so that memory holds a compact index per record and never the sequences:

1. Stream every input (:func:`embedpipe.fasta.iter_fasta`), validate and normalise each
   record, hash its normalised sequence (sha256), and append each *new* sequence to a spool
   file in a temporary directory next to ``out``. In memory: per record its ID, file, line,
   length, status and digest; per unique sequence its spool offset and length.
2. Sort the unique sequences by length, plan shards greedily under the token budget
   (residues + 2 per record: BOS and EOS), read each sequence back from the spool and write
   the shard files, then ``manifest.tsv`` (one row per input record, in input order) and
   ``shards.json``.

Everything is written into the temporary directory and moved into ``out`` only once all of
it is complete, so a failed run leaves no manifest or shard files behind (and never a mix of
an old and a new run).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import stat
import threading
import time
from array import array
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from embedpipe.atomic import check_output_entries, fsync_dir
from embedpipe.errors import EmbedpipeError, InputError
from embedpipe.fasta import INVALID_REASONS, NORMALISATION_KINDS, display_path, iter_fasta, path_text
from embedpipe.manifest import MANIFEST, MANIFEST_COLUMNS, ManifestWriter, quote, quote_all
from embedpipe.progress import progress_bar

ON_INVALID = ("error", "skip")
SHARDS_JSON = "shards.json"
SHARDS_FORMAT = "embedpipe.shards"
SHARDS_VERSION = 1
TOKENS_PER_RECORD = 2  # BOS + EOS

# Per-record status codes (a bytearray in memory): OK, DUPLICATE, then one per invalid reason.
_OK = 0
_DUPLICATE = 1
_SKIP_BASE = 2
_REASON_CODE = {reason: _SKIP_BASE + k for k, reason in enumerate(INVALID_REASONS)}
_NORM_BIT = {kind: 1 << k for k, kind in enumerate(NORMALISATION_KINDS)}


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
    records: int = 0
    unique: int = 0
    duplicates: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    normalised: dict[str, int] = field(default_factory=dict)
    residues: int = 0  # residues of the unique sequences (what gets embedded)
    tokens: int = 0  # residues + 2 per unique sequence
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

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    def render(self) -> str:
        def n(value: int) -> str:
            return f"{value:,}"

        files = "1 file" if len(self.inputs) == 1 else f"{len(self.inputs)} files"
        lines = [
            f"embedpipe shard: {n(self.records)} records read from {files} "
            f"({self.input_bytes / 1e6:,.1f} MB) in {self.elapsed_s:.1f} s",
            f"  unique sequences  {n(self.unique):>14}",
            f"  duplicates        {n(self.duplicates):>14}  (same sequence as an earlier record)",
            f"  skipped           {n(self.n_skipped):>14}"
            + ("" if self.n_skipped else f"  (--on-invalid {self.on_invalid})"),
        ]
        for reason, count in sorted(self.skipped.items()):
            lines.append(f"    {reason:<16}{n(count):>14}")
        lines.append(f"  normalised        {n(self.normalised_records):>14}  (records; by kind:)")
        for kind in NORMALISATION_KINDS:
            lines.append(f"    {kind:<16}{n(self.normalised.get(kind, 0)):>14}")
        lines.append(
            f"  shards            {n(self.n_shards):>14}  (<= {n(self.tokens_per_shard)} tokens each) in {display_path(self.out)}"
        )
        lines.append(f"  residues          {n(self.residues):>14}  ({n(self.tokens)} tokens)")
        if self.unique:
            lines.append(f"  lengths           {n(self.min_length):>14} .. {n(self.max_length)}")
        return "\n".join(lines)


# --------------------------------------------------------------------------------------------


def plan_shards(lengths: Sequence[int], tokens_per_shard: int) -> list[int]:
    """Boundaries of greedy shards over lengths already sorted ascending.

    Returns ``bounds`` with ``bounds[0] == 0`` and ``bounds[-1] == len(lengths)``; shard k is
    ``lengths[bounds[k]:bounds[k+1]]``. A shard holds at most ``tokens_per_shard`` tokens
    (residues + 2 per record), except that a record longer than the budget gets a shard of
    its own.
    """
    bounds = [0]
    used = 0
    for k, length in enumerate(lengths):
        tokens = length + TOKENS_PER_RECORD
        if used and used + tokens > tokens_per_shard:
            bounds.append(k)
            used = 0
        used += tokens
    if len(lengths):
        bounds.append(len(lengths))
    return bounds


def _check_arguments(inputs: Sequence[Path], out: Path, tokens_per_shard: int, on_invalid: str) -> list[Path]:
    if on_invalid not in ON_INVALID:
        raise InputError(f"--on-invalid must be one of {', '.join(ON_INVALID)}, not {on_invalid!r}")
    if not isinstance(tokens_per_shard, int) or tokens_per_shard < 1:
        raise InputError(f"--tokens-per-shard must be a positive integer, not {tokens_per_shard!r}")
    paths = [Path(p) for p in inputs]
    if not paths:
        raise InputError("no input FASTA files given")
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {display_path(out)}: exists and is not a directory")
    out_real = out.resolve()
    seen: dict[Path, Path] = {}
    for path in paths:
        _check_input(path)
        real = path.resolve()
        if real in seen:
            same = "" if seen[real] == path else f" (as {display_path(seen[real])} and {display_path(path)})"
            raise InputError(f"{display_path(path)}: was given twice{same}; give each input file once")
        seen[real] = path
        if real.is_relative_to(out_real):
            raise InputError(
                f"{display_path(path)}: lies inside --out {display_path(out)}, which shard replaces; "
                f"move the input elsewhere or choose another --out"
            )
    return paths


def _check_input(path: Path) -> None:
    """A regular file: shard measures every input first and re-reads it to locate a duplicate ID."""
    shown = display_path(path)
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise InputError(f"{shown}: no such file") from None
    except OSError as exc:
        raise InputError(f"{shown}: cannot open: {exc.strerror or exc}") from None
    if stat.S_ISDIR(mode):
        raise InputError(f"{shown}: is a directory, not a FASTA file")
    if not stat.S_ISREG(mode):
        kind = "a pipe (FIFO)" if stat.S_ISFIFO(mode) else "not a regular file"
        raise InputError(
            f"{shown}: is {kind}; shard needs a regular file (it measures its inputs and may read "
            f"them twice), so write the stream to a file first"
        )


def shard_fasta(
    inputs: Sequence[Path],
    *,
    out: Path,
    tokens_per_shard: int,
    on_invalid: str = "error",
    quiet: bool = False,
) -> ShardSummary:
    """Validate, normalise and deduplicate FASTA ``inputs`` and write length-sorted shards to ``out``.

    Writes ``out/shard-00000.fasta`` ..., ``out/manifest.tsv`` and ``out/shards.json``
    (docs/store-format.md, "Shard manifest"). ``on_invalid="error"`` stops at the first invalid record with an
    :class:`InputError`; ``"skip"`` records it in the manifest as ``skipped:<reason>``.
    """
    started = time.perf_counter()
    out = Path(out)
    paths = _check_arguments(inputs, out, tokens_per_shard, on_invalid)
    check_output_entries(out, [MANIFEST, SHARDS_JSON, *sorted(p.name for p in out.glob("shard-*.fasta"))])
    summary = ShardSummary(
        inputs=[path_text(p) for p in paths], out=path_text(out), tokens_per_shard=tokens_per_shard,
        on_invalid=on_invalid,
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_spools(out)
    with _sigterm_exits():
        # Not mkdtemp: its 0700 mode would stick to ``out`` after the rename; mkdir honours umask.
        tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{_host_tag()}-{secrets.token_hex(4)}"
        tmp.mkdir()
        try:
            _run(paths, tmp, summary, tokens_per_shard, on_invalid, quiet)
            _install(tmp, out, [shard_name(s.index) for s in summary.shards])
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    summary.elapsed_s = time.perf_counter() - started
    return summary


# --------------------------------------------------------------------------------------------
# The spool directory: removed on error, on SIGTERM, and (next run) after SIGKILL


def _host_tag() -> str:
    """8 hex digits naming this host, so a run never judges another host's PIDs."""
    return hashlib.sha256(socket.gethostname().encode("utf-8", "surrogateescape")).hexdigest()[:8]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    return True


def _remove_stale_spools(out: Path) -> None:
    """Remove ``.NAME.tmp-PID-*`` spool directories left by killed runs (SIGKILL, power loss).

    Only those of this host (or of older versions, which did not name the host) whose
    process no longer exists; a live run's spool is left alone.
    """
    pattern = re.compile(rf"\.{re.escape(out.name)}\.tmp-(\d+)-(?:([0-9a-f]{{8}})-)?[0-9a-f]+")
    host = _host_tag()
    try:
        entries = list(os.scandir(out.parent))
    except OSError:
        return
    for entry in entries:
        match = pattern.fullmatch(entry.name)
        if match is None or not entry.is_dir(follow_symlinks=False):
            continue
        pid = int(match[1])
        if match[2] not in (None, host) or pid == os.getpid() or _pid_alive(pid):
            continue
        shutil.rmtree(entry.path, ignore_errors=True)


@contextlib.contextmanager
def _sigterm_exits() -> Iterator[None]:
    """While shard runs, SIGTERM raises ``SystemExit(143)`` so ``finally`` blocks clean up.

    The previous handler comes back afterwards. Signal handlers belong to the main thread;
    elsewhere this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


_WORK_DIR = re.compile(r"^\.(?P<out>.+)\.tmp-\d+-")


def _write_error(path: Path, exc: OSError) -> EmbedpipeError:
    """One line naming the output being written (a full disk says only ``No space left on
    device``): files in the hidden work directory are named by the ``--out`` they become."""
    reason = exc.strerror or exc
    work = _WORK_DIR.match(path.parent.name)
    if work is None:
        return EmbedpipeError(f"{display_path(path)}: cannot write: {reason}")
    out = path.parent.parent / work["out"]
    return EmbedpipeError(
        f"{display_path(out)}: cannot write {path.name} (in the work directory {display_path(path.parent)}): {reason}"
    )


@contextlib.contextmanager
def _spool_errors(spool: IO[bytes], path: Path) -> Iterator[IO[bytes]]:
    """Close the spool; a write failure (full disk) becomes one line naming it."""
    try:
        with spool:
            yield spool
    except OSError as exc:
        raise _write_error(path, exc) from None


def _run(paths: list[Path], tmp: Path, summary: ShardSummary, budget: int, on_invalid: str, quiet: bool) -> None:
    with _Syncer() as syncer:
        _run_passes(paths, tmp, summary, budget, on_invalid, quiet, syncer)


def _run_passes(
    paths: list[Path], tmp: Path, summary: ShardSummary, budget: int, on_invalid: str, quiet: bool, syncer: _Syncer
) -> None:
    import numpy as np

    # ---- pass 1: read, validate, normalise, hash; spool every valid sequence ----------------
    ids: list[str] = []
    file_index = array("I")
    line = array("q")
    length = array("q")
    offset = array("q")  # per record: where its normalised sequence starts in the spool
    status = bytearray()
    norm = bytearray()
    digests = bytearray()
    zero_digest = bytes(32)
    sha256 = hashlib.sha256
    norm_bit = _NORM_BIT
    reason_code = _REASON_CODE
    skipping = on_invalid == "skip"

    summary.input_bytes = total_bytes = sum(p.stat().st_size for p in paths)
    spool_path = tmp / ".spool"
    spool_pos = 0
    try:
        spool = open(spool_path, "wb", buffering=8 << 20)  # noqa: SIM115 - closed below
    except OSError as exc:
        raise _write_error(spool_path, exc) from None
    with _spool_errors(spool, spool_path), progress_bar(
        quiet=quiet, total=total_bytes, unit="B", unit_scale=True, desc="reading"
    ) as bar:
        for rec in iter_fasta(paths, on_bytes=bar.update):
            ids.append(rec.id)
            file_index.append(rec.file_index)
            line.append(rec.line)
            data = rec.data
            size = len(data)
            length.append(size)
            flags = 0
            for kind in rec.normalised:
                flags |= norm_bit[kind]
            norm.append(flags)
            if rec.invalid is not None:
                if not skipping:
                    raise InputError(rec.error or f"{rec.source}: record '{rec.id}': {rec.invalid}")
                status.append(reason_code[rec.invalid])
                digests += zero_digest
                offset.append(-1)
                continue
            digests += sha256(data).digest()
            status.append(_OK)
            offset.append(spool_pos)
            spool.write(data)
            spool_pos += size

    n_records = len(ids)
    if n_records == 0:
        raise InputError(f"no FASTA records found in {', '.join(summary.inputs)}")

    # ---- dedupe by sha256 of the normalised sequence --------------------------------------
    status_np = np.frombuffer(status, dtype=np.uint8)
    length_np = np.frombuffer(length, dtype=np.int64)
    kept = _first_copies(np.frombuffer(digests, dtype=np.uint64).reshape(-1, 4), status_np < _SKIP_BASE)
    is_dup = kept >= 0
    is_dup[is_dup] = kept[is_dup] != np.flatnonzero(is_dup)
    status_np = status_np.copy()
    status_np[is_dup] = _DUPLICATE
    unique_rec = np.flatnonzero(status_np == _OK)  # kept copies, in input order
    unique_of = np.full(n_records, -1, dtype=np.int64)  # per record: its unique sequence
    unique_of[unique_rec] = np.arange(len(unique_rec))
    unique_of[is_dup] = unique_of[kept[is_dup]]
    del kept, is_dup

    # ---- counts --------------------------------------------------------------------------
    code_counts = np.bincount(status_np, minlength=_SKIP_BASE + len(INVALID_REASONS))
    norm_np = np.frombuffer(norm, dtype=np.uint8)
    summary.records = n_records
    summary.unique = int(code_counts[_OK])
    summary.duplicates = int(code_counts[_DUPLICATE])
    summary.skipped = {
        reason: int(code_counts[code]) for reason, code in reason_code.items() if code_counts[code]
    }
    summary.normalised = {kind: int(np.count_nonzero(norm_np & bit)) for kind, bit in norm_bit.items()}
    summary.normalised_records = int(np.count_nonzero(norm_np))
    summary.input_residues = int(length_np[status_np < _SKIP_BASE].sum())

    # ---- plan: sort unique sequences by length (stable: ties in input order), cut by budget --
    u_len = length_np[unique_rec]
    order = np.argsort(u_len, kind="stable")
    sorted_len = u_len[order]
    bounds = plan_shards(sorted_len.tolist(), budget)
    shard_of_unique = np.empty(len(unique_rec), dtype=np.int64)
    for k in range(len(bounds) - 1):
        shard_of_unique[order[bounds[k] : bounds[k + 1]]] = k
    summary.residues = int(sorted_len.sum())
    summary.tokens = summary.residues + TOKENS_PER_RECORD * len(unique_rec)
    if len(unique_rec):
        summary.min_length = int(sorted_len[0])
        summary.max_length = int(sorted_len[-1])

    # ---- pass 2: write the shards from the spool -----------------------------------------
    sorted_rec = unique_rec[order].tolist()
    del order
    # pread, not mmap: faulting in random spool pages maps whole 64 KiB neighbourhoods and
    # would make the page cache look like this process's memory.
    with open(spool_path, "rb") as fh, progress_bar(
        quiet=quiet, total=len(sorted_rec), unit="seq", unit_scale=True, desc="writing shards"
    ) as bar:
        fd = fh.fileno()
        pread = os.pread
        for k in range(len(bounds) - 1):
            lo, hi = bounds[k], bounds[k + 1]
            parts: list[bytes] = []
            for i in sorted_rec[lo:hi]:
                parts.append(b">%s\n%s\n" % (ids[i].encode(), pread(fd, length[i], offset[i])))
            name = shard_name(k)
            syncer.write(tmp / name, b"".join(parts))
            del parts
            residues = int(sorted_len[lo:hi].sum())
            summary.shards.append(
                ShardInfo(
                    index=k,
                    path=name,
                    records=hi - lo,
                    residues=residues,
                    tokens=residues + TOKENS_PER_RECORD * (hi - lo),
                    min_length=int(sorted_len[lo]),
                    max_length=int(sorted_len[hi - 1]),
                )
            )
            bar.update(hi - lo)
    del sorted_rec
    spool_path.unlink()

    # ---- manifest (input order) and shards.json --------------------------------------------
    _write_manifest(
        tmp / MANIFEST, syncer, [path_text(p) for p in paths], ids, file_index, line, length, norm, digests,
        status_np.tolist(), unique_of.tolist(), shard_of_unique.tolist(), unique_rec.tolist(),
    )

    meta = {
        "format": SHARDS_FORMAT,
        "version": SHARDS_VERSION,
        "tokens_per_shard": budget,
        "tokens_per_record": TOKENS_PER_RECORD,
        "inputs": summary.inputs,
        "on_invalid": on_invalid,
        "manifest": MANIFEST,
        "shards": [asdict(s) for s in summary.shards],
        "counts": summary.counts(),
    }
    syncer.write(tmp / SHARDS_JSON, (json.dumps(meta, indent=1) + "\n").encode("utf-8"))


def _write_manifest(
    path: Path, syncer: _Syncer, sources: list[str], ids: list[str], file_index: array, line: array,
    length: array, norm: bytearray, digests: bytearray, status: list[int], unique_of: list[int],
    shard_of: list[int], first_of: list[int],
) -> None:
    """One row per input record, in input order, through :class:`ManifestWriter`.

    Rows are formatted here and written 65536 at a time (millions of rows); only the free-text
    cells (IDs, source paths) can need quoting, so they are quoted once up front.
    """
    # the source cell is "path:line": quoted as a whole when the path needs it
    quoted = [quote(src) for src in sources]
    src_open = [q[:-1] if q != src else src for q, src in zip(quoted, sources)]
    src_close = ['"' if q != src else "" for q, src in zip(quoted, sources)]
    ids = quote_all(ids)
    status_text = ["ok", "duplicate"] + [f"skipped:{reason}" for reason in INVALID_REASONS]
    norm_text = [
        ",".join(kind for kind, bit in _NORM_BIT.items() if flags & bit) for flags in range(1 << len(_NORM_BIT))
    ]
    digest_view = memoryview(digests)
    try:
        fh = open(path, "w", encoding="utf-8", newline="", buffering=8 << 20)  # noqa: SIM115
    except OSError as exc:
        raise _write_error(path, exc) from None
    with syncer.syncing(fh, path):
        writer = ManifestWriter(fh, MANIFEST_COLUMNS)
        rows: list[str] = []
        for i, code, u in zip(range(len(status)), status, unique_of):
            if code >= _SKIP_BASE:
                rows.append(
                    f"{ids[i]}\t{src_open[file_index[i]]}:{line[i]}{src_close[file_index[i]]}\t{length[i]}\t\t\t{status_text[code]}\t\t{norm_text[norm[i]]}\n"
                )
            else:
                rows.append(
                    f"{ids[i]}\t{src_open[file_index[i]]}:{line[i]}{src_close[file_index[i]]}\t{length[i]}\t"
                    f"{digest_view[32 * i : 32 * i + 32].hex()}\t{shard_of[u]}\t{status_text[code]}\t"
                    f"{ids[first_of[u]] if code == _DUPLICATE else ''}\t{norm_text[norm[i]]}\n"
                )
            if len(rows) >= 65536:
                writer.write_lines("".join(rows))
                rows.clear()
        writer.write_lines("".join(rows))
    digest_view.release()


def _first_copies(digests: "np.ndarray", valid: "np.ndarray") -> "np.ndarray":
    """Per record, the index of the first record with the same digest (-1 where not ``valid``).

    ``digests`` is (N, 4) uint64 (a view of the 32-byte sha256 digests). Sorting on the first
    word alone is exact unless two *different* digests share it (odds ~N^2/2^65); then all four
    words are sorted on. Stable sorts keep equal digests in input order, so the first of each
    run is the earliest record.
    """
    import numpy as np

    kept = np.full(len(digests), -1, dtype=np.int64)
    rec = np.flatnonzero(valid)
    if not len(rec):
        return kept
    d = digests[rec]
    order = np.argsort(d[:, 0], kind="stable")
    d = d[order]
    same_word = d[1:, 0] == d[:-1, 0]
    same = same_word & (d[1:] == d[:-1]).all(axis=1)
    if not np.array_equal(same, same_word):  # a first-word collision: sort on all four words
        d = digests[rec]
        order = np.lexsort((np.arange(len(rec)), d[:, 3], d[:, 2], d[:, 1], d[:, 0]))
        d = d[order]
        same = (d[1:] == d[:-1]).all(axis=1)
    starts = np.concatenate(([True], ~same))
    group = np.cumsum(starts) - 1
    first = rec[order][starts]
    kept[rec[order]] = first[group]
    return kept


class _Syncer:
    """Write files and fsync them on a background thread.

    ``fsync`` releases the GIL, so the disk writeback of one shard overlaps the CPU work of the
    next. Leaving the ``with`` block waits for every fsync (and re-raises its error); only then
    are the files moved into place.
    """

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="embedpipe-fsync")
        self._pending: list[Future[None]] = []

    def __enter__(self) -> _Syncer:
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        try:
            for future in self._pending:
                if exc_type is None:
                    future.result()
                else:
                    future.exception()  # wait, but let the first error propagate
        finally:
            self._pool.shutdown(wait=True)

    @staticmethod
    def _finish(fh: IO[Any], path: Path) -> None:
        try:
            fh.flush()
            os.fsync(fh.fileno())
        except OSError as exc:
            raise _write_error(path, exc) from None
        finally:
            with contextlib.suppress(OSError):
                fh.close()

    @contextlib.contextmanager
    def syncing(self, fh: IO[Any], path: Path) -> Iterator[IO[Any]]:
        """Use an open file; on success it is flushed, fsynced and closed in the background.

        A write error (a full disk) becomes one line naming ``path``.
        """
        try:
            yield fh
        except OSError as exc:
            with contextlib.suppress(OSError):
                fh.close()
            raise _write_error(path, exc) from None
        except BaseException:
            with contextlib.suppress(OSError):
                fh.close()
            raise
        self._pending.append(self._pool.submit(self._finish, fh, path))

    def write(self, path: Path, data: bytes) -> None:
        try:
            fh = open(path, "wb")  # noqa: SIM115 - closed by _finish
        except OSError as exc:
            raise _write_error(path, exc) from None
        with self.syncing(fh, path):
            fh.write(data)


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
    "plan_shards",
    "shard_name",
    "MANIFEST",
    "MANIFEST_COLUMNS",
    "SHARDS_JSON",
    "TOKENS_PER_RECORD",
]
