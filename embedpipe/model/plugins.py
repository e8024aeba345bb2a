"""Model families from outside embedpipe: modules named in ``EMBEDPIPE_MODEL_FAMILIES``.

A comma-separated list of importable modules, each defining ``FAMILY`` (a
:class:`~embedpipe.model.registry.Family`). They are registered the first time a spec is
looked up, in every process (``embedpipe`` commands, Snakemake's jobs), so a family living in
its own module (a lab's, or the fake one of tests/helpers/fake_family_layout.py) runs through the CLI
and the workflow with no change to embedpipe. Importing such a module should stay torch-free
(its ``describe`` runs while Snakemake parses the rules).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from typing import Any

from embedpipe.core.errors import ModelError

ENV = "EMBEDPIPE_MODEL_FAMILIES"


def register_from_env(families: list[Any], register: Callable[[Any], None]) -> None:
    """Register each module's ``FAMILY`` not registered yet (by name); one-line errors."""
    for name in (part.strip() for part in os.environ.get(ENV, "").split(",")):
        if not name:
            continue
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            raise ModelError(f"{ENV}: cannot import model family module {name!r}: {exc}") from None
        family = getattr(module, "FAMILY", None)
        if family is None or not hasattr(family, "claims"):
            raise ModelError(f"{ENV}: module {name!r} defines no FAMILY (an embedpipe.model.Family)")
        if all(known.name != family.name for known in families):
            register(family)
