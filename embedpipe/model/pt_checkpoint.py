"""A model ``.pt`` (or a fair-esm name), told apart by its layout: loading it, its facts.

Three layouts share the suffix: fair-esm's ESM-2 (``cfg``) and ESM-1b / ESM-1v (``args``), both
built by :mod:`embedpipe.model.esm2`, and SaProt's esm-format checkpoint (``config``:
:mod:`embedpipe.model.saprot_checkpoint`), built into the same ESM-2 runner over SaProt's
alphabet. The file is read once, weights-only and memory-mapped (:mod:`embedpipe.model.checkpoint`);
its layout, not its name, decides. The registry's fair-esm families load through here.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import esm

from embedpipe.model import esm2, saprot_checkpoint, saprot_spec
from embedpipe.model.checkpoint import load_checkpoint_safely
from embedpipe.model.downloads import checkpoint_sha256, resolve_checkpoint
from embedpipe.model.facts import ModelFacts
from embedpipe.model.saprot import SaProtModel, saprot_alphabet


def load(spec: str) -> esm2.Esm2Model:
    """Resolve, checksum and safely load ``spec``: a fresh fp32 CPU model per call (SaProt's
    ``.pt``: a :class:`~embedpipe.model.saprot.SaProtModel`, stores say ``model_format = saprot-esm``)."""
    path = resolve_checkpoint(spec)
    sha = checkpoint_sha256(path)
    data = load_checkpoint_safely(path)
    if not saprot_checkpoint.is_saprot_layout(data):
        return esm2.from_checkpoint(spec, path, sha, data)
    where = str(path)
    info = saprot_checkpoint.checkpoint_info(data, where=where)
    state = saprot_checkpoint.state_dict(data, info)
    del data
    model, alphabet = esm2.build_model(info, state, where=where, alphabet=saprot_alphabet())
    return esm2.from_info(model, alphabet, info, name=path.stem, source=where, sha256=sha, kind=SaProtModel,
                          provenance={"fair_esm_version": getattr(esm, "__version__", "unknown"),
                                      "model_format": saprot_checkpoint.MODEL_FORMAT})


def inspect(facts: ModelFacts) -> ModelFacts:
    """A checkpoint path's facts completed from its config and parameter count (memory-mapped:
    its weights are never read); SaProt's ``.pt`` is family ``saprot`` with SaProt's layout."""
    path = Path(facts.spec).expanduser()
    data = load_checkpoint_safely(path)
    if not saprot_checkpoint.is_saprot_layout(data):
        return esm2.facts_of(facts, esm2.any_checkpoint_info(data, where=str(path)))
    info = saprot_checkpoint.checkpoint_info(data, where=str(path))
    shape = (info["num_layers"], info["embed_dim"], info["attention_heads"])
    return replace(facts, family=saprot_spec.FAMILY, num_layers=shape[0], embed_dim=shape[1],
                   attention_heads=shape[2], trained=info["trained"], token_layout=saprot_spec.LAYOUT,
                   packs=saprot_spec.PACKS, parameters=saprot_spec.parameter_count(*shape))
