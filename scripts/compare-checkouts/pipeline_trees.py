"""Compare two embedpipe output trees file by file: HDF5 dataset by dataset (dtype, shape, values
bit for bit, chunks, filters) and attribute by attribute, ignoring run uuids, timestamps, paths
and timings; JSON likewise; other files byte for byte."""
import json
import sys
from pathlib import Path

import h5py
import numpy as np

IGNORE = {"store_uuid", "created_utc", "source_store_uuids", "export_source", "store_path", "seconds",
          "source", "model_path", "fasta", "input", "wall_seconds", "merged_from", "shard_stores", "sources",
          "embedpipe_version_commit", "attr_digests"}  # attr_digests: of store_uuid and created_utc too
VOLATILE_WORDS = ("uuid", "utc", "seconds", "path", "time", "rate", "per_s", "hostname", "host", "pid")

def volatile(key):
    k = key.lower()
    return key in IGNORE or any(w in k for w in VOLATILE_WORDS)

def norm_json(v, a_root, b_root, parent=""):
    if isinstance(v, dict):
        # a store's sha256 covers its store_uuid and created_utc: compared dataset by dataset instead
        return {k: norm_json(x, a_root, b_root, k) for k, x in v.items()
                if not volatile(k) and not (parent == "store" and k == "sha256") and k != "store_sha256"}
    if isinstance(v, list):
        return [norm_json(x, a_root, b_root, parent) for x in v]
    if isinstance(v, str):
        return v.replace(a_root, "ROOT").replace(b_root, "ROOT")
    return v

def first_diff(a, b, where=""):
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if a.get(k, "<absent>") != b.get(k, "<absent>"):
                return first_diff(a.get(k, "<absent>"), b.get(k, "<absent>"), f"{where}.{k}")
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return first_diff(x, y, f"{where}[{i}]")
    return f"{where}: {str(a)[:200]} vs {str(b)[:200]}"


def attr(v, roots):
    if isinstance(v, bytes):
        v = v.decode("utf-8", "replace")
    if isinstance(v, str):
        try:
            j = json.loads(v)
            if isinstance(j, (dict, list)):
                return ("json", norm_json(j, *roots))
        except ValueError:
            pass
        return v.replace(roots[0], "ROOT").replace(roots[1], "ROOT")
    if isinstance(v, np.ndarray):
        if v.dtype.kind == "O":
            return ("objects", v.shape, [attr(x, roots) for x in v.ravel().tolist()])
        return ("array", v.dtype.str, v.shape, v.tobytes())
    return v

def props(d):
    """A dataset's layout: what must match besides its values."""
    return (d.dtype.str, d.shape, d.chunks, d.compression, d.compression_opts, d.shuffle, d.fletcher32,
            d.is_virtual, d.maxshape)


def h5(a, b, roots, problems):
    fa, fb = h5py.File(a, "r"), h5py.File(b, "r")
    names_a, names_b = [], []
    fa.visit(names_a.append)
    fb.visit(names_b.append)
    if names_a != names_b:
        problems.append(f"{a.name}: objects differ: {sorted(set(names_a) ^ set(names_b))}")
    count = 0
    for name in ["/", *names_a]:
        if name not in fb and name != "/":
            continue
        oa, ob = fa[name], fb[name]
        ka, kb = [k for k in oa.attrs if not volatile(k)], [k for k in ob.attrs if not volatile(k)]
        if ka != kb:
            problems.append(f"{a.name}:{name}: attribute names {ka} vs {kb}")
        for k in ka:
            if k in ob.attrs and attr(oa.attrs[k], roots) != attr(ob.attrs[k], roots):
                problems.append(f"{a.name}:{name}: attribute {k}: {oa.attrs[k]!r} vs {ob.attrs[k]!r}")
        if isinstance(oa, h5py.Dataset):
            count += 1
            if props(oa) != props(ob):
                problems.append(f"{a.name}:{name}: layout {props(oa)} vs {props(ob)}")
            elif oa[()].tobytes() != ob[()].tobytes() if oa.dtype.kind != "O" else list(oa[()]) != list(ob[()]):
                problems.append(f"{a.name}:{name}: values differ")
    return count

def main(a_root, b_root):
    a_root, b_root = Path(a_root), Path(b_root)
    roots = (str(a_root), str(b_root))
    problems, summary = [], []
    files_a = sorted(p.relative_to(a_root) for p in a_root.rglob("*") if p.is_file() and ".lock" not in p.name)
    files_b = sorted(p.relative_to(b_root) for p in b_root.rglob("*") if p.is_file() and ".lock" not in p.name)
    if files_a != files_b:
        problems.append(f"file lists differ: {sorted(set(map(str, files_a)) ^ set(map(str, files_b)))}")
    for rel in files_a:
        a, b = a_root / rel, b_root / rel
        if not b.exists():
            continue
        if h5py.is_hdf5(a):
            n = h5(a, b, roots, problems)
            summary.append(f"{rel}: HDF5, {n} datasets")
        elif a.suffix == ".json":
            ja, jb = norm_json(json.loads(a.read_text()), *roots), norm_json(json.loads(b.read_text()), *roots)
            if ja != jb:
                problems.append(f"{rel}: JSON differs: {first_diff(ja, jb)}")
            reordered = ja == jb and json.dumps(ja) != json.dumps(jb)
            summary.append(f"{rel}: JSON" + (" (same content, key order differs)" if reordered else ""))
        elif a.suffix in (".html", ".log", ".txt", ".tsv", ".fasta", ".npy", ".pt", ".parquet"):
            same = a.read_bytes() == b.read_bytes()
            if a.suffix == ".parquet" and not same:
                import pyarrow.parquet as pq
                ta, tb = pq.read_table(a), pq.read_table(b)
                same = ta.drop_columns([]).to_pylist() == tb.to_pylist()
                summary.append(f"{rel}: parquet table {'equal' if same else 'DIFFERS'} (bytes differ: metadata)")
            else:
                summary.append(f"{rel}: bytes {'equal' if same else 'differ'}")
            if not same and a.suffix not in (".html", ".log", ".txt"):
                problems.append(f"{rel}: bytes differ")
        else:
            summary.append(f"{rel}: skipped")
    print("\n".join(summary))
    print(f"\n{len(problems)} difference(s)")
    print("\n".join(problems))
    return 1 if problems else 0

if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
