"""What verifying a kept shard store costs: the check a group embed job runs before it keeps a
store from an earlier run (``validate_store``: every chunk read and its fletcher32 checksum
verified, finiteness, each mean against its per-residue rows).

    python benchmarks/keep_check.py [--records 10000] [--length 300] [--dim 1280] [--dtype float16] [--pooled-only]

Writes two synthetic shard stores through the real writer (N records of L residues, D wide):
one with per-residue rows, one pooled only, then times ``validate_store`` on each (best of
``--repeat``, page cache warm: a cold cache adds the file system's read time). Reports seconds,
seconds per GB of store and per 10,000 records.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
from _harness import machine_header, table, time_call

ROOT = Path(__file__).resolve().parents[1]


def write_store(path: Path, n: int, length: int, dim: int, dtype: str, per_residue: bool) -> None:
    from embedpipe.store import EmbeddedRecord, StoreWriter

    rng = np.random.default_rng(0)
    seq = "M" * length
    ids = [f"P{i:07d}" for i in range(n)]
    with StoreWriter(path, ids=ids, sequences=[seq] * n, residue_rows=[length] * n if per_residue else None,
                     layers=[6], dim=dim, storage_dtype=dtype,
                     attrs={"model_name": "synthetic", "model_trained": False}) as writer:
        for i in range(n):
            if per_residue:
                rows = rng.standard_normal((length, dim), dtype=np.float32)
                rows = rows.astype(dtype).astype(np.float32)  # the stored values, so the mean check holds
                mean, residues = rows.mean(0), {6: rows}
            else:
                mean, residues = rng.standard_normal(dim, dtype=np.float32), None
            writer.write(i, EmbeddedRecord(id=ids[i], sequence=seq, precision_used="fp32", mean={6: mean},
                                           per_residue=residues, max_abs_activation=1.0, embedded_length=length))


def time_check(path: Path, repeat: int) -> float:
    from embedpipe.store.validate import validate_store

    def check() -> None:
        problems = validate_store(path)
        if problems:
            raise SystemExit(f"{path}: the synthetic store does not validate: {problems[:3]}")

    return time_call(check, rounds=repeat).best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=10_000)
    parser.add_argument("--length", type=int, default=300)
    parser.add_argument("--dim", type=int, default=1280)
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--pooled-only", action="store_true", help="only the store without per-residue rows")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(dir=ROOT / "benchmarks") as scratch:
        for per_residue in (False,) if args.pooled_only else (True, False):
            path = Path(scratch) / f"store-{per_residue}.h5"
            write_store(path, args.records, args.length, args.dim, args.dtype, per_residue)
            seconds = time_check(path, args.repeat)
            gb = path.stat().st_size / 1e9
            rows.append(("per-residue + mean" if per_residue else "mean only", args.records, gb, seconds,
                         seconds / gb, seconds * 10_000 / args.records))
    print(machine_header() + "\n")
    print(table(("store", "records", "size (GB)", "seconds", "s per GB", "s per 10k records"), rows,
                formats={"size (GB)": "{:.2f}", "seconds": "{:.1f}", "s per GB": "{:.1f}", "s per 10k records": "{:.2f}"}))


if __name__ == "__main__":
    main()
