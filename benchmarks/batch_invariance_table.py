"""How much a record's stored numbers depend on its batch: the before/after table of issue 32.

Embeds the same records twice, ``--tokens-per-batch`` 1000 and 4096 (and, the second row,
reversed with longer records added), on a random 6-layer 320-wide ESM-2 in the packed
layout, and prints per precision how many records are not bit-equal and the largest
absolute difference of the pooled means and per-residue rows. Run it with another
checkout on ``PYTHONPATH`` for the numbers before a change (docs/precision.md,
"Reproducibility")::

    python benchmarks/batch_invariance_table.py --records 120 [--layout padded]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import h5py
import numpy as np

from embedpipe.core.options import EmbedOptions
from embedpipe.embed.run import embed_fasta
from embedpipe.model.random_checkpoint import make_test_model

AMINO = np.array(list("ACDEFGHIKLMNPQRSTVWY"))


def records(count: int, low: int, high: int, seed: int) -> list[tuple[str, str]]:
    """Random proteins (fixed seed), ids ``r<seed>_<i>``."""
    rng = np.random.default_rng(seed)
    return [(f"r{seed}_{i}", "".join(rng.choice(AMINO, int(n)))) for i, n in enumerate(rng.integers(low, high, count))]


def embed(tmp: Path, model: Path, recs: list[tuple[str, str]], name: str, **options: object) -> dict[str, tuple]:
    """id -> (mean, per-residue rows) of one embed of ``recs``."""
    fasta = tmp / f"{name}.fasta"
    fasta.write_text("".join(f">{rid}\n{seq}\n" for rid, seq in recs))
    out = tmp / f"{name}.h5"
    embed_fasta(fasta, model=str(model), out=out, options=EmbedOptions(**options), quiet=True)  # type: ignore[arg-type]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=120)
    parser.add_argument("--precisions", default="fp32,bf16-mixed,int8-mixed")
    parser.add_argument("--layout", default="packed", choices=["packed", "padded"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        model = make_test_model(tmp / "esm2_t6_320.pt", layers=6, dim=320, heads=20, seed=3)
        recs = records(args.records, 40, 400, seed=1)
        more = recs[::-1] + records(30, 400, 700, seed=2)
        for precision in args.precisions.split(","):
            common = dict(precision=precision, layers=(6,), per_residue=True, batch_layout=args.layout, threads=2)
            big = embed(tmp, model, recs, f"{precision}-4096", tokens_per_batch=4096, **common)
            small = embed(tmp, model, recs, f"{precision}-1000", tokens_per_batch=1000, **common)
            mixed = embed(tmp, model, more, f"{precision}-more", tokens_per_batch=4096, **common)
            print(f"{precision:11s} {args.layout} tokens-per-batch 1000 vs 4096: {compare(big, small)}; "
                  f"reversed + 30 longer: {compare(big, mixed)}")


if __name__ == "__main__":
    main()
