"""GPU check (one command, under 5 minutes on one GPU): each policy on a 650M-shaped model.

    python benchmarks/gpu_policies.py            # needs CUDA; prints a markdown table

A random-weight checkpoint with the esm2_t33_650M shape (33 layers, 1280 dims, 20 heads)
is written once; then, for lengths 256 and 1024, each system embeds the same random
sequences: fair-esm's own forward (fp32, the extract.py computation) and embedpipe under
every policy. Reported: residues/s, ratio to embedpipe fp32 and to fair-esm, peak CUDA
memory, the attention memory growth from 256 to 1024 (linear would be 4x per record at
equal batch token budget), and the pooled cosine to embedpipe's fp32 output.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from embedpipe.core.options import POLICY_NAMES

ROOT = Path(__file__).resolve().parent.parent
POLICIES = list(POLICY_NAMES)


def random_records(count: int, length: int, seed: int) -> list[tuple[str, str]]:
    rng = np.random.default_rng(seed)
    amino = np.array(list("ACDEFGHIKLMNPQRSTVWY"))
    return [(f"r{length}_{i}", "".join(rng.choice(amino, length))) for i in range(count)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak_mib(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else float("nan")


def run(args: argparse.Namespace) -> None:
    import esm

    from embedpipe.embed.engine import Embedder, EmbedOptions
    from embedpipe.model import load_model
    from embedpipe.model.random_checkpoint import make_test_model

    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"esm2_gpu_t{args.layers}_{args.dim}.pt"
    if not path.exists():
        make_test_model(path, layers=args.layers, dim=args.dim, heads=args.heads, seed=0, companion=False)
    loaded = load_model(str(path))
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (smoke run)"
    print(f"GPU: {name}; torch {torch.__version__}; fair-esm {esm.__version__}")
    print(f"model: {args.layers} layers x {args.dim} dims x {args.heads} heads (random weights); "
          f"{args.records} records per length; tokens per batch {args.tokens_per_batch}\n")
    print("| length | system | residues/s | x embedpipe fp32 | x fair-esm | peak MiB | min cos to fp32 |")
    print("|---|---|---|---|---|---|---|")
    for length in args.lengths:
        records = random_records(args.records, length, seed=length)
        residues = sum(len(s) for _, s in records)
        results: dict[str, tuple[float, float, dict]] = {}

        # fair-esm's own forward, fp32, same batches of tokens_per_batch
        model = loaded.model.to(device)
        converter = loaded.alphabet.get_batch_converter()
        per_batch = max(1, args.tokens_per_batch // (length + 2))
        _sync(device)
        _reset_peak(device)
        started = time.perf_counter()
        with torch.no_grad():
            for i in range(0, len(records), per_batch):
                _, _, toks = converter(records[i : i + per_batch])
                model(toks.to(device), repr_layers=[args.layers])["representations"][args.layers].mean(1).cpu()
        _sync(device)
        results["fair-esm"] = (residues / (time.perf_counter() - started), _peak_mib(device), {})
        model.cpu()

        for policy in POLICIES:
            embedder = Embedder(loaded, EmbedOptions(precision=policy, tokens_per_batch=args.tokens_per_batch,
                                                     long_sequences="full"), device)
            list(embedder.embed(records[:per_batch]))  # warm-up: kernels, model preparation
            _sync(device)
            _reset_peak(device)
            started = time.perf_counter()
            out = dict(embedder.embed(records))
            _sync(device)
            rate = residues / (time.perf_counter() - started)
            results[policy] = (rate, _peak_mib(device), out)
            del embedder
            if device.type == "cuda":
                torch.cuda.empty_cache()

        ref = results["fp32"][2]
        for system, (rate, peak, out) in results.items():
            cos = "-"
            if out:
                values = [float(out[i].mean[args.layers] @ ref[i].mean[args.layers]
                                / np.linalg.norm(out[i].mean[args.layers]) / np.linalg.norm(ref[i].mean[args.layers]))
                          for i in ref]
                cos = f"{min(values):.6f}"
            print(f"| {length} | {system} | {rate:,.0f} | {rate / results['fp32'][0]:.2f} | "
                  f"{rate / results['fair-esm'][0]:.2f} | {peak:,.0f} | {cos} |", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=33)
    parser.add_argument("--dim", type=int, default=1280)
    parser.add_argument("--heads", type=int, default=20)
    parser.add_argument("--records", type=int, default=64)
    parser.add_argument("--tokens-per-batch", type=int, default=16384)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out" / "gpu")
    parser.add_argument("--device", default="cuda", help="cuda (the measurement) or cpu (a smoke run of the script)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024])
    cli_args = parser.parse_args()
    if cli_args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu_policies.py needs a CUDA device (or --device cpu for a smoke run)")
    run(cli_args)
