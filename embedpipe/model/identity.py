"""What of a model decides its numbers, read from its files with the weights unread.

A store's identity (:mod:`embedpipe.extraction.identity`) covers the model through
:meth:`ModelIdentity.fields`: the weights' sha256, the sha256 of every other file the family's
loader reads that changes the vectors (a Hugging Face directory's ``config.json`` and its
tokenizer or vocabulary files; a fair-esm ``.pt`` holds its config inside), and the family with
its forward version (a constant per family, bumped when its forward changes). Each family
says it through its ``file_identity`` (:mod:`embedpipe.model.registry`). Torch-free.
docs/cluster.md, "Resuming, rerunning".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from embedpipe.core.errors import ModelError


@dataclass(frozen=True)
class ModelIdentity:
    """The model's part of a store's identity, and whether its family packs batches."""

    sha256: str  # the weights' (a store's ``model_sha256``)
    packs: bool
    files: Mapping[str, str] = field(default_factory=dict)  # file name -> sha256, weights excepted
    family: str = ""  # e.g. ``esm2 v1``: the family and its forward version

    def fields(self) -> dict[str, Any]:
        """The identity's model fields (docs/store-format.md, ``embed_identity``)."""
        return {"model_sha256": self.sha256, "model_files": dict(sorted(self.files.items())),
                "model_family": self.family}


def versioned(family: str, version: int) -> str:
    """``family vN``: a family's name with the version of its forward."""
    return f"{family} v{version}"


def files_sha256(directory: Path, names: Sequence[str]) -> dict[str, str]:
    """name -> sha256 of each of ``names`` present in ``directory`` (cached per unchanged file)."""
    from embedpipe.core.checksums import file_sha256

    out: dict[str, str] = {}
    for name in names:
        path = directory / name
        if path.is_file():
            try:
                out[name] = file_sha256(path)  # small files: no stat-keyed cache to go stale
            except OSError as exc:
                raise ModelError(f"cannot read {path}: {exc.strerror or exc}") from None
    return out
