"""How fast can int8-mixed be at all? The same run with its linear layers made free, beside fp32 and int8-mixed.

int8-mixed runs q/k/v, the out projection, fc1 and fc2 in int8 and keeps everything else fp32
by design (docs/precision.md, "int8-mixed"): attention scores and softmax, layer norms, the
residual stream, rotary, pooling, plus start-up and writing the store. So no int8 kernel,
however fast, can make a run take less than that rest. This script measures the rest
directly: ``int8-free`` is ``embedpipe embed --precision int8-mixed`` in a process whose int8
linear layers return zeros of their output's shape (no quantize, no matmul, no rescale; the
zeros keep every later op's shapes and cost, and are finite, so no record falls back).
fp32 time / int8-free time is the ceiling of int8-mixed's speed-up on this CPU; fp32 /
int8-mixed is where it stands. Whole processes, interleaved rounds, medians.

    python benchmarks/int8_ceiling.py --repeat-input 2 --rounds 2      # the 200-protein input
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 python benchmarks/int8_ceiling.py ...
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

from embed_throughput import OUT, add_input_arguments, bench_model, repeat_input, run_rounds, system_command  # noqa: E402

#: the child of ``int8-free``: the int8 layers' forward replaced, then the CLI as usual
FREE_LINEARS = (
    "import sys; import embedpipe.runtime.int8_linear as m\n"
    "m.Int8Linear.__call__ = lambda self, x, gelu=False: x.new_zeros(*x.shape[:-1], self.out_features)\n"
    "sys.argv = ['embedpipe'] + sys.argv[1:]\n"
    "from embedpipe.cli import run; run()\n")


def commands(model: Path, fasta: Path, threads: int) -> dict[str, tuple[list[str], Path]]:
    """fp32, int8-mixed and int8-free: the same embed command line, the last with free linears."""
    out = {}
    for system in ("fp32", "int8-mixed", "int8-free"):
        target = OUT / f"ceiling-{system}.h5"
        cmd = system_command("int8-mixed" if system == "int8-free" else system, model, fasta, target, threads)
        if system == "int8-free":
            cmd = [sys.executable, "-c", FREE_LINEARS, *cmd[3:]]  # [python, -m, embedpipe.cli, embed, ...]
        out[system] = (cmd, target)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_input_arguments(parser)
    parser.add_argument("--repeat-input", type=int, default=1, help="the input N times (2: 200 proteins)")
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    fasta = repeat_input(args.fasta, args.repeat_input) if args.repeat_input > 1 else args.fasta
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    walls, _ = run_rounds(commands(bench_model(args), fasta, args.threads), args.rounds, env)
    median = {system: statistics.median(times) for system, times in walls.items()}
    from embedpipe.runtime.cpu_features import detect, isa_caps

    cpu = detect()
    caps = f"; capped (emulated): {isa_caps()}" if isa_caps() else ""
    print(f"\ninput: {fasta.name}; {args.layers} layers x {args.dim} dims; threads {args.threads}; median of "
          f"{args.rounds} interleaved round(s); CPU {cpu.cpu_class} ({cpu.named()}; torch kernels "
          f"{cpu.torch_capability}{caps})\n")
    print("| run | median s | rounds s | fp32 / this |\n|---|---|---|---|")
    for system, times in walls.items():
        rounds = ", ".join(f"{t:.1f}" for t in times)
        print(f"| {system} | {median[system]:.1f} | {rounds} | {median['fp32'] / median[system]:.2f} |")
    print(f"\nint8-mixed's speed-up {median['fp32'] / median['int8-mixed']:.2f}x of a ceiling of "
          f"{median['fp32'] / median['int8-free']:.2f}x (its linear layers free); the linears take "
          f"{median['int8-mixed'] - median['int8-free']:.1f} s of its {median['int8-mixed']:.1f} s")


if __name__ == "__main__":
    main()
