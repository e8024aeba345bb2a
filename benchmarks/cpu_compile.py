"""Does ``torch.compile`` of the layer's elementwise work pay on this CPU, and from how many residues?

Compiles the pieces between the prepacked matmuls (embedpipe/runtime/fused.py: norms + casts,
residual adds, the rotary rotation; int8's quantize and rescale stay eager, compiled they were
slower; the oneDNN linears and the attention stay eager, dynamo cannot trace them) and runs each policy side by side on the
worker's own batches of the input, each system in a fresh process:

  eager         the forward as `embed` runs it today
  compiled cold the same with the pieces compiled, inductor cache empty (TORCHINDUCTOR_CACHE_DIR
                a new directory): what the first shard job of a workflow pays
  compiled warm the same again on that cache: what every later shard job pays

Each process times its first pass over the input (compile included) and then --repeats steady
passes (best taken). Compile cost = (first - steady) compiled minus the same for eager (eager's
own warm-up). Break-even = compile cost / (seconds saved per residue at steady state): the
residues a job must embed before compiling pays for itself. Recompiles and graph counts come
from dynamo's counters (shapes are dynamic: one graph per piece, none per batch).

    python benchmarks/cpu_compile.py --repeats 2                                    # 35M shape
    python benchmarks/cpu_compile.py --layers 30 --dim 640 --heads 20 --repeats 2   # 150M shape
    python benchmarks/cpu_compile.py --layers 2 --dim 64 --heads 4 --max-records 10 --repeats 1  # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from embed_throughput import OUT, add_input_arguments, bench_model  # noqa: E402

PRECISIONS = ("fp32", "bf16-mixed", "int8-mixed")


def child(args: argparse.Namespace) -> None:
    """One system in this process: print {first_s, steady_s, residues, graphs, recompiles} as JSON."""
    import torch
    import torch._dynamo.utils as dynamo_utils

    from embedpipe.embed.engine import Embedder, EmbedOptions
    from embedpipe.inputs.fasta import read_sequences
    from embedpipe.model import load_model

    torch.set_num_threads(args.threads)
    records = list(read_sequences(args.fasta))[: args.max_records]
    loaded = load_model(str(bench_model(args)))
    embedder = Embedder(loaded, EmbedOptions(precision=args.child, long_sequences="truncate"), torch.device("cpu"))
    plan = embedder.plan(records)
    runner = embedder.runner(embedder.policy)  # prepared (and int8 calibrated) before any timing
    compiled = bool(args.compile) and runner.compile_elementwise()  # type: ignore[attr-defined]

    def one_pass() -> float:
        start = time.perf_counter()
        for _ in embedder.embed(records, plan):
            pass
        return time.perf_counter() - start

    first = one_pass()
    steady = min(one_pass() for _ in range(args.repeats))
    print(json.dumps({
        "first_s": first, "steady_s": steady, "compiled": compiled, "batches": len(plan.batches),
        "residues": sum(min(len(s), 1022) for _, s in records),
        "graphs": dynamo_utils.counters["stats"].get("unique_graphs", 0),
        "recompiles": sum(dynamo_utils.counters["recompiles"].values()) if "recompiles" in dynamo_utils.counters
        else 0,
    }))


def run_child(args: argparse.Namespace, precision: str, compile_: bool, cache: Path) -> dict:
    command = [sys.executable, __file__, "--child", precision, "--fasta", str(args.fasta), "--layers", str(args.layers),
               "--dim", str(args.dim), "--heads", str(args.heads), "--threads", str(args.threads),
               "--repeats", str(args.repeats)]
    if args.max_records is not None:
        command += ["--max-records", str(args.max_records)]
    if compile_:
        command.append("--compile")
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), TORCHINDUCTOR_CACHE_DIR=str(cache))
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{precision} compile={compile_} failed:\n{done.stderr[-3000:]}")
    result: dict = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_input_arguments(parser)
    parser.add_argument("--precisions", nargs="+", default=list(PRECISIONS))
    parser.add_argument("--repeats", type=int, default=2, help="steady passes per process (best taken)")
    parser.add_argument("--max-records", type=int, default=None, help="the first N records only")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return

    rows = []
    for precision in args.precisions:
        cache = OUT / f"inductor-cache-{precision}-t{args.layers}_{args.dim}"
        shutil.rmtree(cache, ignore_errors=True)  # cold: nothing compiled yet
        eager = run_child(args, precision, False, cache)
        cold = run_child(args, precision, True, cache)
        warm = run_child(args, precision, True, cache)  # the cache the cold run filled
        rows.append((precision, eager, cold, warm))

    first = rows[0][1]
    print(f"\ninput: {args.fasta.name} ({first['residues']} residues, {first['batches']} batches); model "
          f"{args.layers} layers x {args.dim} dims x {args.heads} heads; threads {args.threads}; best of {args.repeats}")
    print("\n| policy | eager s | compiled s | eager / compiled | compile s cold | compile s warm "
          "| break-even residues cold | warm | graphs | recompiles |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for precision, eager, cold, warm in rows:
        warmup = eager["first_s"] - eager["steady_s"]
        steady = min(cold["steady_s"], warm["steady_s"])
        saved_per_residue = (eager["steady_s"] - steady) / eager["residues"]
        costs = [max(0.0, run["first_s"] - run["steady_s"] - warmup) for run in (cold, warm)]
        even = [f"{cost / saved_per_residue:,.0f}" if saved_per_residue > 0 else "never" for cost in costs]
        print(f"| {precision} | {eager['steady_s']:.2f} | {steady:.2f} | {eager['steady_s'] / steady:.2f} | "
              f"{costs[0]:.1f} | {costs[1]:.1f} | {even[0]} | {even[1]} | {warm['graphs']} | "
              f"{cold['recompiles']}/{warm['recompiles']} |")


if __name__ == "__main__":
    main()
