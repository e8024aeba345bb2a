"""`embedpipe export` at scale: time and peak memory of each format against the store's size.

    python benchmarks/export_scale.py [--records 100000 1000000] [--dim 32] [--formats npy parquet h5-per-id]

Writes a synthetic merged-shape store (N records, D-wide float32 means, 5% of input IDs as
aliases) once per size, then runs `embedpipe export` for each format in its own process and
reports wall time and peak RSS (the child's VmHWM), next to the size of the vector
matrix itself. Bounded memory means peak RSS grows far slower than the matrix (what is left
grows with the store's ID index, which issue 15 moves to disk).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def write_store(path: Path, n: int, dim: int, seed: int = 0) -> None:
    """A synthetic store in bulk: the documented datasets written whole (docs/store-format.md),
    then its aliases group, as a merged store carries them."""
    from embedpipe.store import EmbeddedRecord, StoreWriter

    rng = np.random.default_rng(seed)
    ids = [f"P{i:08d}" for i in range(n)]
    with StoreWriter(path, ids=ids, sequences=["MKV"] * n, residue_rows=None, layers=[6], dim=dim,
                     storage_dtype="float32", attrs={"model_name": "synthetic", "model_trained": False}) as writer:
        vectors = rng.standard_normal((n, dim), dtype=np.float32)
        for i in range(n):
            writer.write(i, EmbeddedRecord(id=ids[i], sequence="MKV", precision_used="fp32",
                                           mean={6: vectors[i]}, max_abs_activation=1.0, embedded_length=3))
    from embedpipe.store.idindex import encode_ids, index_keys, write_id_index

    aliases = rng.choice(n, size=n // 20, replace=False)
    pairs = [(f"A{i:08d}", ids[j]) for i, j in enumerate(aliases.tolist())]
    with h5py.File(path, "r+") as f:
        group = f.create_group("aliases")
        group.attrs["encoding-type"], group.attrs["encoding-version"] = "aliases", "1"
        for name, values in (("id", [a for a, _ in pairs]), ("of", [b for _, b in pairs])):
            ds = group.create_dataset(name, data=np.array([v.encode() for v in values]), fletcher32=True, chunks=True)
            ds.attrs["encoding-type"], ds.attrs["encoding-version"] = "fixed-utf8-array", "1"
        del f["id_index"]  # the index holds the aliases too (docs/store-format.md, "ID index")
        write_id_index(f, *index_keys(encode_ids(ids), pairs))


_PEAK = "int(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1])"


def run_export(store: Path, fmt: str, out: Path) -> dict[str, float]:
    """Time and peak RSS of one export in a fresh process. Peak RSS is VmHWM, which exec
    resets (``ru_maxrss`` would carry over the parent's peak through fork)."""
    code = (
        "import time\n"
        "from embedpipe.export import export_store\n"
        "t = time.perf_counter()\n"
        f"export_store({str(store)!r}, fmt={fmt!r}, out={str(out)!r}, quiet=True)\n"
        f"print(time.perf_counter() - t, {_PEAK})\n"
    )
    base = f"import embedpipe.export; print({_PEAK})"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    idle = int(subprocess.run([sys.executable, "-c", base], capture_output=True, text=True, check=True, env=env).stdout)
    seconds, peak = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                   env=env).stdout.split()
    return {"seconds": float(seconds), "peak_mib": int(peak) / 1024, "added_mib": (int(peak) - idle) / 1024}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--formats", nargs="+", default=["npy", "parquet", "h5-per-id"])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out" / "export_scale.json")
    args = parser.parse_args(argv)
    results = []
    scratch = ROOT / "benchmarks" / "out"  # git-ignored: a killed run leaves nothing in the tree
    scratch.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=scratch) as tmp:
        for n in args.records:
            store = Path(tmp) / f"store-{n}.h5"
            started = time.perf_counter()
            write_store(store, n, args.dim)
            print(f"{n:,} records: store written in {time.perf_counter() - started:.0f} s", file=sys.stderr)
            matrix_mib = n * 1.05 * args.dim * 4 / 2**20
            for fmt in args.formats:
                row = {"records": n, "format": fmt, "matrix_mib": round(matrix_mib, 1),
                       **run_export(store, fmt, Path(tmp) / f"out-{n}.{fmt}")}
                results.append(row)
                print(json.dumps(row), file=sys.stderr)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print("| records | format | vectors (MiB) | seconds | peak RSS (MiB) | added by export (MiB) |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['records']:,} | {r['format']} | {r['matrix_mib']:.0f} | {r['seconds']:.1f} | "
              f"{r['peak_mib']:.0f} | {r['added_mib']:.0f} |")


if __name__ == "__main__":
    main()
