"""Inputs and measuring tools of benchmarks/gpu_acceptance.py: shapes, devices, random
records of a human-like length distribution, random-weight checkpoints, memory and FLOPs.

A module, not a script: tests/benchmarks/test_benchmark_scripts.py runs only the scripts (no leading _).
"""

from __future__ import annotations

import argparse
import gc
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _harness as harness
import numpy as np
import torch

#: human reference proteome: median ~415 aa, mean ~560 (log-normal sigma 0.77), titin 34,350
HUMAN_MEDIAN, HUMAN_SIGMA, TITIN = 415, 0.77, 34_350
#: fair-esm's trained window: records up to this many residues are embedded whole by every system
WINDOW = 1022
#: record lengths of the correctness and speed sections on a CPU: 1/8 of the human ones (median ~52)
CPU_LENGTH_SCALE = 1 / 8


@dataclass(frozen=True)
class Shape:
    """An ESM-2 size: the real shape (GPU runs) and the tiny stand-in a CPU smoke run uses."""

    key: str
    name: str
    real: tuple[int, int, int]  # layers, dim, heads
    tiny: tuple[int, int, int]
    speed_records: int  # records of the GPU speed section (fewer for bigger models)
    fp16_file: bool = False  # weights stored in fp16: half the file to write, hash and read


SHAPES: dict[str, Shape] = {s.key: s for s in (
    Shape("35M", "esm2_t12_35M", (12, 480, 20), (2, 32, 4), 2000),
    Shape("150M", "esm2_t30_150M", (30, 640, 20), (2, 48, 4), 2000),
    Shape("650M", "esm2_t33_650M", (33, 1280, 20), (2, 64, 4), 1000),
    Shape("3B", "esm2_t36_3B", (36, 2560, 40), (3, 64, 8), 256, fp16_file=True),
)}
#: device memory below which the 3B shape is skipped (fp32 weights 11 GiB, a fair-esm copy
#: beside embedpipe's, a bf16 copy, activations)
MIN_GIB_FOR_3B = 60.0

#: dense bf16 peak FLOP/s by GPU name (first substring that matches; most specific first)
BF16_PEAK_FLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H200 NVL", 835e12),
    ("H100", 989e12),  # SXM
    ("H200", 989e12),
    ("A100", 312e12),
)


def default_device() -> str:
    """cuda when a GPU is visible, else cpu (a smoke run)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def bf16_peak(name: str) -> tuple[float | None, str | None]:
    """(peak FLOP/s, None) for a known GPU name, else (None, why)."""
    for part, peak in BF16_PEAK_FLOPS:
        if part.lower() in name.lower():
            return peak, None
    if name == "cpu":
        return None, "no bf16 peak for a CPU (the MFU target is a GPU target)"
    return None, f"{name!r} is not in the bf16 peak table (benchmarks/_gpu_acceptance_setup.py)"


def device_info(device: torch.device) -> dict[str, Any]:
    """What the JSON says about the device; CPU fields that cannot exist are null with a why."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        name = torch.cuda.get_device_name(device)
        peak, why = bf16_peak(name)
        return {"type": "cuda", "name": name, "capability": f"{props.major}.{props.minor}",
                "capability_why": None, "total_memory_gib": props.total_memory / 2**30, "total_memory_why": None,
                "bf16_peak_flops": peak, "bf16_peak_flops_why": why, "threads": torch.get_num_threads()}
    peak, why = bf16_peak("cpu")
    return {"type": "cpu", "name": "cpu", "capability": None, "capability_why": "not a CUDA device",
            "total_memory_gib": None, "total_memory_why": "host memory is not device memory",
            "bf16_peak_flops": peak, "bf16_peak_flops_why": why, "threads": torch.get_num_threads()}


def shape_dims(shape: Shape, device: torch.device) -> tuple[int, int, int]:
    """The real shape on a GPU; the tiny stand-in on the CPU (a smoke run, not a measurement)."""
    return shape.real if device.type == "cuda" else shape.tiny


def length_scale(device: torch.device) -> float:
    """Human-like lengths on a GPU; short records on the CPU (a smoke run of the script)."""
    return 1.0 if device.type == "cuda" else CPU_LENGTH_SCALE


def shape_skip_reason(shape: Shape, device: torch.device) -> str | None:
    """Why a shape cannot run here (only 3B, on a GPU with too little memory), else None."""
    if shape.key == "3B" and device.type == "cuda":
        gib = torch.cuda.get_device_properties(device).total_memory / 2**30
        if gib < MIN_GIB_FOR_3B:
            return f"{gib:.0f} GiB of device memory < {MIN_GIB_FOR_3B:.0f} GiB needed for the 3B shape"
    return None


# -- records ---------------------------------------------------------------------------------------

def human_lengths(count: int, seed: int, cap: int | None = None, scale: float = 1.0) -> list[int]:
    """Log-normal lengths like the human proteome (median 415, tail past 5,000), times ``scale``
    (a CPU smoke run embeds short records); ``cap`` redraws longer ones, so a capped sample
    keeps the distribution's shape below the cap."""
    rng = np.random.default_rng(seed)
    out: list[int] = []
    while len(out) < count:
        draw = scale * np.exp(rng.normal(math.log(HUMAN_MEDIAN), HUMAN_SIGMA, size=count))
        draw = np.clip(np.rint(draw), 20, TITIN).astype(int)
        out.extend(int(n) for n in draw if cap is None or n <= cap)
    return out[:count]


def proxy_lengths(count: int, seed: int, scale: float = 1.0) -> list[int]:
    """The proteome proxy: human-like lengths plus titin (34,350) and one record past 5,000,
    so even a scaled-down sample has the long tail that embedpipe chunks (all times ``scale``)."""
    lengths = human_lengths(count, seed, scale=scale)
    if count >= 2:
        lengths[-1] = round(TITIN * scale)
        if max(lengths[:-1]) <= 5000 * scale:
            lengths[-2] = round(5500 * scale)
    return lengths


def write_fasta(path: Path, records: list[tuple[str, str]]) -> Path:
    """60-column FASTA (the proxy's input file)."""
    with open(path, "w") as fh:
        for rid, seq in records:
            fh.write(f">{rid}\n")
            fh.writelines(seq[i : i + 60] + "\n" for i in range(0, len(seq), 60))
    return path


# -- models --------------------------------------------------------------------------------------------

def checkpoint(directory: Path, dims: tuple[int, int, int], seed: int = 0, fp16_file: bool = False) -> Path:
    """A random-weight (untrained-marked) checkpoint of ``dims``, written once per directory; the
    name starts with esm2 and the contact companion is written, so fair-esm's loader takes it."""
    from embedpipe.model.random_checkpoint import make_test_model

    layers, dim, heads = dims
    path = directory / f"esm2_acceptance_t{layers}_{dim}_h{heads}_s{seed}{'_fp16' if fp16_file else ''}.pt"
    if not path.exists():
        directory.mkdir(parents=True, exist_ok=True)
        make_test_model(path, layers=layers, dim=dim, heads=heads, seed=seed,
                        storage_dtype=torch.float16 if fp16_file else None)
    return path


def fair_esm_model(path: Path) -> tuple[torch.nn.Module, Any]:
    """(model, alphabet) through fair-esm's own loader: the independent reference and the recipe."""
    import esm

    with torch.serialization.safe_globals([argparse.Namespace]):
        model, alphabet = esm.pretrained.load_model_and_alphabet_local(str(path))
    return model.eval(), alphabet


def park_on_host(loaded: Any) -> None:
    """The shared fp32 model back on the host, without the device tensors that embedpipe's
    runner (fused q/k/v) and fair-esm (rotary tables) cache on its modules: so each system's
    memory window starts with no other system's weights on the device. Between systems only
    (no Engine alive); a later runner fuses again."""
    from embedpipe.model.esm2 import reset_rotary_caches

    loaded.model.to("cpu")
    reset_rotary_caches(loaded.model)
    for module in loaded.model.modules():
        module.__dict__.pop("_embedpipe_qkv", None)


def release(device: torch.device) -> None:
    """Free what the last system left on a GPU (Python garbage, then CUDA's cache); on the CPU
    reference counting already freed it (a full collection costs ~0.2 s with transformers loaded)."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- measuring ------------------------------------------------------------------------------------------

def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise OSError(f"{field} not in /proc/self/status")


class MemoryWindow:
    """Peak memory a system adds: CUDA's peak allocated minus what was allocated at the start;
    on the CPU the peak RSS (VmHWM, reset through /proc/self/clear_refs) minus RSS at the start."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.why: str | None = None
        self.base = 0
        if device.type == "cuda":
            sync(device)
            torch.cuda.reset_peak_memory_stats(device)
            self.base = torch.cuda.memory_allocated(device)
            return
        try:
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
            self.base = _status_kib("VmRSS") * 1024
        except OSError as exc:
            self.why = f"peak RSS cannot be reset here ({exc.strerror or exc})"

    @property
    def kind(self) -> str:
        return "cuda max_memory_allocated delta" if self.device.type == "cuda" else "peak RSS delta (VmHWM)"

    def peak_mib(self) -> float | None:
        if self.device.type == "cuda":
            sync(self.device)
            return (torch.cuda.max_memory_allocated(self.device) - self.base) / 2**20
        if self.why:
            return None
        return max(0, _status_kib("VmHWM") * 1024 - self.base) / 2**20  # the base is read just after the reset


def forward_flops(lengths: list[int], layers: int, dim: int) -> float:
    """Useful forward FLOPs of ESM-2 over records of ``lengths`` residues (each + BOS/EOS = T
    tokens, at most one 1022-residue window): per token per layer 2 x 12 D^2 (q, k, v, out
    projections and the 4D FFN: 2 x the non-embedding parameters) + 4 T D (QK^T and AV).
    Embedding, layer norms, LM and contact heads are left out, padding is not counted."""
    total = 0.0
    for n in lengths:
        t = min(n, WINDOW) + 2
        total += t * layers * (24 * dim * dim + 4 * t * dim)
    return total


class Stopwatch(harness.Stopwatch):
    """The harness's stopwatch, synchronising ``device`` at both ends of the block."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(sync=lambda: sync(device))
