"""GPU acceptance: one command, under 8 minutes on one H100/H200, no network.

    python benchmarks/gpu_acceptance.py                      # the measurement (CUDA)
    python benchmarks/gpu_acceptance.py --device cpu --quick # a smoke run of the script itself

Random-weight checkpoints (written once, marked untrained) in the real shapes of
esm2_t12_35M, esm2_t30_150M, esm2_t33_650M and, where memory allows, esm2_t36_3B; on the
CPU each shape has a tiny stand-in (2-3 layers, 32-64 dims): a smoke run, not performance.

* correctness, per shape: fp32 packed vs padded vs fair-esm's own forward (TF32 off,
  <= 1e-4), every policy finite, batch invariance (a record alone vs in the full batch);
  once: the fp16 overflow fallback (a 'C' row of 7e4) equals fp32 of the record alone.
* speed, per shape, same records, same process: fair-esm's extract.py recipe (fp32 and
  model.half()), Hugging Face EsmModel SDPA bf16, embedpipe fp32 / bf16 / bf16-mixed
  (packed and padded) / fp16-mixed: residues/s, ratios, peak memory, MFU against the
  GPU's bf16 peak, idle fraction = 1 - forward seconds / loop seconds.
* proxy: a human-like proteome (20,000 records, median ~415 aa, titin) through
  ``embedpipe embed --precision bf16-mixed`` on the 650M shape, end to end.

Writes benchmarks/out/gpu/results.json (--out) with every field of REQUIRED_FIELDS (null
plus a *_why where a value cannot exist, e.g. MFU on a CPU), the issue's targets and
whether each was met, and prints Markdown tables for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from _gpu_acceptance_budget import RESERVE_SECONDS, Budget
from _gpu_acceptance_correctness import overflow_section, shape_correctness
from _gpu_acceptance_setup import (
    SHAPES,
    WINDOW,
    checkpoint,
    default_device,
    device_info,
    fair_esm_model,
    forward_flops,
    human_lengths,
    length_scale,
    park_on_host,
    release,
    shape_dims,
    shape_skip_reason,
)
from _gpu_acceptance_speed import PROXY_KEYS, ROW_KEYS, SYSTEMS, proxy_records, proxy_section, shape_speed
from _harness import now, random_records

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = "embedpipe.gpu-acceptance/1"
#: (cuda, cpu) record counts: correctness per shape, speed per shape (cpu), proxy; --quick: /4
COUNTS = {"correctness": (32, 12), "speed_cpu": 24, "proxy": (20_000, 40), "overflow": 9}
PROXY_SHAPE = "650M"
#: the issue's targets: (value's place, comparison, threshold, what)
TARGETS: dict[str, tuple[str, str, float, str]] = {
    "mfu_650m_bf16_mixed_packed": ("mfu", ">=", 0.40, "MFU, embedpipe bf16-mixed packed, 650M"),
    "proxy_seconds": ("proxy", "<=", 60.0, "proteome proxy (20,000 records, 650M, bf16-mixed), seconds"),
    "x_hf_sdpa_bf16_650m": ("x_hf_sdpa_bf16", ">=", 3.0, "bf16-mixed vs HF EsmModel SDPA bf16, 650M"),
    "x_fair_esm_fp32_650m": ("x_fair_esm_fp32", ">=", 8.0, "bf16-mixed vs fair-esm fp32 recipe, 650M"),
    "bf16_mixed_cosine_650m": ("min_cosine_to_fp32", ">=", 0.9999, "bf16-mixed min pooled cosine to fp32, 650M"),
}
_P, _S = "correctness.*.policies.*", "speed.*.systems.*"
#: every field a run fills ('*': each key of that level, skipped shapes excepted)
REQUIRED_FIELDS: tuple[str, ...] = (
    "schema", "complete", "date", "command", "python_version", "torch_version", "fair_esm_version",
    "transformers_version", "transformers_version_why", "embedpipe_version", "embedpipe_path", "git_commit",
    "quick", "seconds_total", "missing_fields", "markdown",
    *(f"device.{k}" for k in ("type", "name", "capability", "capability_why", "total_memory_gib",
                              "total_memory_why", "bf16_peak_flops", "bf16_peak_flops_why", "threads")),
    *(f"shapes.*.{k}" for k in ("skipped", "name", "real_shape", "run_shape", "scaled_down", "scaled_down_why",
                                "checkpoint", "parameters", "seconds")),
    *(f"correctness.*.{k}" for k in ("records", "residues", "tolerance", "tf32", "max_abs_diff_packed_vs_padded",
                                     "packed_equals_padded")),
    *(f"correctness.*.bf16_mixed_packed_vs_padded.{k}" for k in (
        "packed_attention_path", "padded_attention_path", "min_cosine_tolerance", "max_relative_diff_tolerance",
        "min_pooled_cosine", "max_relative_diff_per_residue", "within_tolerance")),
    *(f"correctness.*.{layout}.{k}" for layout in ("packed", "padded")
      for k in ("asked", "batch_layout", "attention_path", "attention_inputs", "tokens_per_batch",
                "max_abs_diff_mean_vs_fair_esm", "max_abs_diff_per_residue_vs_fair_esm", "within_tolerance")),
    *(f"{_P}.{k}" for k in ("batch_layout", "attention_path", "attention_inputs", "tokens_per_batch", "finite",
                            "fallback", "min_cosine_to_fp32", "batch_invariance.records",
                            "batch_invariance.max_abs_diff", "batch_invariance.equal",
                            *(f"two_batchings.{k}" for k in ("tokens_per_batch", "batches", "records_not_bit_equal",
                                                             "max_abs_diff", "equal")))),
    *(f"overflow_fallback.{k}" for k in ("shape", "records", "records_with_c")),
    *(f"overflow_fallback.policies.*.{k}" for k in ("fallback", "fallback_ids_match", "reasons", "finite",
                                                    "max_abs_diff_vs_fp32_alone", "exact", "batch_layout")),
    *(f"speed.*.{k}" for k in ("records", "residues", "tokens", "flops", "flops_formula", "recipe_tokens_per_batch",
                               "peer_tokens_per_batch", "warmup_records", "cosine_reference")),
    *(f"{_S}.{k}" for k in ROW_KEYS),
    *(f"proxy.{k}" for k in ("skipped", "shape", *PROXY_KEYS)),
    *(f"targets.*.{k}" for k in ("what", "comparison", "threshold", "value", "met", "why")),
)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# -- the JSON --------------------------------------------------------------------------------------

def _expand(node: Any, parts: list[str]) -> list[tuple[str, bool]]:
    """(path, present) for one dotted path; '*' stands for every key of a non-skipped entry."""
    if not parts:
        return [("", True)]
    head, rest = parts[0], parts[1:]
    if not isinstance(node, dict):
        return [(head, False)]
    if head == "*":
        items = [(k, v) for k, v in node.items() if not (isinstance(v, dict) and v.get("skipped"))]
    elif head in node:
        items = [(head, node[head])]
    else:
        return [(head, False)]
    return [(f"{key}.{sub}".rstrip("."), ok) for key, value in items for sub, ok in _expand(value, rest)]


def missing_fields(results: dict[str, Any], fields: tuple[str, ...] = REQUIRED_FIELDS) -> list[str]:
    """Required fields the results lack (a skipped shape needs only its 'skipped' entry)."""
    return [path for field in fields for path, ok in _expand(results, field.split(".")) if not ok]


def versions() -> dict[str, Any]:
    """Versions and where embedpipe was imported from (this worktree or an installed copy)."""
    import esm

    import embedpipe

    try:
        import transformers
        hf, hf_why = transformers.__version__, None
    except ImportError:
        hf, hf_why = None, "transformers is not installed"
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    return {"python_version": platform.python_version(), "torch_version": torch.__version__,
            "fair_esm_version": getattr(esm, "__version__", None), "transformers_version": hf,
            "transformers_version_why": hf_why, "embedpipe_version": embedpipe.__version__,
            "embedpipe_path": str(Path(embedpipe.__file__).parent),
            "git_commit": commit.stdout.strip() if commit.returncode == 0 else None}


def save(results: dict[str, Any], out: Path) -> None:
    """Written after every section, so a run cut short still leaves what it measured."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2, default=str) + "\n")


# -- sections --------------------------------------------------------------------------------------

def shape_meta(key: str, device: torch.device, skipped: str | None) -> dict[str, Any]:
    from embedpipe.model.esm2_spec import parameter_count

    shape = SHAPES[key]
    dims = shape_dims(shape, device)
    tiny = device.type != "cuda"
    return {"skipped": skipped, "name": shape.name, "real_shape": dict(zip(("layers", "dim", "heads"), shape.real)),
            "run_shape": dict(zip(("layers", "dim", "heads"), dims)), "scaled_down": tiny,
            "scaled_down_why": "CPU smoke run: a tiny stand-in of the shape, not performance" if tiny else None,
            "checkpoint": None, "parameters": parameter_count(*dims), "seconds": None}


def shape_records(key: str, args: argparse.Namespace, device: torch.device) -> tuple[list, list]:
    """(correctness records, speed records) of one shape: the same on every call."""
    cuda, quarter = device.type == "cuda", 4 if args.quick else 1
    scale = length_scale(device)
    n = COUNTS["correctness"][0 if cuda else 1] // quarter
    correctness = random_records(human_lengths(n, seed=1, cap=WINDOW, scale=scale), seed=2, prefix="c")
    n = args.speed_records or (SHAPES[key].speed_records if cuda else COUNTS["speed_cpu"]) // quarter
    return correctness, random_records(human_lengths(n, seed=3, cap=WINDOW, scale=scale), seed=4, prefix="s")


def shape_flops(key: str, args: argparse.Namespace, device: torch.device) -> float:
    """Forward FLOPs of one shape's records (correctness and speed): what the budget scales by."""
    layers, dim, _ = shape_dims(SHAPES[key], device)
    return sum(forward_flops([len(s) for _, s in records], layers, dim) for records in shape_records(key, args, device))


def run_shape(key: str, args: argparse.Namespace, device: torch.device, results: dict[str, Any]) -> None:
    """Correctness and speed of one shape, on one loaded random-weight checkpoint."""
    from embedpipe.model import load_model

    meta = results["shapes"][key]
    started = now()
    path = checkpoint(args.work, shape_dims(SHAPES[key], device), fp16_file=SHAPES[key].fp16_file)
    meta["checkpoint"] = str(path)
    loaded = load_model(str(path))
    fair = fair_esm_model(path)  # fair-esm's own loader: the reference and the recipe's model
    correctness, speed = shape_records(key, args, device)
    log(f"  {key}: correctness on {len(correctness)} records")
    results["correctness"][key] = shape_correctness(loaded, fair, correctness, device)
    park_on_host(loaded)
    log(f"  {key}: speed on {len(speed)} records")
    results["speed"][key] = shape_speed(loaded, fair, speed, device, results["device"]["bf16_peak_flops"],
                                        results["device"]["bf16_peak_flops_why"], log)
    del loaded, fair
    release(device)
    meta["seconds"] = now() - started


def run_proxy(args: argparse.Namespace, device: torch.device, budget: Budget, results: dict[str, Any]) -> dict[str, Any]:
    """The proteome proxy on the 650M shape (its checkpoint reused when the shape ran), inside
    what is left of the time budget: refused when the 650M rate says it cannot finish, stopped
    when it runs past."""
    count = args.proxy_records
    skipped = {"shape": PROXY_SHAPE, **dict.fromkeys(PROXY_KEYS)}
    if count <= 0:
        return skipped | {"skipped": "--proxy-records 0"}
    rate = results["speed"].get(PROXY_SHAPE, {}).get("systems", {}).get("embedpipe-bf16-mixed", {}).get("residues_per_s")
    limit, why = budget.proxy_limit(sum(len(s) for _, s in proxy_records(count, device)), rate)
    if why:
        return skipped | {"skipped": why}
    path = checkpoint(args.work, shape_dims(SHAPES[PROXY_SHAPE], device))
    log(f"  proxy: {count} records, {PROXY_SHAPE} shape, bf16-mixed, whole process")
    return {"skipped": None, "shape": PROXY_SHAPE, **proxy_section(path, device, count, args.work, args.threads, limit)}


def target_value(results: dict[str, Any], place: str) -> tuple[Any, str | None]:
    """A target's measured value (650M bf16-mixed row, or the proxy), or (None, why)."""
    if place == "proxy":
        proxy = results.get("proxy", {})
        if proxy.get("seconds") is None:
            return None, proxy.get("skipped") or "proxy not run"
        return proxy["seconds"], None
    systems = results["speed"].get("650M", {}).get("systems", {})
    row = systems.get("embedpipe-bf16-mixed")
    if row is None:
        return None, "650M shape not run"
    if row.get(place) is not None:
        return row[place], None
    peer = {"x_hf_sdpa_bf16": "hf-sdpa-bf16", "x_fair_esm_fp32": "fair-esm-fp32"}.get(place)
    skipped = systems.get(peer, {}).get("skipped") if peer else None
    return None, row.get(f"{place}_why") or (f"{peer} skipped: {skipped}" if skipped else "no value")


def targets(results: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """Each target with its value and whether it was met (null on the CPU: tiny shapes)."""
    out = {}
    for name, (place, comparison, threshold, what) in TARGETS.items():
        value, why = target_value(results, place)
        met = None
        if device.type != "cuda":
            why = why or "CPU smoke run: tiny shapes, not the measured configuration"
        elif value is not None:
            met = value >= threshold if comparison == ">=" else value <= threshold
            if name == "proxy_seconds" and results["proxy"]["records"] < 20_000:
                met, why = None, "proxy scaled down (--proxy-records < 20000)"
            if name.startswith("mfu"):  # a value here means the 650M row exists (not so for the proxy)
                layout = results["speed"]["650M"]["systems"]["embedpipe-bf16-mixed"]["batch_layout"]
                if layout != "packed":
                    met, why = False, f"bf16-mixed ran {layout}, not packed"
        out[name] = {"what": what, "comparison": comparison, "threshold": threshold, "value": value,
                     "met": met, "why": why}
    return out


# -- Markdown ----------------------------------------------------------------------------------------

def _f(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def speed_table(results: dict[str, Any]) -> list[str]:
    """One row per shape and system: speed, ratios, MFU, idle fraction, memory, cosine."""
    lines = ["| shape | system | attention path | q/k/v | residues/s | x fair-esm fp32 | x HF SDPA bf16 | MFU | idle "
             "| peak MiB | min cos to fp32 | syncs | warm-up s |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for key, section in results["speed"].items():
        for name, r in section["systems"].items():
            if r["skipped"]:
                lines.append(f"| {key} | {name} | - | - | skipped: {r['skipped']} | | | | | | | | |")
                continue
            lines.append(
                f"| {key} | {name} | {r['attention_path']} | {r['attention_inputs']} | {r['residues_per_s']:,.0f} | "
                f"{_f(r['x_fair_esm_fp32'], '.2f')} | {_f(r['x_hf_sdpa_bf16'], '.2f')} | {_f(r['mfu'], '.1%')} | "
                f"{r['idle_fraction']:.1%} | {_f(r['peak_memory_mib'], ',.0f')} | {_f(r['min_cosine_to_fp32'], '.6f')} | "
                f"{_f(r['syncs'], 'd')} | {_f(r['warmup_seconds'], '.1f')} |")
    return lines


def correctness_table(results: dict[str, Any]) -> list[str]:
    """One row per shape: the layouts against fair-esm, what packed ran as, policies, invariance."""
    lines = ["| shape | packed vs fair-esm | padded vs fair-esm | packed vs padded | layout asked packed -> ran "
             "| bf16-mixed packed vs padded (cos, rel. diff) | policies finite "
             "| batch-invariant: alone/two batchings (max diff) |",
             "|---|---|---|---|---|---|---|---|"]
    for key, c in results["correctness"].items():
        policies, mixed = c["policies"], c["bf16_mixed_packed_vs_padded"]
        invariant = ", ".join(
            f"{p} {'yes' if v['batch_invariance']['equal'] else _f(v['batch_invariance']['max_abs_diff'], '.1e')}"
            f"/{'yes' if v['two_batchings']['equal'] else _f(v['two_batchings']['max_abs_diff'], '.1e')}"
            for p, v in policies.items())
        lines.append(
            f"| {key} | {c['packed']['max_abs_diff_per_residue_vs_fair_esm']:.1e} | "
            f"{c['padded']['max_abs_diff_per_residue_vs_fair_esm']:.1e} | {c['max_abs_diff_packed_vs_padded']:.1e} | "
            f"{c['packed']['batch_layout']} | {mixed['min_pooled_cosine']:.6f}, {mixed['max_relative_diff_per_residue']:.1e}"
            f" ({mixed['packed_attention_path']}{'' if mixed['within_tolerance'] else ', NOT within tolerance'}) | "
            f"{sum(v['finite'] for v in policies.values())}/{len(policies)} | "
            f"{invariant} |")
    return lines


def summary_lines(results: dict[str, Any]) -> list[str]:
    """The overflow fallback and proxy in a sentence each, then the targets table."""
    overflow = results["overflow_fallback"]
    lines = ["fp16 overflow fallback: " + "; ".join(
        f"{p} {v['fallback']} of {overflow['records_with_c']} 'C' records fell back, "
        f"{'exact' if v['exact'] else 'NOT exact'}" for p, v in overflow["policies"].items()), ""]
    proxy = results["proxy"]
    if proxy["seconds"] is not None:
        lines += [f"Proteome proxy: {proxy['records']:,} records ({proxy['residues']:,} residues, "
                  f"{proxy['chunked_records']} chunked), {proxy['shape']} bf16-mixed, end to end "
                  f"{proxy['seconds']:.1f} s ({proxy['residues_per_s']:,.0f} residues/s)", ""]
    lines += ["| target | threshold | value | met |", "|---|---|---|---|"]
    for t in results["targets"].values():
        met = {True: "yes", False: "**no**", None: f"- ({t['why']})"}[t["met"]]
        lines.append(f"| {t['what']} | {t['comparison']} {t['threshold']:g} | {_f(t['value'], '.6g')} | {met} |")
    return lines


def markdown(results: dict[str, Any]) -> str:
    """The tables for docs/benchmarks.md, labelled as a CPU smoke run where they are one."""
    smoke = " (CPU smoke: tiny stand-in shapes, not performance)" if results["device"]["type"] != "cuda" else ""
    head = f"Device: {results['device']['name']}{smoke}; torch {results['torch_version']}; {results['date']}"
    return "\n".join([head, "", *speed_table(results), "", *correctness_table(results), "", *summary_lines(results)])


# -- main -----------------------------------------------------------------------------------------------

#: the issue's budget for the whole run on one GPU
CUDA_BUDGET_MINUTES = 8.0
#: shapes in the order they run: the targets' shape first, the largest (slowest to write and load) last
RUN_ORDER = ("650M", "35M", "150M", "3B")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default=default_device(), help="cuda (the measurement; default when "
                        "available) or cpu (a smoke run on tiny stand-in shapes)")
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=None,
                        help="default: all (3B only with enough GPU memory); --quick: 650M")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out" / "gpu" / "results.json")
    parser.add_argument("--proxy-records", type=int, default=None,
                        help=f"default {COUNTS['proxy'][0]} on cuda, {COUNTS['proxy'][1]} on cpu (/10 with --quick)")
    parser.add_argument("--speed-records", type=int, default=None, help="records per shape in the speed section")
    parser.add_argument("--quick", action="store_true", help="650M only, a quarter of the records")
    parser.add_argument("--budget-minutes", type=float, default=None,
                        help=f"skip shapes that would not finish inside this budget (estimated from the rate "
                             f"measured on the shapes before, times the FLOPs ratio), keeping {RESERVE_SECONDS:.0f} s "
                             f"for the overflow check and the proxy, which stops when the budget is spent "
                             f"(default {CUDA_BUDGET_MINUTES:g} on cuda, none on cpu); 650M runs first")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="torch threads (default %(default)s; 1 is faster on a CPU shared with other jobs)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    cuda = torch.device(args.device).type == "cuda"
    args.shapes = args.shapes or (["650M"] if args.quick else list(SHAPES))
    if args.proxy_records is None:
        args.proxy_records = COUNTS["proxy"][0 if cuda else 1] // (10 if args.quick else 1)
    if args.budget_minutes is None and cuda:
        args.budget_minutes = CUDA_BUDGET_MINUTES
    args.work = args.out.parent / "work"
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_acceptance: no CUDA device here; --device cpu runs the smoke test")
    started = now()
    results: dict[str, Any] = {
        "schema": SCHEMA, "complete": False, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(["python", *sys.argv]) if argv is None else shlex.join(["python", __file__, *argv]),
        **versions(), "quick": args.quick, "seconds_total": None, "missing_fields": None, "markdown": None,
        "device": device_info(device), "systems": list(SYSTEMS),
        "shapes": {key: shape_meta(key, device, shape_skip_reason(SHAPES[key], device)) for key in args.shapes},
        "correctness": {}, "speed": {}, "overflow_fallback": {}, "proxy": {}, "targets": {},
    }
    log(f"gpu_acceptance on {results['device']['name']} -> {args.out}")
    budget = Budget(args.budget_minutes)
    budget.started = started
    for key in sorted(args.shapes, key=RUN_ORDER.index):
        flops = shape_flops(key, args, device)
        results["shapes"][key]["skipped"] = results["shapes"][key]["skipped"] or budget.shape_skip(flops)
        if results["shapes"][key]["skipped"]:
            log(f"  {key}: skipped ({results['shapes'][key]['skipped']})")
            continue
        run_shape(key, args, device, results)
        budget.measured(key, flops, results["shapes"][key]["seconds"])
        save(results, args.out)
    log("  fp16 overflow fallback")
    results["overflow_fallback"] = overflow_section(device, COUNTS["overflow"])
    results["proxy"] = run_proxy(args, device, budget, results)
    results["targets"] = targets(results, device)
    results["markdown"] = markdown(results)
    results["seconds_total"] = now() - started
    results["missing_fields"] = []
    results["missing_fields"] = missing_fields(results)
    results["complete"] = True
    save(results, args.out)
    print(results["markdown"])
    if results["missing_fields"]:
        log(f"missing fields: {', '.join(results['missing_fields'])}")
    log(f"done in {results['seconds_total']:.0f} s -> {args.out}")
    return results


if __name__ == "__main__":
    main()
