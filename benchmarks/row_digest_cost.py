"""What row digests cost (docs/store-format.md, "Row digests"): writing a store with and
without them, and ``embedpipe validate`` with and without their check, side by side; and
what format 3's wider coverage adds (the record part over each record's ID, sequence and
columns, and ``attr_digests``) against format 2's digests of the vectors alone.

    python benchmarks/row_digest_cost.py [--records 20000] [--length 300] [--dim 1280] [--dtype float16]
                                         [--layers 2] [--bos] [--pooled-only] [--repeat 3]

Writes N synthetic records (L residues, D wide) through the real writer, as it is (``with``),
with the record part left out (``vectors``: format 2's hashing) and with no digest at all
(``without``: no hashing), then validates the first store as it is, with the record and
attribute check left out (``vectors``) and with every digest check left out (``without``). The
arms alternate within each round (best of ``--repeat``, page cache warm), for a store with
per-residue rows and for a pooled-only one. Prints one JSON line per store kind with the
seconds of each arm and the ratios with/without.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from unittest import mock

import numpy as np
from _harness import machine_header, time_call

ROOT = Path(__file__).resolve().parents[1]


def write_store(path: Path, args: argparse.Namespace, per_residue: bool) -> None:
    """N records through ``StoreWriter``; each mean is the mean of its stored rows (validate's mean check holds)."""
    from embedpipe.store import EmbeddedRecord, StoreWriter

    rng = np.random.default_rng(0)
    seq = "M" * args.length
    ids = [f"P{i:07d}" for i in range(args.records)]
    layers = list(range(args.layers))
    with StoreWriter(path, ids=ids, sequences=[seq] * args.records,
                     residue_rows=[args.length] * args.records if per_residue else None, layers=layers,
                     dim=args.dim, storage_dtype=args.dtype, pooling=["mean", "bos"] if args.bos else ["mean"],
                     attrs={"model_name": "synthetic", "model_trained": False}) as writer:
        for i in range(args.records):
            mean, residues = {}, {}
            for k in layers:
                if per_residue:
                    rows = rng.standard_normal((args.length, args.dim), dtype=np.float32)
                    residues[k] = rows.astype(args.dtype).astype(np.float32)
                    mean[k] = residues[k].mean(0)
                else:
                    mean[k] = rng.standard_normal(args.dim, dtype=np.float32)
            bos = {k: rng.standard_normal(args.dim, dtype=np.float32) for k in layers} if args.bos else None
            writer.write(i, EmbeddedRecord(id=ids[i], sequence=seq, precision_used="fp32", mean=mean, bos=bos,
                                           per_residue=residues if per_residue else None, max_abs_activation=1.0,
                                           embedded_length=args.length))


def vectors_only() -> AbstractContextManager[object]:
    """The writer hashes the vectors alone (format 2's digests): no record part."""
    import embedpipe.store.writer as writer

    return mock.patch.object(writer, "record_part", lambda values, columns=None: "")


@contextmanager
def without_digests() -> Iterator[None]:
    """The writer stores no digest (nothing hashed): a store less its column's bytes (entered
    when the arm runs, not when it is listed)."""
    import embedpipe.store.writer as writer

    with vectors_only(), mock.patch.object(writer, "record_digest", lambda parts: ""):
        yield


def vectors_check() -> AbstractContextManager[object]:
    """validate without the record part and root attribute check (format 2's digest check)."""
    import embedpipe.store.validate as validate

    return mock.patch.object(validate, "coverage_problems", lambda *args, **kwargs: [])


@contextmanager
def without_check() -> Iterator[None]:
    """validate with no digest check (its checksum, finiteness and mean checks as before)."""
    from embedpipe.store.validate import _Validation

    with vectors_check(), mock.patch.object(_Validation, "digest_checks", lambda self: {}):
        yield


def seconds(run: Callable[[], object], context: AbstractContextManager[object]) -> float:
    with context:
        return time_call(run).best


def measure(scratch: Path, args: argparse.Namespace, per_residue: bool) -> dict[str, object]:
    from embedpipe.store.validate import validate_store

    with_path, without_path = scratch / f"with-{per_residue}.h5", scratch / f"without-{per_residue}.h5"
    vectors_path = scratch / f"vectors-{per_residue}.h5"
    best = {f"{step}_{arm}": float("inf") for step in ("write", "validate") for arm in ("with", "vectors", "without")}

    def check(path: Path) -> None:
        problems = validate_store(path)
        assert not problems, problems

    for _ in range(args.repeat):
        for arm, path, context in (("write_with", with_path, nullcontext()),
                                   ("write_vectors", vectors_path, vectors_only()),
                                   ("write_without", without_path, without_digests())):
            path.unlink(missing_ok=True)
            best[arm] = min(best[arm], seconds(lambda p=path: write_store(p, args, per_residue), context))
        for arm, context in (("validate_with", nullcontext()), ("validate_vectors", vectors_check()),
                             ("validate_without", without_check())):
            best[arm] = min(best[arm], seconds(lambda: check(with_path), context))
    out: dict[str, object] = {"per_residue": per_residue, "records": args.records, "length": args.length,
                              "dim": args.dim, "dtype": args.dtype, "layers": args.layers, "bos": args.bos,
                              "store_mb": round(with_path.stat().st_size / 1e6, 2)}
    out |= {k: round(v, 3) for k, v in best.items()}
    out["write_ratio"] = round(best["write_with"] / best["write_without"], 3)
    out["validate_ratio"] = round(best["validate_with"] / best["validate_without"], 3)
    # what format 3's record part and attr_digests add to format 2's digests of the vectors
    out["write_ratio_vs_vectors"] = round(best["write_with"] / best["write_vectors"], 3)
    out["validate_ratio_vs_vectors"] = round(best["validate_with"] / best["validate_vectors"], 3)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=20_000)
    parser.add_argument("--length", type=int, default=300)
    parser.add_argument("--dim", type=int, default=1280)
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--layers", type=int, default=2, help="stored layers (each a pooled and a per-residue dataset)")
    parser.add_argument("--bos", action="store_true", help="also store BOS vectors")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--pooled-only", action="store_true", help="only the store without per-residue rows")
    args = parser.parse_args(argv)
    print(machine_header(), flush=True)
    with tempfile.TemporaryDirectory(dir=ROOT / "benchmarks") as scratch:
        for per_residue in (False,) if args.pooled_only else (True, False):
            print(json.dumps(measure(Path(scratch), args, per_residue)), flush=True)


if __name__ == "__main__":
    main()
