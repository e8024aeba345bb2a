"""What this CPU computes natively: its flags and class; the advice per class is
:mod:`embedpipe.runtime.advice` (docs/precision.md, "Which policy on which CPU").

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
