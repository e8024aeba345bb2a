"""What this CPU computes natively, and the advice that follows from it (docs/precision.md,
"Which policy on which CPU").

Why: most CPU nodes (AMD EPYC Rome/Milan, many Intel nodes) have AVX2 only, where bf16 and
fp16 arithmetic is emulated through fp32 and several times slower than fp32 itself; a
16-bit policy there is the slowest choice. Native 16-bit arithmetic is AVX512-BF16/AMX-BF16
(bf16) and AVX512-FP16/AMX-FP16 (fp16) on x86, the ``bf16`` and ``fphp``/``asimdhp``
features on ARM (Apple silicon: ``hw.optional.arm.FEAT_BF16``/``FEAT_FP16``).
"""

from __future__ import annotations

import functools
import os
import platform
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import torch

SIXTEEN_BIT = (torch.float16, torch.bfloat16)

#: flags that mean native arithmetic in each dtype (x86 and ARM names, as /proc/cpuinfo spells them)
NATIVE = {
    torch.bfloat16: ("avx512_bf16", "amx_bf16", "bf16"),
    torch.float16: ("avx512_fp16", "amx_fp16", "fphp", "asimdhp"),
}
#: flags of fast int8 dot products (VNNI, AMX-INT8, ARM dot product / i8mm)
INT8_DOT = ("amx_int8", "avx512_vnni", "avx_vnni", "asimddp", "i8mm")
#: the x86 ones among them (oneDNN's VNNI kernels, measured); ARM's are a class of their own
X86_INT8_DOT = ("amx_int8", "avx512_vnni", "avx_vnni")

#: The fastest policy per CPU class, and its measured wall time against fp32 (fp32 time /
#: its time; docs/precision.md, "Which policy on which CPU"; None where not measured).
#: amx: 2-vCPU Xeon (AMX, AVX512-BF16/FP16), 35M shape, 200 proteins, median of 2 interleaved
#: rounds (42.0 s / 22.8 s; int8-mixed 25.5 s; docs/benchmarks.md, "int8 on VNNI CPUs");
#: avx512_bf16: Zen 4 EPYC, 35M shape (18.2 s / 13.3 s); int8-dot: the same Xeon with torch,
#: oneDNN, MKL and fbgemm capped to AVX512-VNNI (emulated Cascade/Ice Lake: 40.7 s / 30.0 s;
#: bf16-mixed 0.37x and fp16 0.16x there; capped to AVX2 + AVX-VNNI 1.75x); avx2: capped to
#: AVX2 (emulated, not an EPYC: 59.7 s / 47.0 s; bf16-mixed and fp16 4x slower than fp32 there,
#: as on the AVX2-only EPYC);
#: arm-int8-dot (ARM dot product, no bf16): not measured
FASTEST: dict[str, tuple[str, float | None]] = {
    "amx": ("bf16-mixed", 1.84),
    "avx512_bf16": ("bf16-mixed", 1.37),
    "int8-dot": ("int8-mixed", 1.36),
    "arm-int8-dot": ("fp32", None),
    "avx2": ("int8-mixed", 1.27),
    "other": ("fp32", None),
}


@dataclass(frozen=True)
class CpuFeatures:
    """The CPU's feature flags (lower case) and torch's own answer for its kernels."""

    flags: frozenset[str] = field(default_factory=frozenset)
    torch_capability: str = ""  # torch.backends.cpu.get_cpu_capability(): DEFAULT, AVX2, AVX512, ...
    machine: str = ""

    def native(self, dtype: torch.dtype) -> bool:
        """Whether arithmetic in ``dtype`` (bf16 or fp16) runs natively, not emulated."""
        return any(flag in self.flags for flag in NATIVE.get(dtype, ()))

    @property
    def native_fp16(self) -> bool:
        return self.native(torch.float16)

    @property
    def native_bf16(self) -> bool:
        return self.native(torch.bfloat16)

    @property
    def cpu_class(self) -> str:
        """amx, avx512_bf16, int8-dot (x86 VNNI without bf16), arm-int8-dot, avx2, or other."""
        if "amx_bf16" in self.flags:
            return "amx"
        if "avx512_bf16" in self.flags:
            return "avx512_bf16"
        if any(flag in self.flags for flag in X86_INT8_DOT):
            return "int8-dot"
        if any(flag in self.flags for flag in INT8_DOT):
            return "arm-int8-dot"
        if "avx2" in self.flags:
            return "avx2"
        return "other"

    def named(self) -> str:
        """The flags that decided, for messages and the benchmark tables."""
        shown = [f for f in (*NATIVE[torch.bfloat16], *NATIVE[torch.float16], *INT8_DOT, "avx512f", "avx2")
                 if f in self.flags]
        return " ".join(shown) or "none of avx2, avx512, vnni, amx, bf16, fp16"


def _proc_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):  # x86, ARM
            return set(value.lower().split())
    return set()


def _apple_flags() -> set[str]:
    """Apple silicon: sysctl's FEAT_BF16 / FEAT_FP16 as the ARM flag names."""
    found = set()
    for feat, flag in (("FEAT_BF16", "bf16"), ("FEAT_FP16", "fphp"), ("FEAT_DotProd", "asimddp")):
        try:
            out = subprocess.run(["sysctl", "-n", f"hw.optional.arm.{feat}"], capture_output=True,
                                 text=True, timeout=5, check=False).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            continue
        if out == "1":
            found.add(flag)
    return found


@functools.lru_cache(maxsize=1)
def detect() -> CpuFeatures:
    """This machine's features, read once per process."""
    flags = _proc_flags()
    if platform.system() == "Darwin" and platform.machine() == "arm64":
        flags |= _apple_flags()
    try:
        capability = str(torch.backends.cpu.get_cpu_capability())
    except (AttributeError, RuntimeError):
        capability = ""
    return CpuFeatures(frozenset(flags), capability, platform.machine())


#: environment variables that cap the instruction sets torch's kernels use (how docs/benchmarks.md
#: emulates AVX2-only and VNNI-only CPUs on a newer one)
ISA_CAPS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "FBGEMM_ENABLE_INSTRUCTIONS")


def isa_caps() -> str:
    """The caps in effect, as ``NAME=value`` words ('' when none): the flags alone would not say
    that a table was measured with the kernels of an older CPU."""
    return " ".join(f"{name}={os.environ[name]}" for name in ISA_CAPS if os.environ.get(name))


def fastest_policy(cpu: CpuFeatures) -> tuple[str, float | None]:
    """The policy measured fastest on CPUs of ``cpu``'s class, and its factor against fp32."""
    return FASTEST[cpu.cpu_class]


def emulation_note(policy: str, dtype: torch.dtype, cpu: CpuFeatures) -> str:
    """The warning for ``policy`` computing in ``dtype`` on a CPU without native ``dtype``
    arithmetic ('' when the CPU has it): it names the fastest policy on this CPU."""
    if cpu.native(dtype):
        return ""
    low = "fp16" if dtype == torch.float16 else "bf16"
    best, factor = fastest_policy(cpu)
    measured = f", {factor:.2f}x fp32's speed as measured" if factor else ""
    return (f"precision {policy!r} on a CPU without native {low} arithmetic (no {' or '.join(NATIVE[dtype][:2])}) "
            f"is emulated and slower than fp32; the fastest policy on this CPU ({cpu.cpu_class}) is "
            f"{best}{measured} (docs/precision.md, \"Which policy on which CPU\")")
