"""``embedpipe.read_fasta``: a FASTA file read in Python as ``embedpipe embed`` reads it, and
the rule by which ``Embedder.embed`` (and ``search``) take a FASTA file in place of sequences.

Why no parser here: a record must get the same ID and sequence, or the same refusal in the
same words, whichever way it enters. So the file goes through the one FASTA reader
(:func:`embedpipe.inputs.fasta.read_sequences`: plain or gzip, the FASTA rules) with the limits
the model's family reads by (:func:`embedpipe.extraction.run.family_limits`: case kept for ProstT5,
SaProt's pairs), as ``embed`` sets them from the same model.

Which values are files (:func:`fasta_path`): a :class:`pathlib.Path` (any ``os.PathLike``)
always; a ``str`` only where it names an existing file whose name ends in ``.fa``, ``.fasta``,
``.faa`` or ``.fas`` (``.gz`` after it too). Any other ``str`` is no file: a sequence is text
too, so nothing is guessed, and one string is refused as before, with a hint where it looks
like a FASTA's name or names another file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol, Union

from embedpipe.core.errors import EmbedpipeError, InputError, quote
from embedpipe.core.options import FASTA_LIMITS, FastaLimits
from embedpipe.core.paths import display_path
from embedpipe.extraction.run import family_limits
from embedpipe.inputs.fasta import read_sequences
from embedpipe.inputs.memory import DISPLAY
from embedpipe.model import inspect

__all__ = ["FASTA_SUFFIXES", "fasta_path", "read_fasta"]

#: the names a ``str`` must end in (``.gz`` after them too) to be read as a FASTA file
FASTA_SUFFIXES = (".fa", ".fasta", ".faa", ".fas")


class _ReadsRecords(Protocol):
    """What :func:`read_fasta` needs of an :class:`~embedpipe.api.embedder.Embedder`: the limits
    its family reads records by."""

    @property
    def limits(self) -> FastaLimits: ...


#: what ``read_fasta``'s ``model`` may be: a model spec (name, file or directory) or an Embedder
ModelLike = Union[str, "os.PathLike[str]", _ReadsRecords]


def _fasta_name(name: str) -> bool:
    return name.lower().removesuffix(".gz").endswith(FASTA_SUFFIXES)


def _is_file(name: str) -> bool:
    """Whether the text ``name`` names an existing file; a sequence of 100,000 residues is too
    long a name for the OS, and a NUL is no path: both are simply not files."""
    try:
        return Path(name).is_file()
    except (OSError, ValueError):
        return False


def fasta_path(value: object) -> Path | None:
    """The FASTA file ``value`` names (see the module's rule), or None where it is not one.

    A ``str`` that ends like a FASTA's name but names no file, or names a file that does not end
    like one, is refused in one line: the usual refusal of one string, with what to do."""
    if isinstance(value, os.PathLike):
        return Path(value)
    if not isinstance(value, str):
        return None
    named, exists = _fasta_name(value), _is_file(value)
    if named and exists:
        return Path(value)
    refusal = f"{DISPLAY}: give a list of sequences, (id, sequence) pairs or a dict, not one string"
    suffixes = "/".join(FASTA_SUFFIXES)
    if named:
        raise InputError(f"{refusal} ({quote(value)} names no file; a FASTA file is read from a pathlib.Path, or "
                         f"from a str naming an existing {suffixes} file, gzip too)")
    if exists:
        raise InputError(f"{refusal} ({quote(value)} is a file whose name does not end in {suffixes}(.gz): pass "
                         f"pathlib.Path({value!r}) to read it as a FASTA)")
    return None


def _limits(model: ModelLike | None, limits: FastaLimits) -> FastaLimits:
    """``limits`` as ``model``'s family reads records (an Embedder: its own limits)."""
    if model is None:
        return limits
    if isinstance(model, (str, os.PathLike)):
        return family_limits(inspect(str(model)).token_layout, limits)
    own = getattr(model, "limits", None)
    if not isinstance(own, FastaLimits):
        raise EmbedpipeError(f"read_fasta: model is a model name or path, or an Embedder, not {type(model).__name__}")
    return own


def read_fasta(path: str | os.PathLike[str], model: ModelLike | None = None, *,
               limits: FastaLimits = FASTA_LIMITS) -> list[tuple[str, str]]:
    """``(id, sequence)`` of every record of the FASTA file ``path`` (plain or gzip), in file
    order, as ``embedpipe embed`` reads it: the FASTA rules, and with ``model`` (a name or path
    as ``--model`` takes, or an :class:`~embedpipe.api.embedder.Embedder`) the model family's
    rules (case kept for ProstT5, SaProt's pairs; without one, the amino-acid rules: upper-cased,
    a trailing ``*`` stripped, ``J`` read as ``X``). ``limits``: ``--max-record-length`` and
    ``--max-id-length`` (an Embedder's own limits stand instead).

    The first record ``embed`` would refuse (a bad or duplicate ID, a character that is no
    residue, a record over the limits), a missing or unreadable file, or a file without
    records is one :class:`~embedpipe.core.errors.InputError` (an ``EmbedpipeError``) naming the
    file and the line, in ``embed``'s words."""
    limits.check(InputError)
    limits = _limits(model, limits)
    records = list(read_sequences(Path(path), limits))
    if not records:
        raise InputError(f"{display_path(path)}: no records to embed")
    return records
