"""The options a Python user decides, named on ``Embedder``, ``embed`` and ``search``, and one
``EmbedOptions`` for the rest: merged into the options the run takes.

Why both: a handful of keywords (the precision policy, the layers, the poolings, per-residue
vectors, the storage dtype, the device) are what a user chooses call by call, typed so that
mypy and an IDE check them; the other options of ``embed`` (the batch budget, threads, long
sequences, int8 smoothing, where ``precision="auto"`` measures) travel as one frozen
:class:`~embedpipe.core.options.EmbedOptions`. A keyword and a field of ``options`` that say two
different things are refused in one line, never silently ranked.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import fields
from typing import Any

from embedpipe.core.errors import EmbedpipeError
from embedpipe.core.options import EmbedOptions

__all__ = ["merged_options"]

_DEFAULTS = EmbedOptions()
#: fields of EmbedOptions that mean nothing in process: how the command compares the stores it
#: keeps and reuses (a Result is no store until saved, and is compared with none)
_NOT_IN_PROCESS = ("accept_platform_mix",)


def _given_options(where: str, options: EmbedOptions | None) -> dict[str, Any]:
    """The fields of ``options`` set to other than their defaults: what the user chose there."""
    if options is None:
        return {}
    if not isinstance(options, EmbedOptions):
        raise EmbedpipeError(f"{where}: options must be an embedpipe.EmbedOptions, not {type(options).__name__}")
    given = {f.name: _field(f.name, getattr(options, f.name)) for f in fields(options)
             if getattr(options, f.name) != getattr(_DEFAULTS, f.name)}
    for name in set(given) & set(_NOT_IN_PROCESS):
        raise EmbedpipeError(f"{where}: options.{name} is for the stores embedpipe embed keeps and reuses; "
                             "it means nothing in process: leave it out")
    return given


def _whole_numbers(name: str, value: object) -> tuple[int, ...]:
    values = (value,) if isinstance(value, int) else value
    if (isinstance(values, (str, bytes)) or not isinstance(values, Sequence)
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in values)):
        raise EmbedpipeError(f"{name} must be a layer index or a sequence of them, not {value!r}")
    return tuple(values)


def _names(name: str, value: object) -> tuple[str, ...]:
    values = (value,) if isinstance(value, str) else value
    if not isinstance(values, Sequence) or not all(isinstance(v, str) for v in values):
        raise EmbedpipeError(f"{name} must be a name or a sequence of names, not {value!r}")
    return tuple(values)


def _field(name: str, value: object) -> object:
    """``value`` as the field of EmbedOptions holds it (the store's config keeps tuples)."""
    if name == "layers":
        return _whole_numbers(name, value)
    if name == "pooling":
        return _names(name, value)
    if name == "per_residue" and not isinstance(value, bool):
        raise EmbedpipeError(f"per_residue must be True or False, not {value!r}")
    return value


def merged_options(where: str, options: EmbedOptions | None, named: Mapping[str, object]) -> dict[str, Any]:
    """The fields ``options`` sets, with each keyword of ``named`` that was given (not None);
    one line naming the field where a keyword and ``options`` disagree."""
    merged = _given_options(where, options)
    for name, value in named.items():
        if value is None:
            continue
        value = _field(name, value)
        if name in merged and merged[name] != value:
            raise EmbedpipeError(f"{where}: {name}={value!r} and options.{name}={merged[name]!r} disagree; "
                                 "give it once")
        merged[name] = value
    return merged
