"""`embedpipe merge --manifest` at scale: time and peak RSS over N records in K shard stores.

Writes (once, cached under ``benchmarks/out/merge-N-K/``) K shard stores holding N records
in all (pooled only, D=8, one layer, 60-400 aa random sequences; written with StoreWriter)
and a ``manifest.tsv`` like ``shard`` writes: one ``ok`` row per stored record, plus
``--duplicates`` (default 20%) ``duplicate`` rows pointing at random stored records and 1%
``skipped`` rows. Then runs ``embedpipe merge`` with and without ``--manifest`` as
subprocesses under GNU time and prints wall time and peak RSS, with the per-record cost and
the linear extrapolation to 60M records (UniRef50).

    python benchmarks/merge_scale.py                    # 1,000,000 records in 100 stores
    python benchmarks/merge_scale.py --records 100000 --stores 10

Needs GNU time (Debian: ``apt-get install time``). Outputs go under ``benchmarks/out/``
(git-ignored).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent

from shard_scale import AA, run  # noqa: E402

from embedpipe.store import EmbeddedRecord, StoreWriter  # noqa: E402

UNIREF50 = 60_000_000
ATTRS = {"model_name": "esm2_t6_8M_UR50D", "model_sha256": "ab" * 32, "precision_policy": "fp32", "device": "cpu",
         "model_trained": False}


def write_stores(root: Path, records: int, stores: int, duplicates: float, seed: int = 0) -> tuple[list[Path], Path]:
    """K stores of N records in all, and the manifest; skipped if already there."""
    manifest = root / "manifest.tsv"
    paths = [root / "stores" / f"shard-{k:05d}.h5" for k in range(stores)]
    if manifest.exists():
        return paths, manifest
    rng = np.random.default_rng(seed)
    alphabet = np.frombuffer(AA, dtype=np.uint8)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--stores", type=int, default=100)
    parser.add_argument("--duplicates", type=float, default=0.2, help="duplicate rows per stored record")
    parser.add_argument("--out", type=Path, default=HERE / "out")
    args = parser.parse_args()

    root = args.out / f"merge-{args.records}-{args.stores}"
    paths, manifest = write_stores(root, args.records, args.stores, args.duplicates)
    base = [sys.executable, "-m", "embedpipe.cli", "merge", *map(str, paths)]
    print(f"{args.records:,} records in {args.stores} stores, {int(args.records * args.duplicates):,} duplicate "
          f"and {args.records // 100:,} skipped manifest rows; extrapolated linearly to {UNIREF50:,}")
    print()
    print("| command | wall (s) | peak RSS (MiB) | per record | at 60M records |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, extra in (("merge", []), ("merge --manifest", ["--manifest", str(manifest)])):
        out = root / "embeddings.h5"
        out.unlink(missing_ok=True)
        wall, rss = run([*base, "--out", str(out), *extra])
        per = rss * 2**20 / args.records
        print(f"| {name} | {wall:.1f} | {rss:,.0f} | {per:,.0f} B | {per * UNIREF50 / 2**30:,.1f} GiB, "
              f"{wall * UNIREF50 / args.records / 60:,.0f} min |")


if __name__ == "__main__":
    main()
