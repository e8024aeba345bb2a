"""What export's checks cost (docs/exports.md, "What export checks"): the same export of one
synthetic store with the checks and with them patched out, side by side, best of ``--repeat``.

    python benchmarks/export_checks.py --records 5000 --dim 320
    python benchmarks/export_checks.py --records 200000 --dim 16 --short

The checks: validate's ID checks through its external sort (``export_problems``) before
anything is written, and an ``isfinite`` pass over every exported block (``require_finite``).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

import embedpipe.export.blocks as blocks
import embedpipe.export.run as run
from embedpipe.store import EmbeddedRecord, StoreWriter

LAYER = 6
ATTRS = {"model_name": "synthetic", "model_sha256": "0" * 64, "model_trained": False,
         "precision_policy": "fp32", "device": "cpu"}


def write(path: Path, n: int, dim: int, short: bool) -> Path:
    """``n`` records with per-residue rows (5-14 of them with ``short``, else 50-249)."""
    rng = np.random.default_rng(0)
    lengths = [(5 + i % 10) if short else (50 + i % 200) for i in range(n)]
    with StoreWriter(path, ids=[f"sp|P{i:06d}|PROT_HUMAN" for i in range(n)], sequences=["A" * n_ for n_ in lengths],
                     residue_rows=lengths, layers=[LAYER], dim=dim, storage_dtype="float32", attrs=ATTRS) as writer:
        for i, length in enumerate(lengths):
            rows = rng.standard_normal((length, dim), dtype=np.float32)
            writer.write(i, EmbeddedRecord(
                id=f"sp|P{i:06d}|PROT_HUMAN", sequence="A" * length, precision_used="fp32", fallback_reason="",
                mean={LAYER: rows.sum(axis=0, dtype=np.float32) / np.float32(length)}, per_residue={LAYER: rows},
                max_abs_activation=1.0, embedded_length=length))
    return path


def best(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=5000)
    parser.add_argument("--dim", type=int, default=320)
    parser.add_argument("--short", action="store_true", help="5-14 residues a record (many small records)")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    checks = (run.export_problems, blocks.require_finite)
    cases = [("npy", False), ("parquet", False)] + ([] if args.short else [("h5-per-id", False), ("npy", True)])
    with tempfile.TemporaryDirectory() as tmp:
        store = write(Path(tmp) / "s.h5", args.records, args.dim, args.short)
        print(f"{args.records} records, D = {args.dim}, {store.stat().st_size / 2**20:.0f} MiB")
        print("| export | with checks s | without s | with / without |\n| --- | --- | --- | --- |")
        for fmt, per_residue in cases:
            out = Path(tmp) / f"x.{fmt}"

            def export(fmt: str = fmt, per_residue: bool = per_residue, out: Path = out) -> None:
                run.export_store(store, fmt=fmt, out=out, per_residue=per_residue, quiet=True)

            run.export_problems, blocks.require_finite = checks
            on = best(export, args.repeat)
            run.export_problems, blocks.require_finite = (lambda path: []), (lambda *a, **k: None)
            off = best(export, args.repeat)
            run.export_problems, blocks.require_finite = checks
            label = f"`{fmt}{' --per-residue' if per_residue else ''}`"
            print(f"| {label} | {on:.3f} | {off:.3f} | {on / off:.2f} |")


if __name__ == "__main__":
    main()
