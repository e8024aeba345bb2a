"""Compare two embedpipe stores dataset by dataset and attribute by attribute.

Ignored: run-specific attributes (uuids, timestamps, paths). Usage: run_compare.py A.h5 B.h5"""
import json
import sys

import h5py
import numpy as np

IGNORE = {"store_uuid", "created_utc", "finished_utc", "input", "model_source", "reused_sources", "store_path"}
PATHY = ("input", "model", "int8_calibration", "path")

def clean(key, value):
    if isinstance(value, bytes):
        value = value.decode()
    if key in ("config", "embed_identity") and isinstance(value, str):
        d = json.loads(value)
        for k in PATHY:
            d.pop(k, None)
        return json.dumps(d, sort_keys=True)
    if key == "reused_sources":
        return None
    return value

def attrs(obj):
    return {k: clean(k, v) for k, v in obj.attrs.items() if k not in IGNORE}

def walk(f):
    out = {"/": f}
    f.visititems(lambda n, o: out.__setitem__(n, o))
    return out

def same(a, b):
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        if a.dtype == object or b.dtype == object:  # variable-length strings: compare the values
            return a.dtype == b.dtype and a.shape == b.shape and a.tolist() == b.tolist()
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    return a == b

def compare(pa, pb):
    problems, n_ds, n_attr = [], 0, 0
    with h5py.File(pa, "r") as fa, h5py.File(pb, "r") as fb:
        wa, wb = walk(fa), walk(fb)
        if set(wa) != set(wb):
            problems.append(f"objects differ: {sorted(set(wa) ^ set(wb))}")
        for name in sorted(set(wa) & set(wb)):
            oa, ob = wa[name], wb[name]
            aa, ab = attrs(oa), attrs(ob)
            for k in sorted(set(aa) | set(ab)):
                n_attr += 1
                if k not in aa or k not in ab or not same(aa[k], ab[k]):
                    problems.append(f"{name} attr {k}: {aa.get(k)!r:.200} != {ab.get(k)!r:.200}")
            if isinstance(oa, h5py.Dataset):
                n_ds += 1
                if oa.dtype != ob.dtype or oa.shape != ob.shape:
                    problems.append(f"{name}: dtype/shape {oa.dtype}{oa.shape} != {ob.dtype}{ob.shape}")
                elif name.endswith("store_uuid") or name.endswith("reused_from"):
                    pass  # uuids of the run
                elif not same(oa[()], ob[()]):
                    problems.append(f"{name}: values differ")
    return problems, n_ds, n_attr

if __name__ == "__main__":
    problems, n_ds, n_attr = compare(sys.argv[1], sys.argv[2])
    print(f"{sys.argv[1]} vs {sys.argv[2]}: {n_ds} datasets, {n_attr} attributes compared, "
          f"{len(problems)} differences")
    for p in problems[:20]:
        print("  ", p)
    sys.exit(1 if problems else 0)
