"""Bytes each op of a 650M packed forward moves outside the GEMMs and attention, per token per
layer, traced on a faked GPU (tests/helpers/fake_cuda.py: no GPU, no weights), and the MFU ceiling
that traffic implies in eager mode (docs/benchmarks.md, "The eager-mode MFU ceiling").

Traffic of an op = bytes of its device inputs plus outputs (views excluded): an upper bound
on HBM traffic when nothing is fused. The ceiling assumes the GEMMs at a given fraction of
the bf16 peak, every other op at a given HBM bandwidth, attention at 350 TFLOP/s.

    python benchmarks/cuda_trace_traffic.py [policy]      # default bf16-mixed
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "runtime"))
from test_cuda_memory import fake_model  # noqa: E402

from embedpipe.core.options import EmbedOptions  # noqa: E402
from embedpipe.embed.engine import Embedder  # noqa: E402
from helpers.fake_cuda import fake_cuda  # noqa: E402

LAYERS, DIM, HEADS, LENGTH, RECORDS = 33, 1280, 20, 415, 40
GEMM_OPS = ("aten.linear.default", "aten.mm.default", "aten.addmm.default", "aten.bmm.default")
ATTENTION_OPS = ("torch_attn._varlen_attn.default",)
PEAK = 989e12  # H100/H200 SXM dense bf16


def traffic(policy: str) -> tuple[dict[str, float], int]:
    """op -> bytes per token per layer, and the layers traced."""
    rng = np.random.default_rng(0)
    amino = np.array(list("ACDEFGHIKLMNPQRSTVWY"))
    records = [(f"r{i}", "".join(rng.choice(amino, LENGTH))) for i in range(RECORDS)]
    with fake_cuda() as trace:
        loaded = fake_model(DIM, HEADS, LAYERS)
        embedder = Embedder(loaded, EmbedOptions(precision=policy, device="cuda"), torch.device("cuda", 0))
        embedder.runner(embedder.policy)
        trace.clear()
        trace.counter.track_traffic = True
        dict(embedder.embed(records))
    tokens, layers = RECORDS * (LENGTH + 2), loaded.num_layers
    return {op: moved / tokens / layers for op, moved in trace.traffic.items()}, layers


def main(policy: str = "bf16-mixed") -> None:
    per, _ = traffic(policy)
    gemm = sum(per.pop(op, 0.0) for op in GEMM_OPS)
    attention = sum(per.pop(op, 0.0) for op in ATTENTION_OPS)
    rest = sum(per.values())
    print(f"650M {policy} packed: bytes moved per token per layer outside GEMMs and attention (not fused):")
    for op, moved in sorted(per.items(), key=lambda kv: -kv[1])[:12]:
        print(f"  {moved / DIM:6.1f} x D  {op}")
    print(f"  total {rest:,.0f} B = {rest / DIM:.0f} x D; GEMM operands {gemm / DIM:.0f} x D; "
          f"attention {attention / DIM:.0f} x D")
    gemm_flops, attention_flops = 24 * DIM * DIM, 4 * (LENGTH + 2) * DIM
    for gemm_rate, hbm in ((700e12, 4.0e12), (600e12, 3.5e12)):
        seconds = gemm_flops / gemm_rate + rest / hbm + attention_flops / 350e12
        print(f"  GEMMs at {gemm_rate / 1e12:.0f} TF/s, other ops at {hbm / 1e12:.1f} TB/s, attention at 350 TF/s: "
              f"MFU <= {(gemm_flops + attention_flops) / seconds / PEAK:.0%} of {PEAK / 1e12:.0f} TF/s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("policy", nargs="?", default="bf16-mixed", help="precision policy (default %(default)s)")
    main(parser.parse_args().policy)
