"""Packed against padded batches per policy (``layouts``), and the attention kernels behind them (``kernels``).

    python benchmarks/batch_layout.py layouts [--records 120 --median 300 --layers 6 --dim 320 --heads 20 --rounds 2]
    python benchmarks/batch_layout.py kernels [--threads 2 --repeats 5]

``layouts``: a random-weight checkpoint, random sequences with log-normal lengths (median
``--median``, 20-1022 residues). Each policy embeds the same records with the batch layout
pinned to ``padded`` and to ``packed`` (``EMBEDPIPE_ENGINE=batch_layout=...`` in this
process), alternating for ``--rounds`` rounds; prints residues/s of each (median over the
rounds), the packed/padded ratio and the largest difference of the pooled last layer. On a CPU
the packed layout attends each sequence alone, which is why the program pads there
(docs/precision.md, "Batch layout"); on a GPU it runs the varlen kernel.

``kernels``: milliseconds per attention call at the 35M head size (20 heads x 24 dims) for a
shard's short, long and tiny batches with a padding mask: torch's fused SDPA (fp32, bf16)
against explicit-matmul attention (fp32, and bf16 matmuls with an fp32 softmax), relative to
fused fp32 SDPA.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from _harness import Ratio, Stopwatch, engine_env, lognormal_lengths, machine_header, random_records, table, time_call

ROOT = Path(__file__).resolve().parent.parent
LAYOUTS = ("padded", "packed")
SHAPES = ((12, 340), (4, 1024), (60, 66))  # (batch, length): a shard's short, long and tiny batches
HEADS, HEAD_DIM = 20, 24


def run(loaded, recs: list[tuple[str, str]], policy: str, layout: str, device: torch.device) -> tuple[float, dict]:
    """(residues/s, pooled last layer by record) of one embedding pass in ``layout``."""
    from _helpers import embedder_for

    from embedpipe.core.options import EmbedOptions

    os.environ.update(engine_env(batch_layout=layout))
    embedder = embedder_for(loaded, EmbedOptions(precision=policy), device)
    with Stopwatch() as clock:
        got = {i: r.mean[loaded.num_layers] for i, r in embedder.embed(recs)}
    return sum(len(s) for _, s in recs) / clock.seconds, got


def layouts(args: argparse.Namespace) -> None:
    from embedpipe.model import load_model
    from embedpipe.model.random_checkpoint import make_test_model

    out = ROOT / "benchmarks" / "out"
    out.mkdir(parents=True, exist_ok=True)
    path = make_test_model(out / f"esm2_layout_t{args.layers}_{args.dim}.pt", layers=args.layers, dim=args.dim,
                           heads=args.heads, seed=3)
    loaded = load_model(str(path))
    device = torch.device(args.device)
    recs = random_records(lognormal_lengths(args.records, args.median, seed=0), seed=1)
    print(f"model {args.layers} x {args.dim} x {args.heads} (random weights); {args.records} records, "
          f"{sum(len(s) for _, s in recs):,} residues, median length {args.median}; {args.device}, "
          f"{torch.get_num_threads()} threads; median of {args.rounds} alternating round(s)\n")
    rows = []
    for policy in args.policies:
        rates: dict[str, list[float]] = {layout: [] for layout in LAYOUTS}
        pooled: dict[str, dict] = {}
        for _ in range(args.rounds):
            for layout in LAYOUTS:
                rate, pooled[layout] = run(loaded, recs, policy, layout, device)
                rates[layout].append(rate)
        padded, packed = (float(np.median(rates[layout])) for layout in LAYOUTS)
        diff = max(float(np.abs(pooled["padded"][i] - pooled["packed"][i]).max()) for i in pooled["padded"])
        rows.append((policy, padded, packed, packed / padded, f"{diff:.1e}"))
    print(table(("policy", "padded residues/s", "packed residues/s", "packed / padded", "max pooled difference"),
                rows, formats={"padded residues/s": "{:,.0f}", "packed residues/s": "{:,.0f}",
                               "packed / padded": "{:.2f}"}))


def explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Scores by matmul in the inputs' dtype, softmax in fp32, then back to the inputs' dtype."""
    scores = torch.matmul(q, k.transpose(-1, -2)).float().masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, -1).to(q.dtype), v)


def attention_kernels(batch: int, length: int) -> dict[str, Callable[[], object]]:
    """kernel name -> one attention call on a (batch, length) batch with one padded record."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, HEADS, length, HEAD_DIM, generator=generator) for _ in range(3))
    mask = torch.ones(batch, 1, 1, length, dtype=torch.bool)
    mask[0, ..., length - 30 :] = False  # one padded record
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    return {
        "sdpa fp32": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
        "sdpa bf16": lambda: F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask),
        "sdpa fp32 no mask": lambda: F.scaled_dot_product_attention(q, k, v),
        "explicit fp32": lambda: explicit_attention(q, k, v, mask),
        "explicit bf16 matmuls, fp32 softmax": lambda: explicit_attention(qb, kb, vb, mask),
    }


def kernels(args: argparse.Namespace) -> None:
    rows = []
    for batch, length in SHAPES:
        for name, fn in attention_kernels(batch, length).items():
            rows.append((f"{batch} x {length}", name, time_call(fn, rounds=args.repeats, warmup=1).median * 1000))
    # each shape's own sdpa fp32 row is its baseline: one table per shape
    per_shape = len(rows) // len(SHAPES)
    for start in range(0, len(rows), per_shape):
        print(table(("batch x length", "kernel", "ms"), rows[start:start + per_shape],
                    ratios=[Ratio("ms", 0, "time / sdpa fp32", lower_is_better=False)], formats={"ms": "{:.1f}"}))
        print()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("measure", choices=["layouts", "kernels"])
    parser.add_argument("--records", type=int, default=120)
    parser.add_argument("--median", type=int, default=300)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--dim", type=int, default=320)
    parser.add_argument("--heads", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--policies", nargs="+", default=["fp32", "bf16-mixed"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--repeats", type=int, default=5, help="kernels: timed calls per kernel (default 5)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(machine_header() + "\n")
    (layouts if args.measure == "layouts" else kernels)(args)


if __name__ == "__main__":
    main()
