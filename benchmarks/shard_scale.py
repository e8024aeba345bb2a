"""Sharding at scale: `embedpipe shard` against `seqkit sort --by-length --two-pass`.

Generates (once, cached) a FASTA of ~1,000,000 protein-like records (~350 MB: lognormal
lengths with a median near 235 aa, mean near 275, 60-column lines, UniProt-style headers, ~2% exact
duplicate sequences, some lowercase and trailing '*'), then runs both tools on it as
subprocesses, one after the other, measuring wall time and peak RSS of each (the harness's
whole-process clock), and prints a table and the wall-time ratio.

    python benchmarks/shard_scale.py                 # 1,000,000 records under benchmarks/out/
    python benchmarks/shard_scale.py --records 100000 --repeat 1
    python benchmarks/shard_scale.py --records 1000000 3000000 10000000 --repeat 1 --no-seqkit

Several ``--records`` sizes also fit peak RSS = a + b * records and extrapolate it to UniRef50
(60M records). Needs, unless ``--no-seqkit``, `seqkit` (Debian: `apt-get install seqkit`).
Data and outputs go under ``benchmarks/out/`` (git-ignored).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
from _harness import Stopwatch, machine_header, run_process, table

HERE = Path(__file__).resolve().parent
# UniProt amino-acid composition (percent), 20 standard residues.
AA = b"ARNDCQEGHILKMFPSTWYV"
FREQ = np.array([8.25, 5.53, 4.06, 5.45, 1.37, 3.93, 6.75, 7.07, 2.27, 5.96,
                 9.66, 5.84, 2.42, 3.86, 4.70, 6.56, 5.34, 1.08, 2.92, 6.87])


def generate(path: Path, records: int, seed: int = 0) -> None:
    """Write ``records`` protein-like FASTA records to ``path`` (atomically)."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(mean=np.log(235), sigma=0.55, size=records), 20, 35000).astype(np.int64)
    dup = rng.random(records) < 0.02  # ~2% repeat an earlier sequence exactly
    lower = rng.random(records) < 0.01  # ~1% lowercase
    stop = rng.random(records) < 0.05  # ~5% end in '*' (translated ORFs)
    alphabet = np.frombuffer(AA, dtype=np.uint8)
    tmp = path.with_suffix(".tmp")
    chunk = 50_000
    sequences: list[bytes] = []  # a small pool of earlier sequences to duplicate
    with open(tmp, "wb", buffering=16 << 20) as fh:
        for start in range(0, records, chunk):
            stop_i = min(records, start + chunk)
            n = lengths[start:stop_i]
            residues = alphabet[rng.choice(20, size=int(n.sum()), p=FREQ / FREQ.sum())].tobytes()
            parts = []
            pos = 0
            for j, size in enumerate(n.tolist()):
                i = start + j
                seq = residues[pos : pos + size]
                pos += size
                if dup[i] and sequences:
                    seq = sequences[int(rng.integers(len(sequences)))]
                elif len(sequences) < 10_000:
                    sequences.append(seq)
                if lower[i]:
                    seq = seq.lower()
                if stop[i]:
                    seq += b"*"
                wrapped = b"\n".join(seq[k : k + 60] for k in range(0, len(seq), 60))
                parts.append(b">tr|A%07d|A%07d_SYNTH Synthetic protein %d OS=Benchmarkia synthetica\n%s\n" % (i, i, i, wrapped))
            fh.write(b"".join(parts))
    os.replace(tmp, path)


def run(cmd: list[str]) -> tuple[float, float]:
    """Run ``cmd`` as a whole process (its output discarded); return (wall seconds, peak RSS in MiB)."""
    done = run_process(cmd, capture=True)
    return done.seconds, done.peak_rss_mib


def measure(fasta: Path, out: Path, budget: int, repeat: int, seqkit: str | None) -> dict[str, list[tuple[float, float]]]:
    """Wall time and peak RSS of each tool on ``fasta``, ``repeat`` runs each."""
    embedpipe_cmd = [sys.executable, "-m", "embedpipe.cli", "shard", str(fasta), "--out", str(out / "shards"),
                     "--tokens-per-shard", str(budget), "--quiet"]
    results: dict[str, list[tuple[float, float]]] = {"embedpipe shard": []}
    # seqkit --two-pass writes a .seqkit.fai index next to the input; removed before each
    # run so that both tools read the input from scratch.
    fai = Path(str(fasta) + ".seqkit.fai")
    for _ in range(repeat):
        results["embedpipe shard"].append(run(embedpipe_cmd))
        if seqkit:
            fai.unlink(missing_ok=True)
            seqkit_cmd = [seqkit, "sort", "--by-length", "--two-pass", str(fasta), "-o", str(out / "seqkit-sorted.fasta")]
            results.setdefault("seqkit sort --two-pass", []).append(run(seqkit_cmd))
            fai.unlink(missing_ok=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, nargs="+", default=[1_000_000])
    parser.add_argument("--out", type=Path, default=HERE / "out")
    parser.add_argument("--tokens-per-shard", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=3, help="runs of each tool; the best wall time counts")
    parser.add_argument("--no-seqkit", action="store_true", help="measure embedpipe shard only")
    args = parser.parse_args()

    seqkit = None if args.no_seqkit else shutil.which("seqkit")
    if seqkit is None and not args.no_seqkit:
        sys.exit("seqkit not found on PATH (Debian/Ubuntu: apt-get install seqkit), or pass --no-seqkit")
    args.out.mkdir(parents=True, exist_ok=True)
    seqkit_version = subprocess.run([seqkit, "version"], capture_output=True, text=True).stdout.strip() if seqkit else ""
    print(machine_header())
    print(f"{seqkit_version or 'no seqkit'}; best of {args.repeat}")
    print()
    points, rows = [], []
    for records in args.records:
        fasta = args.out / f"synthetic-{records}.fasta"
        if not fasta.exists():
            print(f"generating {fasta} ...", file=sys.stderr)
            with Stopwatch() as clock:
                generate(fasta, records)
            print(f"  done in {clock.seconds:.0f} s", file=sys.stderr)
        size_mb = fasta.stat().st_size / 1e6
        results = measure(fasta, args.out, args.tokens_per_shard, args.repeat, seqkit)
        for name, runs in results.items():
            wall, peak = min(w for w, _ in runs), max(r for _, r in runs)
            all_runs = ", ".join(f"{w:.1f}" for w, _ in runs)
            rows.append((records, f"{size_mb:,.0f}", name, f"{wall:.1f}", all_runs, f"{peak:,.0f}",
                         f"{peak * 2**20 / records:,.0f} B"))
        points.append((records, max(r for _, r in results["embedpipe shard"]),
                       min(w for w, _ in results["embedpipe shard"])))
        if seqkit:
            ratio = points[-1][2] / min(w for w, _ in results["seqkit sort --two-pass"])
            rows.append(("", "", f"wall-time ratio embedpipe / seqkit: {ratio:.2f} (target <= 2.0)", "", "", "", ""))
    print(table(("records", "input (MB)", "tool", "wall time (s), best", "all runs (s)", "peak RSS (MiB)", "RSS per record"),
                rows))
    _extrapolate(points)


def _extrapolate(points: list[tuple[int, float, float]]) -> None:
    """Least-squares line RSS = a + b * records (and time) over the sizes run, at UniRef50's 60M."""
    print()
    if len(points) < 2:
        records, rss, wall = points[0]
        print(f"at 60M records (linear from one size): ~{rss * 6e7 / records / 1024:,.1f} GiB, "
              f"~{wall * 6e7 / records / 60:,.0f} min")
        return
    n = np.array([p[0] for p in points], dtype=np.float64)
    slope, base = np.polyfit(n, [p[1] for p in points], 1)
    t_slope, t_base = np.polyfit(n, [p[2] for p in points], 1)
    print(f"peak RSS ~ {base:,.0f} MiB + {slope * 2**20:,.1f} B/record; at 60M records (UniRef50): "
          f"~{(base + slope * 6e7) / 1024:,.2f} GiB, ~{(t_base + t_slope * 6e7) / 60:,.0f} min "
          f"(target: under 1 GiB at 10M: {(base + slope * 1e7):,.0f} MiB)")


if __name__ == "__main__":
    main()
