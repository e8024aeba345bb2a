"""The embed options resolved once per job into one frozen :class:`ResolvedRun`.

Why one object: the precision policy (int8-mixed smoothing: a copy carrying its calibration
set), what the ``auto`` options resolve to on the job's device (the q/k/v dtype, the batch
layout, the attention kernel: ``computed_as``; the token budget, the threads, where fallback
records run: :func:`resolve_fallback_device`), the stored layers and poolings and the store's
identity used to be worked out again by the engine, the preparation, ``--reuse``'s prediction
and the provenance. :func:`resolve_run` decides them once; the engine
(:mod:`embedpipe.extraction.engine`), the preparation, the budget, the job
(:mod:`embedpipe.extraction.job`: the loaded run and the one predicted for ``--reuse`` go through the
same function) and the provenance read them (docs/architecture.md, "The embed run").

Plain values in (the options, a device, the model's layer count, whether its family packs
batches, the model's identity), so a check outside the embed run can call it too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from embedpipe.core.cpus import CpuAllocation, thread_count
from embedpipe.core.errors import EmbedpipeError
from embedpipe.core.options import AUTO, EmbedOptions
from embedpipe.extraction.budget import fallback_weight_bytes, resolve_tokens_per_batch
from embedpipe.extraction.calibration import configured_policy
from embedpipe.extraction.identity import embed_identity
from embedpipe.model import capabilities
from embedpipe.model.base import EmbeddingModel
from embedpipe.model.identity import ModelIdentity
from embedpipe.model.layers import resolve_layers
from embedpipe.runtime import attention as attention_choice
from embedpipe.runtime import cuda, engine_override
from embedpipe.runtime.engine_override import EngineChoice
from embedpipe.runtime.int8_policy import Int8MixedPolicy
from embedpipe.runtime.int8_smoothing import Calibration
from embedpipe.runtime.platform import describe as describe_platform
from embedpipe.runtime.precision import Policy, attention_dtype, dtype_name, resolve_attention_inputs
from embedpipe.store.format import stored_poolings


@dataclass(frozen=True)
class AutoChoice:
    """What ``--precision auto`` resolved to on a job, and why (the store's ``precision_reason``):
    the answer of the job's ``measure`` (:mod:`embedpipe.extraction.auto_precision`, the one
    module of that decision), which :func:`resolve_run` records."""

    policy: str
    reason: str


#: ``--precision auto``'s decision, asked by :func:`resolve_run` with the options and the engine
#: choices it resolved (embedpipe.extraction.auto_precision through the job); None: nothing
#: measured or cached, so the run cannot be predicted (:class:`Unpredictable`)
Measure = Callable[[EmbedOptions, EngineChoice], "AutoChoice | None"]


class Unpredictable(Exception):
    """The run cannot be resolved without the loaded model (``--reuse``'s prediction: auto with no
    measurement cached on this node, int8-mixed without the model's width)."""


@dataclass(frozen=True)
class ResolvedRun:
    """Everything an embed job decided from its options, its device and its model."""

    options: EmbedOptions  # as given (a store's ``config`` keeps ``auto`` as given)
    policy: Policy  # the configured policy (int8-mixed smoothing: carrying its calibration set)
    calibration: Calibration | None  # the calibration set, read once (None: no smoothing)
    device: torch.device  # the job's device (for a prediction: the one --device resolves to)
    threads: CpuAllocation  # --threads, else the CPUs the job owns (embedpipe.core.cpus), counted once
    packs: bool  # the family has a packed runner
    engine: EngineChoice  # the engine choices as requested: derived, or EMBEDPIPE_ENGINE's
    attention: str  # the attention kernel (sdpa unless overridden)
    attention_inputs: str  # q/k/v inputs resolved on the device: fp32 or compute
    qkv_dtype: str  # dtype name of q/k/v at the main policy's attention kernel
    batch_layout: str  # packed or padded: the main policy's batches on the device
    attention_path: str  # the main policy's kernel as the store records it (docs/precision.md)
    fallback_device: str | None  # where fp32 fallback records run: same (the device) or cpu; None: predicted, no model
    layers: tuple[int, ...]  # the stored layers, non-negative, sorted
    pooling: tuple[str, ...]  # the poolings as stored: the mean always, then the rest
    model: ModelIdentity  # the model's part of the identity
    identity: str  # the store's ``embed_identity`` (embedpipe.extraction.identity)
    tokens_per_batch: int | None = None  # the batch budget (``auto`` sized here); None: predicted, no model
    platform: str = ""  # what decides the numbers besides the options (embedpipe.runtime.platform)
    precision_requested: str = ""  # ``auto`` when the policy was chosen here ('' when named)
    precision_reason: str = ""  # what auto measured or read (embedpipe.extraction.auto_precision)

    @property
    def precision_attrs(self) -> dict[str, str]:
        """Root attributes of a policy ``auto`` chose (docs/store-format.md); none for a named one."""
        if not self.precision_requested:
            return {}
        return {"precision_requested": self.precision_requested, "precision_reason": self.precision_reason}

    @property
    def fallback_derived(self) -> bool:
        """Whether the fallback device was derived (no override): the preparation may then still
        move the fp32 model to the CPU when the estimate was wrong and it runs out of memory."""
        return self.engine.fallback_device == AUTO

    @property
    def computed_as(self) -> dict[str, str]:
        """What the engine choices resolved to on the device, as the identity records it."""
        return {"device_type": self.device.type, "batch_layout": self.batch_layout, "attention_inputs": self.qkv_dtype}

    def layout_for(self, policy: Policy, device: torch.device) -> str:
        """The batch layout of ``policy`` on ``device``: the run's own for its main policy on its
        device; for the fp32 fallback elsewhere (the CPU), decided for that device."""
        if not self.packs:  # no packed runner (T5); a packed override is refused by the engine
            return "padded"
        if policy.name == self.policy.name and device == self.device:
            return self.batch_layout
        return attention_choice.batch_layout(self.engine, policy, device)


def resolve_threads(options: EmbedOptions) -> CpuAllocation:
    """The CPU threads a job runs with (``--threads``, else the CPUs it owns), counted once per job
    by :func:`embedpipe.core.cpus.thread_count` and recorded in the run."""
    return thread_count(options.threads)


def resolve_fallback_device(requested: str, policy: Policy, device: torch.device,
                            loaded: EmbeddingModel | None) -> str | None:
    """Where fp32 fallback records run, ``same`` (the job's device) or ``cpu``, decided here once:
    ``requested`` (the engine choice) when the override names one; derived (``auto``), the job's
    device unless it is a GPU where the fp32 fallback model does not fit beside ``policy``'s in
    the memory free now (docs/precision.md, "Where the fallback runs"). None: a prediction
    (``loaded`` None) that would need the model's size to say."""
    if requested != AUTO:
        return requested
    if device.type != "cuda":
        return "same"
    if loaded is None:
        return None
    extra = fallback_weight_bytes(loaded, policy)
    if extra == 0:
        return "same"  # no second model: the fallback runs the policy's own fp32 weights
    fits = loaded.estimate_memory(policy).weight_bytes + extra <= cuda.free_memory(device)
    return "same" if fits else "cpu"


def resolve_policy(options: EmbedOptions) -> Policy:
    """The named policy configured (the calibration file read): what a job resolves before its
    device is claimed and its model loads, so a bad calibration file fails first (the options
    are checked once before, by :func:`embedpipe.extraction.combinations.check_embed`). Hand the
    result to :func:`resolve_run` (``policy=``)."""
    return configured_policy(options)


def resolve_run(options: EmbedOptions, device: torch.device, *, num_layers: int, packs: bool,
                model: ModelIdentity, policy: Policy | None = None, width: int | None = None,
                measure: Measure | None = None, loaded: EmbeddingModel | None = None,
                threads: CpuAllocation | None = None, engine: EngineChoice | None = None) -> ResolvedRun:
    """``options`` resolved for ``device`` and a model of ``num_layers`` layers and ``width``
    (int8-mixed measures its weight range for it) whose family packs batches or not
    (``policy``: :func:`resolve_policy`'s, resolved now when None). ``--precision auto``: the
    job's ``measure`` (embedpipe.extraction.auto_precision), refused without one. ``loaded``: the
    model, to size ``--tokens-per-batch auto`` (None for a prediction). ``threads``: the job's
    count (:func:`resolve_threads`, counted now when None). ``engine``: the engine choices
    (attention kernel, batch layout, q/k/v inputs, fallback device), read from
    ``EMBEDPIPE_ENGINE`` when None (docs/precision.md, "Engine choices"); here only."""
    engine = engine_override.from_environment() if engine is None else engine
    requested, auto = "", None
    if options.precision == AUTO:  # decided once, here: by the job's measure
        requested = AUTO
        if measure is None:
            raise EmbedpipeError("--precision auto is decided by an embed job, on its node; name a policy here")
        auto = measure(options, engine)
        if auto is None:
            raise Unpredictable("--precision auto: nothing measured on this node yet")
        refusal = engine.refusal(auto.policy)
        if refusal:
            raise EmbedpipeError(f"--precision auto chose {auto.policy} on this machine, but {refusal}; "
                                 "name a policy with --precision")
        options, policy = dataclasses.replace(options, precision=auto.policy), None
    elif (refusal := engine.refusal(options.precision)) is not None:
        raise EmbedpipeError(refusal)
    policy = resolve_policy(options) if policy is None else policy
    if isinstance(policy, Int8MixedPolicy) and policy.kernels is None:
        if width is None:
            raise Unpredictable("int8-mixed measures its weight range for the model's width")
        policy = policy.for_width(width)
    inputs = resolve_attention_inputs(engine.attention_inputs, device)
    layout = "padded" if not packs else attention_choice.batch_layout(engine, policy, device)
    path = (f"padded-{engine.attention}" if layout == "padded"
            else attention_choice.attention_path(engine, policy, device))
    calibration = policy.calibration if isinstance(policy, Int8MixedPolicy) else None
    layers = tuple(resolve_layers(options.layers, num_layers))
    fallback = resolve_fallback_device(engine.fallback_device, policy, device, loaded)
    tokens = None if loaded is None or fallback is None else resolve_tokens_per_batch(
        options, loaded, policy, device, layers, attention_inputs=inputs, fallback_device=fallback)
    run = ResolvedRun(options=options, policy=policy, calibration=calibration, device=device,
                      threads=resolve_threads(options) if threads is None else threads, packs=packs, engine=engine,
                      attention=engine.attention, attention_inputs=inputs,
                      qkv_dtype=dtype_name(attention_dtype(policy, inputs)), batch_layout=layout,
                      attention_path=path, fallback_device=fallback, layers=layers,
                      pooling=tuple(stored_poolings(options.pooling)), model=model, identity="",
                      tokens_per_batch=tokens, platform=describe_platform(device), precision_requested=requested,
                      precision_reason=auto.reason if auto is not None else "")
    return _identified(run)


def resolve_loaded(loaded: EmbeddingModel, options: EmbedOptions, device: torch.device,
                   engine: EngineChoice | None = None) -> ResolvedRun:
    """Plain ``options`` checked and resolved for ``loaded`` on ``device`` outside an embed job
    (the cross-check's fp32 re-run, tests, benchmarks): its identity from the loaded weights
    only (a job resolves its own from the model's files, embedpipe.extraction.job)."""
    options.validate()
    packs = capabilities.packs(loaded)
    return resolve_run(options, device, num_layers=loaded.num_layers, packs=packs,
                       model=ModelIdentity(loaded.sha256, packs, {}, loaded.family), width=loaded.embed_dim,
                       loaded=loaded, engine=engine)


def _identified(run: ResolvedRun) -> ResolvedRun:
    """``run`` with its store identity (embedpipe.extraction.identity) built from what it resolved."""
    calibration = run.calibration.sha256 if run.calibration is not None else None
    return dataclasses.replace(run, identity=embed_identity(
        run.options, run.policy, run.model, run.computed_as, run.layers, run.pooling,
        calibration=calibration, platform=run.platform, attention=run.attention))
