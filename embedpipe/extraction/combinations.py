"""Which embed options go together, for a model known by its facts: the one check that both
``embedpipe embed`` (before the model loads) and the workflow (while Snakemake parses the config,
before any job: embedpipe.workflow.config) run, so the two cannot drift (docs/cluster.md,
"Before the first job").

Torch-free and plain values in: the options, the model's facts (:func:`embedpipe.model.describe`)
and the ``--reuse`` paths. A refusal is a :class:`CombinationError`, one line naming the options
(``--precision``, ``--int8-smoothing``, ...); ``keys`` are the same names as config keys
(``precision``, ``int8_smoothing``). Each check is one function of :data:`CHECKS`: a new
option's refusal (``precision: auto`` resolves first, and is then checked as the policy it
resolved to) is one more function there.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from embedpipe.core.errors import EmbedpipeError
from embedpipe.core.options import EmbedOptions
from embedpipe.inputs.fasta import read_calibration
from embedpipe.model.capabilities import check_family
from embedpipe.model.facts import ModelFacts
from embedpipe.model.layers import resolve_layers

#: policies whose kernels exist on the CPU only (oneDNN's int8 matmuls): their policy refuses any
#: other device when the job claims it (embedpipe.runtime.int8_policy); refused here before
CPU_ONLY_POLICIES = ("int8-mixed",)

_FLAG = re.compile(r"--([a-z0-9]+(?:-[a-z0-9]+)*)")


class CombinationError(EmbedpipeError):
    """Options that do not go together (or do not fit the model); one line naming the options."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        #: the options the message names, as config keys (``--int8-smoothing`` -> ``int8_smoothing``)
        self.keys = tuple(dict.fromkeys(flag.replace("-", "_") for flag in _FLAG.findall(message)))


@dataclass(frozen=True)
class Combination:
    """What one embed run is asked to do: its options, its model's facts, its reuse stores."""

    options: EmbedOptions
    facts: ModelFacts
    reuse: tuple[str, ...] = ()


def _values(run: Combination) -> None:
    """Each option's allowed values and the pairs :meth:`EmbedOptions.validate` refuses."""
    run.options.validate()


def _device(run: Combination) -> None:
    precision, device = run.options.precision, run.options.device
    if precision in CPU_ONLY_POLICIES and device.startswith("cuda"):
        raise EmbedpipeError(f"--precision {precision} runs on the CPU only (oneDNN's int8 kernels); with "
                             f"--device {device} use bf16-mixed or fp16-mixed, or --device cpu")


def _family(run: Combination) -> None:
    """What the model's family cannot do (embedpipe.model.capabilities, asked again once loaded)."""
    facts = run.facts
    # the batch layout is derived by the run (an override is checked when it resolves): "auto" here
    check_family(facts.family, facts.token_layout.bos, facts.packs, run.options.pooling, "auto")


def _layers(run: Combination) -> None:
    """``--layers`` within the model's depth, where the facts know it (a checkpoint path's depth
    is read when it loads)."""
    if run.facts.num_layers is None:
        return
    try:
        resolve_layers(run.options.layers, run.facts.num_layers)
    except EmbedpipeError as exc:
        raise EmbedpipeError(f"--layers {','.join(map(str, run.options.layers))}: {exc} ({run.facts.name})") from None


def _reuse(run: Combination) -> None:
    for path in run.reuse:
        if not Path(path).exists():
            raise EmbedpipeError(f"--reuse {path}: no such file")


def _calibration(run: Combination) -> None:
    """The calibration FASTA (``--int8-smoothing smoothquant:FASTA``) read in full, with the reader the job calibrates with
    (embedpipe.runtime.int8_smoothing): an invalid record anywhere in it stops here."""
    path = run.options.int8_calibration
    if path is None or run.options.int8_smoothing == "none":
        return
    read_calibration(Path(path))



#: every check, in the order a refusal is reported
CHECKS: tuple[Callable[[Combination], None], ...] = (_values, _device, _family, _layers, _reuse, _calibration)


def check_embed(options: EmbedOptions, facts: ModelFacts, reuse: Sequence[str | Path] = (), *,
                calibration: bool = True) -> None:
    """Raise :class:`CombinationError` (one line) for the first thing of ``options`` that the
    model of ``facts`` or the ``reuse`` paths refuse. ``calibration=False``: the calibration
    FASTA is left to the caller, which reads it next with the same reader (the embed job:
    once per job)."""
    run = Combination(options, facts, tuple(map(str, reuse)))
    for check in CHECKS if calibration else tuple(c for c in CHECKS if c is not _calibration):
        try:
            check(run)
        except CombinationError:
            raise
        except EmbedpipeError as exc:
            raise CombinationError(str(exc)) from None
