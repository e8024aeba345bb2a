"""The embed options resolved once per job into one frozen :class:`ResolvedRun`.

Why one object: the precision policy (int8-mixed smoothing: a copy carrying its calibration
set), what the ``auto`` options resolve to on the job's device (the q/k/v dtype, the batch
layout, the attention kernel: ``computed_as``), the stored layers and poolings and the store's
identity used to be worked out again by the engine, the preparation, ``--reuse``'s prediction
and the provenance. :func:`resolve_run` decides them once; the engine
(:mod:`embedpipe.embed.engine`), the preparation, the budget, the job
(:mod:`embedpipe.embed.job`: the loaded run and the one predicted for ``--reuse`` go through the
same function) and the provenance read them (docs/architecture.md, "The embed run").

Plain values in (the options, a device, the model's layer count, whether its family packs
batches, the model's identity), so a check outside the embed run can call it too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from embedpipe.core.errors import EmbedpipeError
from embedpipe.core.options import AUTO, EmbedOptions
from embedpipe.embed.calibration import configured_policy
from embedpipe.embed.identity import embed_identity
from embedpipe.model.identity import ModelIdentity
from embedpipe.model.layers import resolve_layers
from embedpipe.runtime import attention as attention_choice
from embedpipe.runtime.auto_precision import AutoChoice
from embedpipe.runtime.fused import decide_compile
from embedpipe.runtime.int8_policy import Int8MixedPolicy
from embedpipe.runtime.int8_smoothing import Calibration
from embedpipe.runtime.platform import describe as describe_platform
from embedpipe.runtime.precision import Policy, attention_dtype, dtype_name, resolve_attention_inputs
from embedpipe.store.format import stored_poolings


@dataclass(frozen=True)
class ResolvedRun:
    """Everything an embed job decided from its options, its device and its model."""

    options: EmbedOptions  # as given (a store's ``config`` keeps ``auto`` as given)
    policy: Policy  # the configured policy (int8-mixed smoothing: carrying its calibration set)
    calibration: Calibration | None  # the calibration set, read once (None: no smoothing)
    device: torch.device  # the job's device (for a prediction: the one --device resolves to)
    threads: int | None  # --threads (None: the CPUs the job owns, embedpipe/core/cpus.py)
    packs: bool  # the family has a packed runner
    attention_inputs: str  # --attention-inputs resolved on the device: fp32 or compute
    qkv_dtype: str  # dtype name of q/k/v at the main policy's attention kernel
    batch_layout: str  # packed or padded: the main policy's batches on the device
    attention_path: str  # the main policy's kernel as the store records it (docs/precision.md)
    layers: tuple[int, ...]  # the stored layers, non-negative, sorted
    pooling: tuple[str, ...]  # the poolings as stored: the mean always, then the rest
    model: ModelIdentity  # the model's part of the identity
    identity: str  # the store's ``embed_identity`` (embedpipe.embed.identity)
    compiled: bool = False  # --compile resolved: the main runner's elementwise work compiled
    compile_reason: str = ""  # why (auto's decision, embedpipe.runtime.fused.decide_compile)
    platform: str = ""  # what decides the numbers besides the options (embedpipe.runtime.platform)
    precision_requested: str = ""  # ``auto`` when the policy was chosen here ('' when named)
    precision_reason: str = ""  # what auto measured or read (embedpipe.embed.auto_probe)

    @property
    def precision_attrs(self) -> dict[str, str]:
        """Root attributes of a policy ``auto`` chose (docs/store-format.md); none for a named one."""
        if not self.precision_requested:
            return {}
        return {"precision_requested": self.precision_requested, "precision_reason": self.precision_reason}

    @property
    def computed_as(self) -> dict[str, str]:
        """What the ``auto`` options resolved to on the device, as the identity records it."""
        resolved = {"device_type": self.device.type, "batch_layout": self.batch_layout,
                    "attention_inputs": self.qkv_dtype}
        # only when compiled: an eager store's identity is what it was before --compile existed
        return resolved | ({"compiled": "true"} if self.compiled else {})

    def eager(self) -> ResolvedRun:
        """This run where ``--compile`` found no compiled path (the family, the policy or the
        device has none): eager, and its identity says so (the numbers are eager ones)."""
        return _identified(dataclasses.replace(self, compiled=False))

    def layout_for(self, policy: Policy, device: torch.device) -> str:
        """The batch layout of ``policy`` on ``device``: the run's own for its main policy on its
        device; for the fp32 fallback elsewhere (``--fallback-device``), decided for that device."""
        if not self.packs:  # no packed runner (T5); an explicit packed is refused by the engine
            return "padded"
        if policy.name == self.policy.name and device == self.device:
            return self.batch_layout
        return attention_choice.batch_layout(self.options, policy, device)


def resolve_threads(options: EmbedOptions) -> int | None:
    """The CPU threads a job asks for (``--threads``; None: the CPUs the job owns, counted by
    :func:`embedpipe.core.cpus.use_threads` when the model loads in :mod:`embedpipe.embed.job`),
    recorded in the run."""
    return options.threads


def resolve_policy(options: EmbedOptions) -> Policy:
    """The options checked and the policy configured (the calibration file read): what a job
    resolves before its device is claimed and its model loads, so a bad option or calibration
    file fails first. Hand the result to :func:`resolve_run` (``policy=``)."""
    options.validate()
    return configured_policy(options)


def resolve_run(options: EmbedOptions, device: torch.device, *, num_layers: int, packs: bool,
                model: ModelIdentity, policy: Policy | None = None, residues: int = 0,
                width: int | None = None, auto: AutoChoice | None = None) -> ResolvedRun:
    """``options`` resolved for ``device`` and a model of ``num_layers`` layers and ``width``
    (int8-mixed measures its weight range for it) whose family packs batches or not
    (``policy``: :func:`resolve_policy`'s, resolved now when None). ``auto``: the policy
    ``--precision auto`` chose on this job (embedpipe.embed.auto_probe), with why; without it
    the table's prior. ``residues``: the whole job's input (every shard, kept ones too, so a
    rerun resolves ``--compile auto`` as the first run did and keeps its stores)."""
    requested = ""
    if options.precision == AUTO:  # decided once, here: measured by the job, else the table's prior
        requested = AUTO
        auto = auto if auto is not None else AutoChoice.from_table(device)
        options, policy = dataclasses.replace(options, precision=auto.policy), None
        try:
            options.validate()
        except EmbedpipeError as exc:
            raise EmbedpipeError(f"--precision auto chose {auto.policy} on this machine, but {exc}; "
                                 "name a policy with --precision") from None
    policy = resolve_policy(options) if policy is None else policy
    if isinstance(policy, Int8MixedPolicy) and policy.kernels is None:
        if width is None:
            raise TypeError("resolve_run: int8-mixed needs the model's width to measure its weight range")
        policy = policy.for_width(width)
    inputs = resolve_attention_inputs(options.attention_inputs, device)
    layout = "padded" if not packs else attention_choice.batch_layout(options, policy, device)
    path = (f"padded-{options.attention}" if layout == "padded"
            else attention_choice.attention_path(options, policy, device))
    calibration = policy.calibration if isinstance(policy, Int8MixedPolicy) else None
    layers = tuple(resolve_layers(options.layers, num_layers))
    pooling = tuple(stored_poolings(options.pooling))
    run = ResolvedRun(options=options, policy=policy, calibration=calibration, device=device,
                      threads=resolve_threads(options), packs=packs, attention_inputs=inputs,
                      qkv_dtype=dtype_name(attention_dtype(policy, inputs)), batch_layout=layout,
                      attention_path=path, layers=layers, pooling=pooling, model=model, identity="")
    compiled, why = decide_compile(options.compile, policy.name, device.type, residues)
    return _identified(dataclasses.replace(run, compiled=compiled, compile_reason=why,
                                           platform=describe_platform(device), precision_requested=requested,
                                           precision_reason=auto.reason if requested and auto is not None else ""))


def _identified(run: ResolvedRun) -> ResolvedRun:
    """``run`` with its store identity (embedpipe.embed.identity) built from what it resolved."""
    calibration = run.calibration.sha256 if run.calibration is not None else None
    return dataclasses.replace(run, identity=embed_identity(
        run.options, run.policy, run.model, run.computed_as, run.layers, run.pooling,
        calibration=calibration, platform=run.platform))
