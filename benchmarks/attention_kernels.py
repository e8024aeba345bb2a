"""Attention kernels on this CPU at ESM-2 35M head size (20 heads x 24 dims), milliseconds per call.

    python benchmarks/attention_kernels.py [--threads 2] [--repeats 5]

Compares torch's fused SDPA (fp32 and bf16) with explicit-matmul attention (fp32, and bf16
matmuls with an fp32 softmax) for a few (batch, length) shapes with a padding mask, side by
side in one run, and prints each kernel's time relative to fused fp32 SDPA.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

SHAPES = ((12, 340), (4, 1024), (60, 66))  # (batch, length): a shard's short, long and tiny batches
HEADS, HEAD_DIM = 20, 24


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    """Mean milliseconds per call over ``repeats`` calls, after one warm-up call."""
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1000


def explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Scores by matmul in the inputs' dtype, softmax in fp32, then back to the inputs' dtype."""
    scores = torch.matmul(q, k.transpose(-1, -2)).float().masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, -1).to(q.dtype), v)


def kernels(batch: int, length: int) -> dict[str, Callable[[], object]]:
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per kernel (default 5)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    for batch, length in SHAPES:
        times = {name: best_ms(fn, args.repeats) for name, fn in kernels(batch, length).items()}
        base = times["sdpa fp32"]
        print(f"batch {batch} x length {length}:")
        for name, ms in times.items():
            print(f"  {name:<38} {ms:8.1f} ms   {ms / base:5.2f}x sdpa fp32")


if __name__ == "__main__":
    main()
