"""Which precision policy to expect on which hardware: the one advice table (docs/precision.md,
"Which policy on which CPU"), from the measurements in docs/benchmarks.md. A prior, not the
decision: ``--precision auto`` measures the policies on the node itself
(:mod:`embedpipe.runtime.auto_precision`); a job too small to pay for measuring takes a row of
this table only where it was measured on a real CPU of the class at a similar model size
(``model_params``), else fp32.

Why one table: the CPU warnings ``embed`` prints, auto's prior and the table in
docs/precision.md all read it (``tests/runtime/test_advice.py`` keeps the doc equal to
:func:`markdown_table`). Each row says the real CPU it was measured on (``basis``); a row
measured only by emulating a class on another CPU, or not at all, says so, is never auto's
prior (fp32 is) and its warnings recommend no policy: emulation reproduces an instruction set,
not the kernels PyTorch dispatches on the real part (on a real AVX2 EPYC the emulated advice
ran >10x slower than fp32).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from embedpipe.runtime.cpu_features import NATIVE, SIXTEEN_BIT, CpuFeatures

#: where the measurements are
WHERE = 'docs/precision.md, "Which policy on which CPU"'
FP16_POLICIES = ("fp16", "amp-fp16", "fp16-mixed")


#: how a row was measured: on a real CPU of the class (named in ``measured``), by emulation, or not
REAL, EMULATED, NOT_MEASURED = "measured on a real CPU of this class", "emulated only", "not measured"


@dataclass(frozen=True)
class ClassAdvice:
    """One CPU class: the policy advised there, its measured speed against fp32 (fp32's wall
    time over its own, None where not measured), how and on which CPU that was measured
    (``basis``: :data:`REAL`, :data:`EMULATED` or :data:`NOT_MEASURED`), the policies
    measured not worth it there with why (what the warnings say), and the parameter count of
    the model shape ``factor`` was measured on (``model_params``; None where not measured):
    ``--precision auto`` takes the row for a job too small to measure only at a similar size."""

    cpu_class: str
    flags: str
    example: str
    advised: str
    factor: float | None
    measured: str
    basis: str = REAL
    not_advised: dict[str, str] = field(default_factory=dict)
    model_params: int | None = None

    @property
    def trusted(self) -> bool:
        """Whether the row was measured on a real CPU of its class (else it advises nothing)."""
        return self.basis == REAL


#: the parameter counts of the model shapes the rows were measured on, as the models are named
#: (ESM-2 35M: 12 layers x 480, of which embedpipe holds 33.5M fp32 weights; 650M: 33 layers x 1280);
#: "similar" is a factor of 4 (auto_precision.SIMILAR_SIZE), far coarser than the naming
ESM2_35M, ESM2_650M = 35_000_000, 650_000_000

_AMX_FP16 = ("no faster than fp32 on this class despite avx512_fp16 (fp16 1.05x fp32's speed; its GEMM peak "
             "142 against fp32's 139 GFLOP/s: docs/benchmarks.md, \"The peers on the AMX Xeon\")")

#: the advice per CPU class (:attr:`CpuFeatures.cpu_class`), from docs/benchmarks.md
ADVICE: dict[str, ClassAdvice] = {a.cpu_class: a for a in (
    ClassAdvice(
        "amx", "`amx_bf16`, `amx_int8`, `avx512_fp16`", "Sapphire/Emerald Rapids Xeon",
        "bf16-mixed", 1.84,
        "a real 2-vCPU Sapphire/Emerald Rapids Xeon, 35M, 200 proteins, 2 interleaved rounds; "
        "docs/benchmarks.md, \"int8 on VNNI CPUs\"", REAL,
        {"int8-mixed": ("not faster than bf16-mixed on this class (1.36-1.65x fp32 quiet against bf16-mixed's 1.84x) "
                        "and 0.52x fp32 on a loaded node (docs/benchmarks.md, \"CPU contention on the AMX Xeon\")"),
         **dict.fromkeys(FP16_POLICIES, _AMX_FP16)}, ESM2_35M),
    ClassAdvice(
        "avx512_bf16", "`avx512_bf16`, no AMX", "Zen 4 / Zen 5 EPYC, Cooper Lake", "bf16-mixed", 1.70,
        "a real Zen 5 EPYC, 650M shape, 16 proteins (1.27x at 35M); docs/benchmarks.md, \"The users' model\"", REAL,
        {"int8-mixed": ("not faster than bf16-mixed at the 650M shape on a Zen 5 EPYC (21.5 against 21.1 s; "
                        "faster at 35M and 150M) and further from fp32 (pooled cosine 0.99990 against 0.99998; "
                        "docs/benchmarks.md, \"The users' model\")")}, ESM2_650M),
    ClassAdvice(
        "int8-dot", "x86 `avx512_vnni`/`avx_vnni`, no bf16", "Cascade/Ice Lake Xeon",
        "int8-mixed", 1.36,
        "emulated on an AMX Xeon (ISA caps), 35M, 200 proteins; never on a real CPU of this class", EMULATED,
        model_params=ESM2_35M),
    ClassAdvice(
        "arm-int8-dot", "ARM `asimddp`/`i8mm`, no bf16", "Graviton 2, Ampere Altra", "fp32", None,
        "not measured", NOT_MEASURED),
    ClassAdvice(
        "avx2", "`avx2` only", "EPYC Rome/Milan (Zen 2/3), Haswell-Skylake client", "int8-mixed", 1.57,
        "a real AVX2-only AMD EPYC (Zen 3), 12 x 480 ESM-2, 105 proteins, oneDNN's 7-bit int8 kernels "
        "(int8-mixed 19.4 s against fp32's 30.4 s; bf16-mixed 0.25x fp32 there: bf16 is emulated); "
        "docs/benchmarks.md, \"AVX2-only EPYC\"", REAL,
        {name: ("emulated through fp32 on this class (bf16-mixed ran 0.25x fp32's speed on a real AVX2 EPYC; "
                "docs/benchmarks.md, \"AVX2-only EPYC\")") for name in ("bf16-mixed", "fp16-mixed")}, ESM2_35M),
    ClassAdvice("other", "none of the above", "-", "fp32", None, "not measured", NOT_MEASURED),
)}


def advice_for(cpu: CpuFeatures) -> ClassAdvice:
    """The advice for ``cpu``'s class."""
    return ADVICE[cpu.cpu_class]


def fastest_policy(cpu: CpuFeatures) -> tuple[str, float | None]:
    """The policy advised on CPUs of ``cpu``'s class, and its measured factor against fp32;
    fp32 (no factor) where the row was not measured on a real CPU of the class."""
    advice = advice_for(cpu)
    return (advice.advised, advice.factor) if advice.trusted else ("fp32", None)


#: what a warning says instead of a policy where the table has no real measurement, or always
MEASURE = "--precision auto measures the policies on the node itself"


def _advised(advice: ClassAdvice) -> str:
    if not advice.trusted:
        return f"not known from a real measurement ({advice.basis}): {MEASURE}"
    measured = f", {advice.factor:.2f}x fp32's speed on {advice.measured.split(',')[0]}" if advice.factor else ""
    return f"{advice.advised}{measured}; {MEASURE}"


def cpu_note(policy: str, dtype: torch.dtype, cpu: CpuFeatures) -> str:
    """The warning for ``policy`` (computing in ``dtype``) on ``cpu`` ('' when none): emulated
    16-bit arithmetic, or a policy the table measured not worth it on this class; it names
    the advised policy."""
    advice = advice_for(cpu)
    if dtype in SIXTEEN_BIT and not cpu.native(dtype):
        low = "fp16" if dtype == torch.float16 else "bf16"
        return (f"precision {policy!r} on a CPU without native {low} arithmetic (no {' or '.join(NATIVE[dtype][:2])}) "
                f"is emulated and slower than fp32; the policy advised on this CPU class ({cpu.cpu_class}) is "
                f"{_advised(advice)} ({WHERE})")
    why = advice.not_advised.get(policy)
    if why is None or policy == advice.advised or not advice.trusted:
        return ""
    return (f"precision {policy!r} on this CPU ({cpu.cpu_class}) is {why}; the policy advised on this CPU class "
            f"({cpu.cpu_class}) is {_advised(advice)} ({WHERE})")


def size_words(params: int) -> str:
    """A parameter count in words: ``35M``, ``31k``, ``1.2B``."""
    if params >= 10**9:
        return f"{params / 1e9:.1f}B"
    return f"{params / 1e6:.0f}M" if params >= 10**6 else f"{params / 1e3:.0f}k"


def similar_size(a: int, b: int, factor: float) -> bool:
    """Whether parameter counts ``a`` and ``b`` are within ``factor`` of each other (either way)."""
    return a > 0 and b > 0 and max(a, b) <= factor * min(a, b)


def cpu_choice(cpu: CpuFeatures, *, params: int | None = None, similar: float = 4.0,
               measure: str = "--auto-measure always") -> tuple[str, str]:
    """``--precision auto``'s choice on the CPU without a measurement, and why, in words: the
    advised policy of ``cpu``'s class only where its row was measured on a real CPU of the
    class at a model size ``similar`` to ``params`` (within that factor; None: the model's size
    not known), else fp32 (``measure``: how to measure regardless)."""
    advice = advice_for(cpu)
    where = f"CPU class {cpu.cpu_class} (flags: {cpu.named()})"
    if not advice.trusted:
        return "fp32", (f"the table has no row measured on this CPU class: {where}: its row is {advice.basis} "
                        f"({advice.measured}), so fp32; {measure} measures regardless")
    at = size_words(advice.model_params) if advice.model_params else "an unrecorded size"
    if params is None or advice.model_params is None or not similar_size(params, advice.model_params, similar):
        this = "this model's size is not known here" if params is None else f"this model has {size_words(params)}"
        return "fp32", (f"the table has no row for this CPU class at this model size: {where} was measured at "
                        f"{at} parameters, {this} (similar: within {similar:g}x), so fp32; {measure} "
                        "measures regardless")
    measured = f"{advice.factor:.2f}x fp32's speed" if advice.factor else "none measured faster"
    return advice.advised, (f"the table's row for this CPU class at a similar model size: {where}: "
                            f"{advice.advised}, {measured} at {at} parameters (this model {size_words(params)}), "
                            f"on {advice.measured}")


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
    lines = ["| CPU class (flags that decide) | example | measured how | advised policy | x fp32 wall time | "
             "model size measured | not advised there |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for advice in ADVICE.values():
        factor = f"{advice.factor:.2f} ({advice.measured})" if advice.factor else advice.measured
        size = f"{size_words(advice.model_params)} parameters" if advice.model_params else "-"
        grouped: dict[str, list[str]] = {}
        for name, why in advice.not_advised.items():
            grouped.setdefault(why, []).append(f"`{name}`")
        others = "; ".join(f"{', '.join(names)}: {why}" for why, names in grouped.items()) or "-"
        advised = f"`{advice.advised}`" if advice.trusted else f"none (auto's prior: `fp32`; `{advice.advised}` emulated)"
        if advice.basis == NOT_MEASURED:
            advised = "none (auto's prior: `fp32`)"
        lines.append(f"| `{advice.cpu_class}` ({advice.flags}) | {advice.example} | {advice.basis} | {advised} | "
                     f"{factor} | {size} | {others} |")
    return "\n".join(lines)
