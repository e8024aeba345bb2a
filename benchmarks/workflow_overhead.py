"""End-to-end overhead of the Snakemake workflow.

Runs the whole workflow (shard -> embed per shard -> merge -> crosscheck) on the bundled
example with a random-weight test model in a fresh temporary directory, and compares its
wall time with the embed jobs' own time (Snakemake's benchmark files) and with the time the
embed workers spent embedding (the "embedded ... in X s" line of each embed log, i.e. without
interpreter start, torch import and model load). Also times a no-op rerun.

    python benchmarks/workflow_overhead.py                       # local, --cores 2
    python benchmarks/workflow_overhead.py --cores 8 --dim 320 --layers 6
    python benchmarks/workflow_overhead.py --profile workflows/profiles/slurm-ci   # via SLURM

Prints a markdown table (and --json for the raw numbers).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "swissprot100.fasta"
EMBEDDED = re.compile(r"embedded (\d+) records \(([\d,]+) residues\) in ([\d.]+)\s*s")


def run(cmd: list[str], cwd: Path) -> tuple[float, str]:
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return elapsed, proc.stdout + proc.stderr


STAMP = re.compile(r"^\[(\w{3} \w{3} +\d+ [\d:]+ \d{4})\]$")
START = re.compile(r"^(?:local)?(?:rule|checkpoint) (\w+):$")
FINISHED = re.compile(r"^Finished jobid: \d+ \(Rule: (\w+)\)$")


def stage_spans(log: str) -> dict[str, float]:
    """Seconds from the first start to the last finish of each rule (1 s resolution)."""
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    stamp = None
    for line in log.splitlines():
        line = line.strip()
        if m := STAMP.match(line):
            stamp = time.mktime(time.strptime(m[1], "%a %b %d %H:%M:%S %Y"))
        elif stamp is not None and (m := START.match(line)):
            first.setdefault(m[1], stamp)
        elif stamp is not None and (m := FINISHED.match(line)):
            last[m[1]] = stamp
    return {rule: last[rule] - first[rule] for rule in first if rule in last and rule != "all"}


def measure(args: argparse.Namespace, workdir: Path) -> dict[str, object]:
    config = {
        "input": str(EXAMPLE),
        "outdir": "out",
        "model": f"out/model/esm2_bench_t{args.layers}_{args.dim}.pt",
        "test_model": {"layers": args.layers, "dim": args.dim, "heads": args.heads, "seed": 0},
        "precision": args.precision,
        "per_residue": True,
        "device": args.device,
        "tokens_per_batch": args.tokens_per_batch,
        "tokens_per_shard": args.tokens_per_shard,
        "crosscheck": {"sample": 16, "seed": 0},
    }
    cfg = workdir / "config.yaml"
    cfg.write_text(json.dumps(config))  # JSON is YAML
    base = [sys.executable, "-m", "snakemake", "--snakefile", str(ROOT / "Snakefile"),
            "--directory", str(workdir), "--configfile", str(cfg)]
    mode = ["--workflow-profile", str(ROOT / args.profile)] if args.profile else ["--cores", str(args.cores)]
    wall, run_log = run(base + mode, workdir)
    noop, _ = run(base + ["--cores", "1", "--dry-run"], workdir)

    jobs = []
    for tsv in sorted((workdir / "out" / "benchmarks" / "embed").glob("*.tsv")):
        with open(tsv, newline="") as fh:
            row = next(csv.DictReader(fh, delimiter="\t"))
        log = (workdir / "out" / "logs" / "embed" / f"{tsv.stem}.log").read_text()
        match = EMBEDDED.search(log)
        jobs.append({
            "shard": tsv.stem,
            "job_s": float(row["s"]),
            "cpu_s": float(row["cpu_time"]),
            "max_rss_mb": float(row["max_rss"]),
            "records": int(match[1]) if match else None,
            "residues": int(match[2].replace(",", "")) if match else None,
            "embed_s": float(match[3]) if match else None,
        })
    job_sum = sum(j["job_s"] for j in jobs)
    embed_sum = sum(j["embed_s"] for j in jobs if j["embed_s"] is not None) if all(
        j["embed_s"] is not None for j in jobs) else None
    return {
        "wall_s": wall,
        "noop_rerun_s": noop,
        "shards": len(jobs),
        "embed_jobs_sum_s": job_sum,
        "embedding_sum_s": embed_sum,
        "wall_over_jobs": wall / job_sum if job_sum else None,
        "wall_over_embedding": wall / embed_sum if embed_sum else None,
        "stages_s": stage_spans(run_log),
        "jobs": jobs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cores", type=int, default=2)
    parser.add_argument("--profile", help="a workflow profile instead of --cores (e.g. workflows/profiles/slurm-ci)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens-per-batch", type=int, default=4096)
    parser.add_argument("--tokens-per-shard", type=int, default=15000)
    parser.add_argument("--repeat", type=int, default=1, help="fresh runs; the table shows the median wall time")
    parser.add_argument("--json", action="store_true", help="print the raw numbers as JSON")
    args = parser.parse_args()

    results = []
    for _ in range(args.repeat):
        with tempfile.TemporaryDirectory(prefix="embedpipe-wf-bench-") as tmp:
            results.append(measure(args, Path(tmp)))
    results.sort(key=lambda r: r["wall_s"])
    r = results[len(results) // 2]
    if args.json:
        print(json.dumps({"args": vars(args), "runs": results}, indent=1))
        return

    where = args.profile or f"local, --cores {args.cores}"
    print(f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; {where}; "
          f"test model {args.layers} layers, dim {args.dim}; {args.precision} on {args.device}; "
          f"median of {args.repeat} run(s)\n")
    print("| measure | seconds |")
    print("| --- | ---: |")
    print(f"| workflow wall time (fresh run, {r['shards']} shards) | {r['wall_s']:.1f} |")
    print(f"| sum of embed jobs (benchmark files) | {r['embed_jobs_sum_s']:.1f} |")
    if r["embedding_sum_s"] is not None:
        print(f"| sum of embedding inside the jobs (embed logs) | {r['embedding_sum_s']:.1f} |")
    print(f"| no-op rerun (`snakemake -n`, nothing to do) | {r['noop_rerun_s']:.1f} |")
    print(f"\nwall / embed jobs = {r['wall_over_jobs']:.2f}", end="")
    if r["wall_over_embedding"]:
        print(f"; wall / embedding = {r['wall_over_embedding']:.2f}")
    else:
        print()
    stages = ", ".join(f"{rule} {span:.0f}" for rule, span in r["stages_s"].items())
    print(f"stages, first start to last finish (s, 1 s resolution): {stages}")
    print("\n| shard | job s | embedding s | records | residues | max RSS MB |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for j in r["jobs"]:
        embed_s = f"{j['embed_s']:.1f}" if j["embed_s"] is not None else "-"
        print(f"| {j['shard']} | {j['job_s']:.1f} | {embed_s} | {j['records'] or '-'} | "
              f"{j['residues'] or '-'} | {j['max_rss_mb']:.0f} |")


if __name__ == "__main__":
    main()
