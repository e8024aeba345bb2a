"""ESM C as the ``esm`` package (EvolutionaryScale) ships it: names, files, what is known
without torch or weights.

``ESMC.from_pretrained("esmc_300m")`` reads a plain state dict, ``data/weights/esmc_300m_2024_12_v0.pth``,
from the hub snapshot of ``EvolutionaryScale/esmc-300m-2024-12`` (esm/pretrained.py,
esm/utils/constants/esm3.py). embedpipe takes the release's name (``esmc_300m``, ``esmc_600m``),
its hub name (read from the local hub cache only, as every Hugging Face name: never downloaded),
or a path to such a ``.pth``. The loader is :mod:`embedpipe.model.esmc_pth`; the weights run
on ESM C's forward under the family ``esmc`` (docs/models.md, "ESM C"). Torch-free.
"""

from __future__ import annotations

import zipfile
from dataclasses import dataclass
from pathlib import Path

from embedpipe.core.errors import ModelError
from embedpipe.model import esmc_spec, families
from embedpipe.model import hf_checkpoint as hf
from embedpipe.model.facts import ModelFacts
from embedpipe.model.identity import ModelIdentity

#: a store's ``model_format`` for these files
MODEL_FORMAT = "esm-pth"
#: every released ESM C has heads of this width (960 / 15, 1152 / 18): a file's head count is its width / 64
HEAD_DIM = 64
#: rows of ``embed.weight`` (the esm package's ``nn.Embedding(64, d_model)``)
EMBED_ROWS = 64
#: rotary base (the esm package's ``RotaryEmbedding`` default)
ROPE_THETA = 10000.0
#: bytes of a pickle read to tell a fair-esm checkpoint named ``.pth`` from an esm state dict (its
#: names come before any tensor's bytes; a 36-layer state dict's whole pickle is some 50 KiB)
SNIFF_BYTES = 4 * 2**20


@dataclass(frozen=True)
class Release:
    """One release of the esm package: where its file lies and the sizes esm/pretrained.py builds."""

    repo: str  # hub repository
    file: str  # the state dict's path inside the snapshot
    layers: int
    dim: int
    heads: int


#: esm/pretrained.py (ESMC_300M_202412, ESMC_600M_202412) and esm/utils/constants/esm3.py (data_root)
RELEASES = {
    "esmc_300m": Release("EvolutionaryScale/esmc-300m-2024-12", "data/weights/esmc_300m_2024_12_v0.pth", 30, 960, 15),
    "esmc_600m": Release("EvolutionaryScale/esmc-600m-2024-12", "data/weights/esmc_600m_2024_12_v0.pth", 36, 1152, 18),
}


def release_of(spec: str) -> tuple[str, Release] | None:
    """The release ``spec`` names, by the esm package's name or by its hub name; None for a path."""
    for name, release in RELEASES.items():
        if spec in (name, release.repo):
            return name, release
    return None


def is_model_name(spec: str) -> bool:
    return release_of(spec) is not None


def _fair_esm_pickle(path: Path) -> bool:
    """Whether the pickle of ``path`` names fair-esm's layout (an ``argparse.Namespace`` config,
    ``encoder.sentence_encoder.`` keys): such a ``.pth`` stays ESM-2's (embedpipe.model.esm2).
    Reads the zip's ``data.pkl`` (or a legacy file's first bytes), no tensor data."""
    try:
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as archive:
                member = next((n for n in archive.namelist() if n.endswith("data.pkl")), None)
                if member is None:
                    return False
                with archive.open(member) as fh:
                    data = fh.read(SNIFF_BYTES)
        else:
            with open(path, "rb") as fh:
                data = fh.read(SNIFF_BYTES)
    except (OSError, zipfile.BadZipFile):
        return False  # the loader says what is wrong with it, in one line
    return b"argparse" in data or b"encoder.sentence_encoder." in data


def claims(spec: str) -> bool:
    """A release's name or hub name, or a ``.pth`` path that is not a fair-esm checkpoint."""
    if is_model_name(spec):
        return True
    path = Path(spec).expanduser()
    return path.suffix == ".pth" and not path.is_dir() and not (path.is_file() and _fair_esm_pickle(path))


def _prefetch(name: str, release: Release) -> str:
    return (f"ESM C {name!r} is not in the local hub cache ({hf.hub_cache()}: no {release.repo} snapshot holding "
            f"{release.file}), and embedpipe never downloads one: on a machine with internet run "
            f"`hf download {release.repo}` (or the esm package's ESMC.from_pretrained('{name}'), "
            "which fills the same cache) with HF_HOME on a file system this machine shares, or pass the .pth itself")


def weights_path(spec: str) -> Path:
    """The ``.pth`` ``spec`` resolves to (a name: its cached snapshot's file); a one-line error
    saying how to fetch a name that is not cached, or naming a path that is not there."""
    found = release_of(spec)
    if found is not None:
        name, release = found
        snapshot = hf.hub_snapshot(release.repo, holding=release.file)
        if snapshot is None:
            raise ModelError(_prefetch(name, release))
        return snapshot / release.file
    path = Path(spec).expanduser()
    if not path.is_file():
        raise ModelError(f"ESM C weights not found: {spec} (a .pth state dict as the esm package saves it)")
    return path.resolve()


def describe(spec: str) -> ModelFacts:
    """A release's sizes from :data:`RELEASES`; a path's file size (its sizes: ``inspect``); what it
    can do, ESM C's row's."""
    capabilities = families.ESMC.capabilities().facts_fields()
    found = release_of(spec)
    if found is None:
        path = Path(spec).expanduser()
        return ModelFacts(**capabilities, spec=spec, kind="path", name=path.stem,
                          weights_bytes=path.stat().st_size if path.is_file() else None)
    name, release = found
    parameters = esmc_spec.parameter_count(release.layers, release.dim, esmc_spec.swiglu_width(release.dim))
    try:
        size = weights_path(spec).stat().st_size
    except (ModelError, OSError):
        size = 4 * parameters  # not cached yet: its fp32 weights
    return ModelFacts(**capabilities, spec=spec, kind="name", name=name, num_layers=release.layers,
                      embed_dim=release.dim, attention_heads=release.heads, parameters=parameters, weights_bytes=size,
                      trained=True)


def file_identity(spec: str) -> ModelIdentity:
    """The ``.pth``'s sha256 (its sizes are its shapes; the vocabulary is fixed), ESM C's forward version."""
    from embedpipe.model.downloads import checkpoint_sha256

    return ModelIdentity(checkpoint_sha256(weights_path(spec)), families.ESMC.packs, {}, families.ESMC.versioned())


def model_files(spec: str) -> list[Path]:
    """The ``.pth`` a name or path resolves to (nothing downloaded): an input no output may replace."""
    try:
        return [weights_path(spec)]
    except ModelError:
        return []


def download_problem(name: str) -> str | None:
    """``None`` when the release is in the hub cache; else how to fetch it (one line)."""
    try:
        weights_path(name)
    except ModelError as exc:
        return str(exc)
    return None


def fetch_model(name: str, dest: Path | None = None) -> Path:
    """The cached ``.pth`` of release ``name``; ``--dest`` is refused (the hub cache decides where)."""
    if dest is not None:
        raise ModelError(f"fetch-model {name}: --dest is for fair-esm checkpoints; an ESM C release lives in the hub "
                         f"cache ({hf.hub_cache()}; set HF_HOME or HF_HUB_CACHE)")
    return weights_path(name)
