"""Packed against padded batches on this machine, side by side in one run, per policy.

    python benchmarks/batch_layout.py [--records 120 --median 300 --layers 6 --dim 320 --heads 20 --rounds 2]

Random-weight checkpoint, random sequences with log-normal lengths (median ``--median``,
20-1022 residues). Each policy embeds the same records with ``--batch-layout padded`` and
``packed``, alternating for ``--rounds`` rounds; prints residues/s of each (median over the
rounds), the packed/padded ratio and the largest difference of the pooled last layer. On a
CPU the packed layout attends with the per-sequence SDPA stand-in, which is why ``auto``
pads there (docs/precision.md, "Batch layout"); on a GPU it runs the varlen kernel.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent

from embedpipe.embed.engine import Embedder, EmbedOptions  # noqa: E402
from embedpipe.model import load_model  # noqa: E402
from embedpipe.model.random_checkpoint import make_test_model  # noqa: E402

LAYOUTS = ("padded", "packed")


def records(count: int, median: int, seed: int) -> list[tuple[str, str]]:
    """``count`` random protein sequences with log-normal lengths around ``median``."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(median), 0.6, count).astype(int), 20, 1022)
    letters = np.array(list("ACDEFGHIKLMNPQRSTVWY"))
    return [(f"r{i}", "".join(rng.choice(letters, n))) for i, n in enumerate(lengths)]


def run(loaded, recs: list[tuple[str, str]], policy: str, layout: str, device: torch.device) -> tuple[float, dict]:
    """(residues/s, pooled last layer by record) of one embedding pass."""
    embedder = Embedder(loaded, EmbedOptions(precision=policy, batch_layout=layout), device)
    started = time.perf_counter()
    got = {i: r.mean[loaded.num_layers] for i, r in embedder.embed(recs)}
    return sum(len(s) for _, s in recs) / (time.perf_counter() - started), got


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=120)
    parser.add_argument("--median", type=int, default=300)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--dim", type=int, default=320)
    parser.add_argument("--heads", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--policies", nargs="+", default=["fp32", "bf16-mixed"])
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    out = ROOT / "benchmarks" / "out"
    out.mkdir(parents=True, exist_ok=True)
    path = make_test_model(out / f"esm2_layout_t{args.layers}_{args.dim}.pt", layers=args.layers, dim=args.dim,
                           heads=args.heads, seed=3)
    loaded = load_model(str(path))
    device = torch.device(args.device)
    recs = records(args.records, args.median, seed=0)
    print(f"model {args.layers} x {args.dim} x {args.heads} (random weights); {args.records} records, "
          f"{sum(len(s) for _, s in recs):,} residues, median length {args.median}; {args.device}, "
          f"{torch.get_num_threads()} threads; median of {args.rounds} alternating round(s)\n")
    print("| policy | padded residues/s | packed residues/s | packed / padded | max pooled difference |")
    print("|---|---|---|---|---|")
    for policy in args.policies:
        rates: dict[str, list[float]] = {layout: [] for layout in LAYOUTS}
        pooled: dict[str, dict] = {}
        for _ in range(args.rounds):
            for layout in LAYOUTS:
                rate, pooled[layout] = run(loaded, recs, policy, layout, device)
                rates[layout].append(rate)
        padded, packed = (statistics.median(rates[layout]) for layout in LAYOUTS)
        diff = max(float(np.abs(pooled["padded"][i] - pooled["packed"][i]).max()) for i in pooled["padded"])
        print(f"| {policy} | {padded:,.0f} | {packed:,.0f} | {packed / padded:.2f} | {diff:.1e} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
