"""What batch invariance costs: the row-tiled, per-record path beside the previous one, per shape and policy.

    python benchmarks/batch_invariance_cost.py [--shapes 35M 150M --policies fp32 bf16-mixed int8-mixed
                                                --records 120 --median 300 --rounds 3 --layout auto --tile N]

Random-weight ESM-2 checkpoints of the 35M (12 x 480, 20 heads) and 150M (30 x 640, 20 heads)
shapes (``tiny``: 2 x 64, for a smoke run), random records with log-normal lengths. Each
round embeds the same records twice in one process, once batch-invariant (linear layers in
fixed row tiles, padded attention per record, docs/precision.md "Reproducibility") and once
as before (the benchmark-only switch ``embedpipe.runtime.packed_linear._batch_invariant``
off), the order alternating between rounds; the model is prepared before the clock starts.
Prints residues/s of each (median over the rounds), the invariant/previous time ratio
(target: at most 1.05) and the largest difference of the pooled last layer between the two.
Time it on a quiet machine: the ratio is what matters.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from embedpipe.embed.engine import Embedder, EmbedOptions
from embedpipe.model import load_model
from embedpipe.model.random_checkpoint import make_test_model
from embedpipe.runtime import packed_linear

#: name -> (layers, dim, heads)
SHAPES = {"tiny": (2, 64, 4), "35M": (12, 480, 20), "150M": (30, 640, 20)}


def records(count: int, median: int, seed: int = 0) -> list[tuple[str, str]]:
    """``count`` random protein sequences with log-normal lengths around ``median`` (20-1022)."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(median), 0.6, count).astype(int), 20, 1022)
    letters = np.array(list("ACDEFGHIKLMNPQRSTVWY"))
    return [(f"r{i}", "".join(rng.choice(letters, n))) for i, n in enumerate(lengths)]


def timed_pass(loaded, recs: list[tuple[str, str]], options: EmbedOptions, invariant: bool) -> tuple[float, dict]:
    """(seconds, pooled last layer by record) of one embedding pass with the switch set."""
    packed_linear._batch_invariant = invariant
    try:
        embedder = Embedder(loaded, options, torch.device("cpu"))
        embedder.runner(embedder.policy)  # preparation (packing, int8 quantization) off the clock
        started = time.perf_counter()
        got = {i: r.mean[loaded.num_layers] for i, r in embedder.embed(recs)}
        return time.perf_counter() - started, got
    finally:
        packed_linear._batch_invariant = True


def measure(loaded, recs: list[tuple[str, str]], options: EmbedOptions, rounds: int) -> tuple[float, float, float]:
    """(median s invariant, median s previous, max |pooled difference|) over interleaved rounds."""
    times: dict[bool, list[float]] = {True: [], False: []}
    pooled: dict[bool, dict] = {}
    for r in range(rounds):
        for invariant in ((True, False) if r % 2 == 0 else (False, True)):
            seconds, pooled[invariant] = timed_pass(loaded, recs, options, invariant)
            times[invariant].append(seconds)
    diff = max(float(np.abs(pooled[True][i] - pooled[False][i]).max()) for i in pooled[True])
    return statistics.median(times[True]), statistics.median(times[False]), diff


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["35M", "150M"], choices=list(SHAPES))
    parser.add_argument("--policies", nargs="+", default=["fp32", "bf16-mixed", "int8-mixed"])
    parser.add_argument("--records", type=int, default=120)
    parser.add_argument("--median", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layout", default="auto", choices=["auto", "packed", "padded"])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--tile", type=int, default=None,
                        help="CPU row tile to measure instead of packed_linear.BATCH_TILE_ROWS['cpu'] (benchmark only)")
    parser.add_argument("--workdir", default=None, help="where the checkpoints go (default: a temporary directory)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.tile:
        packed_linear.BATCH_TILE_ROWS["cpu"] = args.tile
    import tempfile
    from pathlib import Path

    recs = records(args.records, args.median)
    residues = sum(len(s) for _, s in recs)
    print(f"{len(recs)} records, {residues} residues, {torch.get_num_threads()} threads, layout {args.layout}, "
          f"tile {packed_linear.tile_rows(torch.device('cpu'))} rows, {args.rounds} interleaved rounds")
    print(f"{'shape':6s} {'policy':11s} {'invariant res/s':>16s} {'previous res/s':>15s} {'ratio':>6s} {'max |diff|':>11s}")
    with tempfile.TemporaryDirectory(dir=args.workdir) as name:
        for shape in args.shapes:
            layers, dim, heads = SHAPES[shape]
            path = make_test_model(Path(name) / f"esm2_t{layers}_{dim}.pt", layers=layers, dim=dim, heads=heads, seed=1)
            loaded = load_model(str(path))
            for policy in args.policies:
                options = EmbedOptions(precision=policy, batch_layout=args.layout, layers=(-1,))
                invariant, previous, diff = measure(loaded, recs, options, args.rounds)
                print(f"{shape:6s} {policy:11s} {residues / invariant:16.0f} {residues / previous:15.0f} "
                      f"{invariant / previous:6.3f} {diff:11.2g}", flush=True)


if __name__ == "__main__":
    main()
