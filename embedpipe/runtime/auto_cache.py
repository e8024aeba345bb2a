"""The node's cache of ``--precision auto``'s measurements: its directory, its key, and the one
reader and writer of its entries (docs/precision.md, "The cache").

Why one careful reader: every ``embed`` reads the cache (a named policy too, for its warning:
:func:`embedpipe.extraction.auto_precision.notes`), and the directory may be shared by a workflow's
jobs, so an entry may be anything another process left there. An entry is opened without
following a link and without blocking (a FIFO would hang every job), must be a regular file
of at most :data:`MAX_ENTRY_BYTES`, and is used only when every field is well formed: the key
this job computed, a UTC time that parses, finite numbers in range, and times for the key's
own candidates only (a planted policy is never recommended). A bad entry is described, never
quoted (its text could be anything), and the caller measures anew with one warning. A
directory that users other than its owner's group can write to (``mode & 0o002``), or that
is group-writable but not owned by this user, is not used: another user could plant the
measurement the job trusts.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import math
import os
import socket
import stat
import statistics
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import torch

from embedpipe.core.atomic import write_text_atomic
from embedpipe.core.errors import EmbedpipeError
from embedpipe.core.jsonbounds import load_bounded_json
from embedpipe.core.options import AUTO_CACHE_VARIABLE
from embedpipe.runtime import cpu_features

__all__ = ["CACHE_VERSION", "Cached", "CacheRead", "Timing", "cache_key", "default_cache_dir", "measuring",
           "read_cached", "unsafe_directory", "write_cached"]

#: the cache's format; a change of what is measured or how bumps it (older entries are measured again):
#: 2 records each candidate's median of interleaved rounds (1: the best of two passes in a row)
CACHE_VERSION = 2
#: how long a job waits for another job on the same node that is measuring the same key
WAIT_FOR_PROBE_S = 1800.0
#: the largest entry read (one is a few hundred bytes)
MAX_ENTRY_BYTES = 64 << 10
#: how an entry records when it was measured
UTC_FORMAT = "%Y-%m-%dT%H:%M:%SZ"
_TIMING_FIELDS = {"ms_per_1k_residues", "min_cosine"}


@dataclass(frozen=True)
class Timing:
    """One candidate's measurement, as the cache keeps it: milliseconds per 1,000 residues (the
    median of its rounds: :meth:`from_rounds`) and its lowest pooled cosine to fp32."""

    ms_per_1k_residues: float
    min_cosine: float

    @classmethod
    def from_rounds(cls, rounds: Sequence[float], min_cosine: float) -> Timing:
        """The timing of a candidate measured in ``rounds`` (ms per 1,000 residues each): their
        median, so one round slowed by other work on the node moves nothing."""
        if not rounds:
            raise ValueError("a timing needs at least one round")
        return cls(statistics.median(rounds), min_cosine)


def default_cache_dir() -> Path:
    """Where ``embed`` keeps the measurements (no ``auto_cache`` option given): the site's
    ``EMBEDPIPE_AUTO_CACHE``, else the user's cache directory."""
    if site := os.environ.get(AUTO_CACHE_VARIABLE):
        return Path(site)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "embedpipe" / "auto-precision"


def cpu_model() -> str:
    """The CPU's model name as /proc/cpuinfo gives it (the platform's machine name where it gives none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip().lower() in ("model name", "cpu model", "hardware"):
                return value.strip()
    except OSError:
        pass
    return cpu_features.detect().machine


def cache_key(device: torch.device, model: str, threads: int, options: Mapping[str, object],
              candidates: Sequence[str]) -> dict[str, object]:
    """What decides a measurement: the node, its CPU model and flags, torch, the model's identity
    (``model``: its identity fields as JSON), the threads, the device, its ``candidates`` and the
    options that change a candidate's work (layers, pooling, per-residue, storage)."""
    cpu = cpu_features.detect()
    key: dict[str, object] = {
        "version": CACHE_VERSION, "node": socket.gethostname(), "cpu_model": cpu_model(),
        "cpu_flags": hashlib.sha256(" ".join(sorted(cpu.flags)).encode()).hexdigest()[:16],
        "torch": torch.__version__, "model": hashlib.sha256(model.encode()).hexdigest(),
        "threads": int(threads), "device": device.type, "candidates": list(candidates),
        "options": dict(sorted(options.items())),
    }
    if device.type == "cuda":
        key["gpu"] = f"{torch.cuda.get_device_name(device)} {torch.cuda.get_device_capability(device)}"
    return key


def entry_path(directory: Path, key: Mapping[str, object]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    return directory / f"{digest}.json"


def unsafe_directory(directory: Path) -> str | None:
    """Why ``directory`` must not be trusted (writable by other users), or None (also when absent)."""
    try:
        st = os.stat(directory)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"auto-precision cache {directory}: cannot be used ({exc.strerror or exc})"
    if not stat.S_ISDIR(st.st_mode):
        return f"auto-precision cache {directory}: is not a directory"
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o002:
        return f"auto-precision cache {directory}: writable by every user (mode {mode:o}), so not trusted"
    if mode & 0o020 and st.st_uid != os.geteuid():
        return f"auto-precision cache {directory}: group-writable and owned by another user (mode {mode:o}), so not trusted"
    return None


@dataclass(frozen=True)
class Cached:
    """A measurement read back: each candidate's timing, and when it was measured (UTC, re-formatted)."""

    timings: dict[str, Timing]
    measured_utc: str


@dataclass(frozen=True)
class CacheRead:
    """What reading one key gave: a measurement, or nothing (``problem`` says why, when it is
    more than "not cached yet")."""

    found: Cached | None = None
    problem: str | None = None


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def _read_entry(path: Path) -> bytes | str | None:
    """The entry's bytes, None when absent, or why it cannot be read (in words)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return "a symbolic link" if exc.errno == errno.ELOOP else f"unreadable ({exc.strerror or exc})"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return next((what for test, what in _KINDS if test(st.st_mode)), "not a regular file")
        if st.st_size > MAX_ENTRY_BYTES:
            return f"{st.st_size} bytes, more than the {MAX_ENTRY_BYTES} an entry may hold"
        chunks, size = [], 0
        while size <= MAX_ENTRY_BYTES and (chunk := os.read(fd, MAX_ENTRY_BYTES + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks) if size <= MAX_ENTRY_BYTES else f"more than the {MAX_ENTRY_BYTES} bytes an entry may hold"
    except OSError as exc:
        return f"unreadable ({exc.strerror or exc})"
    finally:
        os.close(fd)


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def _validated(data: object, key: Mapping[str, object]) -> Cached | str:
    """The entry's measurement, or what is wrong with it (described, never quoted)."""
    if not isinstance(data, dict) or set(data) != {"key", "measured_utc", "timings"}:
        return "not a measurement embedpipe writes (other fields)"
    if data["key"] != json.loads(json.dumps(key)):
        return "a measurement for another key"
    when = data["measured_utc"]
    try:
        measured = datetime.strptime(when, UTC_FORMAT) if isinstance(when, str) and len(when) == 20 else None
    except ValueError:
        measured = None
    if measured is None:
        return "a measurement whose time is not a UTC time embedpipe writes"
    timings = data["timings"]
    allowed = key.get("candidates")
    if not isinstance(timings, dict) or "fp32" not in timings or not isinstance(allowed, list):
        return "a measurement without fp32's timing"
    if not set(timings) <= set(allowed):
        return f"a measurement of a policy that is not one of this device's candidates ({', '.join(allowed)})"
    found: dict[str, Timing] = {}
    for name, value in timings.items():
        if not isinstance(value, dict) or set(value) != _TIMING_FIELDS:
            return f"a measurement whose timing of {name} is not a time and a cosine"
        ms, cosine = _number(value["ms_per_1k_residues"]), _number(value["min_cosine"])
        if ms is None or cosine is None or ms <= 0 or not -1.0 <= cosine <= 1.0:
            return f"a measurement whose timing of {name} is not a positive time and a cosine in [-1, 1]"
        found[name] = Timing(ms, cosine)
    return Cached(found, measured.strftime(UTC_FORMAT))


def read_cached(directory: Path, key: Mapping[str, object]) -> CacheRead:
    """The measurement cached for exactly ``key``; nothing when none is, or (with a problem, one
    line) when the directory is not trusted or the entry is not a well-formed measurement."""
    if (why := unsafe_directory(directory)) is not None:
        return CacheRead(problem=why)
    path = entry_path(directory, key)
    raw = _read_entry(path)
    if raw is None:
        return CacheRead()
    if isinstance(raw, str):
        return CacheRead(problem=f"{path}: the cached measurement is {raw}")
    try:
        data = load_bounded_json(raw.decode("utf-8"), str(path), EmbedpipeError)
    except (UnicodeDecodeError, ValueError, EmbedpipeError):
        return CacheRead(problem=f"{path}: the cached measurement is not valid JSON")
    checked = _validated(data, key)
    if isinstance(checked, str):
        return CacheRead(problem=f"{path}: the cached measurement is {checked}")
    return CacheRead(found=checked)


def write_cached(directory: Path, key: Mapping[str, object], timings: Mapping[str, Timing]) -> Path | str:
    """Record a measurement (atomically: a reader sees the old entry or the whole new one); its
    path, or why it could not be written (the job goes on: the measurement is only not kept)."""
    path = entry_path(directory, key)
    body = {"key": key, "measured_utc": time.strftime(UTC_FORMAT, time.gmtime()),
            "timings": {k: {"ms_per_1k_residues": t.ms_per_1k_residues, "min_cosine": t.min_cosine}
                        for k, t in timings.items()}}
    try:
        write_text_atomic(path, json.dumps(body, indent=1, sort_keys=True))
    except (OSError, EmbedpipeError) as exc:
        return f"{path}: the measurement was not cached ({getattr(exc, 'strerror', None) or exc})"
    return path


@contextlib.contextmanager
def measuring(directory: Path, key: Mapping[str, object]) -> Iterator[None]:
    """Held while one job measures ``key``: a second job on the node waits for its result
    instead of measuring beside it (two probes at once would time each other's load). The lock
    file is opened without following links and never chmod'ed."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(entry_path(directory, key).with_suffix(".lock"),
                     os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise EmbedpipeError(f"auto-precision cache {directory}: cannot use it ({exc.strerror or exc}); "
                             f"set {AUTO_CACHE_VARIABLE} to a writable directory") from None
    try:
        deadline = time.monotonic() + WAIT_FOR_PROBE_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise EmbedpipeError(f"auto-precision cache {directory}: another job has measured for "
                                         f"{WAIT_FOR_PROBE_S:.0f} s without a result; name a policy") from None
                time.sleep(0.5)
        yield
    finally:
        os.close(fd)
