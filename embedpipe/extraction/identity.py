"""The one identity of a store's numbers: everything that decides them, built by one function
(:func:`embed_identity`) that resuming (:mod:`embedpipe.extraction.run`: a store with another
identity is embedded again) and ``--reuse`` (:mod:`embedpipe.extraction.reuse`: a source with
another identity is refused) both compare, and the first difference in user words
(:func:`describe_difference`). docs/cluster.md, "Resuming, rerunning"; docs/store-format.md,
``embed_identity``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

from embedpipe.core.options import EmbedOptions
from embedpipe.model.identity import ModelIdentity
from embedpipe.runtime.precision import Policy

#: the identity's version: 2 covers the model's config and tokenizer files, the family's forward
#: version, the int8 weight range and canonical pooling (older stores carry none); 3 the platform,
#: and only what the batch layout and the attention inputs resolved to
IDENTITY_VERSION = 3

#: options that change how a job runs, not its numbers: a retry's smaller batches, threads,
#: where ``auto`` keeps its cache and when it measures (the policy it chose is compared),
#: whether another platform's stores are accepted
#: (docs/cluster.md, "Resuming, rerunning"); where fallback records run is not an option
#: (the run derives it) and is left out likewise
HOW_IT_RUNS = ("tokens_per_batch", "threads", "auto_cache", "auto_measure", "accept_platform_mix")

#: options replaced by what they resolve to (``layers``, ``pooling``, the device's type in
#: ``computed_as``) or by the file's bytes (``int8_calibration``): two spellings that run alike
#: keep each other's stores
_RESOLVED = ("device", "layers", "pooling", "int8_smoothing", "int8_calibration")

#: the identity's field that ``--accept-platform-mix`` leaves out of the comparison (still recorded)
PLATFORM = "platform"

#: the fields in the order a difference is named (what a user chose first, what the run
#: resolved it to last), each in user words; fields not listed follow, by name
FIELDS: dict[str, str] = {
    "model_sha256": "model_sha256",
    "model_files": "the model's config and tokenizer files",  # named file by file (_files_difference)
    "model_family": "the model family and its forward version",
    "precision": "the precision policy",
    "int8_smoothing": "int8_smoothing",
    "int8_weight_range": "the int8 weight range (resolved on the CPU by the int8 kernels)",
    "layers": "layers",
    "pooling": "pooling",
    "per_residue": "per_residue",
    "storage_dtype": "storage_dtype",
    "long_sequences": "long_sequences",
    "attention": "attention",
    "overflow_margin": "overflow_margin",
    "computed_as.device_type": "the device type (resolved from --device)",
    "computed_as.batch_layout": "the batch layout (resolved on the device)",
    "computed_as.attention_inputs": "the dtype of q/k/v at attention (resolved from the precision policy and the device)",
    "computed_as.compiled": "compiled elementwise work (an older embedpipe's --compile; this one runs eager)",
    PLATFORM: ("the platform (CPU instruction-set class or GPU model, torch and oneDNN versions decide the "
               "numbers; --accept-platform-mix to accept it)"),
}

#: what an identity written before :data:`IDENTITY_VERSION` 2 did not cover
_OLDER = ("written by an older embedpipe whose identity did not cover the model's config.json and tokenizer "
          "files, the model family's version or the int8 weight range")
#: what an identity of version 2 did not cover
_OLDER_2 = ("written by an older embedpipe whose identity did not cover the platform (CPU instruction set or GPU "
            "model, torch and oneDNN versions) and held --batch-layout, --attention-inputs and --compile as "
            "requested, not as resolved")
_MISSING = "(not recorded)"


def embed_identity(options: EmbedOptions, policy: Policy, model: ModelIdentity, computed_as: Mapping[str, str],
                   layers: Sequence[int], pooling: Sequence[str], *, calibration: str | None, platform: str,
                   attention: str) -> str:
    """What makes a store's numbers, as JSON: the model (:meth:`ModelIdentity.fields`: weights,
    config and tokenizer sha256s, the family's version), every option except how the job ran
    (:data:`HOW_IT_RUNS`), the precision policy's resolved parameters, and what the ``auto``
    options resolved to on this job's device (``computed_as``).

    Resolved values, not spellings: ``layers`` (non-negative indices: ``--layers -1`` and
    ``--layers 2`` of a 2-layer model agree), ``pooling`` as stored (the mean always is:
    ``--pooling bos`` and ``--pooling mean --pooling bos`` agree), the device only as the type
    used (``--device auto`` and ``--device cpu`` agree on the CPU), the calibration set's bytes
    (``calibration``: its sha256, None without smoothing), the ``platform`` that ran it
    (:func:`embedpipe.runtime.platform.describe`), the ``attention`` kernel the run derived
    (sdpa unless ``EMBEDPIPE_ENGINE`` overrides it). The values come resolved from
    :func:`embedpipe.extraction.resolved.resolve_run`; nothing is resolved here."""
    chosen: dict[str, Any] = {k: v for k, v in asdict(options).items() if k not in HOW_IT_RUNS + _RESOLVED}
    chosen["layers"] = sorted(int(n) for n in layers)
    chosen["pooling"] = list(pooling)
    chosen["attention"] = attention
    if calibration is not None:
        chosen["int8_smoothing"] = f"{options.int8_smoothing}, calibration sha256 {calibration}"
    chosen |= _policy_facts(policy)
    chosen |= model.fields() | {"identity_version": IDENTITY_VERSION, "computed_as": dict(computed_as),
                                PLATFORM: platform}
    return json.dumps(chosen, sort_keys=True)


def _policy_facts(policy: Policy) -> dict[str, str]:
    """What the policy resolved on this machine that changes the numbers: int8-mixed's weight
    range (7-bit where the CPU's int8 kernels saturate, docs/precision.md)."""
    weight_range = policy.provenance().get("quantization_weight_range")
    return {"int8_weight_range": weight_range} if weight_range else {}


def _flat(identity: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in identity.items():
        if isinstance(value, dict) and key != "model_files":
            out |= _flat(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def ignored(options: EmbedOptions) -> tuple[str, ...]:
    """The fields a comparison for a run of ``options`` leaves out: the platform with
    ``--accept-platform-mix`` (docs/cluster.md, "Resuming, rerunning")."""
    return (PLATFORM,) if options.accept_platform_mix else ()


def first_difference(theirs: str, ours: str, ignore: Sequence[str] = ()) -> tuple[str, Any, Any] | None:
    """(field, their value, ours) of the first field (:data:`FIELDS` order) the identities
    differ in, ``ignore`` left out; None when they agree."""
    a, b = _flat(json.loads(theirs)), _flat(json.loads(ours))
    order = list(FIELDS)
    for key in sorted((set(a) | set(b)) - set(ignore),
                      key=lambda k: (order.index(k) if k in order else len(order), k)):
        if a.get(key, _MISSING) != b.get(key, _MISSING):
            return key, a.get(key, _MISSING), b.get(key, _MISSING)
    return None


def describe_difference(theirs: str, ours: str, ignore: Sequence[str] = ()) -> str | None:
    """The first difference of two identities in user words (``embedded with the precision
    policy 'fp32', this run 'bf16'``), or that ``theirs`` predates this identity; None: equal
    (``ignore``: fields left out, :func:`ignored`)."""
    try:
        version = json.loads(theirs).get("identity_version")
    except (ValueError, AttributeError):
        return "its embed_identity is not an identity embedpipe writes"
    diff = first_difference(theirs, ours, ignore)
    if diff is None:
        return None
    if version != IDENTITY_VERSION:
        return _OLDER_2 if version == 2 else _OLDER
    key, a, b = diff
    if key == "model_files":
        return _files_difference(a if isinstance(a, dict) else {}, b if isinstance(b, dict) else {})
    return f"embedded with {FIELDS.get(key, key)} {_shown(a)}, this run {_shown(b)}"


def _shown(value: object) -> str:
    """A value of the identity as a message shows it: strings quoted, true/false, [a, b],
    {key: value}; not Python's ``True`` or ``{'key': ...}``."""
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "none"}[value]
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_shown(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_shown(v)}" for k, v in value.items()) + "}"
    return repr(value)


def _files_difference(theirs: Mapping[str, str], ours: Mapping[str, str]) -> str:
    """The first model file (not the weights) whose bytes differ, or one only one side has."""
    for name in sorted(set(theirs) | set(ours)):
        if theirs.get(name) != ours.get(name):
            if name not in theirs or name not in ours:
                change = "no longer there" if name in theirs else "new"
                return f"the model's {name} is {change} (the weights are the same; the file changes the numbers)"
            return (f"embedded with the model's {name} sha256 {theirs[name][:16]}..., this run "
                    f"{ours[name][:16]}... (the weights are the same; the file changes the numbers)")
    return "the model's files differ"  # pragma: no cover - a difference was found above
