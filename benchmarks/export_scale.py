"""`embedpipe export`: time and peak memory per format at scale (``scale``), and what its checks cost (``checks``).

    python benchmarks/export_scale.py scale [--records 100000 1000000] [--dim 32] [--formats npy parquet h5-per-id]
    python benchmarks/export_scale.py checks [--records 5000] [--dim 320] [--short] [--repeat 3]

``scale`` writes a synthetic merged-shape store (N records, D-wide float32 means, 5% of input IDs as
aliases) once per size, then runs `embedpipe export` for each format in its own process and
reports wall time and peak RSS (the child's VmHWM), next to the size of the vector
matrix itself. Bounded memory means peak RSS grows far slower than the matrix (what is left
grows with the store's ID index).

``checks`` (docs/exports.md, "What export checks"): the same export of one synthetic store
with per-residue rows, in this process, with the checks and with them patched out by this
script, best of ``--repeat``: validate's ID checks through its external sort
(``export_problems``) before anything is written, and an ``isfinite`` pass over every
exported block (``require_finite``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import h5py
import numpy as np
from _harness import Stopwatch, machine_header, run_process, table, time_call

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
    """Seconds of the export call (start-up and imports not counted) and peak RSS of one export in
    a fresh process, and what it added over a process that only imported ``embedpipe.export``.
    Peak RSS is VmHWM, which exec resets."""
    code = ("from _harness import Stopwatch\n"
            "from embedpipe.export import export_store\n"
            "with Stopwatch() as clock:\n"
            f"    export_store({str(store)!r}, fmt={fmt!r}, out={str(out)!r}, quiet=True)\n"
            f"print(clock.seconds, {_PEAK})\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join((str(ROOT), str(ROOT / "benchmarks"))))
    idle = int(run_process([sys.executable, "-c", f"import embedpipe.export; print({_PEAK})"], env,
                           capture=True).stdout)
    seconds, peak = run_process([sys.executable, "-c", code], env, capture=True).stdout.split()[-2:]
    return {"seconds": float(seconds), "peak_mib": int(peak) / 1024, "added_mib": (int(peak) - idle) / 1024}


def scale(args: argparse.Namespace) -> None:
    results = []
    scratch = ROOT / "benchmarks" / "out"  # git-ignored: a killed run leaves nothing in the tree
    scratch.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=scratch) as tmp:
        for n in args.records or [100_000, 1_000_000]:
            store = Path(tmp) / f"store-{n}.h5"
            with Stopwatch() as clock:
                write_store(store, n, args.dim or 32)
            print(f"{n:,} records: store written in {clock.seconds:.0f} s", file=sys.stderr)
            matrix_mib = n * 1.05 * (args.dim or 32) * 4 / 2**20
            for fmt in args.formats:
                row = {"records": n, "format": fmt, "matrix_mib": round(matrix_mib, 1),
                       **run_export(store, fmt, Path(tmp) / f"out-{n}.{fmt}")}
                results.append(row)
                print(json.dumps(row), file=sys.stderr)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(table(("records", "format", "vectors (MiB)", "seconds", "peak RSS (MiB)", "added by export (MiB)"),
                [(r["records"], r["format"], r["matrix_mib"], r["seconds"], r["peak_mib"], r["added_mib"]) for r in results],
                formats={"vectors (MiB)": "{:.0f}", "seconds": "{:.1f}", "peak RSS (MiB)": "{:.0f}",
                         "added by export (MiB)": "{:.0f}"}))


LAYER = 6
ATTRS = {"model_name": "synthetic", "model_sha256": "0" * 64, "model_trained": False,
         "precision_policy": "fp32", "device": "cpu"}


def write_per_residue_store(path: Path, n: int, dim: int, short: bool) -> Path:
    """``n`` records with per-residue rows (5-14 of them with ``short``, else 50-249)."""
    from embedpipe.store import EmbeddedRecord, StoreWriter

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


def checks(args: argparse.Namespace) -> None:
    import embedpipe.export.blocks as blocks
    import embedpipe.export.run as run

    records, dim = (args.records or [5000])[0], args.dim or 320
    saved = (blocks.export_problems, blocks.require_finite)
    cases = [("npy", False), ("parquet", False)] + ([] if args.short else [("h5-per-id", False), ("npy", True)])
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        store = write_per_residue_store(Path(tmp) / "s.h5", records, dim, args.short)
        print(f"{records} records, D = {dim}, {store.stat().st_size / 2**20:.0f} MiB\n")
        for fmt, per_residue in cases:
            out = Path(tmp) / f"x.{fmt}"

            def export(fmt: str = fmt, per_residue: bool = per_residue, out: Path = out) -> None:
                run.export_store(store, fmt=fmt, out=out, per_residue=per_residue, quiet=True)

            try:
                on = time_call(export, args.repeat).best
                blocks.export_problems, blocks.require_finite = (lambda path: []), (lambda *a, **k: None)
                off = time_call(export, args.repeat).best
            finally:
                blocks.export_problems, blocks.require_finite = saved
            rows.append((f"`{fmt}{' --per-residue' if per_residue else ''}`", on, off, on / off))
    print(table(("export", "with checks s", "without s", "with / without"), rows,
                formats={"with checks s": "{:.3f}", "without s": "{:.3f}", "with / without": "{:.2f}"}))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("measure", choices=["scale", "checks"])
    parser.add_argument("--records", type=int, nargs="+", default=None,
                        help="scale: store sizes (default 100000 1000000); checks: one size (default 5000)")
    parser.add_argument("--dim", type=int, default=None, help="vector width (default: scale 32, checks 320)")
    parser.add_argument("--formats", nargs="+", default=["npy", "parquet", "h5-per-id"], help="scale: formats")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out" / "export_scale.json",
                        help="scale: the results as JSON")
    parser.add_argument("--short", action="store_true", help="checks: 5-14 residues a record (many small records)")
    parser.add_argument("--repeat", type=int, default=3, help="checks: best of N")
    args = parser.parse_args(argv)
    print(machine_header() + "\n")
    (scale if args.measure == "scale" else checks)(args)


if __name__ == "__main__":
    main()
