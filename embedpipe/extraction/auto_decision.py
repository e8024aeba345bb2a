"""``precision: auto`` decided once for a whole run (docs/precision.md, "One decision per run").

Why: when each embed job of a workflow decided ``auto`` for itself, a small group that ran
first took the table's prior while a large one measured and chose another policy, ``merge``
refused the mix and a rerun failed the same way; on a cluster each node could choose its own.
``embedpipe decide-precision`` (:func:`decide_run`) measures once, on records drawn across the
whole input, on the resources an embed job gets, through the same
:func:`~embedpipe.extraction.auto_precision.measure_candidates` and
:func:`~embedpipe.extraction.auto_precision.pick` a job uses, and writes the decision file; each
embed job given it (``--precision auto:FILE``) runs that policy, with its reason, through
:func:`~embedpipe.extraction.resolved.resolve_run` (:func:`chosen`: the job's ``measure``). The
file is keyed by the model's identity and the options that decide the numbers: a rerun with
the same key keeps it, another key decides again, and a job whose key differs is refused.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import math
import os
import socket
import stat
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from embedpipe.core.atomic import check_output_path, write_text_atomic
from embedpipe.core.cpus import thread_count, use_threads
from embedpipe.core.devices import claim_device, resolve_device
from embedpipe.core.errors import EmbedpipeError
from embedpipe.core.jsonbounds import load_bounded_json
from embedpipe.core.options import AUTO, AUTO_MEASURE_ALWAYS, FASTA_LIMITS, EmbedOptions, FastaLimits
from embedpipe.core.stats import DECISION_SAMPLE_FILES, spread
from embedpipe.extraction import auto_precision
from embedpipe.extraction.auto_precision import (
    measure_candidates,
    model_params,
    probe_records,
    too_small,
    usable_candidates,
)
from embedpipe.extraction.identity import HOW_IT_RUNS
from embedpipe.extraction.resolved import AutoChoice
from embedpipe.inputs.fasta import read_sequences
from embedpipe.model import capabilities, load_model, registry
from embedpipe.model.identity import ModelIdentity
from embedpipe.model.layout import TokenLayout
from embedpipe.runtime import auto_cache, cpu_features, engine_override
from embedpipe.runtime.auto_cache import Timing
from embedpipe.runtime.engine_override import EngineChoice
from embedpipe.runtime.platform import describe as describe_platform

__all__ = ["DECISION_FORMAT", "Decision", "chosen", "decide_run", "read_decision", "split_precision"]

DECISION_FORMAT = "embedpipe.precision-decision"
#: the file's version; a change of its fields or of what the key holds bumps it
DECISION_VERSION = 1
#: the largest decision file read (one is a few kilobytes)
MAX_DECISION_BYTES = 256 << 10
UTC_FORMAT = "%Y-%m-%dT%H:%M:%SZ"
_FIELDS = {"format", "version", "key", "policy", "reason", "candidates", "node", "cpu_model", "cpu_flags",
           "cpu_class", "gpu", "platform", "device", "threads", "torch", "decided_utc", "sample"}


def split_precision(text: str) -> tuple[str, Path | None]:
    """``--precision auto:FILE`` -> (``auto``, FILE): run the decision FILE holds; anything
    else unchanged, with no file."""
    name, sep, path = text.partition(":")
    if not sep or name != AUTO:
        return text, None
    if not path:
        raise EmbedpipeError("--precision auto:FILE needs the decision file (embedpipe decide-precision writes it)")
    return AUTO, Path(path)


def decision_key(options: EmbedOptions, engine: EngineChoice, device: torch.device,
                 model: ModelIdentity) -> dict[str, Any]:
    """What a decision holds for: the model's identity and every option that decides the numbers
    (as given; not how a job runs: batch budget, threads, cache, platform mix), the device type
    and the engine choices. Not the node: a job elsewhere runs the run's decision."""
    given = {name: value for name, value in dataclasses.asdict(options).items()
             if name not in (*HOW_IT_RUNS, "precision", "device")}
    return json.loads(json.dumps({"version": DECISION_VERSION, "model": model.fields(), "device": device.type,
                                  "options": given, "engine": dataclasses.asdict(engine)}, sort_keys=True))


def _gpu(device: torch.device) -> str:
    """The GPU model and compute capability ('' off CUDA)."""
    if device.type != "cuda":
        return ""
    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)} sm_{major}{minor}"


def _hardware(device_type: str, cpu_class: str, gpu: str) -> str:
    """The class of hardware whose kernels decide a policy's speed, in words: the CPU's
    instruction-set class (docs/precision.md, "Which policy on which CPU"), or the GPU's model."""
    return f"cuda {gpu}" if device_type == "cuda" else f"{device_type} {cpu_class}"


def hardware_class(device: torch.device) -> str:
    """This node's :func:`_hardware` for ``device``."""
    return _hardware(device.type, cpu_features.detect().cpu_class, _gpu(device))


# ------------------------------------------------------------------------------ the decision file


@dataclass(frozen=True)
class Decision:
    """A decision file read back and checked."""

    path: Path
    key: dict[str, Any]
    policy: str
    reason: str
    fields: dict[str, Any]  # the whole file

    @property
    def hardware(self) -> str:
        """The class of hardware it was decided on (its ``cpu_class``, or ``gpu`` on CUDA)."""
        return _hardware(str(self.key["device"]), self.fields["cpu_class"], self.fields["gpu"])

    def mismatch(self, key: dict[str, Any]) -> str | None:
        """Which part of ``key`` (a job's) differs from the decision's, in words; None when none."""
        for part, words in (("version", "another decision format"), ("model", "another model"),
                            ("device", "another device type"), ("engine", "other engine choices (EMBEDPIPE_ENGINE)")):
            if self.key.get(part) != key.get(part):
                return words
        theirs, ours = self.key.get("options", {}), key.get("options", {})
        names = sorted(name for name in set(theirs) | set(ours) if theirs.get(name) != ours.get(name))
        return f"other options ({', '.join(names)})" if names else None


def _bad(path: Path, what: str) -> EmbedpipeError:
    return EmbedpipeError(f"{path}: not a precision decision embedpipe writes ({what}); delete it and run "
                          "`embedpipe decide-precision` again")


def _read_bytes(path: Path) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise EmbedpipeError(f"{path}: no such precision decision file (embedpipe decide-precision writes it)") from None
    except OSError as exc:
        raise _bad(path, "a symbolic link" if exc.errno == errno.ELOOP else f"unreadable: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _bad(path, "not a regular file")
        if st.st_size > MAX_DECISION_BYTES:
            raise _bad(path, f"{st.st_size} bytes, more than the {MAX_DECISION_BYTES} a decision may hold")
        data = os.read(fd, MAX_DECISION_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_DECISION_BYTES:
        raise _bad(path, f"more than the {MAX_DECISION_BYTES} bytes a decision may hold")
    return data


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
        return None
    return float(value)


def read_decision(path: Path) -> Decision:
    """The decision ``path`` holds, checked field by field; a damaged or foreign file is one
    line naming it (described, never quoted)."""
    path = Path(path)
    try:
        data = load_bounded_json(_read_bytes(path).decode("utf-8"), str(path), EmbedpipeError)
    except (UnicodeDecodeError, ValueError):
        raise _bad(path, "not valid JSON") from None
    if not isinstance(data, dict) or data.get("format") != DECISION_FORMAT:
        raise _bad(path, f"no \"format\": \"{DECISION_FORMAT}\"")
    if data.get("version") != DECISION_VERSION:
        raise _bad(path, f"version {DECISION_VERSION} expected")
    if set(data) != _FIELDS:
        raise _bad(path, "other fields than a decision's")
    key, policy, reason, candidates = data["key"], data["policy"], data["reason"], data["candidates"]
    if not isinstance(key, dict) or not {"model", "device", "options", "engine", "version"} <= set(key) \
            or not isinstance(key["device"], str) or not isinstance(key["options"], dict):
        raise _bad(path, "its key is not a model and options")
    if not all(isinstance(data[name], str) for name in ("reason", "gpu", "node", "cpu_class", "decided_utc")):
        raise _bad(path, "a field that should be text is not")
    if not isinstance(policy, str) or not isinstance(candidates, dict):
        raise _bad(path, "its policy is not one of its candidates")
    if not candidates:  # a run too small to pay for the probe: nothing measured, and said so
        if policy not in set(auto_precision.CPU_CANDIDATES) | {"fp16-mixed"} or ": not measured (" not in reason:
            raise _bad(path, "no candidates measured, and its reason does not say why")
    elif policy not in candidates:
        raise _bad(path, "its policy is not one of its candidates")
    elif not set(candidates) <= set(auto_precision.CPU_CANDIDATES) | {"fp16-mixed"} or "fp32" not in candidates:
        raise _bad(path, "a candidate that auto does not measure, or no fp32")
    for name, timing in candidates.items():
        values = [_number(timing.get(k)) for k in ("ms_per_1k_residues", "min_cosine")] \
            if isinstance(timing, dict) and set(timing) == {"ms_per_1k_residues", "min_cosine"} else [None]
        if None in values or (values[0] or 0) <= 0 or not -1.0 <= (values[1] or 0) <= 1.0:
            raise _bad(path, f"the timing of {name} is not a positive time and a cosine in [-1, 1]")
    if not reason.startswith(f"auto -> {policy}:"):
        raise _bad(path, "its reason does not name its policy")
    return Decision(path, key, policy, reason, data)


def chosen(decision: Decision, options: EmbedOptions, engine: EngineChoice, device: torch.device,
           model: ModelIdentity) -> AutoChoice:
    """``auto`` for a job given the run's ``decision`` (the job's ``measure`` for
    :func:`~embedpipe.extraction.resolved.resolve_run`): its policy and reason; refused in one line
    when it was decided for another model or other options. On hardware of another class than
    the decision's the job runs it all the same and its reason says so (:func:`other_class`)."""
    differs = decision.mismatch(decision_key(options, engine, device, model))
    if differs is not None:
        raise EmbedpipeError(f"--precision auto:{decision.path}: decided for {differs} than this job's; "
                             "run `embedpipe decide-precision` for these, or give --precision auto")
    note = other_class(decision, device)
    return AutoChoice(decision.policy, decision.reason + (f"; {note}" if note else ""))


def other_class(decision: Decision, device: torch.device) -> str:
    """'' on hardware of the decision's class; else what the job says and records."""
    here = hardware_class(device)
    if here == decision.hardware:
        return ""
    return (f"run here on {here}, another class than the decision's ({decision.hardware}), which "
            "the run's one decision keeps (this job's platform is recorded as its own)")


# ------------------------------------------------------------------------------ deciding


def sample_records(fastas: Sequence[Path], limits: FastaLimits, layout: TokenLayout) -> list[tuple[str, str]]:
    """The probe's records drawn across the whole input: from up to :data:`~embedpipe.core.stats.DECISION_SAMPLE_FILES` of
    ``fastas`` evenly spaced over them (first and last included; the workflow's shards run
    short to long), each read through the FASTA reader (``limits``: the family's rules) and
    thinned by :func:`~embedpipe.extraction.auto_precision.probe_records`, then the union thinned the same way."""
    if not fastas:
        raise EmbedpipeError("decide-precision: no FASTA to draw the probe's records from")
    drawn: list[tuple[str, str]] = []
    for fasta in spread(fastas, DECISION_SAMPLE_FILES):
        drawn += probe_records(list(read_sequences(Path(fasta), limits)), layout=layout)
    return probe_records(drawn, layout=layout)


def _same_key(out: Path, key: dict[str, Any], options: EmbedOptions) -> Decision | None:
    """The decision already at ``out`` for ``key``, else None (none there, or another key: it is
    replaced). A decision taken without a measurement (a run too small to pay for the probe) is
    kept only while ``--auto-measure`` is not ``always``. A damaged or foreign file there is
    refused, not overwritten."""
    if not out.exists() and not out.is_symlink():
        return None
    decision = read_decision(out)
    if not decision.fields["candidates"] and options.auto_measure == AUTO_MEASURE_ALWAYS:
        return None
    return decision if decision.mismatch(key) is None else None


def decide_run(fastas: Sequence[Path], *, model: str, options: EmbedOptions, out: Path,
               limits: FastaLimits = FASTA_LIMITS, run_residues: int | None = None, quiet: bool = False) -> str:
    """``embedpipe decide-precision``: write ``out``, the run's one ``auto`` decision, or keep the
    one there for the same model and options (its time renewed, its content untouched). Returns
    the line that says which. ``limits``: as the model's family reads records (the caller ran
    embed's start checks: :func:`embedpipe.extraction.run.start_checks`). ``run_residues``: the
    residues the run embeds; a run too small to pay for the probe is not measured (fp32, or the
    table's row for this CPU class at a similar model size), unless ``--auto-measure always``."""
    if options.precision != AUTO:
        raise EmbedpipeError(f"decide-precision decides --precision auto; --precision {options.precision} needs no "
                             "decision")
    out = Path(out)
    check_output_path(out)
    engine = engine_override.from_environment()
    facts = registry.model_identity(model)
    if facts is not None and (kept := _same_key(out, decision_key(options, engine, resolve_device(options.device),
                                                                 facts), options)) is not None:
        return _kept(out, kept)
    threads = use_threads(thread_count(options.threads), quiet=quiet)
    with claim_device(options.device) as device:
        loaded = load_model(model)
        identity = facts or ModelIdentity(loaded.sha256, False, {}, loaded.family)
        key = decision_key(options, engine, device, identity)
        if facts is None and (kept := _same_key(out, key, options)) is not None:
            return _kept(out, kept)
        usable = usable_candidates(engine, device)
        if not usable:
            raise EmbedpipeError("--precision auto: no policy it measures is allowed with these options; name one")
        sample = sample_records(fastas, limits, capabilities.layout_of(loaded))
        when = time.strftime(UTC_FORMAT, time.gmtime())
        where = f"{socket.gethostname()} ({hardware_class(device)}, {threads.count} threads) at {when}"
        if len(usable) == 1:
            timings = {usable[0]: Timing(1.0, 1.0)}
            policy, why = usable[0], "the only policy these options allow"
            reason = f"auto -> {policy}: decided once for the run on {where}: {why}"
        elif too_small(usable, sample, options, run_residues):  # a job's rule, applied to the whole run
            timings = {}  # nothing measured: the decision says so, and holds no invented times
            choice = auto_precision.from_table(device, "the run is too small to pay for the probe, which may cost "
                                               f"at most {auto_precision.PROBE_SHARE:.0%} of its residues",
                                               params=model_params(loaded))
            policy = choice.policy if choice.policy in usable else "fp32"
            reason = f"{choice.reason} (decided once for the run on {where})"
            if policy != choice.policy:
                reason = f"auto -> fp32: {reason.partition(': ')[2]}; {choice.policy} is not allowed with these options"
        else:
            timings = measure_candidates(loaded, options, engine, device, identity, sample, usable, threads, quiet)
            policy = auto_precision.pick(timings)
            reason = f"auto -> {policy}: decided once for the run on {where}: {auto_precision.describe(timings)}"
        body = _body(key, policy, reason, timings, device, threads.count, when, sample)
    write_text_atomic(out, json.dumps(body, indent=1, sort_keys=True) + "\n")
    read_decision(out)  # what the jobs will read: checked once here
    return f"decided {policy} for the run -> {out}: {reason}"


def _body(key: dict[str, Any], policy: str, reason: str, timings: dict[str, Timing], device: torch.device,
          threads: int, when: str, sample: Sequence[tuple[str, str]]) -> dict[str, Any]:
    """The decision file's fields: the choice, its measurement, and where and when it was made."""
    cpu = cpu_features.detect()
    return {
        "format": DECISION_FORMAT, "version": DECISION_VERSION, "key": key, "policy": policy, "reason": reason,
        "candidates": {name: {"ms_per_1k_residues": t.ms_per_1k_residues, "min_cosine": t.min_cosine}
                       for name, t in timings.items()},
        "node": socket.gethostname(), "cpu_model": auto_cache.cpu_model() or "unknown", "cpu_flags": cpu.named(),
        "cpu_class": cpu.cpu_class, "gpu": _gpu(device), "platform": describe_platform(device), "device": str(device),
        "threads": threads, "torch": torch.__version__, "decided_utc": when,
        "sample": {"records": len(sample), "residues": sum(len(s) for _, s in sample)},
    }


def _kept(out: Path, kept: Decision) -> str:
    """The decision at ``out`` kept for the same key: its content untouched, its time renewed
    (newer than its inputs, so the workflow sees it current)."""
    os.utime(out)
    return f"kept {out}: decided for this model and options at {kept.fields['decided_utc']} ({kept.policy})"
