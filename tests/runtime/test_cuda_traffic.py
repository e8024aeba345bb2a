"""Bytes each op of a 650M packed forward moves outside the GEMMs and attention, per token per
layer, traced on the faked GPU (helpers/fake_cuda.py: no GPU, no weights), and the MFU ceiling
that traffic implies in eager mode: the figures of docs/benchmarks.md ("The eager-mode MFU
ceiling"), checked against that table and printed with ``-s``:

    python -m pytest tests/runtime/test_cuda_traffic.py -s -q

A trace on the test harness, not a timing, so it lives beside the other fake-CUDA traces
(it was benchmarks/cuda_trace_traffic.py; benchmarks never import tests/, issue 31).
Traffic of an op = bytes of its device inputs plus outputs (views excluded): an upper bound
on HBM traffic when nothing is fused. The ceiling assumes the GEMMs at a given fraction of
the bf16 peak, every other op at a given HBM bandwidth, attention at 350 TFLOP/s.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch
from test_cuda_memory import fake_model

from embedpipe.core.options import EmbedOptions
from helpers.engine import embedder_for
from helpers.fake_cuda import fake_cuda

LAYERS, DIM, HEADS, LENGTH, RECORDS = 33, 1280, 20, 415, 40
GEMM_OPS = ("aten.linear.default", "aten.mm.default", "aten.addmm.default", "aten.bmm.default")
ATTENTION_OPS = ("torch_attn._varlen_attn.default",)
PEAK = 989e12  # H100/H200 SXM dense bf16
#: the documented table's columns: the ops each one adds up
COLUMNS = {"casts": ("aten._to_copy.default",), "rotation": ("aten.mul.out", "aten.addcmul_.default"),
           "residual adds": ("aten.add.Tensor",), "layer norms": ("aten.layer_norm.default",),
           "GELU": ("aten.gelu.default",), "largest-activation check": ("aten.aminmax.default",)}
DOC = Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md"


def traffic(policy: str) -> dict[str, float]:
    """op -> bytes per token per layer of one packed forward under ``policy``."""
    rng = np.random.default_rng(0)
    amino = np.array(list("ACDEFGHIKLMNPQRSTVWY"))
    records = [(f"r{i}", "".join(rng.choice(amino, LENGTH))) for i in range(RECORDS)]
    with fake_cuda() as trace:
        loaded = fake_model(DIM, HEADS, LAYERS)
        embedder = embedder_for(loaded, EmbedOptions(precision=policy, device="cuda"), torch.device("cuda", 0))
        embedder.runner(embedder.policy)
        trace.clear()
        trace.counter.track_traffic = True
        dict(embedder.embed(records))
    tokens = RECORDS * (LENGTH + 2)
    return {op: moved / tokens / loaded.num_layers for op, moved in trace.traffic.items()}


def ceilings(rest: float) -> list[float]:
    """The MFU ceiling at (700 TF/s GEMMs, 4.0 TB/s) and (600 TF/s, 3.5 TB/s)."""
    gemm_flops, attention_flops = 24 * DIM * DIM, 4 * (LENGTH + 2) * DIM
    return [(gemm_flops + attention_flops) / (gemm_flops / rate + rest / hbm + attention_flops / 350e12) / PEAK
            for rate, hbm in ((700e12, 4.0e12), (600e12, 3.5e12))]


def _documented() -> list[str]:
    row = next(line for line in DOC.read_text(encoding="utf-8").splitlines() if line.startswith("| after |"))
    return [cell.strip() for cell in row.strip("|").split("|")[1:]]


def test_the_bf16_mixed_traffic_is_the_documented_one():
    per = traffic("bf16-mixed")
    gemm = sum(per.pop(op, 0.0) for op in GEMM_OPS)
    attention = sum(per.pop(op, 0.0) for op in ATTENTION_OPS)
    rest = sum(per.values())
    print("\n650M bf16-mixed packed: bytes moved per token per layer outside GEMMs and attention (not fused):")
    for op, moved in sorted(per.items(), key=lambda kv: -kv[1])[:12]:
        print(f"  {moved / DIM:6.1f} x D  {op}")
    high, low = ceilings(rest)
    print(f"  total {rest:,.0f} B = {rest / DIM:.0f} x D; GEMM operands {gemm / DIM:.0f} x D; attention "
          f"{attention / DIM:.0f} x D; MFU ceiling {high:.0%} ({low:.0%}) of {PEAK / 1e12:.0f} TF/s")

    cells = _documented()
    assert len(cells) == len(COLUMNS) + 2, cells
    for (name, ops), cell in zip(COLUMNS.items(), cells):
        documented = float(re.match(r"([\d.]+) D", cell)[1])
        assert abs(sum(per.get(op, 0.0) for op in ops) / DIM - documented) < 0.05, (name, cell)
    assert f"{rest / DIM:.0f} D" == cells[-2]
    assert f"{high:.0%} ({low:.0%})" == cells[-1]
    assert gemm > rest / 10 and attention > 0  # the GEMMs and the varlen kernel were traced too
