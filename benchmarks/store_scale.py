"""The store at scale: open, per-ID reads, merge and validate over many records and many shards.

Writes synthetic shard stores quickly with h5py, following docs/store-format.md (format 1
shards, which every embedpipe reads; D = 8, float32, one layer, per-residue rows with
means that are the means of their rows, one 35,000-aa record), merges them with
``embedpipe.store.merge_stores`` and measures, each step in its own subprocess (peak RSS from
``resource.getrusage`` of that process, RSS added by ``open_store`` from psutil):

* ``merge`` and ``validate``: time and peak RSS;
* ``open_store``: time and RSS added;
* per-ID reads: mean latency of ``mean_vector`` and ``per_residue`` over random IDs;
* ``records(sequence=True)``: time;
* ``--nofile N``: the reads and ``validate`` again with ``RLIMIT_NOFILE`` set to N (no NaN,
  validate clean, no error).

``--manifest``: instead, ``embedpipe merge`` with and without ``--manifest`` as whole
processes, wall time and peak RSS, per record and extrapolated to 60M records (UniRef50). It
writes (once, cached under ``benchmarks/out/merge-N-K/``) K stores of N records in all (pooled
only, D=8, 60-400 aa random sequences, through StoreWriter) and a ``manifest.tsv`` like
``shard`` writes: one ``ok`` row per stored record, ``--duplicates`` (default 20%)
``duplicate`` rows pointing at random stored records and 1% ``skipped`` rows.

    python benchmarks/store_scale.py --records 1000000 --shards 100      # 1M records
    python benchmarks/store_scale.py --records 20000 --shards 1000 --nofile 256
    python benchmarks/store_scale.py --records 100000 --shards 5000 --nofile 256
    python benchmarks/store_scale.py --manifest --records 1000000 --shards 100

Outputs go under ``benchmarks/out/store_scale/`` (git-ignored). docs/benchmarks.md, "Store at scale".
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import h5py
import numpy as np
from _harness import Stopwatch, machine_header, run_process, table, time_call

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
AA = np.frombuffer(b"ACDEFGHIKLMNPQRSTVWY", dtype=np.uint8)
DIM = 8
LONG = 35_000
#: chunk size of the synthetic datasets (the writer's target; tests make it smaller)
CHUNK_BYTES = 4 << 20


def _strings(f: h5py.Group, name: str, values: list[bytes]) -> None:
    width = max(1, max((len(v) for v in values), default=1))
    rows = max(1, min(len(values), 65536, CHUNK_BYTES // width))  # chunks of <= 4 MiB, as the writer makes
    ds = f.create_dataset(name, data=np.array(values, dtype=h5py.string_dtype("utf-8", width)), chunks=(rows,),
                          compression="gzip", fletcher32=True)
    ds.attrs["encoding-type"], ds.attrs["encoding-version"] = "fixed-utf8-array", "1"


def _array(f: h5py.Group, name: str, data: np.ndarray, encoding: str = "array") -> None:
    rows = max(1, min(len(data), CHUNK_BYTES // max(1, data[:1].nbytes)))
    ds = f.create_dataset(name, data=data, chunks=(rows, *data.shape[1:]), fletcher32=True)
    ds.attrs["encoding-type"], ds.attrs["encoding-version"] = encoding, "1"


def write_shard(path: Path, first: int, n: int, rng: np.random.Generator, long_record: bool) -> None:
    """One complete format-1 shard store of ``n`` records, IDs ``UniRef50_{first + i:09d}``."""
    ids = [f"UniRef50_{first + i:09d}".encode() for i in range(n)]
    rows = rng.integers(1, 8, size=n)
    lengths = rows.copy()
    if long_record:
        lengths[0] = LONG  # truncated: 35,000 residues stored, ``rows[0]`` embedded
    seqs = [AA[rng.integers(0, 20, size=int(k))].tobytes() for k in lengths]
    offsets = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)
    per_residue = rng.standard_normal((int(offsets[-1]), DIM)).astype(np.float32)
    means = np.add.reduceat(per_residue.astype(np.float64), offsets[:-1], axis=0) / rows[:, None]
    with h5py.File(path, "w", libver=("v110", "v110")) as f:
        f.attrs.update({"encoding-type": "embedpipe.store", "encoding-version": "1", "format": "embedpipe.store",
                        "format_version": np.int64(1), "store_uuid": uuid.uuid4().hex, "storage_dtype": "float32",
                        "layers": np.array([1]), "dim": DIM, "per_residue": True, "pooling": ["mean"],
                        "created_utc": "2026-01-01T00:00:00Z", "model_sha256": "0" * 64, "precision_policy": "fp32",
                        "config": "{}", "json_attrs": ["config"]})
        _strings(f, "ids", ids)
        _strings(f, "sequence", seqs)
        _array(f, "length", lengths.astype(np.int64))
        _array(f, "embedded_length", rows.astype(np.int64))
        _strings(f, "precision_used", [b"fp32"] * n)
        _strings(f, "fallback_reason", [b""] * n)
        _array(f, "max_abs_activation", np.ones(n, dtype=np.float32))
        _strings(f, "long_handling", [b"truncated" if long_record and i == 0 else b"none" for i in range(n)])
        _array(f, "windows", np.ones(n, dtype=np.int64))
        for group in ("mean", "per_residue"):
            g = f.create_group(group)
            g.attrs["encoding-type"] = "pooled-layers" if group == "mean" else "ragged-layers"
            g.attrs["encoding-version"] = "1"
        f["mean"].attrs["pooling"] = "mean"
        _array(f["mean"], "layer_1", means.astype(np.float32))
        _array(f["per_residue"], "offsets", offsets, "offsets")
        _array(f["per_residue"], "layer_1", per_residue)
        f.attrs["complete"] = True


def build(out: Path, records: int, shards: int) -> list[Path]:
    """``shards`` shard stores holding ``records`` records in all (cached by their count)."""
    stores = out / "stores"
    done = out / "stores.done"
    paths = [stores / f"shard-{s:05d}.h5" for s in range(shards)]
    if done.exists():
        return paths
    shutil.rmtree(stores, ignore_errors=True)
    stores.mkdir(parents=True)
    rng = np.random.default_rng(0)
    per = np.full(shards, records // shards)
    per[: records % shards] += 1
    first = 0
    for s, (path, n) in enumerate(zip(paths, per.tolist())):
        write_shard(path, first, n, rng, long_record=s == 0)
        first += n
    done.write_text("ok\n")
    return paths


# the measured steps, each run as ``python store_scale.py --step NAME ...`` in its own process
def step_merge(args: argparse.Namespace) -> dict:
    from embedpipe.store import merge_stores

    paths = sorted((args.out / "stores").glob("shard-*.h5"))
    with Stopwatch() as clock:
        merge_stores(paths, out=args.out / "merged.h5")
    return {"merge_s": clock.seconds}


def step_open(args: argparse.Namespace) -> dict:
    import psutil

    import embedpipe
    import embedpipe.store.reader  # noqa: F401 - dask's import is not part of opening a store

    proc = psutil.Process()
    rss0 = proc.memory_info().rss
    with Stopwatch() as clock:
        store = embedpipe.open_store(args.out / "merged.h5")
    open_s = clock.seconds
    added = proc.memory_info().rss - rss0
    rng = np.random.default_rng(1)
    n = len(store)
    rows = rng.integers(0, n, size=args.lookups)
    ids = [store.ids[int(r)] for r in rows]
    with Stopwatch() as clock:
        for rid in ids:
            store.mean_vector(rid)
    mean_us = clock.seconds / len(ids) * 1e6
    bad = 0
    with Stopwatch() as clock:
        for rid in ids:
            bad += int(not np.isfinite(store.per_residue(rid)).all())
    pr_us = clock.seconds / len(ids) * 1e6
    rec_s = time_call(lambda: store.records(sequence=True, rows=slice(0, min(n, 10_000)))).best
    return {"open_s": open_s, "open_added_mib": added / 2**20, "mean_vector_us": mean_us, "per_residue_us": pr_us,
            "records_seq_10k_s": rec_s, "nan_records": bad, "open_rss_mib": proc.memory_info().rss / 2**20}


def step_validate(args: argparse.Namespace) -> dict:
    from embedpipe.store import validate_store

    with Stopwatch() as clock:
        problems = validate_store(args.out / "merged.h5")
    return {"validate_s": clock.seconds, "validate_problems": len(problems),
            "validate_first": problems[0][:200] if problems else ""}


def step_nofile(args: argparse.Namespace) -> dict:
    """Reads and validate with ``RLIMIT_NOFILE`` lowered to ``args.nofile``."""
    import resource

    import embedpipe
    from embedpipe.store import validate_store

    resource.setrlimit(resource.RLIMIT_NOFILE, (args.nofile, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    out: dict = {"nofile": args.nofile}
    try:
        with embedpipe.open_store(args.out / "merged.h5") as store:
            arr = store.per_residue_array().compute()
            out["array_nan_rows"] = int((~np.isfinite(arr)).any(axis=1).sum())
            step = max(1, len(store) // 2000)
            out["per_residue_nan"] = sum(int(not np.isfinite(store.per_residue(store.ids[i])).all())
                                         for i in range(0, len(store), step))
    except Exception as exc:  # noqa: BLE001 - reported, the point of the measurement
        out["read_error"] = f"{type(exc).__name__}: {exc}"[:200]
    problems = validate_store(args.out / "merged.h5")
    out["validate_problems"], out["validate_first"] = len(problems), problems[0][:200] if problems else ""
    return out


STEPS = {"merge": step_merge, "open": step_open, "validate": step_validate, "nofile": step_nofile}


def run_step(name: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--step", name, "--out", str(args.out), "--lookups", str(args.lookups),
           "--nofile", str(args.nofile or 0)]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if res.returncode:
        return {f"{name}_error": (res.stderr.strip().splitlines() or ["?"])[-1][:200]}
    return json.loads(res.stdout.strip().splitlines()[-1])


UNIREF50 = 60_000_000
ATTRS = {"model_name": "esm2_t6_8M_UR50D", "model_sha256": "ab" * 32, "precision_policy": "fp32", "device": "cpu",
         "model_trained": False}


def write_stores(root: Path, records: int, stores: int, duplicates: float, seed: int = 0) -> tuple[list[Path], Path]:
    """K stores of N records in all, and the manifest; skipped if already there."""
    from embedpipe.store import EmbeddedRecord, StoreWriter

    manifest = root / "manifest.tsv"
    paths = [root / "stores" / f"shard-{k:05d}.h5" for k in range(stores)]
    if manifest.exists():
        return paths, manifest
    rng = np.random.default_rng(seed)
    alphabet = AA
    rows, sha = [], []
    per_store = np.array_split(np.arange(records), stores)
    for k, rec in enumerate(per_store):
        lengths = rng.integers(60, 400, size=len(rec))
        residues = alphabet[rng.integers(0, 20, size=int(lengths.sum()))].tobytes().decode()
        ends = np.cumsum(lengths).tolist()
        seqs = [residues[e - n : e] for e, n in zip(ends, lengths.tolist())]
        ids = [f"UniRef50_S{i:09d}" for i in rec.tolist()]
        mean = {6: np.zeros(8, dtype=np.float32)}
        with StoreWriter(paths[k], ids=ids, sequences=seqs, residue_rows=None, layers=[6], dim=8,
                         storage_dtype="float16", attrs={**ATTRS, "config": {}}) as w:
            for i, (rid, seq) in enumerate(zip(ids, seqs)):
                w.write(i, EmbeddedRecord(id=rid, sequence=seq, precision_used="fp32", mean=mean,
                                          embedded_length=len(seq)))
        for rid, seq in zip(ids, seqs):
            digest = hashlib.sha256(seq.encode()).hexdigest()
            sha.append(digest)
            rows.append(f"{rid}\tin.fa:1\t{len(seq)}\t{digest}\t{k}\tok\t\t\n")
    shard_of = np.repeat(np.arange(stores), [len(r) for r in per_store])
    for j, target in enumerate(rng.integers(0, records, size=int(records * duplicates)).tolist()):
        rows.append(f"D{j:09d}\tin.fa:2\t0\t{sha[target]}\t{shard_of[target]}\tduplicate\t"
                    f"UniRef50_S{target:09d}\t\n")
    rows += [f"X{j:09d}\tin.fa:3\t0\t\t\tskipped:empty\t\t\n" for j in range(records // 100)]
    tmp = manifest.with_suffix(".tmp")
    with open(tmp, "w") as fh:
        fh.write("id\tsource\tlength\tsequence_sha256\tshard\tstatus\tduplicate_of\tnormalised\n")
        fh.writelines(rows)
    os.replace(tmp, manifest)
    return paths, manifest


def manifest_main(args: argparse.Namespace) -> None:
    """``merge`` with and without ``--manifest`` over the same stores, whole processes."""
    root = HERE / "out" / f"merge-{args.records}-{args.shards}" if args.out is None else args.out
    paths, manifest = write_stores(root, args.records, args.shards, args.duplicates)
    base = [sys.executable, "-m", "embedpipe.cli", "merge", *map(str, paths)]
    print(f"{args.records:,} records in {args.shards} stores, {int(args.records * args.duplicates):,} duplicate "
          f"and {args.records // 100:,} skipped manifest rows; extrapolated linearly to {UNIREF50:,}\n")
    rows = []
    for name, extra in (("merge", []), ("merge --manifest", ["--manifest", str(manifest)])):
        out = root / "embeddings.h5"
        out.unlink(missing_ok=True)
        done = run_process([*base, "--out", str(out), *extra], capture=True)
        per = done.peak_rss_mib * 2**20 / args.records
        rows.append((name, done.seconds, done.peak_rss_mib, f"{per:,.0f} B",
                     f"{per * UNIREF50 / 2**30:,.1f} GiB, {done.seconds * UNIREF50 / args.records / 60:,.0f} min"))
    print(table(("command", "wall (s)", "peak RSS (MiB)", "per record", "at 60M records"), rows,
                formats={"wall (s)": "{:.1f}", "peak RSS (MiB)": "{:,.0f}"}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--shards", type=int, default=100)
    ap.add_argument("--lookups", type=int, default=1000)
    ap.add_argument("--nofile", type=int, default=0, help="also read and validate with RLIMIT_NOFILE set to this")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--manifest", action="store_true", help="merge with and without --manifest instead (see above)")
    ap.add_argument("--duplicates", type=float, default=0.2, help="--manifest: duplicate rows per stored record")
    ap.add_argument("--step", choices=sorted(STEPS), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.manifest:
        print(machine_header())
        manifest_main(args)
        return
    if args.step:
        result = STEPS[args.step](args)
        # VmHWM: this process's own peak (ru_maxrss is kept across fork and exec: the parent's)
        hwm = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmHWM"))
        result[f"{args.step}_peak_rss_mib"] = int(hwm.split()[1]) / 1024
        print(json.dumps(result))
        return
    args.out = args.out or HERE / "out" / "store_scale" / f"{args.records}x{args.shards}"
    args.out.mkdir(parents=True, exist_ok=True)
    print(machine_header())
    with Stopwatch() as clock:
        build(args.out, args.records, args.shards)
    print(f"# {args.records} records in {args.shards} shard stores (D={DIM}); built in {clock.seconds:.1f} s", flush=True)
    results: dict = {}
    for name in ("merge", "open", "validate") + (("nofile",) if args.nofile else ()):
        results.update(run_step(name, args))
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in results.items()}), flush=True)


if __name__ == "__main__":
    main()
