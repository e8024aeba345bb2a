"""How fast can bf16-mixed or int8-mixed be on this CPU at all? A floor from measured parts, beside the real runs.

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

    python benchmarks/cpu_ceiling.py --repeats 3                                   # bundled example, 35M shape
    python benchmarks/cpu_ceiling.py --layers 30 --dim 640 --heads 20 --repeats 3  # the 150M shape
    python benchmarks/cpu_ceiling.py --layers 2 --dim 64 --heads 4 --repeats 1     # smoke run
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from embed_throughput import OUT, add_input_arguments, bench_model, best_of, system_command, timed  # noqa: E402


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_input_arguments(parser)
    parser.add_argument("--repeats", type=int, default=2, help="best of N for each measured part")
    parser.add_argument("--policies", nargs="+", default=["bf16-mixed", "int8-mixed", "auto"],
                        help="whole embed runs to set against the floor (the policy this CPU's table row advises is "
                             "marked; auto measures on this node)")
    args = parser.parse_args()

    import torch
    import torch.nn.functional as F

    from embedpipe.embed.engine import Embedder, EmbedOptions
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
    recipe_s, _ = timed(system_command("fair-esm", model_path, args.fasta, OUT / "fair-esm", args.threads), env)
    embed_s = {}
    for policy in args.policies:
        store = OUT / f"ceiling-{policy}.h5"
        store.unlink(missing_ok=True)
        embed_s[policy], _ = timed(system_command(policy, model_path, args.fasta, store, args.threads), env)
    advised, _ = fastest_policy(detect())
    startup_s = min(timed([sys.executable, "-c", "import torch, esm, h5py; from embedpipe.model import load_model; "
                           f"torch.set_num_threads({args.threads}); load_model({str(model_path)!r})"], env)[0]
                    for _ in range(args.repeats))

    # -- the parts, on the worker's own batches ------------------------------------------------
    loaded = load_model(str(model_path))
    embedder = Embedder(loaded, EmbedOptions(precision="bf16-mixed", long_sequences="truncate"), torch.device("cpu"))
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
        bf16_matmul_s = best_of(args.repeats, matmuls)
        int8_matmul_s = best_of(args.repeats, int8_matmuls(matmul_inputs, dim, layers))
        matmul_s = min(bf16_matmul_s, int8_matmul_s)  # the best speed this machine has for them
        attention_s = best_of(args.repeats, attention(torch.float32))
        attention_bf16_s = best_of(args.repeats, attention(torch.bfloat16))

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
    print("\n| part | seconds | recipe / this |")
    print("|---|---|---|")
    for name, seconds in rows:
        print(f"| {name} | {seconds:.1f} | {recipe_s / seconds:.2f} |")
    cpu = detect()
    print(f"\nCPU class {cpu.cpu_class} ({cpu.named()}); advised policy {advised}. No implementation can pass "
          f"{recipe_s / floor_s:.2f}x the recipe here (everything but the matmuls, at the faster of bf16 and int8, "
          f"and the attention free); bf16 attention would change the floor by {attention_s - attention_bf16_s:+.1f} s.")
    for policy, seconds in embed_s.items():
        print(f"{policy}: {recipe_s / seconds:.2f}x the recipe; floor / embedpipe = {floor_s / seconds:.0%} "
              "(issue 35's target for the advised policy: >= 50%)")


if __name__ == "__main__":
    main()
