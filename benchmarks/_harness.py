"""The one harness every benchmark script shares: clocks, random records, cosine, tables, the machine.

A module, not a script (tests/benchmarks/ runs only the scripts, no leading _). Why one place:
every table in docs/benchmarks.md must mean the same thing by "seconds" (a whole process's
wall time, or one in-process call's), by "x baseline" and by "this machine", and the records a
benchmark embeds must be reproducible from a seed whichever script made them.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

AMINO = np.array(list("ACDEFGHIKLMNPQRSTVWY"))
#: the /proc/cpuinfo flags that decide the precision policies (printed in the machine header)
DECIDING_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "avx512_fp16", "avx512_vnni", "avx_vnni",
                  "amx_bf16", "amx_int8", "amx_fp16")


# -- records ------------------------------------------------------------------------------------

def random_records(lengths: Sequence[int], seed: int | np.random.Generator,
                   prefix: str = "r") -> list[tuple[str, str]]:
    """Deterministic random proteins (the 20 standard residues) of the given lengths, IDs
    ``<prefix><i:05d>``; ``seed`` may be a generator that drew the lengths (it goes on from there)."""
    rng = np.random.default_rng(seed)
    return [(f"{prefix}{i:05d}", "".join(rng.choice(AMINO, int(n)))) for i, n in enumerate(lengths)]


def lognormal_lengths(count: int, median: int, seed: int, low: int = 20, high: int = 1022) -> list[int]:
    """``count`` protein lengths, log-normal around ``median`` (sigma 0.6, as UniProt's), clipped to [low, high]."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(median), 0.6, count).astype(int), low, high).tolist()


def write_fasta(path: Path, records: Sequence[tuple[str, str]]) -> Path:
    """``records`` as a FASTA file at ``path`` (one line per sequence)."""
    path.write_text("".join(f">{rid}\n{seq}\n" for rid, seq in records))
    return path


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """Cosine similarity of two vectors, in float64 (1.0 for identical directions)."""
    a64, b64 = np.asarray(a, dtype=np.float64).ravel(), np.asarray(b, dtype=np.float64).ravel()
    return float(a64 @ b64 / (np.linalg.norm(a64) * np.linalg.norm(b64)))


# -- clocks -------------------------------------------------------------------------------------

@dataclass
class Timing:
    """Wall seconds of each round (and each process's peak RSS, where a process was timed)."""

    seconds: list[float] = field(default_factory=list)
    peak_rss_mib: list[float] = field(default_factory=list)

    @property
    def best(self) -> float:
        return min(self.seconds)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def peak(self) -> float:
        """The highest peak RSS over the rounds (MiB); nan where no process was timed."""
        return max(self.peak_rss_mib, default=float("nan"))


def now() -> float:
    """The benchmarks' one clock (monotonic seconds): every duration below is a difference of two."""
    return time.perf_counter()


class Stopwatch:
    """Wall seconds of a ``with`` block (``seconds`` is set when the block ends); ``sync`` (e.g. a
    CUDA synchronise) runs at both ends, so queued device work counts in the block it belongs to."""

    def __init__(self, sync: Callable[[], None] | None = None) -> None:
        self.seconds = float("nan")
        self._start = 0.0
        self._sync = sync

    def __enter__(self) -> Stopwatch:
        if self._sync is not None:
            self._sync()
        self._start = now()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._sync is not None:
            self._sync()
        self.seconds = now() - self._start


def time_call(fn: Callable[[], object], rounds: int = 1, warmup: int = 0) -> Timing:
    """In-process wall seconds of ``rounds`` calls of ``fn`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    timing = Timing()
    for _ in range(rounds):
        with Stopwatch() as clock:
            fn()
        timing.seconds.append(clock.seconds)
    return timing


@dataclass
class ProcessRun:
    """One finished child process: wall seconds, its own peak RSS, exit code and captured output."""

    seconds: float
    peak_rss_mib: float
    returncode: int
    stdout: str = ""
    stderr: str = ""


#: a small Python process that forks and execs the timed command, waits for it and writes its
#: wall seconds and ``wait4`` peak RSS to the fd in argv[1]. Why not time the command straight
#: from here: a child's ``ru_maxrss`` starts at the peak of the process it was forked from and
#: survives ``exec``, so a command forked from a benchmark that imported torch would report the
#: benchmark's memory; forked from this launcher it starts near zero (as GNU time's ``%M``).
LAUNCHER = """import os, sys, time
fd = int(sys.argv[1])
start = time.perf_counter()
pid = os.fork()
if pid == 0:
    os.close(fd)
    try:
        os.execvp(sys.argv[2], sys.argv[2:])
    finally:
        os._exit(127)
_, status, usage = os.wait4(pid, 0)
os.write(fd, f"{time.perf_counter() - start} {usage.ru_maxrss}".encode())
sys.exit(os.waitstatus_to_exitcode(status) % 256)
"""


def run_process(cmd: Sequence[str], env: Mapping[str, str] | None = None, cwd: Path | None = None,
                check: bool = True, capture: bool = False, limit: float | None = None) -> ProcessRun:
    """Run ``cmd`` as a whole process: wall seconds from its start to its exit and its own peak
    RSS (through :data:`LAUNCHER`). ``capture``: keep stdout and stderr (else they pass through).
    ``check``: a failure stops the benchmark with the command named. ``limit``: seconds after
    which its whole process group is killed (then ``returncode`` is -9 and seconds and RSS are nan)."""
    import signal
    import tempfile

    read, write = os.pipe()
    try:
        with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
            proc = subprocess.Popen([sys.executable, "-S", "-c", LAUNCHER, str(write), *cmd],
                                    env=None if env is None else dict(env), cwd=cwd, pass_fds=(write,),
                                    stdout=out if capture else None, stderr=err if capture else None,
                                    start_new_session=limit is not None)
            os.close(write)
            write = -1
            try:
                code = proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return ProcessRun(float("nan"), float("nan"), -9)
            report = os.read(read, 256).decode().split()
            out.seek(0), err.seek(0)
            stdout, stderr = (out.read(), err.read()) if capture else ("", "")
    finally:
        os.close(read)
        if write >= 0:
            os.close(write)
    if check and (code != 0 or len(report) != 2):
        raise SystemExit(f"failed ({code}): {shlex.join(cmd)}\n{stderr[-2000:]}")
    seconds, rss_kib = (float(report[0]), float(report[1])) if len(report) == 2 else (float("nan"), float("nan"))
    return ProcessRun(seconds, rss_kib / 1024, code, stdout, stderr)


def interleaved(commands: Mapping[str, Sequence[str]], rounds: int, env: Mapping[str, str] | None = None,
                envs: Mapping[str, Mapping[str, str]] | None = None,
                before: Callable[[str], None] | None = None) -> dict[str, Timing]:
    """Every command once per round, in the same order each round (so a busy spell hits all of
    them): ``envs[name]`` (else ``env``) is its environment, ``before(name)`` is called ahead of
    each run (e.g. to delete its last output). Progress goes to stderr."""
    timings = {name: Timing() for name in commands}
    for round_index in range(rounds):
        for name, cmd in commands.items():
            if before is not None:
                before(name)
            run = run_process(cmd, env=(envs or {}).get(name, env))
            timings[name].seconds.append(run.seconds)
            timings[name].peak_rss_mib.append(run.peak_rss_mib)
            print(f"  round {round_index + 1}: {name:<15} {run.seconds:7.1f}s", file=sys.stderr, flush=True)
    return timings


ENGINE_ENV = "EMBEDPIPE_ENGINE"


def engine_env(base: Mapping[str, str] | None = None, **choices: str) -> dict[str, str]:
    """``base`` (default: this process's environment) with ``EMBEDPIPE_ENGINE`` set to the expert
    engine choices given (``attention="math"``, ``batch_layout="padded"``; ``"auto"`` ones left
    out): how a benchmark pins what the program would otherwise decide itself, in the process it times."""
    env = dict(os.environ if base is None else base)
    env.pop(ENGINE_ENV, None)
    pinned = ",".join(f"{key}={value}" for key, value in choices.items() if value != "auto")
    if pinned:
        env[ENGINE_ENV] = pinned
    return env


@contextlib.contextmanager
def pinned_engine(**choices: str) -> Iterator[None]:
    """Inside the block, this process's ``EMBEDPIPE_ENGINE`` holds ``choices`` (:func:`engine_env`):
    for benchmarks that build an ``Engine`` in-process."""
    saved = os.environ.get(ENGINE_ENV)
    os.environ.pop(ENGINE_ENV, None)
    if ENGINE_ENV in engine_env(**choices):
        os.environ[ENGINE_ENV] = engine_env(**choices)[ENGINE_ENV]
    try:
        yield
    finally:
        os.environ.pop(ENGINE_ENV, None)
        if saved is not None:
            os.environ[ENGINE_ENV] = saved


# -- the machine --------------------------------------------------------------------------------

def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> tuple[str, list[str]]:
    """(model name, the deciding flags present) from ``cpuinfo``; ("unknown", []) where it is absent."""
    if not cpuinfo.is_file():
        return platform.processor() or "unknown", []
    model, flags = "unknown", set()
    for line in cpuinfo.read_text().splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and model == "unknown":
            model = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    return model, [f for f in DECIDING_FLAGS if f in flags]


def machine_header(argv: Sequence[str] | None = None, cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The lines every table is printed under: CPU model and flags, CPUs, torch and Python
    versions, the UTC date and the command that ran (so a table pasted in the docs says where it ran)."""
    model, flags = cpu_model(cpuinfo)
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:  # the store/shard benchmarks do not need torch
        torch_version = "not installed"
    command = shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]] if argv is None else list(argv))
    return "\n".join([
        f"machine: {model}; {os.cpu_count()} CPUs; flags {' '.join(flags) or 'none of ' + '/'.join(DECIDING_FLAGS[:3])}",
        f"software: Python {platform.python_version()}, torch {torch_version}",
        f"date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; command: {command}",
    ])


# -- tables -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Ratio:
    """A column of ratios to a baseline row: ``baseline``'s ``column`` value over each row's
    (``lower_is_better``: times, so a faster row gets > 1) or each row's over the baseline's (rates)."""

    column: str
    baseline: int = 0
    label: str = "x baseline"
    lower_is_better: bool = True


def _cell(value: object) -> str:
    if isinstance(value, float):
        return "-" if value != value else f"{value:,.{3 if abs(value) < 10 else 1}f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def table(columns: Sequence[str], rows: Sequence[Sequence[object]], ratios: Sequence[Ratio] = (),
          formats: Mapping[str, str] | None = None) -> str:
    """A Markdown table; each :class:`Ratio` adds a column right after its source column.
    ``formats``: column -> format spec for its numbers (``"{:.1f}"``); others: ints with
    thousands separators, floats 3 decimals below 10, else 1."""
    formats = dict(formats or {})
    out_columns: list[str] = []
    for name in columns:
        out_columns.append(name)
        out_columns += [r.label for r in ratios if r.column == name]
    lines = ["| " + " | ".join(out_columns) + " |", "|" + "---|" * len(out_columns)]
    for row in rows:
        if len(row) != len(columns):
            raise ValueError(f"row {list(row)} has {len(row)} cells for {len(columns)} columns")
        cells: list[str] = []
        for name, value in zip(columns, row):
            spec = formats.get(name)
            cells.append(spec.format(value) if spec and isinstance(value, (int, float)) else _cell(value))
            for r in (r for r in ratios if r.column == name):
                base = float(rows[r.baseline][columns.index(name)])  # type: ignore[arg-type]
                this = float(value)  # type: ignore[arg-type]
                cells.append(f"{(base / this if r.lower_is_better else this / base):.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
