"""Which precision policy to use on which hardware: the one advice table (docs/precision.md,
"Which policy on which CPU"), from the measurements in docs/benchmarks.md.

Why one table: the CPU warnings ``embed`` prints, ``--precision auto`` and the table in
docs/precision.md all read it (``tests/runtime/test_advice.py`` keeps the doc equal to
:func:`markdown_table`), so the advice cannot say one thing in the docs and another at run
time. Where int8-mixed is not faster than bf16-mixed at the users' model (the 650M shape where
measured), bf16-mixed is advised; fp16 counts as
fast only where it was measured faster than fp32, whatever the flags say.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from embedpipe.runtime.cpu_features import NATIVE, SIXTEEN_BIT, CpuFeatures

#: where the measurements are
WHERE = 'docs/precision.md, "Which policy on which CPU"'
FP16_POLICIES = ("fp16", "amp-fp16", "fp16-mixed")


@dataclass(frozen=True)
class ClassAdvice:
    """One CPU class: the policy advised there, its measured speed against fp32 (fp32's wall
    time over its own, None where not measured), how that was measured, and the policies
    measured not worth it there with why (what the warnings say)."""

    cpu_class: str
    flags: str
    example: str
    advised: str
    factor: float | None
    measured: str
    not_advised: dict[str, str] = field(default_factory=dict)


_AMX_FP16 = ("no faster than fp32 on this class despite avx512_fp16 (fp16 1.05x fp32's speed; its GEMM peak "
             "142 against fp32's 139 GFLOP/s: docs/benchmarks.md, \"int8-mixed, second pass\")")

#: the advice per CPU class (:attr:`CpuFeatures.cpu_class`), from docs/benchmarks.md
ADVICE: dict[str, ClassAdvice] = {a.cpu_class: a for a in (
    ClassAdvice(
        "amx", "`amx_bf16`, `amx_int8`, `avx512_fp16`", "this project's 2-vCPU Xeon (Sapphire/Emerald Rapids class)",
        "bf16-mixed", 1.84,
        "35M, 200 proteins, 2 interleaved rounds; docs/benchmarks.md, \"int8 on VNNI CPUs\"",
        {"int8-mixed": ("not faster than bf16-mixed on this class (1.36-1.65x fp32 quiet against bf16-mixed's 1.84x) "
                        "and 0.52x fp32 on a loaded node (docs/benchmarks.md, \"CPU contention\")"),
         **dict.fromkeys(FP16_POLICIES, _AMX_FP16)}),
    ClassAdvice(
        "avx512_bf16", "`avx512_bf16`, no AMX", "Zen 4 / Zen 5 EPYC, Cooper Lake", "bf16-mixed", 1.70,
        "650M shape, 16 proteins, Zen 5; 1.27x at 35M (1.37x on Zen 4); docs/benchmarks.md, \"The users' model\"",
        {"int8-mixed": ("not faster than bf16-mixed at the 650M shape on this class (Zen 5: 21.5 against 21.1 s; "
                        "faster at 35M, 1.60x fp32 against 1.27x, and 150M) and further from fp32 (pooled cosine "
                        "0.99990 against 0.99998; docs/benchmarks.md, \"The users' model\")")}),
    ClassAdvice(
        "int8-dot", "x86 `avx512_vnni`/`avx_vnni`, no bf16",
        "Cascade/Ice Lake; measured as the AMX Xeon with `ATEN_CPU_CAPABILITY=avx512 ONEDNN_MAX_CPU_ISA=AVX512_CORE_VNNI "
        "MKL_ENABLE_INSTRUCTIONS=AVX512_E1 FBGEMM_ENABLE_INSTRUCTIONS=AVX512_E1` (emulated)",
        "int8-mixed", 1.36,
        "emulated, 35M, 200 proteins, 2 rounds; bf16-mixed 0.37x, fp16 0.16x on 60 records"),
    ClassAdvice(
        "arm-int8-dot", "ARM `asimddp`/`i8mm`, no bf16", "Graviton 2, Ampere Altra", "fp32", None, "not measured here"),
    ClassAdvice(
        "avx2", "`avx2` only",
        "EPYC Rome/Milan; measured as the AMX Xeon with `ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 "
        "MKL_ENABLE_INSTRUCTIONS=AVX2 FBGEMM_ENABLE_INSTRUCTIONS=AVX2` (emulated)",
        "int8-mixed", 1.27,
        "emulated, rounds 1.36, 1.19; 1.09 in an earlier run; 7-bit weights; bf16-mixed 0.25x on the real AVX2 EPYC"),
    ClassAdvice("other", "none of the above", "-", "fp32", None, "not measured"),
)}


def advice_for(cpu: CpuFeatures) -> ClassAdvice:
    """The advice for ``cpu``'s class."""
    return ADVICE[cpu.cpu_class]


def fastest_policy(cpu: CpuFeatures) -> tuple[str, float | None]:
    """The policy advised on CPUs of ``cpu``'s class, and its measured factor against fp32."""
    advice = advice_for(cpu)
    return advice.advised, advice.factor


def _advised(advice: ClassAdvice) -> str:
    measured = f", {advice.factor:.2f}x fp32's speed as measured" if advice.factor else ""
    return f"{advice.advised}{measured}"


def cpu_note(policy: str, dtype: torch.dtype, cpu: CpuFeatures) -> str:
    """The warning for ``policy`` (computing in ``dtype``) on ``cpu`` ('' when none): emulated
    16-bit arithmetic, or a policy the table measured not worth it on this class; it names
    the advised policy."""
    advice = advice_for(cpu)
    if dtype in SIXTEEN_BIT and not cpu.native(dtype):
        low = "fp16" if dtype == torch.float16 else "bf16"
        return (f"precision {policy!r} on a CPU without native {low} arithmetic (no {' or '.join(NATIVE[dtype][:2])}) "
                f"is emulated and slower than fp32; the fastest policy on this CPU ({cpu.cpu_class}) is "
                f"{_advised(advice)} ({WHERE})")
    why = advice.not_advised.get(policy)
    if why is None or policy == advice.advised:
        return ""
    return (f"precision {policy!r} on this CPU ({cpu.cpu_class}) is {why}; the fastest policy on this CPU "
            f"({cpu.cpu_class}) is {_advised(advice)} ({WHERE})")


def cpu_choice(cpu: CpuFeatures) -> tuple[str, str]:
    """``--precision auto`` on the CPU: the advised policy and why, in words."""
    advice = advice_for(cpu)
    measured = f"measured {advice.factor:.2f}x fp32's speed" if advice.factor else "none measured faster"
    return advice.advised, (f"CPU class {cpu.cpu_class} (flags: {cpu.named()}): {advice.advised} advised, "
                            f"{measured} ({advice.measured})")


#: ``--precision auto`` on CUDA, by compute capability (the thresholds of runtime/precision.py's
#: CUDA_CAPABILITY: native bf16 from 8.0, fp16 from 5.3)
CUDA_CHOICES = (((8, 0), "bf16-mixed", "native bf16 (compute capability 8.0 and up)"),
                ((5, 3), "fp16-mixed", "native fp16 but no native bf16 (compute capability 5.3 to 7.x)"),
                ((0, 0), "fp32", "no native 16-bit arithmetic (compute capability below 5.3)"))


def cuda_choice(name: str, capability: tuple[int, int]) -> tuple[str, str]:
    """``--precision auto`` on a GPU called ``name``: its policy and why."""
    for need, policy, why in CUDA_CHOICES:
        if capability >= need:
            return policy, f"{name}, compute capability {capability[0]}.{capability[1]}: {why}"
    raise AssertionError("unreachable: the last threshold is 0.0")


def markdown_table() -> str:
    """The table docs/precision.md shows ("Which policy on which CPU"), made from :data:`ADVICE`."""
    lines = ["| CPU class (flags that decide) | example | advised policy | x fp32 wall time | not advised there |",
             "| --- | --- | --- | --- | --- |"]
    for advice in ADVICE.values():
        factor = f"{advice.factor:.2f} ({advice.measured})" if advice.factor else advice.measured
        grouped: dict[str, list[str]] = {}
        for name, why in advice.not_advised.items():
            grouped.setdefault(why, []).append(f"`{name}`")
        others = "; ".join(f"{', '.join(names)}: {why}" for why, names in grouped.items()) or "-"
        lines.append(f"| `{advice.cpu_class}` ({advice.flags}) | {advice.example} | `{advice.advised}` | {factor} | {others} |")
    return "\n".join(lines)
