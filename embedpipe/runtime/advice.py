"""The precision table, read once from ``embedpipe/data/auto_precision_table.json`` and checked,
and the warnings it gives for a named policy on the CPU (docs/precision.md, "Which policy on
which CPU"; the measurements are docs/benchmarks.md's).

Why data: the table is measurements, not logic; ``--precision auto``'s choice without a
measurement (:mod:`embedpipe.extraction.auto_precision`, the one module of that decision), the CPU
warnings ``embed`` prints (:meth:`embedpipe.runtime.precision.Policy.check_device`, here in
``runtime`` because a policy's device check reads it) and the table docs/precision.md shows
(``tests/runtime/test_advice.py`` keeps the doc equal to :func:`markdown_table`) all read this
one file. Each row says the real CPU it was measured on (``basis``); a row measured only by
emulating a class on another CPU, or not at all, says so, is never auto's prior (fp32 is) and
its warnings recommend no policy: emulation reproduces an instruction set, not the kernels
PyTorch dispatches on the real part (on a real AVX2 EPYC the emulated advice ran >10x slower
than fp32).
"""

from __future__ import annotations

import json
from collections.abc import Set
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from embedpipe.core.errors import EmbedpipeError
from embedpipe.core.options import POLICY_NAMES
from embedpipe.runtime.cpu_features import NATIVE, SIXTEEN_BIT, CpuFeatures

#: the table, shipped with the package (pyproject.toml's package data)
TABLE = Path(__file__).resolve().parents[1] / "data" / "auto_precision_table.json"
#: where the measurements are
WHERE = 'docs/precision.md, "Which policy on which CPU"'
#: how a row was measured: on a real CPU of the class (named in ``measured``), by emulation, or not
REAL, EMULATED, NOT_MEASURED = "measured on a real CPU of this class", "emulated only", "not measured"
#: the file's word for each
BASES = {"real": REAL, "emulated": EMULATED, "none": NOT_MEASURED}
#: what a warning says instead of a policy where the table has no real measurement, or always
MEASURE = "--precision auto measures the policies on the node itself"


@dataclass(frozen=True)
class ClassAdvice:
    """One CPU class: the policy advised there, its measured speed against fp32 (fp32's wall
    time over its own, None where not measured), how and on which CPU that was measured
    (``basis``), the policies measured not worth it there with why, and the parameter count of
    the model shape ``factor`` was measured on (``model_params``; None where not measured)."""

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


def _fields(row: Any, where: str, required: Set[str], optional: Set[str] = frozenset()) -> dict[str, Any]:
    if not isinstance(row, dict) or not required <= set(row) <= required | optional:
        raise EmbedpipeError(f"{where}: needs the fields {', '.join(sorted(required))} "
                             f"(and may have {', '.join(sorted(optional)) or 'no others'})")
    return row


def _policy(name: Any, where: str) -> str:
    if name not in POLICY_NAMES:
        raise EmbedpipeError(f"{where}: {name!r} is not a precision policy ({', '.join(POLICY_NAMES)})")
    return str(name)


def _cpu_row(row: Any, where: str) -> ClassAdvice:
    row = _fields(row, where, {"class", "flags", "example", "advised", "measured", "basis"},
                  {"factor", "model_params", "not_advised"})
    if row["basis"] not in BASES or any(not isinstance(row[k], str) for k in ("class", "flags", "example", "measured")):
        raise EmbedpipeError(f"{where}: basis must be one of {', '.join(BASES)}, and the texts strings")
    factor, params = row.get("factor"), row.get("model_params")
    if (factor is None) != (params is None) or (factor is not None and not (
            isinstance(factor, (int, float)) and factor > 0 and isinstance(params, int) and params > 0)):
        raise EmbedpipeError(f"{where}: factor (a positive number) and model_params (a positive count) "
                             "come together, where measured")
    not_advised: dict[str, str] = {}
    for i, group in enumerate(row.get("not_advised", [])):
        group = _fields(group, f"{where} not_advised {i + 1}", {"policies", "why"})
        for name in group["policies"]:
            not_advised[_policy(name, where)] = str(group["why"])
    return ClassAdvice(row["class"], row["flags"], row["example"], _policy(row["advised"], where),
                       None if factor is None else float(factor),
                       row["measured"], BASES[row["basis"]], not_advised, params)


def _cuda_row(row: Any, where: str) -> tuple[tuple[int, int], str, str]:
    row = _fields(row, where, {"capability", "policy", "why"})
    need = row["capability"]
    if not (isinstance(need, list) and len(need) == 2 and all(isinstance(n, int) for n in need)):
        raise EmbedpipeError(f"{where}: capability must be [major, minor]")
    return (need[0], need[1]), _policy(row["policy"], where), str(row["why"])


def read_table(path: Path = TABLE) -> tuple[dict[str, ClassAdvice], tuple[tuple[tuple[int, int], str, str], ...]]:
    """The CPU rows by class and the CUDA thresholds (highest first, down to 0.0) of ``path``;
    one line naming the file and the row for anything malformed."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise EmbedpipeError(f"{path}: cannot read the precision table ({str(exc).splitlines()[0]})") from None
    data = _fields(data, str(path), {"cpu", "cuda"}, {"about"})
    rows = [_cpu_row(row, f"{path}: cpu row {i + 1}") for i, row in enumerate(data["cpu"])]
    table = {row.cpu_class: row for row in rows}
    cuda = tuple(_cuda_row(row, f"{path}: cuda row {i + 1}") for i, row in enumerate(data["cuda"]))
    if len(table) != len(rows) or "other" not in table:
        raise EmbedpipeError(f"{path}: needs one cpu row per class, `other` among them")
    if not cuda or cuda[-1][0] != (0, 0) or list(cuda) != sorted(cuda, reverse=True):
        raise EmbedpipeError(f"{path}: the cuda rows must go from the highest capability down to [0, 0]")
    return table, cuda


#: the advice per CPU class (:attr:`CpuFeatures.cpu_class`) and ``auto`` on CUDA by compute
#: capability: (capability, policy, why), read once
ADVICE, CUDA_CHOICES = read_table()


def advice_for(cpu: CpuFeatures) -> ClassAdvice:
    """The advice for ``cpu``'s class."""
    return ADVICE[cpu.cpu_class]


def fastest_policy(cpu: CpuFeatures) -> tuple[str, float | None]:
    """The policy advised on CPUs of ``cpu``'s class, and its measured factor against fp32;
    fp32 (no factor) where the row was not measured on a real CPU of the class."""
    advice = advice_for(cpu)
    return (advice.advised, advice.factor) if advice.trusted else ("fp32", None)


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
