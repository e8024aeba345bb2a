"""How many CPUs this process may really use, and how its threads wait (docs/cluster.md, "CPU threads").

Why: torch starts one thread per CPU it sees, but a job on a shared node owns fewer: an
affinity mask (``taskset``, SLURM's task/affinity), a cgroup CPU quota (containers, SLURM's
cgroup plugin: a job given 4 CPUs of a 64-core node sees 64 cores and would start 64
threads), or only ``SLURM_CPUS_PER_TASK``; and ``OMP_NUM_THREADS``, which torch honours too
(Snakemake sets it to a job's threads). The smallest of these is the default thread count
of ``embed`` for torch's intra-op pool (which oneDNN and MKL share) and its inter-op pool;
``--threads`` wins over it. Torch-free: the wait policy must be set before torch is imported.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path

from embedpipe.core.errors import quote
from embedpipe.core.progress import say

#: how idle OpenMP pool threads wait between parallel regions, set by ``embed`` when the user
#: has not chosen (docs/cluster.md, "CPU threads"): spin about 10 microseconds (libgomp's
#: ``GOMP_SPINCOUNT``; its default 300000 spins is about 3 ms), then sleep. Regions that follow
#: each other within the spin keep their threads awake, as on a node of one's own; a thread
#: that waits longer, for the one sharing a core with a neighbour, sleeps and gives the core up.
#: Measured (``benchmarks/cpu_contention.py --wait-policies``, docs/benchmarks.md "CPU
#: contention"): as fast as the spin default quiet and as robust as ``OMP_WAIT_POLICY=PASSIVE``
#: beside a neighbour, where 10000 spins already collapsed like the default. Intel's and LLVM's
#: runtimes read ``KMP_BLOCKTIME`` instead (libgomp ignores it): 0, sleep at once, PASSIVE's
#: behaviour, the robust choice there (not measured: torch's pip wheels ship libgomp).
WAIT_SETTINGS = {"GOMP_SPINCOUNT": "1000", "KMP_BLOCKTIME": "0"}
#: the variables that choose it (libgomp and Intel's OpenMP read the first; Intel's the
#: second; libgomp's spin count before a waiting thread sleeps the third)
WAIT_VARIABLES = ("OMP_WAIT_POLICY", "KMP_BLOCKTIME", "GOMP_SPINCOUNT")
#: the cgroup file systems' usual mount point
CGROUP_ROOT = Path("/sys/fs/cgroup")
#: this process's cgroups, one ``id:controllers:path`` line each (v2: ``0::path``)
PROC_CGROUP = Path("/proc/self/cgroup")


@dataclass(frozen=True)
class CpuAllocation:
    """A thread count and where it came from (the store's ``threads_from``); ``note``: the
    warning for a setting that was ignored ('' when none was)."""

    count: int
    source: str
    note: str = ""


def _count(text: str | None) -> int | None:
    """``text`` as a whole number when it is ASCII digits only, else None: ``str.isdigit``
    also takes ``'²'`` or ``'٣'``, which ``int`` then refuses (a ValueError traceback)."""
    return int(text) if text and text.isascii() and text.isdigit() else None


def _affinity() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _quota_v2(directory: Path) -> tuple[int, int] | None:
    """(quota, period) of a cgroup v2 ``cpu.max`` (``max 100000``: none)."""
    text = _read(directory / "cpu.max")
    parts = text.split() if text else []
    quota, period = (_count(parts[0]), _count(parts[1])) if len(parts) == 2 else (None, None)
    return (quota, period) if quota is not None and period else None


def _quota_v1(directory: Path) -> tuple[int, int] | None:
    """(quota, period) of a cgroup v1 ``cpu.cfs_quota_us`` (-1: none)."""
    quota, period = _count(_read(directory / "cpu.cfs_quota_us")), _count(_read(directory / "cpu.cfs_period_us"))
    return (quota, period) if quota and period else None


def _cgroup_dirs(root: Path) -> list[tuple[Path, bool]]:
    """Candidate directories of this process's CPU cgroup, innermost first, each with whether
    it is v2: from ``/proc/self/cgroup``'s paths, each under the mount and every parent up to
    it (a quota on an ancestor binds too), and the mount itself (inside a container's cgroup
    namespace the path is ``/`` and the files are at the mount)."""
    text = _read(PROC_CGROUP) or ""
    found: list[tuple[Path, bool]] = []
    for line in text.splitlines():
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":
            mounts = [(root, True)]
        elif "cpu" in controllers.split(","):
            mounts = [(root / name, False) for name in ("cpu,cpuacct", "cpu", "cpuacct,cpu")]
        else:
            continue
        for mount, v2 in mounts:
            directory = mount / path.lstrip("/")
            while True:
                found.append((directory, v2))
                if directory == mount or mount not in directory.parents:
                    break
                directory = directory.parent
    return found


def cgroup_quota(root: Path = CGROUP_ROOT) -> tuple[int, str] | None:
    """The tightest CPU quota of this process's cgroups, rounded up to whole CPUs, with its
    file and value; None when there is none."""
    best: tuple[int, str] | None = None
    for directory, v2 in _cgroup_dirs(root):
        quota = _quota_v2(directory) if v2 else _quota_v1(directory)
        if quota is None:
            continue
        cpus = max(1, math.ceil(quota[0] / quota[1]))
        name = "cpu.max" if v2 else "cpu.cfs_quota_us"
        if best is None or cpus < best[0]:
            best = (cpus, f"cgroup {directory / name} {quota[0]}/{quota[1]}")
    return best


#: the environment's thread limits: SLURM's CPUs per task, and ``OMP_NUM_THREADS``, which torch
#: and numpy honour too (a user sharing a node sets it; its first value, the outer level, counts)
ENV_LIMITS = ("SLURM_CPUS_PER_TASK", "OMP_NUM_THREADS")


def allocated(env: Mapping[str, str] = os.environ, root: Path = CGROUP_ROOT) -> CpuAllocation:
    """The CPUs this process may run on: the smallest of its affinity mask, its cgroup's CPU
    quota, ``SLURM_CPUS_PER_TASK`` and ``OMP_NUM_THREADS`` (a value that is not a positive whole
    number in ASCII digits is not a limit: ignored, and the allocation's ``note`` says so); its
    ``source`` names every limit at that count, comma-separated."""
    count = _affinity()
    limits = [(count, f"affinity ({count} CPUs)")]
    quota = cgroup_quota(root)
    if quota is not None:
        limits.append(quota)
    notes = []
    for name in ENV_LIMITS:
        raw = env.get(name, "").strip()
        value = raw.split(",")[0].strip() if name == "OMP_NUM_THREADS" else raw
        if _count(value):
            limits.append((int(value), f"{name}={value}"))
        elif raw:
            notes.append(f"{name}={quote(raw)} is not a positive whole number: ignored (threads follow the "
                         "affinity and cgroup quota; docs/cluster.md, \"CPU threads\")")
    cpus = min(count for count, _ in limits)
    # every limit at the count is named: OMP_NUM_THREADS set to the CPUs a job owns binds too
    source = ", ".join(label for count, label in limits if count == cpus)
    return CpuAllocation(cpus, source, "; ".join(notes))


def thread_count(requested: int | None, env: Mapping[str, str] = os.environ,
                 root: Path = CGROUP_ROOT) -> CpuAllocation:
    """``--threads`` when given (its note: :func:`oversubscribed`), else :func:`allocated`: the
    one count of a job's threads, which :func:`embedpipe.extraction.resolved.resolve_run` records."""
    if requested:
        return CpuAllocation(int(requested), "--threads", oversubscribed(requested, env, root))
    return allocated(env, root)


def oversubscribed(requested: int | None, env: Mapping[str, str] = os.environ, root: Path = CGROUP_ROOT) -> str:
    """The warning for ``--threads`` above the CPUs the job owns ('' when it is not): threads
    beyond the allocation take turns on its cores, and every parallel region then waits for
    the one that lost its turn (docs/benchmarks.md, "CPU contention")."""
    if not requested:
        return ""
    owned = allocated(env, root)
    if requested <= owned.count:
        return ""
    return (f"--threads {requested} is more than the {owned.count} CPU(s) this job may use ({owned.source}): "
            f"the extra threads share cores and slow every step down; give --threads {owned.count} or leave it "
            "out (docs/cluster.md, \"CPU threads\")")


def use_threads(allocation: CpuAllocation, *, quiet: bool = False) -> CpuAllocation:
    """Size torch's intra-op pool (shared by oneDNN and MKL) and, while it can still be set,
    its inter-op pool to ``allocation`` (:func:`thread_count`'s); returns it. Its note (a setting
    ignored, more threads than CPUs) is one warning line."""
    import torch

    if allocation.note:
        say(f"warning: {allocation.note}", quiet=quiet)
    torch.set_num_threads(allocation.count)
    try:
        torch.set_num_interop_threads(allocation.count)
    except RuntimeError:  # only settable before the first inter-op work (a second job in one process)
        pass
    return allocation


def provenance(allocation: CpuAllocation) -> dict[str, int | str]:
    """Root attributes (docs/store-format.md): ``threads``, the intra-op threads the run used,
    and ``threads_from``, where ``allocation`` (the run's count) came from."""
    import torch

    return {"threads": int(torch.get_num_threads()), "threads_from": allocation.source}


def set_wait_policy(env: MutableMapping[str, str] = os.environ) -> None:
    """Set :data:`WAIT_SETTINGS` unless the user chose a wait policy (any of
    :data:`WAIT_VARIABLES` set: ``KMP_BLOCKTIME`` alone keeps libgomp's own default, which the
    benchmark compares). Must run before torch is imported: the OpenMP runtime reads them when
    it loads."""
    if not any(env.get(name) for name in WAIT_VARIABLES):  # "": the runtime's own default
        env.update(WAIT_SETTINGS)
