"""The default thread count is the CPUs the process may run on (docs/cluster.md, "CPU threads"):
affinity, the cgroup quota (v1 and v2, the tightest of the process's cgroup and its parents)
and SLURM_CPUS_PER_TASK, whichever is smallest; --threads wins. Fake cgroup trees, a faked
affinity mask and environment: nothing here depends on the machine running it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import h5py
import pytest

from embedpipe.core import cpus
from helpers.embed_helpers import random_sequences, write_fasta
from helpers.processes import ROOT


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """``node(cpus, cgroup_lines, files)``: an affinity mask of ``cpus`` CPUs, a /proc/self/cgroup
    of ``cgroup_lines`` and the cgroup files ``{relative path: text}`` under a fake mount; returns
    the mount."""
    root = tmp_path / "cgroup"

    def make(count: int, lines: list[str], files: dict[str, str] | None = None) -> Path:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(count)))
        proc = tmp_path / "proc-self-cgroup"
        proc.write_text("".join(f"{line}\n" for line in lines))
        monkeypatch.setattr(cpus, "PROC_CGROUP", proc)
        for name, text in (files or {}).items():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_text(text + "\n")
        return root

    return make


def test_without_limits_the_affinity_mask_decides(node) -> None:
    root = node(6, ["0::/"], {"cpu.max": "max 100000"})
    assert cpus.allocated({}, root) == cpus.CpuAllocation(6, "affinity (6 CPUs)")


def test_a_cgroup_v2_quota_binds_rounded_up_and_the_tightest_ancestor_wins(node) -> None:
    root = node(64, ["0::/job/step"], {"job/step/cpu.max": "250000 100000", "job/cpu.max": "max 100000"})
    got = cpus.allocated({}, root)
    assert got.count == 3  # 2.5 CPUs of quota: 3 threads
    assert got.source == f"cgroup {root / 'job' / 'step' / 'cpu.max'} 250000/100000"
    (root / "job" / "cpu.max").write_text("100000 100000\n")  # a parent's 1 CPU binds the child too
    assert cpus.allocated({}, root).count == 1


def test_a_cgroup_v1_cfs_quota_binds_and_minus_one_means_none(node) -> None:
    root = node(64, ["4:memory:/x", "3:cpu,cpuacct:/slurm/uid_1/job_7"], {
        "cpu,cpuacct/slurm/uid_1/job_7/cpu.cfs_quota_us": "400000",
        "cpu,cpuacct/slurm/uid_1/job_7/cpu.cfs_period_us": "100000"})
    assert cpus.allocated({}, root) == cpus.CpuAllocation(
        4, f"cgroup {root / 'cpu,cpuacct/slurm/uid_1/job_7/cpu.cfs_quota_us'} 400000/100000")
    (root / "cpu,cpuacct/slurm/uid_1/job_7/cpu.cfs_quota_us").write_text("-1\n")
    assert cpus.allocated({}, root) == cpus.CpuAllocation(64, "affinity (64 CPUs)")


def test_inside_a_cgroup_namespace_the_quota_is_read_at_the_mount(node) -> None:
    root = node(16, ["0::/"], {"cpu.max": "200000 100000"})
    assert cpus.allocated({}, root).count == 2


def test_slurm_cpus_per_task_binds_and_a_value_that_is_no_count_does_not(node) -> None:
    root = node(8, ["0::/"])
    assert cpus.allocated({"SLURM_CPUS_PER_TASK": "3"}, root) == cpus.CpuAllocation(3, "SLURM_CPUS_PER_TASK=3")
    for junk in ("0", "two", "", "-2"):
        assert cpus.allocated({"SLURM_CPUS_PER_TASK": junk}, root).count == 8, junk
    # the smallest limit decides, whichever it is
    assert cpus.allocated({"SLURM_CPUS_PER_TASK": "12"}, root).source == "affinity (8 CPUs)"


@pytest.mark.parametrize("value", ["\u00b2", "\u0663", "3\u00b9", "0", "-2", "two", "1.5"])
def test_a_slurm_cpus_per_task_that_is_no_ascii_count_is_ignored_with_a_note(node, value: str) -> None:
    """``'²'.isdigit()`` is true and ``int('²')`` fails: every value that is not ASCII digits of a
    positive count is not a limit, and the allocation carries the one warning line for it."""
    root = node(8, ["0::/"])
    got = cpus.allocated({"SLURM_CPUS_PER_TASK": value}, root)
    assert (got.count, got.source) == (8, "affinity (8 CPUs)")
    assert got.note == (f"SLURM_CPUS_PER_TASK={value!r} is not a positive whole number: ignored (threads follow the "
                        "affinity and cgroup quota; docs/cluster.md, \"CPU threads\")")
    assert cpus.allocated({"SLURM_CPUS_PER_TASK": "3"}, root).note == cpus.allocated({}, root).note == ""


def test_omp_num_threads_binds_as_torch_and_numpy_honour_it(node) -> None:
    """A user sharing a node sets OMP_NUM_THREADS=1: the job runs one thread, as torch and numpy
    would; its first value counts (the outer level of a nested list); a value that is no count
    is ignored with a note; the smallest limit decides, whichever it is."""
    root = node(8, ["0::/"])
    assert cpus.allocated({"OMP_NUM_THREADS": "1"}, root) == cpus.CpuAllocation(1, "OMP_NUM_THREADS=1")
    assert cpus.allocated({"OMP_NUM_THREADS": "3,2"}, root) == cpus.CpuAllocation(3, "OMP_NUM_THREADS=3")
    assert cpus.allocated({"OMP_NUM_THREADS": "12"}, root).source == "affinity (8 CPUs)"
    assert cpus.allocated({"OMP_NUM_THREADS": "2", "SLURM_CPUS_PER_TASK": "4"}, root).source == "OMP_NUM_THREADS=2"
    assert cpus.allocated({"OMP_NUM_THREADS": "4", "SLURM_CPUS_PER_TASK": "2"}, root).source == "SLURM_CPUS_PER_TASK=2"
    # a tie names every limit at the count: the variable binds as much as the affinity does
    assert cpus.allocated({"OMP_NUM_THREADS": "8"}, root) == cpus.CpuAllocation(8, "affinity (8 CPUs), OMP_NUM_THREADS=8")
    assert cpus.allocated({"OMP_NUM_THREADS": "2", "SLURM_CPUS_PER_TASK": "2"}, root).source == (
        "SLURM_CPUS_PER_TASK=2, OMP_NUM_THREADS=2")
    got = cpus.allocated({"OMP_NUM_THREADS": "many"}, root)
    assert (got.count, got.source) == (8, "affinity (8 CPUs)")
    assert got.note == ("OMP_NUM_THREADS='many' is not a positive whole number: ignored (threads follow the "
                        "affinity and cgroup quota; docs/cluster.md, \"CPU threads\")")
    assert cpus.thread_count(2, {"OMP_NUM_THREADS": "1"}, root).count == 2  # --threads still wins


def test_cgroup_files_with_non_ascii_digits_are_no_quota(node) -> None:
    root = node(8, ["0::/job"], {"job/cpu.max": "\u00b2 100000"})
    assert cpus.allocated({}, root) == cpus.CpuAllocation(8, "affinity (8 CPUs)")
    root = node(8, ["3:cpu:/job"], {"cpu/job/cpu.cfs_quota_us": "\u0664", "cpu/job/cpu.cfs_period_us": "100000"})
    assert cpus.allocated({}, root).count == 8


def test_embed_under_a_non_ascii_slurm_cpus_per_task_runs_and_warns_once(tiny_model_path, tmp_path) -> None:
    fasta = write_fasta(tmp_path / "in.fasta", random_sequences(2, (10, 20), seed=3))
    out = tmp_path / "out.h5"
    proc = subprocess.run([sys.executable, "-m", "embedpipe.cli", "embed", str(fasta), "--model", str(tiny_model_path),
                           "--out", str(out), "--device", "cpu"], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "SLURM_CPUS_PER_TASK": "\u00b2"})
    assert proc.returncode == 0, proc.stderr
    assert [line for line in proc.stderr.splitlines() if "SLURM_CPUS_PER_TASK" in line] == [
        "warning: SLURM_CPUS_PER_TASK='\u00b2' is not a positive whole number: ignored (threads follow the affinity "
        "and cgroup quota; docs/cluster.md, \"CPU threads\")"]
    with h5py.File(out, "r") as f:
        assert str(f.attrs["threads_from"]).startswith(("affinity", "cgroup"))


def test_explicit_threads_win_over_the_allocation(node) -> None:
    root = node(2, ["0::/"], {"cpu.max": "100000 100000"})
    chosen = cpus.thread_count(6, {"SLURM_CPUS_PER_TASK": "1"}, root)
    assert (chosen.count, chosen.source) == (6, "--threads")
    # the one count carries the warning that 6 threads oversubscribe the cgroup's one CPU
    assert chosen.note.startswith("--threads 6 is more than the 1 CPU(s) this job may use (cgroup ")
    assert cpus.thread_count(1, {"SLURM_CPUS_PER_TASK": "1"}, root) == cpus.CpuAllocation(1, "--threads")
    assert cpus.thread_count(None, {}, root).count == 1


def test_threads_above_the_allocation_are_named_with_where_the_allocation_came_from(node) -> None:
    root = node(8, ["0::/job"], {"job/cpu.max": "400000 100000"})
    assert cpus.oversubscribed(None, {}, root) == ""  # the default is the allocation itself
    assert cpus.oversubscribed(4, {}, root) == ""
    note = cpus.oversubscribed(6, {}, root)
    assert note.startswith(f"--threads 6 is more than the 4 CPU(s) this job may use (cgroup {root / 'job' / 'cpu.max'} ")
    assert "give --threads 4" in note
    assert "the 2 CPU(s)" in cpus.oversubscribed(3, {"SLURM_CPUS_PER_TASK": "2"}, root)


def test_the_wait_policy_is_set_only_when_the_user_chose_none(monkeypatch: pytest.MonkeyPatch) -> None:
    env: dict[str, str] = {}
    cpus.set_wait_policy(env)
    assert env == cpus.WAIT_SETTINGS == {"GOMP_SPINCOUNT": "1000", "KMP_BLOCKTIME": "0"}
    for chosen in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"KMP_BLOCKTIME": "200"}, {"GOMP_SPINCOUNT": "10000"}):
        env = dict(chosen)
        cpus.set_wait_policy(env)
        assert env == chosen
    monkeypatch.setattr(cpus, "WAIT_SETTINGS", {})  # the runtime's own default: nothing set
    env = {}
    cpus.set_wait_policy(env)
    assert env == {}


def test_the_console_script_sets_the_wait_policy_before_torch_loads(tmp_path: Path) -> None:
    child = ("import os, sys\nfrom embedpipe.cli.commands import run\nsys.argv = ['embedpipe', '--help']\n"
             "try:\n    run()\nexcept SystemExit:\n    pass\n"
             "print(os.environ.get('GOMP_SPINCOUNT'), 'torch' in sys.modules, file=sys.stderr)\n")
    env = {k: v for k, v in os.environ.items() if k not in cpus.WAIT_VARIABLES} | {"PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == f"{cpus.WAIT_SETTINGS['GOMP_SPINCOUNT']} False"


@pytest.mark.parametrize(("args", "env", "want"), [
    ((), {"SLURM_CPUS_PER_TASK": "1"}, (1, "SLURM_CPUS_PER_TASK=1")),
    (("--threads", "2"), {"SLURM_CPUS_PER_TASK": "1"}, (2, "--threads")),
])
def test_the_store_records_the_threads_and_where_they_came_from(tiny_model_path, tmp_path, args, env, want) -> None:
    fasta = write_fasta(tmp_path / "in.fasta", random_sequences(2, (10, 20), seed=3))
    out = tmp_path / "out.h5"
    proc = subprocess.run([sys.executable, "-m", "embedpipe.cli", "embed", str(fasta), "--model", str(tiny_model_path),
                           "--out", str(out), "--device", "cpu", *args],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT), **env})
    assert proc.returncode == 0, proc.stderr
    with h5py.File(out, "r") as f:
        assert (int(f.attrs["threads"]), str(f.attrs["threads_from"])) == want
        assert json.loads(f.attrs["config"])["threads"] == (None if not args else 2)
    # threads above the allocation run, and say so once (docs/cluster.md, "CPU threads")
    warned = [line for line in proc.stderr.splitlines() if "CPU(s) this job may use" in line]
    assert warned == ([] if not args else [
        "warning: --threads 2 is more than the 1 CPU(s) this job may use (SLURM_CPUS_PER_TASK=1): the extra threads "
        "share cores and slow every step down; give --threads 1 or leave it out (docs/cluster.md, \"CPU threads\")"])



def test_omp_num_threads_bounds_an_embed_and_its_store_says_so(tiny_model_path, tmp_path) -> None:
    """``OMP_NUM_THREADS=1`` (what Snakemake sets for a one-thread job) bounds ``embed`` like the
    affinity mask and the cgroup quota do, and the store's ``threads_from`` names it."""
    fasta = write_fasta(tmp_path / "in.fasta", random_sequences(2, (10, 20), seed=3))
    out = tmp_path / "out.h5"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "SLURM_CPUS_PER_TASK": ""}
    proc = subprocess.run([sys.executable, "-m", "embedpipe.cli", "embed", str(fasta), "--model", str(tiny_model_path),
                           "--out", str(out), "--device", "cpu"], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    with h5py.File(out, "r") as f:
        assert int(f.attrs["threads"]) == 1
        assert "OMP_NUM_THREADS=1" in str(f.attrs["threads_from"]).split(", ")  # alone, or tied with a 1-CPU mask
        assert json.loads(f.attrs["config"])["threads"] is None  # no --threads: counted, not given
