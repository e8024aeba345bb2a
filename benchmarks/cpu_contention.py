"""Each CPU policy quiet, beside a neighbour, and pinned to fewer CPUs: who collapses on a shared node?

Cluster nodes are shared: a job's cores also run other jobs' threads. This script runs
``embedpipe embed`` (whole processes, no ``--threads``: the thread count is the job's
allocation, docs/cluster.md "CPU threads") per policy under three conditions, interleaved
in rounds:

* **quiet**: nothing else running (as far as this script knows);
* **neighbour**: beside ``--neighbours`` processes that each keep one core busy (a Python spin);
* **pinned**: under ``taskset -c 0..P-1`` (``--pinned-cpus``, default half the CPUs), next to a
  quiet run with ``--threads P``: a job given fewer CPUs than the node has must find them
  itself and run no slower than that.

It prints each policy's slowdown beside the neighbour (neighbour / quiet) and its ratio to
fp32's own slowdown; the targets: the advised policy slows down no more than 1.3x
fp32's slowdown and stays faster than fp32 there, and pinned / quiet-P <= 1.3.

``--wait-policies`` repeats everything per OpenMP wait policy (``embedpipe`` sets
a short spin, ``GOMP_SPINCOUNT=1000``, unless one is set: docs/cluster.md): ``embedpipe`` (its own
choice), ``PASSIVE``, ``ACTIVE`` and ``default`` (the OpenMP runtime's own: ``KMP_BLOCKTIME=200``,
which libgomp ignores, so embedpipe sets nothing), and ``spin-1k`` .. ``spin-100k``: libgomp's
``GOMP_SPINCOUNT`` (how long a waiting thread spins before it sleeps; its default is 300000,
about 3 ms, PASSIVE's 0). ``--conditions quiet neighbour`` skips the pinned runs. ``int8-mixed-1mib`` is int8-mixed with
the quantize passes' chunks fixed at 1 MiB whatever the threads (the code before the
per-thread chunks; embedpipe/runtime/int8_linear.py, ``row_chunks``), for a before/after in
one run.

    python benchmarks/cpu_contention.py --repeat-input 2 --rounds 3               # 200 proteins, 35M shape
    python benchmarks/cpu_contention.py --repeat-input 2 --rounds 3 --wait-policies embedpipe default ACTIVE
    python benchmarks/cpu_contention.py --repeat-input 2 --rounds 3 --conditions quiet neighbour \
        --wait-policies embedpipe default spin-1k spin-10k spin-100k
    python benchmarks/cpu_contention.py --layers 2 --dim 64 --heads 4 --max-records 8 --rounds 1   # smoke run
    python benchmarks/cpu_contention.py --count-ops --threads 2     # eager ops per int8 linear (a count, no timing)
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _harness import machine_header, run_process, table, write_fasta
from embed_throughput import OUT, add_input_arguments, bench_model, repeat_input, system_command

from embedpipe.core.cpus import WAIT_VARIABLES

POLICIES = ("fp32", "bf16-mixed", "int8-mixed")
#: the environment of each wait policy (embedpipe: none set, so its own choice applies)
WAIT_POLICIES = {"embedpipe": {}, "PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"}, "ACTIVE": {"OMP_WAIT_POLICY": "ACTIVE"},
                 "default": {"KMP_BLOCKTIME": "200"},
                 # libgomp's spin before a waiting thread sleeps (its default 300000 is ~3 ms, PASSIVE 0)
                 **{f"spin-{n // 1000}k": {"GOMP_SPINCOUNT": str(n)} for n in (1000, 10000, 30000, 100000)}}
CONDITIONS = ("quiet", "neighbour", "pinned", "quiet-P")
#: int8-mixed with the quantize chunks of the code before per-thread chunks (1 MiB whatever the threads)
FIXED_CHUNKS = (
    "import sys; import embedpipe.runtime.int8_linear as m\n"
    "m.row_chunks = lambda n, k: range(0, n, max(16, m.CHUNK_BYTES // (4 * max(k, 1))))\n"
    "sys.argv = ['embedpipe'] + sys.argv[1:]\n"
    "from embedpipe.cli import run; run()\n")
#: a neighbour that keeps one core busy, and stops when the benchmark that started it is gone
SPIN = "import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n    pass\n"


def embed_command(system: str, model: Path, fasta: Path, target: Path, threads: int | None) -> list[str]:
    """``embedpipe embed`` for ``system`` (a policy, or int8-mixed-1mib), ``--threads`` only when given."""
    cmd = system_command("int8-mixed" if system == "int8-mixed-1mib" else system, model, fasta, target, 1)
    at = cmd.index("--threads")
    cmd = cmd[:at] + ([] if threads is None else ["--threads", str(threads)]) + cmd[at + 2:]
    if system == "int8-mixed-1mib":
        cmd = [sys.executable, "-c", FIXED_CHUNKS, *cmd[3:]]  # [python, -m, embedpipe.cli, embed, ...]
    return cmd


def pinned(cmd: list[str], cpus: int) -> list[str]:
    """``cmd`` under ``taskset`` to the first ``cpus`` CPUs this process may use."""
    allowed = sorted(os.sched_getaffinity(0))[:cpus]
    if shutil.which("taskset") is None:
        raise SystemExit("taskset is not installed (util-linux)")
    return ["taskset", "-c", ",".join(map(str, allowed)), *cmd]


def run_once(cmd: list[str], env: dict[str, str], neighbours: int) -> float:
    """Wall seconds of ``cmd``, beside ``neighbours`` spinning processes started just before."""
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(neighbours)]
    try:
        time.sleep(0.2 if spinners else 0)  # the neighbours are running before the job starts
        return run_process(cmd, env=env, capture=True).seconds
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def conditions(args: argparse.Namespace, system: str, model: Path, fasta: Path) -> dict[str, tuple[list[str], int]]:
    """condition -> (command, neighbours) for one system."""
    target = OUT / f"contention-{system}.h5"
    free = embed_command(system, model, fasta, target, None)
    every = {"quiet": (free, 0), "neighbour": (free, args.neighbours),
             "pinned": (pinned(free, args.pinned_cpus), 0),
             "quiet-P": (embed_command(system, model, fasta, target, args.pinned_cpus), 0)}
    return {name: every[name] for name in args.conditions}


def measure(args: argparse.Namespace, model: Path, fasta: Path) -> dict[tuple[str, str, str], list[float]]:
    """(wait policy, system, condition) -> wall seconds per round; rounds interleave everything."""
    walls: dict[tuple[str, str, str], list[float]] = {}
    for round_index in range(args.rounds):
        for wait in args.wait_policies:
            env = {k: v for k, v in os.environ.items() if k not in (*WAIT_VARIABLES, "OMP_NUM_THREADS")}
            env |= WAIT_POLICIES[wait]
            for system in args.systems:
                for condition, (cmd, neighbours) in conditions(args, system, model, fasta).items():
                    (OUT / f"contention-{system}.h5").unlink(missing_ok=True)
                    wall = run_once(cmd, env, neighbours)
                    walls.setdefault((wait, system, condition), []).append(wall)
                    print(f"  round {round_index + 1}: {wait:<9} {system:<15} {condition:<9} {wall:7.1f}s",
                          file=sys.stderr, flush=True)
    return walls


def report(args: argparse.Namespace, walls: dict[tuple[str, str, str], list[float]]) -> None:
    """One table per wait policy: seconds per condition, slowdowns, their ratio to fp32's; the
    policy this CPU's table row advises marked, and ``auto`` (measured on this node) beside it."""
    from embedpipe.runtime.advice import fastest_policy
    from embedpipe.runtime.cpu_features import detect

    median = {key: statistics.median(times) for key, times in walls.items()}
    for wait in args.wait_policies:
        chosen = WAIT_POLICIES[wait] or "(embedpipe sets GOMP_SPINCOUNT=1000 unless a wait policy is set)"
        print(f"\nwait policy: {wait} {chosen}\n")
        rows = []
        nan = float("nan")  # a condition not run (--conditions)
        fp32_slow = median.get((wait, "fp32", "neighbour"), nan) / median[(wait, "fp32", "quiet")]
        advised = fastest_policy(detect())[0]  # this CPU's table row (on AVX2: int8-mixed)
        for system in args.systems:
            m = {c: median.get((wait, system, c), nan) for c in CONDITIONS}
            label = f"{system} (advised here)" if system == advised else system
            slow = m["neighbour"] / m["quiet"]
            rounds = "/".join(f"{t:.1f}" for t in walls.get((wait, system, "neighbour"), []))
            fp32_beside = median.get((wait, "fp32", "neighbour"), nan)
            rows.append((label, f"{m['quiet']:.1f}", f"{m['neighbour']:.1f} ({rounds})", f"{slow:.2f}",
                         f"{slow / fp32_slow:.2f}", f"{fp32_beside / m['neighbour']:.2f}", f"{m['pinned']:.1f}",
                         f"{m['quiet-P']:.1f}", f"{m['pinned'] / m['quiet-P']:.2f}"))
        print(table(("policy", "quiet s", f"beside {args.neighbours} neighbour(s) s", "slowdown", "x fp32's slowdown",
                     "x fp32 beside neighbour", f"pinned to {args.pinned_cpus} s", f"quiet, --threads {args.pinned_cpus} s",
                     "pinned / quiet"), rows))
    print("\ntargets: the advised policy's slowdown <= 1.3x fp32's and x fp32 beside the neighbour > 1; "
          "pinned / quiet <= 1.3")


def count_ops(dim: int, tokens: int = 4096) -> None:
    """Top-level aten ops of one int8 linear call per layer shape (each a parallel region once
    above ATen's grain), at 1 MiB chunks and at 1 MiB per thread, against the prepacked fp32
    linear: a count, so it does not depend on the machine's load."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    import embedpipe.runtime.int8_linear as m
    from embedpipe.runtime.packed_linear import pack_linear

    def ops(run, x) -> int:
        run(x)
        with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
            run(x)
        return sum(1 for e in prof.events() if e.cpu_parent is None)

    per_thread = m.row_chunks
    print(f"\n{torch.get_num_threads()} threads, {tokens} tokens\n")
    rows = []
    for name, (k, n) in {"q/k/v": (dim, 3 * dim), "fc1": (dim, 4 * dim), "fc2": (4 * dim, dim)}.items():
        weight, x = torch.randn(n, k), torch.randn(tokens, k)
        layer, packed = m.Int8Linear(weight, torch.zeros(n)), pack_linear(weight, torch.zeros(n))
        m.row_chunks = lambda rows, cols: range(0, rows, max(16, m.CHUNK_BYTES // (4 * max(cols, 1))))
        fixed = ops(layer, x)
        m.row_chunks = per_thread
        fp32 = ops(packed, x) if packed is not None else "-"
        rows.append((f"{name} {k} -> {n}", fixed, ops(layer, x), fp32))
    print(table(("layer", "int8, 1 MiB chunks", "int8, 1 MiB per thread", "fp32 prepacked"), rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_input_arguments(parser)  # its --threads is unused here: the runs take their allocation
    parser.add_argument("--systems", nargs="+", default=[*POLICIES, "auto"],
                        choices=[*POLICIES, "auto", "int8-mixed-1mib", "fp16", "bf16", "amp-bf16", "fp16-mixed"])
    parser.add_argument("--repeat-input", type=int, default=1, help="the input N times (2: 200 proteins)")
    parser.add_argument("--max-records", type=int, default=None, help="the first N records only (smoke runs)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--neighbours", type=int, default=1, help="processes that each keep one core busy")
    parser.add_argument("--pinned-cpus", type=int, default=max(1, len(os.sched_getaffinity(0)) // 2))
    parser.add_argument("--conditions", nargs="+", default=list(CONDITIONS), choices=CONDITIONS,
                        help="quiet and neighbour are needed for the slowdowns")
    parser.add_argument("--wait-policies", nargs="+", default=["embedpipe"], choices=list(WAIT_POLICIES))
    parser.add_argument("--count-ops", action="store_true",
                        help="only count the eager ops of one int8 linear per layer shape (no timing)")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # killed: the finally blocks stop the neighbours
    if args.count_ops:
        import torch

        torch.set_num_threads(args.threads)
        return count_ops(args.dim)
    if "fp32" not in args.systems:
        parser.error("--systems must include fp32 (the slowdowns are compared with its own)")
    OUT.mkdir(parents=True, exist_ok=True)
    fasta = repeat_input(args.fasta, args.repeat_input) if args.repeat_input > 1 else args.fasta
    if args.max_records:
        from embedpipe.inputs.fasta import read_sequences

        records = list(read_sequences(fasta))[: args.max_records]
        fasta = write_fasta(OUT / f"first{args.max_records}-{fasta.name}", records)
    from embedpipe.core.cpus import allocated
    from embedpipe.runtime.cpu_features import detect

    model = bench_model(args)
    cpu, own = detect(), allocated()
    print(f"input: {fasta.name}; {args.layers} layers x {args.dim} dims; {own.count} CPUs ({own.source}); "
          f"CPU {cpu.cpu_class} ({cpu.named()}); {args.rounds} interleaved round(s), medians", file=sys.stderr)
    print(machine_header())
    report(args, measure(args, model, fasta))


if __name__ == "__main__":
    main()
