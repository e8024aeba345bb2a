"""How far each precision policy is from fp32, on long sequences where the traps bite.

    python benchmarks/precision_accuracy.py [--layers 4 --dim 64 --heads 4 --records 8]

Random-weight checkpoint, random sequences of 700-1022 residues (rotary positions beyond
256 are not exact in bf16; position x frequency loses more in either low dtype). For each
policy: mean per-residue relative L2 error of the last layer against embedpipe's fp32
output, and min pooled cosine. The mixed policies keep rotary tables, attention and layer
norms in fp32 and should sit clearly below the plain casts of the same dtype
(tests/runtime/test_precision.py asserts it on a smaller sample). The mixed policies run twice: with
fp32 attention inputs (the CPU default) and with ``EMBEDPIPE_ENGINE=attention_inputs=compute`` (rotated in
fp32, then q/k/v cast to the compute dtype: the CUDA default, for tensor-core kernels), with
residues/s of each run on this machine (docs/precision.md, "Attention inputs").
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
from _harness import Stopwatch, cosine, machine_header, pinned_engine, random_records, table
from _helpers import embedder_for

from embedpipe.core.options import FP32_ISLAND_POLICIES, EmbedOptions
from embedpipe.model import load_model
from embedpipe.model.random_checkpoint import make_test_model
from embedpipe.runtime.precision import POLICIES

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--records", type=int, default=8)
    parser.add_argument("--seed", type=int, default=9)
    args = parser.parse_args()

    out = ROOT / "benchmarks" / "out"
    out.mkdir(parents=True, exist_ok=True)
    path = make_test_model(out / f"esm2_acc_t{args.layers}_{args.dim}.pt", layers=args.layers, dim=args.dim,
                           heads=args.heads, seed=3)
    loaded = load_model(str(path))
    rng = np.random.default_rng(args.seed)  # the lengths, then the residues, from one generator
    records = random_records(rng.integers(700, 1023, size=args.records).tolist(), seed=rng, prefix="rec")
    last = loaded.num_layers

    residues = sum(len(seq) for _, seq in records)

    def run(policy: str, inputs: str = "auto") -> tuple[dict, float]:
        with pinned_engine(attention_inputs=inputs):
            embedder = embedder_for(loaded, EmbedOptions(precision=policy, per_residue=True), torch.device("cpu"))
        with Stopwatch() as clock:
            got = dict(embedder.embed(records))
        return got, residues / clock.seconds

    ref, _ = run("fp32")
    print(machine_header() + "\n")
    print(f"model {args.layers} layers x {args.dim} dims x {args.heads} heads (random weights); "
          f"{args.records} random sequences of 700-1022 residues\n")
    rows = []
    runs = [(policy, "auto") for policy in POLICIES] + [(policy, "compute") for policy in FP32_ISLAND_POLICIES]
    for policy, inputs in runs:
        got, rate = run(policy, inputs)
        errors = [np.linalg.norm(got[i].per_residue[last] - ref[i].per_residue[last]) / np.linalg.norm(ref[i].per_residue[last])
                  for i in ref]
        cosines = [cosine(got[i].mean[last], ref[i].mean[last]) for i in ref]
        shown = ("compute" if inputs == "compute" else "fp32") if policy in FP32_ISLAND_POLICIES else "policy dtype"
        rows.append((policy, shown, f"{np.mean(errors):.2e}", f"{np.max(errors):.2e}", f"{min(cosines):.7f}", rate))
    print(table(("policy", "attention inputs", "mean per-residue rel. L2 error", "max per-residue rel. L2 error",
                 "min pooled cosine", "residues/s"), rows, formats={"residues/s": "{:,.0f}"}))


if __name__ == "__main__":
    main()
