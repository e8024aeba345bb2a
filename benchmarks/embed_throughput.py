"""Side-by-side embedding throughput: fair-esm's extraction recipe vs `embedpipe embed` per policy.

Every system runs as its own whole process on the same input and the same random-weight
checkpoint (esm2_t12_35M shape by default: 12 layers, 480 dims, 20 heads), so start-up,
model loading and output writing count too. Prints residues/s, the ratio to the fair-esm
recipe, padding efficiency, model FLOP utilisation against this machine's measured matmul
peak, peak RSS, and the pooled cosine of every store to embedpipe's fp32 store.

    python benchmarks/embed_throughput.py                       # all policies, bundled example
    python benchmarks/embed_throughput.py --systems fair-esm fp32 bf16-mixed amp-bf16

Optional peers: Hugging Face transformers' EsmModel with SDPA attention on the same weights
(benchmarks/hf_esm_peer.py), in fp32 (hf-transformers) and cast to bf16 (hf-transformers-bf16,
the peer a CPU user after speed would pick), when `transformers` is installed
(`pip install transformers`). With the bf16 peer in the run, the table has a column of
ratios to it. esm.cpp (PyPI ``esm-cpp``, benchmarks/esm_cpp_peer.py) when it is installed:
its fp32 path (esm-cpp) and, where the CPU has VNNI or AMX, its int8 path (esm-cpp-int8).

``--repeat-input 2`` doubles the input (the second copy reversed, new IDs): swissprot100
becomes the 200-protein real-length input of docs/benchmarks.md. The CPU's flags that
decide the policies (native bf16/fp16, int8 dot products) are printed with the table.

The fair-esm recipe reproduces the logic of scripts/extract.py from the fair-esm repository:
FastaBatchedDataset, length-sorted batches of at most 4096 tokens, truncation at 1022
residues, fp32, one output file per sequence with its mean representation. embedpipe runs
with ``--long-sequences truncate`` here so both systems embed exactly the same residues.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import shutil
import sys
from pathlib import Path

import numpy as np
from _harness import Ratio, cosine, engine_env, interleaved, machine_header, table, time_call, write_fasta

from embedpipe.core.options import AUTO_CACHE_VARIABLE, CPU_TOKENS_PER_BATCH, POLICY_NAMES

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "out" / "throughput"
DIRECTORY_SYSTEMS = ("fair-esm", "hf-transformers", "hf-transformers-bf16", "esm-cpp", "esm-cpp-int8")  # one .pt per sequence
ESM_CPP_SYSTEMS = {"esm-cpp": "float32", "esm-cpp-int8": "int8"}  # system -> its matmul dtype
HF_SYSTEMS = {"hf-transformers": "float32", "hf-transformers-bf16": "bfloat16"}  # system -> the peer's --dtype
POLICIES = list(POLICY_NAMES)
#: embedpipe runs with options beyond the policy: system -> (policy, extra arguments)
VARIANTS: dict[str, tuple[str, list[str]]] = {f"{policy}-bf16-attention": (policy, []) for policy in ("bf16-mixed", "int8-mixed")}
#: embedpipe runs with an engine choice pinned (the expert ``EMBEDPIPE_ENGINE``): system -> choices
ENGINE_CHOICES = {f"{policy}-bf16-attention": {"attention_inputs": "compute"} for policy in ("bf16-mixed", "int8-mixed")}
#: ``--precision auto`` with one measurement cache for the whole benchmark run
#: (``EMBEDPIPE_AUTO_CACHE``): its first run measures on this node (the probe's cost included),
#: later ones read the cache
VARIANTS["auto"] = ("auto", [])
AUTO_CACHE = OUT / "auto-precision"
#: ``auto`` measured whatever the job's size, as a user asks for it: ``decide-precision`` (which
#: measures when not given the run's residues), then ``embed --precision auto:FILE``, timed
#: together: the decision's cost beside the policies it chooses among
MEASURED = "auto-measured"
DECISION = OUT / "auto-measured-decision.json"
VARIANTS[MEASURED] = (f"auto:{DECISION}", [])
#: embedpipe's batch budget here: the CPU's ``--tokens-per-batch auto`` (options.CPU_TOKENS_PER_BATCH),
#: given as a number so that it is the recipe's 4096 whatever the default becomes
EMBEDPIPE_TOKENS_PER_BATCH = CPU_TOKENS_PER_BATCH


# -- fair-esm's recipe (runs in a child process) -----------------------------------------------

def run_fair_esm_recipe(model_path: Path, fasta: Path, out_dir: Path, threads: int) -> None:
    """scripts/extract.py's logic: --include mean --repr_layers -1 --toks_per_batch 4096 --truncation_seq_length 1022."""
    import argparse as _argparse

    import esm
    import torch
    from esm.data import FastaBatchedDataset

    torch.set_num_threads(threads)
    with torch.serialization.safe_globals([_argparse.Namespace]):
        model, alphabet = esm.pretrained.load_model_and_alphabet_local(str(model_path))
    model.eval()
    dataset = FastaBatchedDataset.from_file(str(fasta))
    batches = dataset.get_batch_indices(4096, extra_toks_per_seq=1)
    loader = torch.utils.data.DataLoader(dataset, collate_fn=alphabet.get_batch_converter(1022), batch_sampler=batches)
    out_dir.mkdir(parents=True, exist_ok=True)
    layer = model.num_layers
    real = computed = 0
    with torch.no_grad():
        for labels, strs, toks in loader:
            out = model(toks, repr_layers=[layer], return_contacts=False)
            reps = out["representations"][layer].to(device="cpu")
            computed += toks.numel()
            for i, label in enumerate(labels):
                n = min(1022, len(strs[i]))
                real += n + 2
                result = {"label": label, "mean_representations": {layer: reps[i, 1 : n + 1].mean(0).clone()}}
                torch.save(result, out_dir / f"{label.split()[0].replace('|', '_')}.pt")
    (out_dir / "_stats.json").write_text(json.dumps({"padding_efficiency": real / computed}))


# -- measurement helpers -------------------------------------------------------------------------

def system_command(system: str, model: Path, fasta: Path, target: Path, threads: int) -> list[str]:
    """The whole-process command line of one compared system writing to ``target``."""
    if system == "fair-esm":
        return [sys.executable, __file__, "--threads", str(threads), "--run-recipe", str(model), str(fasta), str(target)]
    if system in HF_SYSTEMS:
        return [sys.executable, str(ROOT / "benchmarks" / "hf_esm_peer.py"), str(model), str(fasta), str(target),
                "--threads", str(threads), "--dtype", HF_SYSTEMS[system]]
    if system in ESM_CPP_SYSTEMS:
        return [sys.executable, str(ROOT / "benchmarks" / "esm_cpp_peer.py"), str(model), str(fasta), str(target),
                "--threads", str(threads), *(["--int8"] if system == "esm-cpp-int8" else [])]
    policy, extra = VARIANTS.get(system, (system, []))
    embed = [sys.executable, "-m", "embedpipe.cli", "embed", str(fasta), "--model", str(model), "--out", str(target),
             "--precision", policy, "--long-sequences", "truncate",
             "--tokens-per-batch", str(EMBEDPIPE_TOKENS_PER_BATCH), "--threads", str(threads), "--quiet", *extra]
    if system != MEASURED:
        return embed
    decide = [sys.executable, "-m", "embedpipe.cli", "decide-precision", str(fasta), "--model", str(model),
              "--out", str(DECISION), "--long-sequences", "truncate", "--threads", str(threads), "--quiet"]
    return ["sh", "-c", f"{shlex.join(decide)} && {shlex.join(embed)}"]


def matmul_peak(dtype_name: str, threads: int, n: int = 2048, repeats: int = 5) -> float:
    """Measured dense GEMM FLOP/s for a dtype on this machine: the better (best of ``repeats``)
    of ``F.linear`` and a oneDNN-prepacked weight (what embedpipe's CPU projections use)."""
    import torch
    import torch.nn.functional as F

    from embedpipe.runtime.packed_linear import pack_linear

    torch.set_num_threads(threads)
    if dtype_name == "int8":  # embedpipe's int8 matmul (int8-mixed), quantization excluded
        from embedpipe.runtime.int8_linear import Int8Linear

        layer = Int8Linear(torch.randn(n, n), None)
        xq = (torch.randint(-127, 128, (n, n)) + layer.zero_point).to(layer.input_dtype)
        layer.scaled_matmul(xq)
        return 2 * n**3 / time_call(lambda: layer.scaled_matmul(xq), rounds=repeats).best
    dtype = getattr(torch, dtype_name)
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    packed = pack_linear(b, None)
    candidates = [lambda: F.linear(a, b)] + ([lambda: packed(a)] if packed is not None else [])
    return 2 * n**3 / min(time_call(run, rounds=repeats, warmup=1).best for run in candidates)


def model_flops(lengths: list[int], layers: int, dim: int) -> float:
    """Forward FLOPs: projections + FFN (24 D^2 per token per layer) + attention (4 T D per token per layer)."""
    total = 0.0
    for n in lengths:
        t = min(n, 1022) + 2
        total += t * layers * (24 * dim * dim + 4 * t * dim)
    return total


def read_means(system: str, path: Path, layer: int) -> dict[str, np.ndarray]:
    if system in DIRECTORY_SYSTEMS:
        import torch

        out = {}
        for f in path.glob("*.pt"):
            data = torch.load(f, weights_only=True)
            out[data["label"].split()[0]] = data["mean_representations"][layer].numpy()
        return out
    import h5py

    with h5py.File(path, "r") as f:
        ids = [x.decode() if isinstance(x, bytes) else str(x) for x in f["ids"][()]]
        matrix = f[f"mean/layer_{layer}"][()].astype(np.float32)
    return dict(zip(ids, matrix))


def add_input_arguments(parser: argparse.ArgumentParser) -> None:
    """Input, model shape (esm2_t12_35M by default) and threads: shared by the CPU benchmarks."""
    parser.add_argument("--fasta", type=Path, default=ROOT / "examples" / "swissprot100.fasta")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--dim", type=int, default=480)
    parser.add_argument("--heads", type=int, default=20)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)


def bench_model(args: argparse.Namespace) -> Path:
    """The random-weight checkpoint of the requested shape, made once under benchmarks/out/."""
    from embedpipe.model.random_checkpoint import make_test_model

    OUT.mkdir(parents=True, exist_ok=True)
    model = OUT / f"esm2_bench_t{args.layers}_{args.dim}.pt"
    if not model.exists():
        make_test_model(model, layers=args.layers, dim=args.dim, heads=args.heads, seed=0)
    return model


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_input_arguments(parser)
    parser.add_argument("--max-records", type=int, default=None,
                        help="use the first N records only (fp16 is emulated on most CPUs: keep its runs short)")
    parser.add_argument("--systems", nargs="+", default=["fair-esm", *HF_SYSTEMS, *ESM_CPP_SYSTEMS, *POLICIES])
    parser.add_argument("--repeat-input", type=int, default=1,
                        help="the input N times, copies after the first reversed with new IDs (2: 200 proteins)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every system N times, interleaved (system order per round), and report the "
                             "median: on a shared or noisy machine drifts then hit all systems alike")
    parser.add_argument("--run-recipe", nargs=3, metavar=("MODEL", "FASTA", "OUT"), help=argparse.SUPPRESS)
    return parser.parse_args()


def system_commands(args: argparse.Namespace, model: Path) -> dict[str, tuple[list[str], Path]]:
    """system -> (command, its output), for every system that can run here."""
    commands = {}
    for system in args.systems:
        if system in HF_SYSTEMS and importlib.util.find_spec("transformers") is None:
            print(f"  {system} skipped: transformers not installed", file=sys.stderr)
            continue
        if system in ESM_CPP_SYSTEMS and not esm_cpp_runs(system):
            continue
        target = OUT / system if system in DIRECTORY_SYSTEMS else OUT / f"{system}.h5"
        commands[system] = (system_command(system, model, args.fasta, target, args.threads), target)
    return commands


def esm_cpp_runs(system: str) -> bool:
    """esm.cpp peers run where ``esm_cpp`` (and transformers, for the export) is installed; its
    int8 path only where the CPU has VNNI or AMX int8."""
    missing = [m for m in ("esm_cpp", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"  {system} skipped: {', '.join(missing)} not installed (pip install esm-cpp)", file=sys.stderr)
        return False
    from embedpipe.runtime.cpu_features import INT8_DOT, detect

    if system == "esm-cpp-int8" and not any(flag in detect().flags for flag in INT8_DOT[:3]):
        print(f"  {system} skipped: no VNNI or AMX-INT8 on this CPU", file=sys.stderr)
        return False
    return True


def repeat_input(fasta: Path, times: int) -> Path:
    """``fasta`` ``times`` over (copies after the first reversed, IDs suffixed), under benchmarks/out/."""
    from embedpipe.inputs.fasta import read_sequences

    records = list(read_sequences(fasta))
    out = OUT / f"x{times}-{fasta.name}"
    lines = [f">{rid}\n{seq}\n" for rid, seq in records]
    for copy in range(1, times):
        lines += [f">{rid.split()[0]}_rev{copy}\n{seq[::-1]}\n" for rid, seq in records]
    out.write_text("".join(lines))
    return out


def run_rounds(commands: dict[str, tuple[list[str], Path]], rounds: int,
               env: dict[str, str]) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Every system ``rounds`` times, interleaved, each from a clean output and with its engine
    choices pinned where it has any: (wall seconds per round, peak RSS MiB) per system."""
    def clean(system: str) -> None:
        target = commands[system][1]
        if system in DIRECTORY_SYSTEMS:
            shutil.rmtree(target, ignore_errors=True)  # no stale files from a run with other settings
        else:
            target.unlink(missing_ok=True)
        if system == MEASURED:
            DECISION.unlink(missing_ok=True)  # a kept decision would measure nothing

    envs = {system: engine_env(env, **ENGINE_CHOICES[system]) for system in commands if system in ENGINE_CHOICES}
    if "auto" in commands:
        envs["auto"] = {**env, AUTO_CACHE_VARIABLE: str(AUTO_CACHE)}
    timings = interleaved({system: cmd for system, (cmd, _) in commands.items()}, rounds, env, envs, before=clean)
    return {s: t.seconds for s, t in timings.items()}, {s: t.peak for s, t in timings.items()}


def result_rows(commands: dict[str, tuple[list[str], Path]], walls: dict[str, list[float]], rss: dict[str, float],
                residues: int, flops: float, peaks: dict[str, float]) -> list[dict]:
    """One row per system: median seconds, residues/s, padding efficiency, MFU, peak RSS."""
    rows = []
    for system, (_, target) in commands.items():
        wall = float(np.median(walls[system]))
        policy = VARIANTS.get(system, (system,))[0]
        if system in DIRECTORY_SYSTEMS:
            padding = json.loads((target / "_stats.json").read_text())["padding_efficiency"]
        else:
            import h5py

            with h5py.File(target, "r") as f:
                padding = float(f.attrs.get("padding_efficiency", float("nan")))
                policy = str(f.attrs.get("precision_policy", policy))  # auto: the policy it ran
        peak_dtype = {"fp32": "float32", "fair-esm": "float32", "int8-mixed": "int8", **HF_SYSTEMS,
                      **ESM_CPP_SYSTEMS}.get(policy, "float16" if "fp16" in policy else "bfloat16")
        rows.append({"system": system, "seconds": wall, "all_seconds": walls[system], "residues_per_s": residues / wall,
                     "padding_efficiency": padding, "mfu": flops / wall / peaks[peak_dtype], "peak_dtype": peak_dtype,
                     "peak_rss_mib": rss[system], "path": target})
    return rows


def print_table(rows: list[dict], ref: dict[str, np.ndarray], layer: int) -> None:
    """The Markdown table, with ratios to the recipe (and to HF bf16) and cosines to fp32;
    the ratios and cosines are added to the rows."""
    systems = [row["system"] for row in rows]
    ratios = [Ratio("residues/s", systems.index("fair-esm"), "x fair-esm recipe", lower_is_better=False)
              ] if "fair-esm" in systems else []
    if "hf-transformers-bf16" in systems:
        ratios.append(Ratio("residues/s", systems.index("hf-transformers-bf16"), "x HF bf16", lower_is_better=False))
    cells = []
    for row in rows:
        means = read_means(row["system"], row["path"], layer)
        cos = [cosine(means[k], v) for k, v in ref.items() if k in means]
        for r in ratios:
            base = rows[r.baseline]["residues_per_s"]
            row["ratio" if r.label.startswith("x fair") else "ratio_hf_bf16"] = row["residues_per_s"] / base
        row["min_cosine"] = min(cos) if cos else None
        row["path"] = str(row["path"])
        cells.append((row["system"], row["seconds"], row["residues_per_s"], row["padding_efficiency"],
                      f"{row['mfu']:.1%} ({row['peak_dtype']})", row["peak_rss_mib"],
                      f"{min(cos):.6f}" if cos else "-", f"{float(np.median(cos)):.6f}" if cos else "-"))
    print("\n" + table(("system", "seconds", "residues/s", "padding eff.", "MFU", "peak RSS MiB", "min cos to fp32",
                        "median cos"), cells, ratios,
                       {"seconds": "{:.1f}", "residues/s": "{:,.0f}", "padding eff.": "{:.3f}", "peak RSS MiB": "{:.0f}"}))
    recipe = next((r for r in rows if r["system"] == "fair-esm"), None)
    if recipe and len(recipe["all_seconds"]) > 1:  # the spread behind each median, round by round
        print("\nper round, x fair-esm recipe (same round):")
        for row in rows:
            per_round = [r / s for r, s in zip(recipe["all_seconds"], row["all_seconds"])]
            row["round_ratios"] = per_round
            print(f"  {row['system']:<15} " + ", ".join(f"{x:.2f}" for x in per_round))


def main() -> None:
    args = parse_args()
    if args.run_recipe:
        run_fair_esm_recipe(Path(args.run_recipe[0]), Path(args.run_recipe[1]), Path(args.run_recipe[2]), args.threads)
        return

    from embedpipe.inputs.fasta import read_sequences

    OUT.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(AUTO_CACHE, ignore_errors=True)  # auto starts from an empty cache (a measurement of this run)
    if args.repeat_input > 1:
        args.fasta = repeat_input(args.fasta, args.repeat_input)
    if args.max_records:
        subset = OUT / f"first{args.max_records}-{args.fasta.name}"
        records = list(read_sequences(args.fasta))[: args.max_records]
        write_fasta(subset, records)
        args.fasta = subset
    model = bench_model(args)
    lengths = [len(s) for _, s in read_sequences(args.fasta)]
    residues = sum(min(n, 1022) for n in lengths)
    peaks = {d: matmul_peak(d, args.threads) for d in ("float32", "bfloat16", "float16", "int8")}
    commands = system_commands(args, model)
    walls, rss = run_rounds(commands, args.rounds, dict(os.environ, OMP_NUM_THREADS=str(args.threads)))
    rows = result_rows(commands, walls, rss, residues, model_flops(lengths, args.layers, args.dim), peaks)
    ref = read_means("fp32", OUT / "fp32.h5", args.layers) if "fp32" in args.systems else {}
    print("\n" + machine_header())
    print(f"input: {args.fasta.name} ({len(lengths)} records, {residues} residues embedded); model "
          f"{args.layers} layers x {args.dim} dims x {args.heads} heads (random weights); threads {args.threads}; "
          f"median of {args.rounds} interleaved round(s)")
    print("matmul peak (GFLOP/s; int8: GOP/s): " + ", ".join(f"{d} {p / 1e9:.0f}" for d, p in peaks.items()))
    from embedpipe.runtime.cpu_features import detect, isa_caps

    cpu = detect()
    print(f"CPU: {cpu.cpu_class} (flags: {cpu.named()}; torch kernels {cpu.torch_capability})"
          + (f"; capped (emulated): {isa_caps()}" if isa_caps() else ""))
    print_table(rows, ref, args.layers)
    (OUT / "results.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
