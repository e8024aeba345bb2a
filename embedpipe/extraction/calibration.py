"""The calibration step of a freshly prepared runner (``--int8-smoothing smoothquant``).

Why here, through the :class:`~embedpipe.model.base.Runner` interface: it works for every
model family and batch layout alike. The policy's linear layers are made in their calibrating
state (:class:`embedpipe.runtime.int8_smoothing.CalibratingLinear`: exact fp32, recording each
input channel's absmax) while the family prepares its runner; each calibration record then runs
alone (no padding rows in the absmax), in true fp32, and every layer is quantized with its
factors. The set is fixed, not the run's first batch, so a store's numbers never depend on
which records came first (docs/precision.md, "int8-mixed").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from embedpipe.core.errors import EmbedpipeError
from embedpipe.core.options import EmbedOptions
from embedpipe.model.base import EmbeddingModel, Runner
from embedpipe.runtime import int8_smoothing
from embedpipe.runtime.int8_policy import Int8MixedPolicy
from embedpipe.runtime.precision import Policy, forward_context, get_policy, true_fp32_matmuls


def configured_policy(options: EmbedOptions) -> Policy:
    """``--precision``'s policy; with ``--int8-smoothing smoothquant`` a copy of it that carries
    its calibration set (read now: a bad file is a one-line error before anything runs)."""
    policy = get_policy(options.precision)
    if options.int8_smoothing == "none":
        return policy
    if not isinstance(policy, Int8MixedPolicy):  # EmbedOptions.validate refuses the combination first
        raise EmbedpipeError(f"--int8-smoothing {options.int8_smoothing} needs --precision int8-mixed, "
                             f"not {options.precision}")
    return dataclasses.replace(policy, calibration=int8_smoothing.load_calibration(options.int8_calibration))


def prepare_calibrated(loaded: EmbeddingModel, policy: Policy, device: torch.device,
                       prepare: Callable[[], Runner]) -> Runner:
    """``prepare()``'s runner, calibrated on the policy's calibration records when it has any."""
    records = policy.calibration_records()
    if not records:
        return prepare()
    with int8_smoothing.collecting() as layers:
        runner = prepare()
    with true_fp32_matmuls(), forward_context(policy, device):
        for _, sequence in records:  # alone, within the trained window: what the model sees
            runner(loaded.tokenize([sequence[: loaded.trained_window]]).to(device), [])
    for layer in layers:
        layer.finish()
    return runner
