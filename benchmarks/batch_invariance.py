"""Batch invariance: what it costs (``cost``), and whether records are bit-equal across batchings (``bits``).

    python benchmarks/batch_invariance.py cost [--shapes 35M 150M --policies fp32 bf16-mixed int8-mixed
                                                --records 120 --median 300 --rounds 3 --layout auto --tile N]
    python benchmarks/batch_invariance.py bits [--records 120 --precisions fp32,bf16-mixed,int8-mixed --layout packed]

``cost``: random-weight ESM-2 checkpoints of the 35M (12 x 480, 20 heads) and 150M (30 x 640,
20 heads) shapes (``tiny``: 2 x 64, for a smoke run), random records with log-normal lengths.
Each round embeds the same records twice in one process, once batch-invariant (linear layers
in fixed row tiles, padded attention per record, docs/precision.md "Reproducibility") and
once the previous way, which this script sets up in its own process (linear layers untiled,
one masked SDPA call per padded batch), the order alternating between rounds; the model is
prepared before the clock starts. Prints residues/s of each (median over the rounds), the
invariant/previous time ratio (target: at most 1.05) and the largest difference of the
pooled last layer between the two.

``bits``: embeds the same records with ``--tokens-per-batch`` 1000 and 4096 (and reversed with
30 longer records added) through ``embed_fasta``, a random 6-layer 320-wide ESM-2, and prints
per precision how many records are not bit-equal and the largest absolute difference. Run
it with another checkout on ``PYTHONPATH`` for the numbers before a change.

The layout is pinned through ``EMBEDPIPE_ENGINE`` (``batch_layout=...``) in this process.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import h5py
import numpy as np
import torch
import torch.nn.functional as F
from _harness import Stopwatch, engine_env, lognormal_lengths, machine_header, random_records, table, write_fasta
from _helpers import embedder_for

from embedpipe.core.options import EmbedOptions
from embedpipe.extraction.run import embed_fasta
from embedpipe.model import load_model
from embedpipe.model.random_checkpoint import make_test_model
from embedpipe.runtime import packed, packed_linear, precision

#: name -> (layers, dim, heads)
SHAPES = {"tiny": (2, 64, 4), "35M": (12, 480, 20), "150M": (30, 640, 20)}


def _untiled(linear, x: torch.Tensor) -> torch.Tensor:
    return linear(x)


def _one_masked_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths) -> torch.Tensor:
    """The previous padded CPU attention: one SDPA call over the batch, padding masked out."""
    keep = torch.arange(q.shape[2]) < torch.as_tensor(list(lengths))[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :], scale=1.0)


@contextlib.contextmanager
def previous_path() -> Iterator[None]:
    """Inside: linear layers untiled and padded attention batched, as before batch invariance."""
    saved = precision.row_tiled, packed.padded_per_sequence_attention
    precision.row_tiled, packed.padded_per_sequence_attention = _untiled, _one_masked_call  # type: ignore[assignment]
    try:
        yield
    finally:
        precision.row_tiled, packed.padded_per_sequence_attention = saved


def timed_pass(loaded, recs: list[tuple[str, str]], options: EmbedOptions, invariant: bool) -> tuple[float, dict]:
    """(seconds, pooled last layer by record) of one embedding pass, invariant or the previous way."""
    with contextlib.nullcontext() if invariant else previous_path():
        embedder = embedder_for(loaded, options, torch.device("cpu"))
        embedder.runner(embedder.policy)  # preparation (packing, int8 quantization) off the clock
        with Stopwatch() as clock:
            got = {i: r.mean[loaded.num_layers] for i, r in embedder.embed(recs)}
    return clock.seconds, got


def measure(loaded, recs: list[tuple[str, str]], options: EmbedOptions, rounds: int) -> tuple[float, float, float]:
    """(median s invariant, median s previous, max |pooled difference|) over interleaved rounds."""
    times: dict[bool, list[float]] = {True: [], False: []}
    pooled: dict[bool, dict] = {}
    for r in range(rounds):
        for invariant in ((True, False) if r % 2 == 0 else (False, True)):
            seconds, pooled[invariant] = timed_pass(loaded, recs, options, invariant)
            times[invariant].append(seconds)
    diff = max(float(np.abs(pooled[True][i] - pooled[False][i]).max()) for i in pooled[True])
    return float(np.median(times[True])), float(np.median(times[False])), diff


def cost(args: argparse.Namespace, tmp: Path) -> None:
    if args.tile:
        packed_linear.BATCH_TILE_ROWS["cpu"] = args.tile
    recs = random_records(lognormal_lengths(args.records, args.median, seed=0), seed=1)
    residues = sum(len(s) for _, s in recs)
    print(f"{len(recs)} records, {residues} residues, {torch.get_num_threads()} threads, layout {args.layout}, "
          f"tile {packed_linear.tile_rows(torch.device('cpu'))} rows, {args.rounds} interleaved rounds\n")
    rows = []
    for shape in args.shapes:
        layers, dim, heads = SHAPES[shape]
        path = make_test_model(tmp / f"esm2_t{layers}_{dim}.pt", layers=layers, dim=dim, heads=heads, seed=1)
        loaded = load_model(str(path))
        for policy in args.policies:
            invariant, previous, diff = measure(loaded, recs, EmbedOptions(precision=policy, layers=(-1,)), args.rounds)
            rows.append((shape, policy, residues / invariant, residues / previous, invariant / previous, f"{diff:.2g}"))
    print(table(("shape", "policy", "invariant res/s", "previous res/s", "invariant / previous", "max pooled diff"), rows,
                formats={"invariant res/s": "{:,.0f}", "previous res/s": "{:,.0f}", "invariant / previous": "{:.3f}"}))


def read_store(out: Path) -> dict[str, tuple]:
    """id -> (mean, per-residue rows) of the last layer of a 6-layer store."""
    with h5py.File(out, "r") as f:
        ids = [x.decode() for x in f["ids"][()]]
        mean, offsets = f["mean/layer_6"][()], f["per_residue/offsets"][()]
        rows = f["per_residue/layer_6"][()]
        return {rid: (mean[i], rows[offsets[i]:offsets[i + 1]]) for i, rid in enumerate(ids)}


def compare(a: dict[str, tuple], b: dict[str, tuple]) -> str:
    """'differing/shared, max |diff| pooled (per residue)' over the records both hold."""
    shared = sorted(set(a) & set(b))
    differ = sum(not (np.array_equal(a[r][0], b[r][0]) and np.array_equal(a[r][1], b[r][1])) for r in shared)
    pooled = max(float(np.abs(a[r][0] - b[r][0]).max()) for r in shared)
    rows = max(float(np.abs(a[r][1] - b[r][1]).max()) for r in shared)
    return f"{differ}/{len(shared)}, {pooled:.2g} pooled ({rows:.2g} per residue)"


def bits(args: argparse.Namespace, tmp: Path) -> None:
    model = make_test_model(tmp / "esm2_t6_320.pt", layers=6, dim=320, heads=20, seed=3)
    rng = np.random.default_rng(1)
    recs = random_records(rng.integers(40, 400, args.records).tolist(), seed=rng, prefix="a")
    more = recs[::-1] + random_records(rng.integers(400, 700, 30).tolist(), seed=rng, prefix="b")
    rows = []
    for policy in args.precisions.split(","):
        stores = {}
        for name, batch, which in (("4096", 4096, recs), ("1000", 1000, recs), ("more", 4096, more)):
            fasta, out = write_fasta(tmp / f"{policy}-{name}.fasta", which), tmp / f"{policy}-{name}.h5"
            options = EmbedOptions(precision=policy, layers=(6,), per_residue=True, threads=2, tokens_per_batch=batch)
            embed_fasta(fasta, model=str(model), out=out, options=options, quiet=True)
            stores[name] = read_store(out)
        rows.append((policy, args.layout, compare(stores["4096"], stores["1000"]),
                     compare(stores["4096"], stores["more"])))
    print(table(("policy", "layout", "tokens-per-batch 1000 vs 4096", "reversed + 30 longer"), rows))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("measure", choices=["cost", "bits"])
    parser.add_argument("--shapes", nargs="+", default=["35M", "150M"], choices=list(SHAPES), help="cost: shapes")
    parser.add_argument("--policies", nargs="+", default=["fp32", "bf16-mixed", "int8-mixed"], help="cost: policies")
    parser.add_argument("--precisions", default="fp32,bf16-mixed,int8-mixed", help="bits: policies, comma-separated")
    parser.add_argument("--records", type=int, default=120)
    parser.add_argument("--median", type=int, default=300, help="cost: median record length")
    parser.add_argument("--rounds", type=int, default=3, help="cost: interleaved rounds")
    parser.add_argument("--layout", default="auto", choices=["auto", "packed", "padded"])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--tile", type=int, default=None,
                        help="cost: CPU row tile to measure instead of packed_linear.BATCH_TILE_ROWS['cpu']")
    parser.add_argument("--workdir", default=None, help="where the checkpoints go (default: a temporary directory)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.layout != "auto":
        os.environ.update(engine_env(batch_layout=args.layout))
    print(machine_header() + "\n")
    with tempfile.TemporaryDirectory(dir=args.workdir) as name:
        (cost if args.measure == "cost" else bits)(args, Path(name))


if __name__ == "__main__":
    main()
