"""Hugging Face model directories: finding one (a path or a hub name), its config, its weights.

A spec is a Hugging Face model when it is a directory holding ``config.json``, or a hub name
(``org/name``) that is either one of :data:`HUB_NAMES` (the table's) or already in the local hub cache.
Hub names resolve through the cache only (``HF_HUB_CACHE``, else ``HF_HOME/hub``, else
``~/.cache/huggingface/hub``), as ``HF_HUB_OFFLINE=1`` does: embedpipe never downloads a
Hugging Face model; a name that is not cached is a one-line error saying how to pre-fetch it.

``model_type`` picks the family: the Hugging Face formats of
:data:`embedpipe.model.families.FAMILY_TABLE`, each with its :class:`~embedpipe.model.hf_families.HfFamily`
(``esm``: ESM-2 into the ESM-2 runner, ``t5``: ProtT5, ProstT5 and Ankh into the T5 encoder, ``esmc``
and ESM++'s ``ESMplusplus``: ESM C); a variant sharing a type is told apart by its ``takes``
(``esm`` with a pair vocabulary: SaProt; with absolute positions: ESM-1b/1v), rows sharing one
reading by make-test-model's marker, the hub name, then the tokenization style (:func:`format_for`);
any other type is refused. Untrained test directories (``embedpipe make-test-model --family``)
carry ``"embedpipe": {"trained": false, ...}`` in ``config.json``; without that key the weights
are taken as trained (docs/models.md). Torch-free until weights are read.
"""

from __future__ import annotations

import hashlib
import importlib
import math
import os
import re
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from embedpipe.core.errors import ModelError, out_of_memory
from embedpipe.core.jsonbounds import load_bounded_json
from embedpipe.model import families
from embedpipe.model.capabilities import Capabilities
from embedpipe.model.facts import ModelFacts
from embedpipe.model.families import Format
from embedpipe.model.hf_families import HfFamily, is_trained, marked_family
from embedpipe.model.identity import ModelIdentity, files_sha256
from embedpipe.model.optional import require

#: the table's Hugging Face formats, in its order (variants are asked in it)
FORMATS: tuple[Format, ...] = families.of_reader(families.HUGGING_FACE)
#: ``model_type`` -> the reading of the type itself (its variants aside), as refusals list them
MODEL_TYPES: dict[str, HfFamily] = {f.hf.model_type: f.hf for f in FORMATS if f.hf is not None and f.hf.takes is None}
#: Hub names embedpipe knows -> their format; others load too once they are cached.
HUB_NAMES: dict[str, Format] = {name: f for f in FORMATS for name in f.names}

_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_PREFETCH = ("on a machine with internet run `hf download {name}` (or "
             "`python -c \"import huggingface_hub; huggingface_hub.snapshot_download('{name}')\"`) with "
             "HF_HOME on a file system this machine shares, or pass the model's local directory")


def hub_cache() -> Path:
    """The Hugging Face hub cache, as huggingface_hub finds it."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME")
    return (Path(home).expanduser() if home else Path.home() / ".cache" / "huggingface") / "hub"


def hub_snapshot(name: str, holding: str = "config.json") -> Path | None:
    """The cached snapshot directory of hub model ``name`` (``refs/main``) that holds the file
    ``holding`` (a path inside the snapshot: an ``esm`` package release holds no config.json), or None."""
    repo = hub_cache() / ("models--" + name.replace("/", "--"))
    ref = repo / "refs" / "main"
    if ref.is_file():
        snapshot = repo / "snapshots" / ref.read_text().strip()
        return snapshot if (snapshot / holding).is_file() else None
    snapshots = sorted(p for p in (repo / "snapshots").glob("*") if (p / holding).is_file()) \
        if (repo / "snapshots").is_dir() else []
    return snapshots[-1] if len(snapshots) == 1 else None


def _is_hub_name(spec: str) -> bool:
    return bool(_HUB_NAME.match(spec)) and not Path(spec).expanduser().exists() and not spec.endswith(".pt")


def is_model_name(spec: str) -> bool:
    return spec in HUB_NAMES


def claims(spec: str) -> bool:
    """A directory with ``config.json``, a known hub name, or a hub name in the cache."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return (path / "config.json").is_file()
    return _is_hub_name(spec) and (spec in HUB_NAMES or hub_snapshot(spec) is not None)


def resolve_directory(spec: str) -> Path:
    """The model directory of ``spec``; a one-line error saying how to pre-fetch a hub name."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return path.resolve()
    snapshot = hub_snapshot(spec)
    if snapshot is None:
        raise ModelError(f"Hugging Face model {spec!r} is not in the local hub cache ({hub_cache()}), and "
                         f"embedpipe never downloads one: {_PREFETCH.format(name=spec)}")
    return snapshot


def read_config(directory: Path) -> dict[str, Any]:
    """``config.json`` as a dict, with a supported ``model_type``; one-line errors otherwise."""
    where = directory / "config.json"
    try:
        config = load_bounded_json(where.read_text(), str(where), ModelError)  # a crafted nesting: one line
    except OSError as exc:
        raise ModelError(f"cannot read {where}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ModelError(f"{where} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ModelError(f"{where} is not a JSON object")
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ModelError(f"{where}: model_type {model_type!r} is not supported (embedpipe reads "
                         f"{', '.join(repr(t) for t in MODEL_TYPES)}: "
                         f"{', '.join(f.label for f in MODEL_TYPES.values())})")
    return config


def weight_files(directory: Path) -> list[Path]:
    """The weight files: safetensors (single or sharded by an index) first, else pytorch_model.bin."""
    for index_name, single in (("model.safetensors.index.json", "model.safetensors"),
                               ("pytorch_model.bin.index.json", "pytorch_model.bin")):
        if (directory / single).is_file():
            return [directory / single]
        index = directory / index_name
        if index.is_file():
            try:
                names = sorted(set(load_bounded_json(index.read_text(), str(index), ModelError)["weight_map"].values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                raise ModelError(f"{index}: not a weight index (no 'weight_map' object)") from None
            missing = [n for n in names if not (directory / n).is_file()]
            if missing:
                raise ModelError(f"{index} names {missing[0]}, which is not in {directory}")
            return [directory / n for n in names]
    raise ModelError(f"{directory} holds no weights (model.safetensors or pytorch_model.bin)")


def weights_sha256(files: list[Path]) -> str:
    """One file: its sha256. Several: sha256 of their ``sha256sum``-style listing, sorted by name."""
    from embedpipe.core.checksums import file_sha256

    try:
        digests = [(file_sha256(f, cache=True), f.name) for f in files]
    except OSError as exc:
        raise ModelError(f"cannot read weights {exc.filename}: {exc.strerror or exc}") from None
    if len(digests) == 1:
        return digests[0][0]
    listing = "".join(f"{sha}  {name}\n" for sha, name in sorted(digests, key=lambda d: d[1]))
    return hashlib.sha256(listing.encode()).hexdigest()


def read_state_dict(files: list[Path]) -> dict[str, Any]:
    """Every tensor of ``files``: safetensors through the ``safetensors`` package, ``.bin``
    through embedpipe's weights-only torch load (nothing in the file is executed)."""
    state: dict[str, Any] = {}
    for path in files:
        if path.suffix == ".safetensors":
            torch_io = require("safetensors.torch", f"reading {path.name}")
            try:
                state.update(torch_io.load_file(str(path), device="cpu"))
            except Exception as exc:  # corrupt header, truncated file
                if out_of_memory(exc):  # no refusal: more memory may load it
                    raise
                raise ModelError(f"cannot read {path}: {' '.join(str(exc).split())[:200]}") from None
        else:
            from embedpipe.model.checkpoint import HF_WEIGHTS, load_checkpoint_safely

            state.update(load_checkpoint_safely(path, HF_WEIGHTS))
    return state


def hf_of(fmt: Format) -> HfFamily:
    """The Hugging Face reading of one of :data:`FORMATS`."""
    assert fmt.hf is not None, fmt.name  # FORMATS are the table's formats with one
    return fmt.hf


def format_for(spec: str, directory: Path, config: Mapping[str, Any]) -> Format:
    """The format of ``directory``, whose config :func:`read_config` accepted: the first variant of
    its ``model_type`` that takes it, else the type's own; of rows sharing one reading (T5), the one
    make-test-model's marker names, else the hub name's, else the one of the vocabulary's style."""
    model_type = config["model_type"]
    candidates = [f for f in FORMATS if hf_of(f).model_type == model_type]
    taken = next((f for f in candidates if (takes := hf_of(f).takes) is not None and takes(directory, config)), None)
    if taken is not None:
        return taken
    own = [f for f in candidates if hf_of(f).takes is None]
    if len(own) == 1:
        return own[0]
    marked = marked_family(config, tuple(f.name for f in own))
    named = next((f for f in own if f.name == marked or (marked is None and spec in f.names)), None)
    if named is not None:
        return named
    style = hf_of(own[0]).style
    found = style(directory) if style is not None else None
    return next(f for f in own if f.hf_style == found)


def capabilities(fmt: Format, config: Mapping[str, Any] | None) -> Capabilities:
    """What a model of ``fmt`` can do: its row's, with the window ``config`` sets (None: not cached yet)."""
    window = hf_of(fmt).window
    return families.row_of(fmt).capabilities(window(config) if window is not None and config is not None else None)


def describe(spec: str) -> ModelFacts:
    """Facts from ``config.json`` (no weights read, no torch); a name not cached yet is known by
    its row only."""
    path = Path(spec).expanduser()
    directory = path.resolve() if path.is_dir() else hub_snapshot(spec)
    if directory is None:
        fmt = HUB_NAMES.get(spec, FORMATS[0])
        return ModelFacts(**capabilities(fmt, None).facts_fields(), spec=spec, kind="name", name=spec.split("/")[-1],
                          trained=True)
    config = read_config(directory)
    fmt = format_for(spec, directory, config)
    # the same bounds as loading (model-info, the workflow's mem_mb): one line, nothing sized by them
    sizes = hf_of(fmt).sizes(config, str(directory / "config.json"))
    try:
        size = sum(f.stat().st_size for f in weight_files(directory))
    except ModelError:
        size = None
    return ModelFacts(
        **capabilities(fmt, config).facts_fields(), spec=spec, kind="path" if path.is_dir() else "name",
        name=directory.name if path.is_dir() else spec.split("/")[-1],
        num_layers=sizes["num_layers"], embed_dim=sizes["embed_dim"], attention_heads=sizes["attention_heads"],
        weights_bytes=size, trained=is_trained(config),
    )


def inspect(facts: ModelFacts) -> ModelFacts:
    """:func:`describe`'s facts and the parameter count, from the safetensors headers (a few KiB
    read, no weights; ``.bin`` weights: unknown)."""
    try:
        files = weight_files(resolve_directory(facts.spec))
    except ModelError:  # no weights yet: describe's facts still stand (loading says what is missing)
        return replace(facts)
    return replace(facts, parameters=stored_parameters(files))


#: a safetensors header larger than this is refused (the format's own limit is 100 MB)
MAX_HEADER_BYTES = 100_000_000


def stored_parameters(files: list[Path]) -> int | None:
    """The number of values the safetensors ``files`` store, read from their headers (None for
    ``.bin`` files, whose count needs unpickling); a header that is not one is a one-line error."""
    total = 0
    for path in files:
        if path.suffix != ".safetensors":
            return None
        try:
            with path.open("rb") as fh:
                size = int.from_bytes(fh.read(8), "little")
                if not 0 < size <= MAX_HEADER_BYTES:
                    raise ModelError(f"{path}: not a safetensors file (header length {size})")
                header = load_bounded_json(fh.read(size).decode("utf-8"), f"{path}: the safetensors header",
                                           ModelError)
        except OSError as exc:
            raise ModelError(f"cannot read {path}: {exc.strerror or exc}") from None
        except ValueError:
            raise ModelError(f"{path}: not a safetensors file (its header is not JSON)") from None
        try:
            for name, entry in header.items():
                if name != "__metadata__":
                    total += math.prod(int(n) for n in entry["shape"])
        except (AttributeError, KeyError, TypeError, ValueError):
            raise ModelError(f"{path}: not a safetensors file (a tensor without a shape)") from None
    return total


def load(spec: str) -> Any:
    """Load ``spec`` with the loader its format names (told the format: decided once)."""
    directory = resolve_directory(spec)
    config = read_config(directory)
    fmt = format_for(spec, directory, config)
    return importlib.import_module(fmt.loader).load_directory(spec, directory, config, fmt)


def file_identity(spec: str) -> ModelIdentity:
    """Weights, config and tokenizer sha256s, the family and its version, whether it packs,
    without reading the weights (docs/cluster.md, "Resuming, rerunning"); the files besides the
    weights are those the format's loader reads that decide the numbers (``config.json``, and
    ESM's ``vocab.txt`` or T5's tokenizer files: its ``identity_files``)."""
    directory = resolve_directory(spec)
    config = read_config(directory)
    fmt = format_for(spec, directory, config)
    row = families.row_of(fmt)
    return ModelIdentity(weights_sha256(weight_files(directory)), row.packs,
                         files_sha256(directory, hf_of(fmt).identity_files(directory, config)), row.versioned())
