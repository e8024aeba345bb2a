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

``--stub`` measures Snakemake's own overhead on synthetic plans instead: every `embedpipe`
command the rules call is replaced by a stub that only writes its outputs (the shard stub
writes N tiny shards and the real group plan, ``embedpipe.shard.passes.plan_groups``), so the wall
time of a fresh run is the workflow engine's cost. One embed job per shard (the design before
groups: ``max_jobs`` >= shards) is run up to ``--per-shard-cap`` shards and extrapolated with
its fitted exponent; the grouped plan (``--max-jobs``) is run at every size:

    python benchmarks/workflow_overhead.py --stub --shards 250 500 1000 5000 20000 --max-jobs 1000
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import re
import sys
import tempfile
import time
from pathlib import Path

from _harness import machine_header, run_process, table

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "swissprot100.fasta"
EMBEDDED = re.compile(r"embedded (\d+) records \(([\d,]+) residues\) in ([\d.]+)\s*s")


def run(cmd: list[str], cwd: Path) -> tuple[float, str]:
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    done = run_process(cmd, env=env, cwd=cwd, check=False, capture=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}")
    return done.seconds, done.stdout + done.stderr


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


# ---------------------------------------------------------------- --stub: the engine's own cost

#: stands in for `embedpipe` on PATH: writes each command's outputs and nothing else
STUB = r"""#!/bin/bash
cmd=$1; shift
files=(); out=; done_=
while [ $# -gt 0 ]; do
  case $1 in
    --out|--out-dir) out=$2; shift 2;;
    --done) done_=$2; shift 2;;
    --per-residue|--no-per-residue|-q|--quiet) shift;;
    --*) shift 2;;
    *) files+=("$1"); shift;;
  esac
done
case $cmd in
  make-test-model) : > "${files[0]}"; : > "${files[0]%.pt}-contact-regression.pt";;
  shard) exec "$STUB_PYTHON" "$STUB_SCRIPT" _stub-shard "$out";;
  embed) for f in "${files[@]}"; do b=${f##*/}; : > "$out/${b%.fasta}.h5"; done; echo '{}' > "$done_";;
  merge) : > "$out";;
  crosscheck) mkdir -p "$out"; : > "$out/crosscheck.json"; : > "$out/crosscheck.html";;
esac
"""


def stub_shard(out: Path) -> None:
    """The shard stub: $STUB_SHARDS tiny shards, a manifest, and shards.json with the real groups."""
    from embedpipe.shard.passes import plan_groups, shard_name

    n, max_jobs = int(os.environ["STUB_SHARDS"]), int(os.environ["STUB_MAX_JOBS"])
    out.mkdir(parents=True, exist_ok=True)
    for k in range(n):
        (out / shard_name(k)).write_text(f">s{k}\nMKV\n")
    (out / "manifest.tsv").write_text("id\tstatus\n")
    shards = [{"index": k, "path": shard_name(k)} for k in range(n)]
    listing = {"shards": shards, "max_jobs": max_jobs, "groups": plan_groups(n, max_jobs)}
    (out / "shards.json").write_text(json.dumps(listing))


def stub_run(shards: int, max_jobs: int, cores: int, scheduler: str) -> dict[str, float]:
    """A fresh stub run of the whole workflow: wall time, embed jobs, no-op dry-run time."""
    with tempfile.TemporaryDirectory(prefix="embedpipe-wf-stub-") as tmp:
        work = Path(tmp)
        (work / "bin").mkdir()
        stub = work / "bin" / "embedpipe"
        stub.write_text(STUB)
        stub.chmod(0o755)
        (work / "in.fasta").write_text(">x\nMKV\n")
        config = {"input": "in.fasta", "outdir": "out", "model": "out/model/esm2_stub.pt",
                  "test_model": {"layers": 1, "dim": 8, "heads": 1, "seed": 0}, "device": "cpu",
                  "max_jobs": max_jobs}
        (work / "config.yaml").write_text(json.dumps(config))
        env = dict(os.environ, PATH=f"{work / 'bin'}{os.pathsep}{os.environ['PATH']}", STUB_SHARDS=str(shards),
                   STUB_MAX_JOBS=str(max_jobs), STUB_PYTHON=sys.executable, STUB_SCRIPT=str(Path(__file__).resolve()))
        base = [sys.executable, "-m", "snakemake", "--snakefile", str(ROOT / "Snakefile"), "--directory", str(work),
                "--configfile", str(work / "config.yaml"), "--quiet", "all"]
        fresh = run_process(base + ["--cores", str(cores), "--scheduler", scheduler], env=env, cwd=work, check=False,
                            capture=True)
        if fresh.returncode != 0:
            sys.exit(f"stub run of {shards} shards failed:\n{fresh.stdout[-3000:]}\n{fresh.stderr[-5000:]}")
        jobs = len(list((work / "out" / "stores").glob("group-*.json")))
        noop = run_process(base + ["--cores", "1", "--dry-run"], env=env, cwd=work, capture=True)
        return {"shards": shards, "embed_jobs": jobs, "wall_s": fresh.seconds, "noop_s": noop.seconds}


def fit_exponent(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares fit of log(y) = log(a) + b log(x): returns (a, b)."""
    xs, ys = [math.log(x) for x, _ in points], [math.log(y) for _, y in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return math.exp(my - b * mx), b


def stub_main(args: argparse.Namespace) -> None:
    rows = [("baseline: 1 shard (start-up, fixed stages)", stub_run(1, 1, args.cores, args.scheduler))]
    base = rows[0][1]["wall_s"]
    grouped = f"groups, max_jobs {args.max_jobs}"
    for n in args.shards:
        if n <= args.per_shard_cap:
            rows.append(("one job per shard", stub_run(n, n, args.cores, args.scheduler)))
        if n >= args.max_jobs:  # below it the grouped plan is one job per shard too
            same = n == args.max_jobs and rows[-1][0] == "one job per shard"
            rows.append((grouped, rows[-1][1] if same else stub_run(n, args.max_jobs, args.cores, args.scheduler)))
        print(f"# {n} shards: " + "; ".join(f"{p} {r['embed_jobs']} jobs {r['wall_s']:.1f} s"
                                             for p, r in rows if r["shards"] == n), file=sys.stderr, flush=True)
    # Embedding time of UniRef50 at the stated throughput, spread over `gpus` concurrent jobs.
    gpu_s = args.residues / args.residues_per_gpu_s
    wall_embed = gpu_s / args.gpus
    print(machine_header())
    print(f"stub jobs, local executor, --cores {args.cores}, --scheduler {args.scheduler}\n")
    print(table(("plan", "shards", "embed jobs", "fresh run, wall s", "no-op dry-run s"),
                [(plan, r["shards"], r["embed_jobs"], r["wall_s"], r["noop_s"]) for plan, r in rows],
                formats={"fresh run, wall s": "{:.1f}", "no-op dry-run s": "{:.1f}"}))
    print(f"\nUniRef50: {args.target_shards:,} shards, {args.residues:.3g} residues at {args.residues_per_gpu_s:,.0f} "
          f"residues/s per GPU = {gpu_s / 3600:,.0f} GPU-hours, {wall_embed / 3600:,.1f} h on {args.gpus} GPUs\n")
    fits = []
    for plan in dict.fromkeys(p for p, _ in rows[1:]):
        points = [(r["shards"], max(r["wall_s"] - base, 0.1)) for p, r in rows if p == plan]
        if len(points) < 2:
            continue
        a, b = fit_exponent(points)
        at = base + a * args.target_shards ** b
        fits.append((plan, f"{b:.2f}", f"{at:,.0f} s", f"{100 * at / wall_embed:.2f}%"))
    print(table(("plan", "growth exponent (wall - baseline ~ shards^b)", "overhead at UniRef50",
                 "% of embedding wall time"), fits))
    if args.json:
        print(json.dumps([{"plan": p, **r} for p, r in rows], indent=1))


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "_stub-shard":
        stub_shard(Path(sys.argv[2]))
        return
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
    stub = parser.add_argument_group("--stub: Snakemake's own overhead on synthetic plans")
    stub.add_argument("--stub", action="store_true", help="stub jobs on synthetic plans instead of the example")
    stub.add_argument("--shards", type=int, nargs="+", default=[250, 500, 1000, 5000, 20000])
    stub.add_argument("--max-jobs", type=int, default=1000, help="the grouped plan's max_jobs")
    stub.add_argument("--per-shard-cap", type=int, default=1000, help="largest plan run with one job per shard")
    stub.add_argument("--scheduler", default="greedy", help="Snakemake's --scheduler: greedy or ilp")
    stub.add_argument("--target-shards", type=int, default=16_100, help="UniRef50 at tokens_per_shard 1M")
    stub.add_argument("--residues", type=float, default=16e9, help="UniRef50 residues")
    stub.add_argument("--residues-per-gpu-s", type=float, default=6_060,
                      help="assumed throughput: ~1,880 s per human proteome (11.4M residues), fair-esm 650M, one GPU")
    stub.add_argument("--gpus", type=int, default=100, help="concurrent GPU jobs (the slurm profile's jobs: 100)")
    args = parser.parse_args()
    if args.stub:
        stub_main(args)
        return

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
    print(machine_header())
    print(f"{where}; test model {args.layers} layers, dim {args.dim}; {args.precision} on {args.device}; "
          f"median of {args.repeat} run(s)\n")
    measures = [(f"workflow wall time (fresh run, {r['shards']} shards)", r["wall_s"]),
                ("sum of embed jobs (benchmark files)", r["embed_jobs_sum_s"])]
    if r["embedding_sum_s"] is not None:
        measures.append(("sum of embedding inside the jobs (embed logs)", r["embedding_sum_s"]))
    measures.append(("no-op rerun (`snakemake -n`, nothing to do)", r["noop_rerun_s"]))
    print(table(("measure", "seconds"), measures, formats={"seconds": "{:.1f}"}))
    print(f"\nwall / embed jobs = {r['wall_over_jobs']:.2f}", end="")
    if r["wall_over_embedding"]:
        print(f"; wall / embedding = {r['wall_over_embedding']:.2f}")
    else:
        print()
    stages = ", ".join(f"{rule} {span:.0f}" for rule, span in r["stages_s"].items())
    print(f"stages, first start to last finish (s, 1 s resolution): {stages}")
    jobs = [(j["shard"], f"{j['job_s']:.1f}", "-" if j["embed_s"] is None else f"{j['embed_s']:.1f}",
             j["records"] or "-", j["residues"] or "-", f"{j['max_rss_mb']:.0f}") for j in r["jobs"]]
    print("\n" + table(("shard", "job s", "embedding s", "records", "residues", "max RSS MB"), jobs))


if __name__ == "__main__":
    main()
