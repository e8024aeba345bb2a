"""How fast can bf16-mixed or int8-mixed be here at all? A floor from parts (``parts``), or int8's linears free (``int8-free``).

``parts``:

bf16-mixed runs every projection and FFN matmul in bf16 and keeps attention scores and
softmax in fp32 (docs/precision.md). So no implementation of that policy can take
less time than

    start-up (import torch + esm + h5py, load the checkpoint)
  + the model's matmuls in bf16 at this machine's best measured speed (oneDNN-prepacked
    weights) for exactly those shapes
  + fp32 fused attention (SDPA) on exactly the worker's batches,

with every layer norm, GELU, rotation, cast, check and write taken as free. This script
measures each part on the batches embedpipe's planner makes for the input, runs fair-esm's
extraction recipe and `embedpipe embed --precision bf16-mixed` as whole processes in the
same run, and prints the recipe's time over the floor: the best ratio to the recipe any
bf16-mixed implementation could reach here. The matmuls are also timed in int8 (embedpipe's
int8 kernel, quantization excluded) and the floor takes the faster: on AMX and VNNI CPUs int8
may be this machine's best arithmetic. It also times the attention in bf16, to show whether
giving up the fp32 island would buy anything on this CPU.

    python benchmarks/cpu_ceiling.py parts --repeats 3                                   # bundled example, 35M shape
    python benchmarks/cpu_ceiling.py parts --layers 30 --dim 640 --heads 20 --repeats 3  # the 150M shape
    python benchmarks/cpu_ceiling.py parts --layers 2 --dim 64 --heads 4 --repeats 1     # smoke run

``int8-free``: int8-mixed runs q/k/v, the out projection, fc1 and fc2 in int8 and keeps
everything else fp32 by design (docs/precision.md, "int8-mixed"), so no int8 kernel, however
fast, can make a run take less than that rest. This measures the rest directly: ``int8-free``
is ``embedpipe embed --precision int8-mixed`` in a process whose int8 linear layers return zeros
of their output's shape (set up by this script in that child: no quantize, no matmul, no
rescale; the zeros keep every later op's shapes and cost, and are finite, so no record falls
back). fp32 time / int8-free time is the ceiling of int8-mixed's speed-up on this CPU; fp32 /
int8-mixed is where it stands. Whole processes, interleaved rounds, medians.

    python benchmarks/cpu_ceiling.py int8-free --repeat-input 2 --rounds 2      # the 200-protein input
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 python benchmarks/cpu_ceiling.py int8-free ...
"""

from __future__ import annotations

import argparse
import os
import sys

from _harness import Ratio, machine_header, run_process, table, time_call
from embed_throughput import OUT, add_input_arguments, bench_model, repeat_input, run_rounds, system_command

#: the child of ``int8-free``: the int8 layers' forward replaced, then the CLI as usual
FREE_LINEARS = (
    "import sys; import embedpipe.runtime.int8_linear as m\n"
    "m.Int8Linear.__call__ = lambda self, x, gelu=False: x.new_zeros(*x.shape[:-1], self.out_features)\n"
    "sys.argv = ['embedpipe'] + sys.argv[1:]\n"
    "from embedpipe.cli import run; run()\n")


def int8_matmuls(matmul_inputs, dim: int, layers: int):
    """The same matmuls in int8 (embedpipe's int8 kernel, inputs quantized before timing): on
    CPUs with AMX or VNNI int8 may be the fastest arithmetic this machine has."""
    import torch

    from embedpipe.runtime.int8_linear import Int8Linear

    generator = torch.Generator().manual_seed(0)
    shapes = {"qkv": (3 * dim, dim), "out": (dim, dim), "fc1": (4 * dim, dim), "fc2": (dim, 4 * dim)}
    linears = {name: Int8Linear(torch.randn(*shape, generator=generator), None) for name, shape in shapes.items()}
    zero, dtype = linears["qkv"].zero_point, linears["qkv"].input_dtype
    inputs = [tuple((torch.randint(-127, 128, t.shape, generator=generator) + zero).to(dtype) for t in pair)
              for pair in matmul_inputs]

    def run() -> None:
        for x, h in inputs:
            for _ in range(layers):
                for name in ("qkv", "out", "fc1"):
                    linears[name].scaled_matmul(x)
                linears["fc2"].scaled_matmul(h)
    return run


def int8_free(args: argparse.Namespace) -> None:
    """fp32, int8-mixed and int8-free as whole processes, interleaved rounds, medians."""
    import statistics

    from embedpipe.runtime.cpu_features import detect, isa_caps

    fasta = repeat_input(args.fasta, args.repeat_input) if args.repeat_input > 1 else args.fasta
    model = bench_model(args)
    commands = {}
    for system in ("fp32", "int8-mixed", "int8-free"):
        target = OUT / f"ceiling-{system}.h5"
        cmd = system_command("int8-mixed" if system == "int8-free" else system, model, fasta, target, args.threads)
        if system == "int8-free":
            cmd = [sys.executable, "-c", FREE_LINEARS, *cmd[3:]]  # [python, -m, embedpipe.cli, embed, ...]
        commands[system] = (cmd, target)
    walls, _ = run_rounds(commands, args.rounds, dict(os.environ, OMP_NUM_THREADS=str(args.threads)))
    median = {system: statistics.median(times) for system, times in walls.items()}
    cpu = detect()
    caps = f"; capped (emulated): {isa_caps()}" if isa_caps() else ""
    print(f"\ninput: {fasta.name}; {args.layers} layers x {args.dim} dims; threads {args.threads}; median of "
          f"{args.rounds} interleaved round(s); CPU {cpu.cpu_class} ({cpu.named()}; torch kernels "
          f"{cpu.torch_capability}{caps})\n")
    rows = [(system, median[system], ", ".join(f"{t:.1f}" for t in times)) for system, times in walls.items()]
    print(table(("run", "median s", "rounds s"), rows, [Ratio("median s", 0, "fp32 / this")], {"median s": "{:.1f}"}))
    print(f"\nint8-mixed's speed-up {median['fp32'] / median['int8-mixed']:.2f}x of a ceiling of "
          f"{median['fp32'] / median['int8-free']:.2f}x (its linear layers free); the linears take "
          f"{median['int8-mixed'] - median['int8-free']:.1f} s of its {median['int8-mixed']:.1f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("measure", choices=["parts", "int8-free"])
    add_input_arguments(parser)
    parser.add_argument("--repeats", type=int, default=2, help="parts: best of N for each measured part")
    parser.add_argument("--policies", nargs="+", default=["bf16-mixed", "int8-mixed", "auto"],
                        help="parts: whole embed runs to set against the floor (the policy this CPU's table row "
                             "advises is marked; auto measures on this node)")
    parser.add_argument("--repeat-input", type=int, default=1, help="int8-free: the input N times (2: 200 proteins)")
    parser.add_argument("--rounds", type=int, default=1, help="int8-free: interleaved rounds")
    args = parser.parse_args()
    print(machine_header())
    (parts if args.measure == "parts" else int8_free)(args)


def parts(args: argparse.Namespace) -> None:
    """The floor from measured parts beside the recipe and the real runs."""
    import torch
    import torch.nn.functional as F
    from _helpers import embedder_for

    from embedpipe.core.options import EmbedOptions
    from embedpipe.inputs.fasta import read_sequences
    from embedpipe.model import load_model
    from embedpipe.runtime.advice import fastest_policy
    from embedpipe.runtime.cpu_features import detect
    from embedpipe.runtime.packed_linear import pack_linear

    torch.set_num_threads(args.threads)
    model_path = bench_model(args)
    records = list(read_sequences(args.fasta))
    residues = sum(min(len(s), 1022) for _, s in records)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))

    # -- whole processes: the recipe and the real bf16-mixed run ---------------------------------
    recipe_s = run_process(system_command("fair-esm", model_path, args.fasta, OUT / "fair-esm", args.threads), env).seconds
    embed_s = {}
    for policy in args.policies:
        store = OUT / f"ceiling-{policy}.h5"
        store.unlink(missing_ok=True)
        embed_s[policy] = run_process(system_command(policy, model_path, args.fasta, store, args.threads), env).seconds
    advised, _ = fastest_policy(detect())
    startup_s = min(run_process([sys.executable, "-c", "import torch, esm, h5py; from embedpipe.model import load_model; "
                                 f"torch.set_num_threads({args.threads}); load_model({str(model_path)!r})"], env).seconds
                    for _ in range(args.repeats))

    # -- the parts, on the worker's own batches ------------------------------------------------
    loaded = load_model(str(model_path))
    embedder = embedder_for(loaded, EmbedOptions(precision="bf16-mixed", long_sequences="truncate"), torch.device("cpu"))
    plan = embedder.plan(records)
    shapes = [(len(batch), max(p.residues for p in batch) + 2) for batch in plan.batches]
    dim, heads, layers = args.dim, args.heads, args.layers
    generator = torch.Generator().manual_seed(0)
    shapes_of = {"qkv": (3 * dim, dim), "out": (dim, dim), "fc1": (4 * dim, dim), "fc2": (dim, 4 * dim)}
    weights = {name: torch.randn(*shape, generator=generator).bfloat16() for name, shape in shapes_of.items()}
    # the fastest matmul this machine offers for the shape: oneDNN-prepacked where available
    linears = {}
    for name, weight in weights.items():
        bias = torch.zeros(weight.shape[0], dtype=torch.bfloat16)
        packed = pack_linear(weight, bias)
        linears[name] = packed if packed is not None else (lambda x, w=weight, b=bias, **_: F.linear(x, w, b))
    # inputs made before timing: only the kernels are measured
    matmul_inputs = [(torch.randn(b * w, dim).bfloat16(), torch.randn(b * w, 4 * dim).bfloat16()) for b, w in shapes]

    def matmuls() -> None:
        for x, h in matmul_inputs:
            for _ in range(layers):
                linears["qkv"](x)
                linears["out"](x)
                linears["fc1"](x, gelu=True)  # GELU in the epilogue: the floor does not count it either
                linears["fc2"](h)

    def attention(dtype: torch.dtype):
        inputs = []
        for (batch, width), pieces in zip(shapes, plan.batches):
            q, k, v = (torch.randn(batch, heads, width, dim // heads).to(dtype) for _ in range(3))
            keep = torch.zeros(batch, 1, 1, width, dtype=torch.bool)
            for row, piece in enumerate(pieces):
                keep[row, ..., : piece.residues + 2] = True
            inputs.append((q, k, v, None if bool(keep.all()) else keep))

        def run() -> None:
            for q, k, v, mask in inputs:
                for _ in range(layers):
                    F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return run

    with torch.inference_mode():
        bf16_matmul_s = time_call(matmuls, args.repeats).best
        int8_matmul_s = time_call(int8_matmuls(matmul_inputs, dim, layers), args.repeats).best
        matmul_s = min(bf16_matmul_s, int8_matmul_s)  # the best speed this machine has for them
        attention_s = time_call(attention(torch.float32), args.repeats).best
        attention_bf16_s = time_call(attention(torch.bfloat16), args.repeats).best

    floor_s = startup_s + matmul_s + attention_s
    rows = [
        ("fair-esm recipe (fp32, whole process)", recipe_s),
        *((f"embedpipe {policy}{' (advised here)' if policy == advised else ''} (whole process)", seconds)
          for policy, seconds in embed_s.items()),
        ("floor: start-up + the fastest matmuls + fp32 attention", floor_s),
        ("  start-up (imports + checkpoint load)", startup_s),
        ("  bf16 matmuls, worker's batch shapes", bf16_matmul_s),
        ("  (int8 matmuls, same shapes, quantization excluded)", int8_matmul_s),
        ("  fp32 SDPA attention, worker's batches", attention_s),
        ("  (bf16 SDPA attention, same batches)", attention_bf16_s),
    ]
    print(f"\ninput: {args.fasta.name} ({len(records)} records, {residues} residues); model {layers} layers x "
          f"{dim} dims x {heads} heads; {len(shapes)} batches; threads {args.threads}")
    print("\n" + table(("part", "seconds"), rows, [Ratio("seconds", 0, "recipe / this")], {"seconds": "{:.1f}"}))
    cpu = detect()
    print(f"\nCPU class {cpu.cpu_class} ({cpu.named()}); advised policy {advised}. No implementation can pass "
          f"{recipe_s / floor_s:.2f}x the recipe here (everything but the matmuls, at the faster of bf16 and int8, "
          f"and the attention free); bf16 attention would change the floor by {attention_s - attention_bf16_s:+.1f} s.")
    for policy, seconds in embed_s.items():
        print(f"{policy}: {recipe_s / seconds:.2f}x the recipe; floor / embedpipe = {floor_s / seconds:.0%} "
              "(the target for the advised policy: >= 50%)")


if __name__ == "__main__":
    main()
