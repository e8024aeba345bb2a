"""Does SmoothQuant smoothing bring int8-mixed closer to fp32? (docs/precision.md, int8-mixed smoothing)

    python benchmarks/int8_smoothing.py [--max-records 84 --repeats 2]

A random-weight ESM-2 of the 35M model's shape (12 layers x 480 dims x 20 heads), twice: as
written, and with planted outlier channels (trained transformers, ESM-2 included, have a few
input channels with very large activations): channels 7, 100, 250 and 401 of every layer's two
layer norm weights (self_attn_layer_norm and final_layer_norm, which feed q/k/v and fc1)
multiplied by 30. On each: int8-mixed with ``--int8-smoothing none`` and ``smoothquant``
(calibrated on the shipped set, the first 16 records of examples/swissprot100.fasta) against
fp32, on the other 84 records (``--max-records`` fewer): min and median pooled (mean) cosine
of the first, middle and last layer, and the max abs difference of the pooled vectors; then
each int8 run's embed time, the two interleaved in this process, best of ``--repeats``
(preparation and calibration not counted). Table: docs/precision.md, "int8-mixed smoothing, measured".
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _harness import Stopwatch, cosine, machine_header, table
from _helpers import edit_weights, embedder_for

from embedpipe.core.options import EmbedOptions
from embedpipe.extraction.engine import Engine
from embedpipe.inputs.fasta import read_sequences
from embedpipe.model import load_model
from embedpipe.model.random_checkpoint import make_test_model

ROOT = Path(__file__).resolve().parent.parent

#: the planted outliers (see the module docstring)
CHANNELS, GAIN = [7, 100, 250, 401], 30.0
CALIBRATION_RECORDS = 16  # the shipped set: the example's first 16


def plant(state: dict) -> None:
    for key, value in state.items():
        if key.startswith("layers.") and key.endswith("layer_norm.weight"):
            value[CHANNELS] *= GAIN


def _models(out: Path) -> dict[str, Any]:
    """The loaded models: the random checkpoint as written, and the same with the planted
    outliers (edited in the loaded model, benchmarks/_helpers.py)."""
    shape = {"layers": 12, "dim": 480, "heads": 20, "seed": 11}
    path = make_test_model(out / "esm2_smooth_t12_480.pt", **shape)
    planted = load_model(str(path))
    edit_weights(planted, plant)
    return {"random weights": load_model(str(path)), f"planted outliers ({len(CHANNELS)} ch x{GAIN:g})": planted}


def _embed(embedder: Engine, records: list) -> tuple[dict, float]:
    with Stopwatch() as clock:
        got = dict(embedder.embed(records))
    return got, clock.seconds


def _row(name: str, smoothing: str, got: dict, ref: dict, layers: list[int]) -> tuple[str, ...]:
    cells = []
    for layer in layers:
        cos = [cosine(got[i].mean[layer], ref[i].mean[layer]) for i in ref]
        cells.append(f"{min(cos):.6f} / {np.median(cos):.6f}")
    diff = max(float(np.abs(got[i].mean[layer] - ref[i].mean[layer]).max()) for i in ref for layer in layers)
    return (name, smoothing, *cells, f"{diff:.2e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-records", type=int, default=84)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    out = ROOT / "benchmarks" / "out"
    out.mkdir(parents=True, exist_ok=True)
    records = list(read_sequences(ROOT / "examples" / "swissprot100.fasta"))[CALIBRATION_RECORDS:]
    records = records[: args.max_records]
    layers = [1, 6, 12]
    residues = sum(len(s) for _, s in records)
    print(machine_header())
    print(f"{len(records)} Swiss-Prot records ({residues} residues) not in the calibration set; "
          f"{torch.get_num_threads()} threads\n")
    timing, rows = [], []
    for name, loaded in _models(out).items():
        embedders = {s: embedder_for(loaded, EmbedOptions(precision=p, layers=tuple(layers), int8_smoothing=smooth),
                                 torch.device("cpu"))
                     for s, p, smooth in (("fp32", "fp32", "none"), ("none", "int8-mixed", "none"),
                                          ("smoothquant", "int8-mixed", "smoothquant"))}
        ref, _ = _embed(embedders.pop("fp32"), records)
        for embedder in embedders.values():  # prepared (and calibrated) before the clock starts
            embedder.runner(embedder.policy)
        best, got = {s: float("inf") for s in embedders}, {}
        for _ in range(args.repeats):  # interleaved: none, smoothquant, none, ...
            for smoothing, embedder in embedders.items():
                got[smoothing], seconds = _embed(embedder, records)
                best[smoothing] = min(best[smoothing], seconds)
        rows += [_row(name, smoothing, got[smoothing], ref, layers) for smoothing in embedders]
        timing.append((name, best["none"], best["smoothquant"], best["smoothquant"] / best["none"]))
    print(table(("model", "smoothing", "layer 1 cosine min / median", "layer 6", "layer 12", "max abs diff"), rows))
    print("\n" + table(("model", "int8-mixed, none (s)", "int8-mixed, smoothquant (s)", "smoothquant / none"), timing,
                       formats={"int8-mixed, none (s)": "{:.2f}", "int8-mixed, smoothquant (s)": "{:.2f}",
                                "smoothquant / none": "{:.3f}"}))


if __name__ == "__main__":
    main()
