"""Which reader takes a spec, its facts, and loading it.

The built-in readers are the table's (:data:`embedpipe.model.families.READERS`: the esm package's
``.pth``, Hugging Face, fair-esm), each a :class:`Family` here; a reader asks its formats' rows
of :data:`embedpipe.model.families.FAMILY_TABLE`, so adding a family is its own modules plus one
row there (docs/architecture.md, "The family table"). A family from outside embedpipe is one
more :class:`Family` (:func:`register`, or ``EMBEDPIPE_MODEL_FAMILIES``: :mod:`embedpipe.model.plugins`),
asked before the built-in ones. Readers are asked in order; fair-esm comes last because it
takes every spec (its names and any checkpoint path).

A reader's loader is imported when a model is first loaded or inspected, by name
(``importlib``): describing a spec must stay torch-free, since the workflow does it while
Snakemake parses the rules in every job (importing torch costs 2.5 s).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from embedpipe.model import families, plugins
from embedpipe.model.facts import ModelFacts
from embedpipe.model.identity import ModelIdentity

if TYPE_CHECKING:  # pragma: no cover - annotations only
    from embedpipe.model.base import EmbeddingModel


@dataclass(frozen=True)
class Family:
    """One reader of specs (a built-in reader of the family table, or a family from outside
    embedpipe): cheap, torch-free ``claims``/``describe``, and the module that loads it."""

    name: str
    claims: Callable[[str], bool]  # does this family take the spec?
    describe: Callable[[str], ModelFacts]  # facts without loading weights or importing torch
    is_name: Callable[[str], bool]  # is the spec one of the family's registered names?
    module: str  # defines load(spec) -> EmbeddingModel and inspect(facts) -> ModelFacts
    #: defines download_problem(name) -> str | None and fetch_model(name, dest) -> Path for the
    #: family's registered names (``fetch-model``, the workflow); None: nothing to fetch
    sources: str | None = None
    #: what of the model decides its numbers (weights, config, tokenizer sha256s, the family's
    #: version) and whether batches may be packed, from its files, weights unread: a store's
    #: identity (embedpipe.model.identity); None: only the loaded model's sha256 is known
    file_identity: Callable[[str], ModelIdentity] | None = None
    #: every file the spec resolves to (a name's cached files too): inputs no output may
    #: replace (:func:`model_files`); None: the spec's own file, or a directory's files
    files: Callable[[str], list[Path]] | None = None

    def implementation(self) -> ModuleType:
        return importlib.import_module(self.module)


def reader_family(reader: families.Reader) -> Family:
    """The :class:`Family` of a built-in reader: its modules' functions (each torch-free)."""
    module, sources = importlib.import_module(reader.module), importlib.import_module(reader.sources)
    return Family(reader.name, module.claims, module.describe, module.is_model_name, reader.loader, reader.sources,
                  module.file_identity, sources.model_files)


FAMILIES: list[Family] = [reader_family(reader) for reader in families.READERS]


def register(family: Family) -> None:
    """Ask ``family`` before those already registered (fair-esm, which takes every spec, stays last)."""
    FAMILIES.insert(0, family)


def family_for(spec: str) -> Family:
    """The first registered family that takes ``spec`` (families named in
    ``EMBEDPIPE_MODEL_FAMILIES`` registered first: :mod:`embedpipe.model.plugins`)."""
    plugins.register_from_env(FAMILIES, register)
    spec = str(spec)
    return next(family for family in FAMILIES if family.claims(spec))


def describe(spec: str) -> ModelFacts:
    """What is known about ``spec`` without loading weights or importing torch."""
    return family_for(spec).describe(str(spec))


def inspect(spec: str) -> ModelFacts:
    """:func:`describe`, plus what an existing checkpoint file's header says (its weights stay
    unread). Names and missing files are only described: no torch import."""
    family = family_for(spec)
    facts = family.describe(str(spec))
    if facts.kind == "name" or facts.weights_bytes is None:
        return facts
    return family.implementation().inspect(facts)


def is_model_name(spec: str) -> bool:
    """Whether ``spec`` is a registered name of any family (not a path)."""
    plugins.register_from_env(FAMILIES, register)
    return any(family.is_name(str(spec)) for family in FAMILIES)


def model_identity(spec: str) -> ModelIdentity | None:
    """The model's part of a store's identity from its files; None for a family that cannot say."""
    family = family_for(spec)
    return family.file_identity(str(spec)) if family.file_identity else None


def model_files(spec: str) -> list[Path]:
    """Every file ``spec`` resolves to, whether given as a path, a directory or a name (a hub
    snapshot's files, which link to its blobs; the shards its index names): what a command's
    output guard (embedpipe.core.output_guard) refuses to replace. Nothing is downloaded."""
    family = family_for(spec)
    if family.files is not None:
        return family.files(str(spec))
    path = Path(spec).expanduser()
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.is_file())
    return [path] if path.is_file() else []


def load_model(spec: str) -> EmbeddingModel:
    """Resolve, checksum and load ``spec`` with its family: a fresh fp32 CPU model per call."""
    return family_for(spec).implementation().load(str(spec))
