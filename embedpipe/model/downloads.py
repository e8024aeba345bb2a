"""The fair-esm reader: names and checkpoint paths, their facts, the torch hub cache, downloads.

A fair-esm name (the names of the fair-esm reader's formats in
:data:`embedpipe.model.families.FAMILY_TABLE`: ESM-2, ESM-1b, ESM-1v) resolves through the torch hub
cache (``torch.hub.get_dir()/checkpoints/NAME.pt``, the file fair-esm itself uses) and is
downloaded from fair-esm's URL when it is not there yet; any other spec is a checkpoint path,
whose layout says its format (:func:`embedpipe.model.families.pt_format`).
The ``NAME-contact-regression.pt`` companion is fetched alongside (ESM-1v has none) and never required.
"""

from __future__ import annotations

import os
import socket
import urllib.error
import urllib.request
import warnings
from pathlib import Path

from embedpipe.core.atomic import atomic_path
from embedpipe.core.checksums import file_sha256
from embedpipe.core.errors import ModelError, one_line
from embedpipe.core.output_guard import guard_outputs
from embedpipe.core.progress import progress_bar
from embedpipe.model import esm1b_spec, families
from embedpipe.model.facts import ModelFacts
from embedpipe.model.identity import ModelIdentity

#: Same URL scheme as fair-esm's ``esm/pretrained.py``.
MODEL_URL = "https://dl.fbaipublicfiles.com/fair-esm/models/{name}.pt"
REGRESSION_URL = "https://dl.fbaipublicfiles.com/fair-esm/regression/{name}-contact-regression.pt"

#: Socket timeout (seconds) for downloads: a node without internet fails fast.
PROBE_TIMEOUT_S = 5.0  # the workflow's start-up check that a download would answer
DOWNLOAD_TIMEOUT_S = 30.0

#: Set to 1/true/yes to never attempt a download while resolving a name (``fetch_model``
#: still downloads when called explicitly).
OFFLINE_ENV = "EMBEDPIPE_OFFLINE"


def is_model_name(spec: str) -> bool:
    """Whether ``spec`` is a fair-esm name embedpipe reads (ESM-2, ESM-1b, ESM-1v)."""
    return families.named(spec, families.FAIR_ESM) is not None


def valid_names() -> str:
    return ", ".join(name for fmt in families.of_reader(families.FAIR_ESM) for name in fmt.names)


def claims(spec: str) -> bool:
    """fair-esm takes every spec: its names, and any path (a checkpoint, checked on load)."""
    return True


def describe(spec: str) -> ModelFacts:
    """Facts of a fair-esm name from its format's name table (trained fp32 weights), or of a path
    from its file size, as ESM-2's until its header is read (``inspect``); no torch."""
    fmt = families.named(spec, families.FAIR_ESM)
    if fmt is not None and fmt.name_sizes is not None:
        (layers, dim, heads), parameters = fmt.name_sizes(spec)
        return ModelFacts(**families.row_of(fmt).capabilities().facts_fields(), spec=spec, kind="name", name=spec,
                          num_layers=layers, embed_dim=dim, attention_heads=heads, parameters=parameters,
                          weights_bytes=4 * parameters, trained=True)
    path = Path(spec).expanduser()
    size = path.stat().st_size if path.is_file() else None
    return ModelFacts(**families.row_of(families.pt_format({})).capabilities().facts_fields(), spec=spec, kind="path",
                      name=path.stem, weights_bytes=size)


def hub_checkpoint_path(name: str) -> Path:
    """Where fair-esm (torch hub) keeps ``name``: ``torch.hub.get_dir()/checkpoints/NAME.pt``.

    ``torch.hub.get_dir()`` follows ``TORCH_HOME`` (default ``~/.cache/torch``).
    """
    import torch  # the hub's directory is torch's to decide; the module itself stays torch-free (model-info)

    return Path(torch.hub.get_dir()) / "checkpoints" / f"{name}.pt"


def companion_path(path: Path) -> Path:
    """The contact-regression companion of a checkpoint, named as fair-esm expects it."""
    path = Path(path)
    return Path(str(path.with_suffix("")) + "-contact-regression.pt")


def model_files(spec: str) -> list[Path]:
    """The checkpoint a fair-esm name or path resolves to and its contact-regression companion,
    which fair-esm's loader reads beside it (nothing downloaded): inputs no output may replace."""
    path = hub_checkpoint_path(spec) if is_model_name(spec) else Path(spec).expanduser()
    return [path, companion_path(path)] if path.is_file() else []


def checkpoint_sha256(path: Path) -> str:
    """:func:`embedpipe.core.checksums.file_sha256`, cached per unchanged file (checkpoints are
    gigabytes), with an unreadable file as a ``ModelError``."""
    try:
        return file_sha256(path, cache=True)
    except OSError as exc:
        raise ModelError(f"cannot read checkpoint {path}: {exc.strerror or exc}") from None


def _offline() -> bool:
    return os.environ.get(OFFLINE_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


DEMO_COMMAND = "snakemake --cores 2 --configfile configs/offline-demo.yaml"


def _offline_message(name: str, target: Path, reason: str, *, fetching: bool = False) -> str:
    """How to get model ``name`` on a machine that cannot download it; ``fetching`` when the
    user already ran fetch-model here (then telling them to run it is no help)."""
    where = (
        "run this same command where the internet is reachable (a login node), with TORCH_HOME "
        "(or --dest) on a file system this machine shares"
        if fetching else
        f"on a machine with internet run `embedpipe fetch-model {name}` (it fills the torch hub "
        "cache; point TORCH_HOME at a shared directory, or use --dest DIR and pass that file)"
    )
    return (
        f"model {name!r} is not in the local cache ({target}) and could not be downloaded from "
        f"{MODEL_URL.format(name=name)} ({reason}). Fix: {where}; or pass a local fair-esm .pt "
        f"checkpoint path as the model; or run the offline demo, which needs no download: {DEMO_COMMAND}"
    )


def download_problem(name: str, *, timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """Why fair-esm model ``name`` cannot be had here (``None``: it is cached, or its download
    answers). The workflow asks this when it starts, so an offline run stops before any job
    with the fix, not after a failed job (docs/cluster.md, offline compute nodes)."""
    target = hub_checkpoint_path(name)
    if target.is_file():
        return None
    if _offline():
        return _offline_message(name, target, f"{OFFLINE_ENV} is set")
    request = urllib.request.Request(MODEL_URL.format(name=name), method="HEAD", headers={"User-Agent": "embedpipe"})
    try:
        with urllib.request.urlopen(request, timeout=timeout):
            return None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return _offline_message(name, target, _network_reason(exc))


def resolve_checkpoint(spec: str) -> Path:
    """The checkpoint file for a model spec.

    A fair-esm name resolves to the torch hub cache and is downloaded when missing (unless
    ``EMBEDPIPE_OFFLINE`` is set); offline, a ``ModelError`` says how to pre-fetch it. Any
    other spec is a path that must exist.
    """
    spec = str(spec)
    if is_model_name(spec):
        target = hub_checkpoint_path(spec)
        if target.is_file():
            return target
        if _offline():
            raise ModelError(_offline_message(spec, target, f"{OFFLINE_ENV} is set"))
        return fetch_model(spec, fetching=False)
    path = Path(spec).expanduser()
    if path.is_file():
        return path.resolve()
    if path.exists():
        raise ModelError(f"model path {spec} is not a file (expected a fair-esm .pt checkpoint)")
    looks_like_path = spec.endswith(".pt") or os.sep in spec or "/" in spec
    if looks_like_path:
        raise ModelError(f"model checkpoint not found: {spec}")
    raise ModelError(
        f"unknown model {spec!r}: use a fair-esm name ({valid_names()}) or a path to a "
        f"checkpoint in fair-esm's format (e.g. one written by `embedpipe make-test-model`)"
    )



def _download(url: str, dest: Path, *, timeout: float = DOWNLOAD_TIMEOUT_S) -> None:
    """Stream ``url`` into ``dest`` (a temporary file the caller renames). Raises on failure,
    including a short read (fewer bytes than Content-Length)."""
    request = urllib.request.Request(url, headers={"User-Agent": "embedpipe"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        length = response.headers.get("Content-Length")
        total = int(length) if length and length.isdigit() else None
        received = 0
        with open(dest, "wb") as fh, progress_bar(
            total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=Path(url).name
        ) as bar:
            while chunk := response.read(1024 * 1024):
                fh.write(chunk)
                received += len(chunk)
                bar.update(len(chunk))
    if total is not None and received != total:
        raise OSError(f"download truncated: {received} of {total} bytes")


def _fetch_one(url: str, target: Path) -> None:
    with atomic_path(target) as tmp:
        _download(url, tmp)
        if tmp.stat().st_size == 0:
            raise OSError("empty download")


def _network_reason(exc: BaseException) -> str:
    if isinstance(exc, urllib.error.HTTPError):
        return f"HTTP {exc.code} {exc.reason}"
    if isinstance(exc, urllib.error.URLError):
        return f"network error: {one_line(exc.reason)}"
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return "network timeout"
    return one_line(exc) or type(exc).__name__


def fetch_model(name: str, dest: Path | None = None, *, fetching: bool = True) -> Path:
    """Download fair-esm model ``name`` (and its small contact-regression companion) into
    ``dest`` (a directory) or the torch hub cache; return the checkpoint path.

    Files are written under a temporary name and renamed, so an interrupted download never
    leaves a partial checkpoint. An already present checkpoint is not downloaded again.
    ``fetching``: called by ``embedpipe fetch-model`` (an offline error then does not
    suggest running it), not on behalf of another command.
    """
    if not is_model_name(name):
        raise ModelError(f"unknown model {name!r}: fetch-model takes one of {valid_names()}")
    if dest is None:
        target = hub_checkpoint_path(name)
    else:
        dest = Path(dest).expanduser()
        if dest.exists() and not dest.is_dir():
            raise ModelError(f"--dest {dest} exists and is not a directory")
        target = dest / f"{name}.pt"
    guard_outputs("fetch-model", [("checkpoint", target), ("companion", companion_path(target))])
    if not target.is_file():
        if _offline():
            raise ModelError(_offline_message(name, target, f"{OFFLINE_ENV} is set", fetching=fetching))
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ModelError(f"cannot create {target.parent}: {exc.strerror or exc}") from None
        try:
            _fetch_one(MODEL_URL.format(name=name), target)
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise ModelError(_offline_message(name, target, _network_reason(exc), fetching=fetching)) from None
    companion = companion_path(target)
    if not companion.is_file() and esm1b_spec.has_contact_regression(name):
        try:
            _fetch_one(REGRESSION_URL.format(name=name), companion)
        except (urllib.error.URLError, OSError, ValueError) as exc:
            # Only fair-esm's contact prediction needs it; embeddings do not.
            warnings.warn(
                f"could not download the contact-regression companion of {name} "
                f"({_network_reason(exc)}); embeddings do not need it",
                stacklevel=2,
            )
    return target


def file_identity(spec: str) -> ModelIdentity:
    """The checkpoint's sha256 (its config is inside), whether its family packs, and its family
    (``esm2 v1``, ``esm1b v1``, ``saprot v1``: a name's from its format, a path's from the
    checkpoint's layout), weights unread, except in a legacy non-zip file, which torch reads whole;
    both read from the family's row."""
    path = resolve_checkpoint(spec)
    fmt = families.named(spec, families.FAIR_ESM)
    if fmt is None:
        from embedpipe.model.checkpoint import load_checkpoint_safely

        fmt = families.pt_format(load_checkpoint_safely(path))
    row = families.row_of(fmt)
    return ModelIdentity(checkpoint_sha256(path), row.packs, {}, row.versioned())
