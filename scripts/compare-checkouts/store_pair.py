"""Compare two embedpipe stores dataset by dataset and attribute by attribute.

Ignored: run-specific attributes (uuids, timestamps, paths). Listed, not failed: attributes
(and ``config`` keys) that record options the newer checkout removed (``--removed``), and
attributes whose value is a timing decision that leaves the numbers alone (``--timed``: which
exact int8 engine ran a layer). Usage: store_pair.py A.h5 B.h5 [--removed K,...] [--timed K,...]"""
import argparse
import json
import sys

import h5py
import numpy as np

# attr_digests: the root attributes' digests, store_uuid and created_utc among them (format 3)
IGNORE = {"store_uuid", "created_utc", "finished_utc", "input", "model_source", "reused_sources", "store_path",
          "attr_digests"}
PATHY = ("input", "model", "int8_calibration", "path")

REMOVED: set[str] = set()  # attributes and config keys of options the newer checkout removed
TIMED: set[str] = set()  # attributes a timing decides (the numbers do not depend on them)
noted: list[str] = []


def clean(key, value):
    if isinstance(value, bytes):
        value = value.decode()
    if key in ("config", "embed_identity") and isinstance(value, str):
        d = json.loads(value)
        for k in PATHY:
            d.pop(k, None)
        for k in sorted(REMOVED & set(d)) if key == "config" else ():  # the identity is compared whole
            noted.append(f"{key}[{k}] (removed option)")
            d.pop(k)
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

def vector_digests(f):
    """``row_digest`` without format 3's record part (its last 32 hex digits)."""
    cut = 32 if int(f.attrs["format_version"]) >= 3 else 0
    return [d[: len(d) - cut] for d in f["row_digest"].asstr()[()].tolist()]

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
                if k in REMOVED and k not in ab:
                    noted.append(f"{name} attr {k} (removed option)")
                    continue
                if k in TIMED and k in aa and k in ab and not same(aa[k], ab[k]):
                    noted.append(f"{name} attr {k} (timed): {aa[k]!r:.80} vs {ab[k]!r:.80}")
                    continue
                if k not in aa or k not in ab or not same(aa[k], ab[k]):
                    problems.append(f"{name} attr {k}: {aa.get(k)!r:.200} != {ab.get(k)!r:.200}")
            if isinstance(oa, h5py.Dataset):
                n_ds += 1
                if oa.dtype != ob.dtype or oa.shape != ob.shape:
                    problems.append(f"{name}: dtype/shape {oa.dtype}{oa.shape} != {ob.dtype}{ob.shape}")
                elif name.endswith("store_uuid") or name.endswith("reused_from"):
                    pass  # uuids of the run
                elif name == "row_digest":  # the vectors' digests; format 3's record part covers reused_from
                    if vector_digests(fa) != vector_digests(fb):
                        problems.append(f"{name}: the vectors' digests differ")
                elif not same(oa[()], ob[()]):
                    problems.append(f"{name}: values differ")
    return problems, n_ds, n_attr

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--removed", default="")
    ap.add_argument("--timed", default="")
    args = ap.parse_args()
    REMOVED.update(filter(None, args.removed.split(",")))
    TIMED.update(filter(None, args.timed.split(",")))
    problems, n_ds, n_attr = compare(args.a, args.b)
    print(f"{args.a} vs {args.b}: {n_ds} datasets, {n_attr} attributes compared, "
          f"{len(problems)} differences; {len(set(noted))} listed")
    for p in problems[:20]:
        print("  ", p)
    for p in sorted(set(noted)):
        print("   listed:", p)
    sys.exit(1 if problems else 0)
