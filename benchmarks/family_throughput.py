"""Per model family, side by side: the recipe a user would run vs `embedpipe embed` per policy.

Families (docs/models.md): ProtT5 and Ankh (T5 encoders), ESM-2 as a Hugging Face
directory, and ESM C. For each, in one run, whole processes on the same input:

* **recipe**: the family's user recipe in transformers (benchmarks/_family_recipes.py):
  ProtTrans' ``prott5_embedder.py`` logic for ProtT5 (``T5EncoderModel``, ``T5Tokenizer`` on
  space-separated residues with UZOB -> X, length-sorted batches, mean over the residue rows,
  ``</s>`` excluded), the same with per-character tokens for Ankh, ``EsmModel`` for hf-esm,
  ``EsmcModel`` (SDPA) for esmc, in fp32 and also cast to bf16 (**recipe bf16**);
* **embedpipe P**: ``python -m embedpipe.cli embed --precision P`` on the same directory;
* hf-esm also: **fair-esm** (scripts/extract.py's logic, embed_throughput.py's recipe) and
  **embedpipe fp32 (.pt)** on the fair-esm checkpoint the directory was converted from.

Every system runs ``--rounds`` times, interleaved (every family's systems, then again); the
table shows the median seconds, residues/s, the ratio to the family's recipe (and per round),
padding efficiency, peak RSS and the pooled cosine of each system's means to the recipe's.

Models are random-weight directories (``make-test-model --family``), scaled down from the real
shapes so a run fits a 2-core machine: see SHAPES. Input: ``--max-records`` records
evenly spaced through ``--fasta`` (its length distribution), each cut to ``--max-length``.

    python benchmarks/family_throughput.py                 # about 10 minutes on 2 busy cores
    python benchmarks/family_throughput.py --quick         # tiny shapes, seconds of work: a smoke run
    python benchmarks/family_throughput.py --families prot-t5 --policies fp32 bf16-mixed --rounds 3

Needs the ``hf`` extra (transformers, tokenizers, safetensors) and fair-esm.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import _family_recipes as recipes
import numpy as np
from _harness import cosine, machine_header, table
from embed_throughput import matmul_peak, read_means, run_rounds, system_command  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
#: family -> make-test-model shape, scaled down from the real model (docs/benchmarks.md)
SHAPES = {
    # ProtT5-XL-U50: 24 layers, d_model 1024, 32 heads x d_kv 128, d_ff 16384 (16 x d_model), relu
    "prot-t5": {"layers": 4, "dim": 256, "heads": 8, "d_kv": 128, "d_ff": 4096},
    # ankh-base: 48 layers, d_model 768, 12 heads x d_kv 64, d_ff 3072 (4 x d_model), gated-gelu
    "ankh": {"layers": 6, "dim": 384, "heads": 6, "d_kv": 64, "d_ff": 1536},
    # facebook/esm2_t6_8M_UR50D's own shape (6 layers, 320 dims, 20 heads)
    "hf-esm": {"layers": 6, "dim": 320, "heads": 20},
    # ESMC-300M: 30 layers, width 960, 15 heads of 64, SwiGLU 2560 (8/3 x width); scaled: 6 layers,
    # width 384, 6 heads of 64, SwiGLU 1024 (the same proportions)
    "esmc": {"layers": 6, "dim": 384, "heads": 6, "d_ff": 1024},
}
QUICK_SHAPES = {
    "prot-t5": {"layers": 2, "dim": 32, "heads": 2, "d_kv": 16, "d_ff": 512},
    "ankh": {"layers": 2, "dim": 32, "heads": 2, "d_kv": 16, "d_ff": 128},
    "hf-esm": {"layers": 2, "dim": 32, "heads": 4},
    "esmc": {"layers": 2, "dim": 32, "heads": 2, "d_ff": 64},
}
POLICIES = ("fp32", "bf16-mixed", "bf16")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fasta", type=Path, default=ROOT / "examples" / "swissprot100.fasta")
    parser.add_argument("--max-records", type=int, default=34,
                        help="N records evenly spaced through --fasta, so their lengths follow the file's "
                             "(default 34: every third of the bundled 100, median length 338 against 344)")
    parser.add_argument("--max-length", type=int, default=512,
                        help="cut each record to N residues (default 512; at most 1000, so no system windows)")
    parser.add_argument("--families", nargs="+", choices=recipes.FAMILIES, default=list(recipes.FAMILIES))
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), help="embedpipe --precision values")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds; the table shows medians")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "out" / "families")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: tiny shapes, 6 records of <= 48 residues, fp32 and bf16-mixed, 1 round")
    parser.add_argument("--run-recipe", nargs=4, metavar=("FAMILY", "MODEL", "FASTA", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.max_records, args.max_length, args.rounds = 6, 48, 1
        args.policies = [p for p in args.policies if p in ("fp32", "bf16-mixed")] or ["fp32"]
    if not 1 <= args.max_length <= recipes.MAX_SEQ_LEN:
        parser.error(f"--max-length must be 1..{recipes.MAX_SEQ_LEN}")
    return args


def write_input(args: argparse.Namespace) -> tuple[Path, list[int]]:
    """The benchmark's input FASTA (records evenly spaced, cut to --max-length) and its lengths."""
    records = list(recipes.read_fasta(args.fasta).items())
    if args.max_records < len(records):
        records = [records[i] for i in np.linspace(0, len(records) - 1, args.max_records).round().astype(int)]
    path = args.out_dir / "input.fasta"
    path.write_text("".join(f">{rid}\n{seq[: args.max_length]}\n" for rid, seq in records))
    return path, [min(len(seq), args.max_length) for _, seq in records]


def make_models(args: argparse.Namespace) -> dict[str, Path]:
    """family -> random-weight model directory (and "fair-esm" -> the .pt), made once per shape."""
    from embedpipe.model import load_model
    from embedpipe.model.random_checkpoint import make_test_model
    from embedpipe.model.random_hf import make_hf_test_model, write_hf_esm

    shapes = QUICK_SHAPES if args.quick else SHAPES
    models = {}
    for family in args.families:
        shape = shapes[family]
        tag = "_".join(f"{k}{v}" for k, v in shape.items())
        target = args.out_dir / f"{family}_{tag}"
        if family == "hf-esm":
            pt = args.out_dir / f"esm2_bench_{tag}.pt"  # fair-esm's loader wants an esm2* name
            if not pt.exists():
                make_test_model(pt, seed=0, **shape)
            if not target.exists():
                loaded = load_model(str(pt))
                write_hf_esm(target, loaded.model.state_dict(), **shape)
            models["fair-esm"] = pt
        elif not target.exists():
            make_hf_test_model(target, family=family, seed=0, **shape)
        models[family] = target
    return models


def embedpipe_command(model: Path, fasta: Path, target: Path, policy: str, threads: int) -> list[str]:
    return [sys.executable, "-m", "embedpipe.cli", "embed", str(fasta), "--model", str(model), "--out", str(target),
            "--precision", policy, "--threads", str(threads), "--quiet"]


def family_systems(args: argparse.Namespace, family: str, models: dict[str, Path],
                   fasta: Path) -> dict[str, tuple[list[str], Path]]:
    """"family system" -> (command, output) for one family: its recipe first, then embedpipe."""
    out, model = args.out_dir, models[family]
    systems = {f"{family} recipe": ([sys.executable, __file__, "--threads", str(args.threads), "--run-recipe",
                                     family, str(model), str(fasta), str(out / f"{family}-recipe.h5")],
                                    out / f"{family}-recipe.h5")}
    if family == "hf-esm":
        # key "fair-esm": embed_throughput.run_rounds clears that output as a directory
        systems["fair-esm"] = (system_command("fair-esm", models["fair-esm"], fasta, out / "fair-esm", args.threads),
                               out / "fair-esm")
        pt_store = out / "hf-esm-embedpipe-pt-fp32.h5"
        systems["hf-esm embedpipe fp32 (.pt)"] = (
            embedpipe_command(models["fair-esm"], fasta, pt_store, "fp32", args.threads), pt_store)
    if family == "esmc":  # transformers' EsmcModel in bf16 too
        systems[f"{family} recipe bf16"] = (
            [sys.executable, __file__, "--threads", str(args.threads), "--run-recipe", f"{family}:bf16", str(model),
             str(fasta), str(out / f"{family}-recipe-bf16.h5")], out / f"{family}-recipe-bf16.h5")
    for policy in args.policies:
        target = out / f"{family}-embedpipe-{policy}.h5"
        command = embedpipe_command(model, fasta, target, policy, args.threads)
        systems[f"{family} embedpipe {policy}"] = (command, target)
    return systems


def means_of(system: str, target: Path, layer: int) -> dict[str, np.ndarray]:
    if " recipe" in system:
        return recipes.read_recipe(target)
    return read_means("fair-esm" if system == "fair-esm" else "fp32", target, layer)


def stats_of(system: str, target: Path) -> tuple[float, str]:
    """(padding efficiency, attention): the recipe's attrs, fair-esm's _stats.json, a store's attrs."""
    if system == "fair-esm":
        return float(json.loads((target / "_stats.json").read_text())["padding_efficiency"]), "fair-esm"
    import h5py

    with h5py.File(target, "r") as f:
        return float(f.attrs.get("padding_efficiency", float("nan"))), str(f.attrs.get("attention", "-"))


def cosines(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> list[float]:
    """Per-record cosine of ``got`` to ``want`` (every record of ``want`` must be in ``got``)."""
    missing = sorted(set(want) - set(got))
    if missing:
        raise SystemExit(f"records missing from a system's output: {missing[:3]}")
    return [cosine(got[k], v) for k, v in want.items()]


def family_rows(family: str, systems: dict, walls: dict, rss: dict, residues: int, layer: int) -> list[dict]:
    """One row per system of ``family``: median time, rate, ratio to the recipe, cosines to it."""
    recipe_key = f"{family} recipe"
    reference = means_of(recipe_key, systems[recipe_key][1], layer)
    recipe_walls = walls[recipe_key]
    rows = []
    for system, (_, target) in systems.items():
        cos = cosines(means_of(system, target, layer), reference)
        seconds = float(np.median(walls[system]))
        padding, attention = stats_of(system, target)
        rows.append({"family": family, "system": system, "seconds": seconds, "all_seconds": walls[system],
                     "residues_per_s": residues / seconds, "ratio": float(np.median(recipe_walls)) / seconds,
                     "round_ratios": [r / s for r, s in zip(recipe_walls, walls[system])],
                     "padding_efficiency": padding, "attention": attention, "peak_rss_mib": rss[system],
                     "min_cosine": min(cos), "median_cosine": float(np.median(cos)), "records": len(cos)})
    return rows


COLUMNS = ("family", "system", "seconds", "residues/s", "x recipe", "padding eff.", "peak RSS MiB",
           "min cos to recipe", "median cos")


def family_table_rows(rows: list[dict]) -> list[tuple]:
    """The family's table rows, and a last one naming its fastest embedpipe policy (marked ``best``)."""
    out: list[tuple] = [(r["family"], r["system"].removeprefix(r["family"] + " "), f"{r['seconds']:.1f}",
                         f"{r['residues_per_s']:,.0f}", f"{r['ratio']:.2f}", f"{r['padding_efficiency']:.3f}",
                         f"{r['peak_rss_mib']:.0f}", f"{r['min_cosine']:.6f}", f"{r['median_cosine']:.6f}") for r in rows]
    ours = [r for r in rows if " embedpipe " in r["system"] and not r["system"].endswith("(.pt)")]
    if ours:
        best = max(ours, key=lambda r: r["residues_per_s"])
        best["best"] = True
        out.append(("", f"fastest embedpipe policy here: **{best['system'].split()[-1]}** ({best['ratio']:.2f}x the "
                        "recipe)", *[""] * 7))
    return out


def machine_line(threads: int, quick: bool) -> str:
    """The machine header and the measured GEMM peaks bf16 and fp16 speed depend on."""
    size, repeats = (256, 1) if quick else (2048, 3)
    peaks = ", ".join(f"{d} {matmul_peak(d, threads, n=size, repeats=repeats) / 1e9:.0f}"
                      for d in ("float32", "bfloat16", "float16"))
    return f"{machine_header()}\nGEMM {size}^3 GFLOP/s: {peaks}"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.run_recipe:
        family, model, fasta, out = args.run_recipe
        recipes.run_recipe(family, Path(model), Path(fasta), Path(out), args.threads)
        return
    args.out_dir.mkdir(parents=True, exist_ok=True)
    fasta, lengths = write_input(args)
    models = make_models(args)
    shapes = QUICK_SHAPES if args.quick else SHAPES
    per_family = {family: family_systems(args, family, models, fasta) for family in args.families}
    commands = {k: v for systems in per_family.values() for k, v in systems.items()}
    machine = machine_line(args.threads, args.quick)
    walls, rss = run_rounds(commands, args.rounds, dict(os.environ, OMP_NUM_THREADS=str(args.threads)))
    import torch
    import transformers

    print(f"\ninput: {fasta} ({len(lengths)} records evenly spaced through {args.fasta.name}, cut to "
          f"{args.max_length} residues: {sum(lengths)} residues, median length {int(np.median(lengths))}); "
          f"threads {args.threads}; median of {args.rounds} interleaved round(s); torch {torch.__version__}, "
          f"transformers {transformers.__version__}")
    print(machine)
    print("shapes (random weights): " + "; ".join(f"{f} {shapes[f]}" for f in args.families))
    rows, cells = [], []
    for family, systems in per_family.items():
        family_rows_ = family_rows(family, systems, walls, rss, sum(lengths), shapes[family]["layers"])
        cells += family_table_rows(family_rows_)
        rows += family_rows_
    print("\n" + table(COLUMNS, cells))
    print("\nrecipes' attention (transformers' attn_implementation): "
          + ", ".join(f"{r['family']} {r['attention']}" for r in rows if r["system"].endswith(" recipe")))
    if args.rounds > 1:
        print("\nper round, recipe seconds / system seconds (same round):")
        for r in rows:
            print(f"  {r['system']:<32} " + ", ".join(f"{x:.2f}" for x in r["round_ratios"]))
    (args.out_dir / "results.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
