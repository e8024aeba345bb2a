"""The int8 engines torch offers on this CPU, on the feed-forward block of the 35M shape.

480 -> 1920 (GELU) -> 480 on 4,096 tokens, one process, rounds interleaved, median per
engine, time relative to embedpipe's fp32 (oneDNN-prepacked). Engines:

* fp32 / bf16: oneDNN-prepacked ``F.linear`` (what the fp32 and bf16-mixed policies run);
* ao-dynamic-{fbgemm,x86,onednn}: ``torch.ops.quantized.linear_dynamic`` with per-channel
  weights, but one activation scale per *tensor* (a record would depend on its batch-mates);
* int8-onednn: embedpipe's :class:`~embedpipe.runtime.int8_linear.Int8Linear` (per-token scales,
  ``torch.ops.onednn.qlinear_pointwise``), quantization of the activations included;
* int8-int_mm: the same through ``torch._int_mm``;
* int8-onednn-s8 (``--with-s8``): int8-onednn fed s8 activations, as before it took u8 with zero
  point 128; on AVX512-VNNI CPUs without AMX that is oneDNN's scalar reference kernel (minutes);
* w8a16-int8pack: ``torch.ops.aten._weight_int8pack_mm`` (int8 weights, bf16 activations).

    python benchmarks/int8_engines.py [--rounds 5] [--tokens 4096] [--with-s8]
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from _harness import Ratio, Stopwatch, Timing, machine_header, table

from embedpipe.runtime.int8_linear import Int8Linear
from embedpipe.runtime.packed_linear import pack_linear


def engines(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor,
            b2: torch.Tensor, with_s8: bool = False) -> dict[str, Callable[[], torch.Tensor]]:
    """engine -> one pass of the feed-forward block."""
    out: dict[str, Callable[[], torch.Tensor]] = {}
    p1, p2 = pack_linear(w1, b1), pack_linear(w2, b2)
    out["fp32"] = lambda: p2(p1(x, gelu=True))
    q1, q2 = pack_linear(w1.bfloat16(), b1.bfloat16()), pack_linear(w2.bfloat16(), b2.bfloat16())
    if q1 is not None and q2 is not None:  # None: oneDNN cannot pack bf16 on this CPU (AVX2)
        out["bf16"] = lambda: q2(q1(x.bfloat16(), gelu=True)).float()
    for engine in ("fbgemm", "x86", "onednn"):
        if engine not in torch.backends.quantized.supported_engines:
            continue
        torch.backends.quantized.engine = engine
        packs = []
        for w, b in ((w1, b1), (w2, b2)):
            scale = (w.abs().amax(1) / 127).double()
            qw = torch.quantize_per_channel(w, scale, torch.zeros(len(scale), dtype=torch.long), 0, torch.qint8)
            packs.append(torch.ops.quantized.linear_prepack(qw, b))
        out[f"ao-dynamic-{engine}"] = (lambda a, c: lambda: torch.ops.quantized.linear_dynamic(
            F.gelu(torch.ops.quantized.linear_dynamic(x, a, True)), c, True))(*packs)
    for engine in ("onednn", "int_mm"):
        l1, l2 = Int8Linear(w1, b1, engine=engine), Int8Linear(w2, b2, engine=engine)
        out[f"int8-{engine}"] = (lambda a, c: lambda: c(a(x, gelu=True)))(l1, l2)
    if with_s8:
        s1, s2 = Int8Linear(w1, b1, engine="onednn"), Int8Linear(w2, b2, engine="onednn")
        s1.zero_point = s2.zero_point = 0  # the same integers as s8: oneDNN's other kernel choice
        out["int8-onednn-s8"] = lambda: s2(s1(x, gelu=True))
    try:
        i1, s1 = Int8Linear(w1, None).qweight, Int8Linear(w1, None).weight_scale.bfloat16()
        i2, s2 = Int8Linear(w2, None).qweight, Int8Linear(w2, None).weight_scale.bfloat16()
        xb = x.bfloat16()
        torch.ops.aten._weight_int8pack_mm(xb[:2], i1, s1)
        out["w8a16-int8pack"] = lambda: torch.ops.aten._weight_int8pack_mm(
            F.gelu(torch.ops.aten._weight_int8pack_mm(xb, i1, s1) + b1.bfloat16()), i2, s2) + b2.bfloat16()
    except (RuntimeError, AttributeError):
        pass
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=480)
    parser.add_argument("--with-s8", action="store_true", help="also int8-onednn with s8 activations")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    g = torch.Generator().manual_seed(0)
    d = args.dim
    x = torch.randn(args.tokens, d, generator=g)
    w1, b1 = torch.randn(4 * d, d, generator=g) / d**0.5, torch.randn(4 * d, generator=g) * 0.1
    w2, b2 = torch.randn(d, 4 * d, generator=g) / (4 * d) ** 0.5, torch.randn(d, generator=g) * 0.1
    runs = engines(x, w1, b1, w2, b2, args.with_s8)
    ref = runs["fp32"]().double()
    times = {name: Timing() for name in runs}
    for run in runs.values():
        run()  # warm-up
    for _ in range(args.rounds):  # interleaved: a busy spell hits every engine
        for name, run in runs.items():
            with Stopwatch() as clock:
                run()
            times[name].seconds.append(clock.seconds)
    from embedpipe.runtime.cpu_features import detect, isa_caps

    cpu = detect()
    caps = f", capped (emulated): {isa_caps()}" if isa_caps() else ""
    print(f"CPU {cpu.cpu_class} ({cpu.named()}{caps}), {torch.get_num_threads()} threads, {args.tokens} tokens, "
          f"{d} -> {4 * d} -> {d}, median of {args.rounds} interleaved rounds\n")
    rows = [(name, times[name].median * 1e3, f"{F.cosine_similarity(run().double(), ref, dim=1).min().item():.6f}")
            for name, run in runs.items()]
    print(machine_header())
    print(table(("engine", "ms", "min row cosine to fp32"), rows,
                [Ratio("ms", 0, "time / fp32", lower_is_better=False)], {"ms": "{:.1f}"}))


if __name__ == "__main__":
    main()
