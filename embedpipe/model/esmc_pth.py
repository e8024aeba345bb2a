"""ESM C from the ``esm`` package's ``.pth`` state dict, on embedpipe's ESM C forward; and a
random-weight one for tests (``make-test-model --family esmc-pth``).

The file is ``ESMC.state_dict()`` (esm/models/esmc.py): the names ESM++ kept
(:data:`embedpipe.model.esmc.ESM_PLUSPLUS`, read by the same :func:`~embedpipe.model.esmc.esmc_weights`),
no config. The sizes are the shapes': the width is ``embed.weight``'s, the layers the
``transformer.blocks`` present, the heads width / 64 and the SwiGLU width ESM C's 8/3 rule, as the
esm package builds every release; a named release must have its own sizes (esm/pretrained.py).
Read with ``torch.load(weights_only=True)``. The untrained marker of a test file is the state
dict's ``_metadata["embedpipe"]`` (``{"trained": false, ...}``), which ``load_state_dict`` ignores.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from embedpipe.core.atomic import atomic_paths, check_output_path
from embedpipe.core.errors import ModelError
from embedpipe.core.output_guard import writing_outputs
from embedpipe.model import esmc_pth_spec as spec_module
from embedpipe.model import esmc_spec, families
from embedpipe.model.checkpoint import FileRole, load_checkpoint_safely, validate_shape
from embedpipe.model.downloads import checkpoint_sha256
from embedpipe.model.esmc import ESM_PLUSPLUS, TRANSFORMERS, EsmcModel, esmc_weights
from embedpipe.model.esmc_forward import EsmcShape
from embedpipe.model.facts import ModelFacts
from embedpipe.model.hf_families import MARKER_KEY

#: how a refusal names the file
ESM_PTH = FileRole("ESM C state dict", "an ESM C state dict as the esm package saves it", "only tensors")
_BLOCK = re.compile(r"^transformer\.blocks\.(\d+)\.")


def read_state(path: Path) -> dict[str, Any]:
    """The state dict (weights-only, memory-mapped), every value a tensor; one line otherwise."""
    state = load_checkpoint_safely(path, ESM_PTH)
    for key, value in state.items():
        if not isinstance(key, str):
            raise ModelError(f"{path} is not {ESM_PTH.article}: a key {key!r} that is not a weight's name")
        if not isinstance(value, torch.Tensor):
            raise ModelError(f"{path} is not {ESM_PTH.article}: {key!r} holds a {type(value).__name__}, not a tensor")
    return state


def shape_of(state: Mapping[str, Any], where: str) -> EsmcShape:
    """The shape the weights say: the width of ``embed.weight``, the blocks present, heads of 64."""
    embed = state.get("embed.weight")
    if embed is None or embed.dim() != 2:
        raise ModelError(f"{where} is not {ESM_PTH.article}: no 2-D embed.weight")
    rows, dim = (int(n) for n in embed.shape)
    if rows != spec_module.EMBED_ROWS:
        raise ModelError(f"{where}: embed.weight has {rows} rows, ESM C's embedding has {spec_module.EMBED_ROWS}")
    if dim % spec_module.HEAD_DIM:
        raise ModelError(f"{where}: embed.weight is {dim} wide, not a multiple of ESM C's head width "
                         f"{spec_module.HEAD_DIM}")
    blocks = {int(m[1]) for key in state if (m := _BLOCK.match(key))}
    if not blocks:
        raise ModelError(f"{where} is not {ESM_PTH.article}: no transformer.blocks")
    layers, dim, heads = validate_shape(max(blocks) + 1, dim, dim // spec_module.HEAD_DIM, where=where,
                                        fields=("transformer.blocks", "embed.weight's width", "heads"))
    return EsmcShape(num_layers=layers, dim=dim, heads=heads, ffn=esmc_spec.swiglu_width(dim),
                     rope_theta=spec_module.ROPE_THETA, pad_id=esmc_spec.PAD)


def untrained_marker(state: Mapping[str, Any]) -> Any:
    """make-test-model's marker (the state dict's ``_metadata["embedpipe"]``), or None."""
    metadata = getattr(state, "_metadata", None)
    return metadata.get(MARKER_KEY) if isinstance(metadata, Mapping) else None


def is_trained(state: Mapping[str, Any]) -> bool:
    """False when the marker says so (anything but ``trained: true`` in it)."""
    mark = untrained_marker(state)
    return mark is None or (isinstance(mark, Mapping) and mark.get("trained") is True)


def load(spec: str) -> EsmcModel:
    """An :class:`EsmcModel` from a release's name, its hub name or a ``.pth`` path."""
    path = spec_module.weights_path(spec)
    where = str(path)
    state = read_state(path)
    shape = shape_of(state, where)
    found = spec_module.release_of(spec)
    if found is not None:
        name, release = found
        if (shape.num_layers, shape.dim, shape.heads) != (release.layers, release.dim, release.heads):
            raise ModelError(f"{where} is not {name}: its weights are an ESM C of {shape.num_layers} layers, width "
                             f"{shape.dim}, where {name} has {release.layers} layers, width {release.dim} "
                             f"({release.heads} heads)")
    weights = esmc_weights(state, shape, spec_module.EMBED_ROWS, where, ESM_PLUSPLUS, "embed.weight's width")
    return EsmcModel(weights=weights, shape=shape, name=found[0] if found else path.stem, source=where,
                     sha256=checkpoint_sha256(path), trained=is_trained(state), **families.ESMC.capabilities().model_fields(),
                     provenance={"model_format": spec_module.MODEL_FORMAT})


def inspect(facts: ModelFacts) -> ModelFacts:
    """A path's facts completed from its shapes (memory-mapped: the weights stay unread)."""
    path = spec_module.weights_path(facts.spec)
    state = read_state(path)
    shape = shape_of(state, str(path))
    return replace(facts, num_layers=shape.num_layers, embed_dim=shape.dim, attention_heads=shape.heads,
                   parameters=sum(int(v.numel()) for v in state.values()), trained=is_trained(state))


# --------------------------------------------------------------------------- test files


def esm_state(transformers_state: Mapping[str, torch.Tensor], layers: int) -> dict[str, torch.Tensor]:
    """``EsmcModel`` weights (transformers' names) under the esm package's: q/k/v and gate/up
    concatenated in the order the key maps give them (the same tensors, not copies of other values)."""
    out: dict[str, torch.Tensor] = {}
    pairs = [(TRANSFORMERS.outside[n], ESM_PLUSPLUS.outside[n]) for n in TRANSFORMERS.outside]
    for i in range(layers):
        ours, theirs = TRANSFORMERS.layer.format(i=i), ESM_PLUSPLUS.layer.format(i=i)
        pairs += [(tuple(ours + t for t in TRANSFORMERS.per_layer[n]), tuple(theirs + t for t in ESM_PLUSPLUS.per_layer[n]))
                  for n in TRANSFORMERS.per_layer]
    for source, (target,) in pairs:
        out[target] = torch.cat([transformers_state[t] for t in source]).contiguous()
    return out


def sequence_head(dim: int, seed: int) -> dict[str, torch.Tensor]:
    """The esm package's ``RegressionHead(d_model, 64)`` (Linear, GELU, LayerNorm, Linear), drawn in
    ``seed``: in the file as in a release, dropped on load."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {"0.weight": (dim, dim), "0.bias": (dim,), "2.weight": (dim,), "2.bias": (dim,),
              "3.weight": (spec_module.EMBED_ROWS, dim), "3.bias": (spec_module.EMBED_ROWS,)}
    return {f"sequence_head.{k}": 0.1 * torch.randn(*shape, generator=gen) for k, shape in shapes.items()}


def _is_test_file(path: Path) -> bool:
    try:
        mark = untrained_marker(load_checkpoint_safely(path, ESM_PTH))
    except (OSError, ModelError):
        return False
    return isinstance(mark, Mapping) and mark.get("created_by") == "embedpipe make-test-model"


def make_test_model(out: Path, *, layers: int = 2, dim: int = 128, heads: int | None = None, seed: int = 0,
                    family: str = "esmc-pth") -> Path:
    """A random-weight ESM C ``.pth`` in the esm package's layout, with the untrained marker
    (``family``: the format its marker names, ``make-test-model --family``).

    Its weights are :func:`~embedpipe.model.random_hf.random_esmc`'s for ``seed`` at ESM C's SwiGLU
    width: the weights ``make_hf_test_model(..., family="esmc", d_ff=swiglu_width(dim))`` writes as
    an ``EsmcModel`` (a test compares the two stores); the sequence head is drawn besides them.
    ``heads``: width / 64 when None, and refused otherwise (every release's rule).
    """
    from embedpipe.model.random_checkpoint import save
    from embedpipe.model.random_hf import marker, random_esmc

    out = Path(out)
    heads = dim // spec_module.HEAD_DIM if heads is None else heads
    layers, dim, heads = validate_shape(layers, dim, heads, where="make-test-model")
    if out.suffix != ".pth":
        raise ModelError(f"make-test-model --family esmc-pth: {out} must end in .pth (how embedpipe tells the "
                         "esm package's state dicts)")
    if dim % spec_module.HEAD_DIM or heads != dim // spec_module.HEAD_DIM:
        raise ModelError(f"make-test-model --family esmc-pth: ESM C's heads are {spec_module.HEAD_DIM} wide: --dim "
                         f"a multiple of 64 and --heads dim / 64 (e.g. --dim 128 --heads 2), not {dim} and {heads}")
    state: OrderedDict[str, torch.Tensor] = OrderedDict(
        esm_state(random_esmc(layers, dim, heads, esmc_spec.swiglu_width(dim), seed), layers))
    state |= sequence_head(dim, seed + 1)
    state._metadata = OrderedDict({MARKER_KEY: marker(family, seed)})  # type: ignore[attr-defined]
    with writing_outputs("make-test-model", [("OUT", out)]):
        if out.exists() and not (out.is_file() and _is_test_file(out)):
            raise ModelError(f"make-test-model: {out} exists and is not a test model make-test-model wrote; "
                             "refusing to replace it (remove it or choose another path)")
        check_output_path(out)
        with atomic_paths(out) as (tmp,):
            save(state, tmp)
    return out
