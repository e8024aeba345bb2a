"""``--precision auto``: the policy measured fastest and trustworthy on the hardware the job
runs on, chosen when the job starts (docs/precision.md, "precision: auto").

Why at job start: the workflow parses its config on a login node, whose CPU need not be the
compute node's; each embed job resolves ``auto`` on its own node (the CPU's flags through
:mod:`embedpipe.runtime.advice`, a GPU's compute capability), and the store records both the
request and the choice (``precision_requested``, ``precision_reason``; ``precision_policy`` is
the policy that ran, so readers need not know about ``auto``).
"""

from __future__ import annotations

import dataclasses

import torch

from embedpipe.core.devices import resolve_device
from embedpipe.core.errors import EmbedpipeError
from embedpipe.core.options import AUTO, EmbedOptions
from embedpipe.core.progress import say
from embedpipe.runtime import advice, cpu_features


def choose(device: torch.device, cpu: cpu_features.CpuFeatures | None = None) -> tuple[str, str]:
    """(policy, why) for ``device``: a GPU by its compute capability, the CPU by its class."""
    if device.type == "cuda":
        return advice.cuda_choice(torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device))
    if device.type == "cpu":
        return advice.cpu_choice(cpu or cpu_features.detect())
    return "fp32", f"{device.type}: no measured advice for this device"


def resolve(options: EmbedOptions, quiet: bool = False,
            cpu: cpu_features.CpuFeatures | None = None) -> tuple[EmbedOptions, dict[str, str]]:
    """``options`` checked, with ``precision: auto`` replaced by the policy chosen here, and the
    root attributes that record it (none when a policy was named). A choice the other options
    exclude (``--attention fair-esm`` with a mixed policy) is refused in one line naming both."""
    options.validate()
    if options.precision != AUTO:
        return options, {}
    policy, why = choose(resolve_device(options.device), cpu)
    chosen = dataclasses.replace(options, precision=policy)
    try:
        chosen.validate()
    except EmbedpipeError as exc:
        raise EmbedpipeError(f"--precision auto chose {policy} on this machine ({why}), but {exc}; "
                             "name a policy with --precision") from None
    reason = f"auto -> {policy}: {why}"
    say(f"precision {reason}", quiet=quiet)
    return chosen, {"precision_requested": AUTO, "precision_reason": reason}
