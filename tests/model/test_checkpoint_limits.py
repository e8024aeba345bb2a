"""Issue 19, E: a checkpoint's cfg is compared with its weights' shapes before anything is
built from it: a cfg claiming a huge width or depth is one line naming the file, the cfg key
and the mismatch, not a 4 TB allocation or a minute of building layers and a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from embedpipe.core.errors import ModelError
from embedpipe.model import inspect, load_model
from embedpipe.model.checkpoint import load_checkpoint_safely


def _edited(tiny_model_path: Path, tmp_path: Path, **cfg: int) -> Path:
    data = load_checkpoint_safely(tiny_model_path)
    for key, value in cfg.items():
        setattr(data["cfg"]["model"], key, value)
    path = tmp_path / "edited.pt"
    torch.save(data, path)
    return path


@pytest.mark.parametrize(("key", "value", "mismatch"), [  # within the bounds (issue 30: larger is refused first)
    ("encoder_embed_dim", 4096, r"embed_tokens\.weight has shape \(33, 32\) \(dim 32\)"),
    ("encoder_layers", 1000, r"the state dict holds layers 0\.\.1 \(2 distinct\) \(missing layers\.2\)"),
])
def test_a_cfg_the_weights_contradict_is_refused_before_the_model_is_built(tiny_model_path, tmp_path, key, value,
                                                                           mismatch):
    path = _edited(tiny_model_path, tmp_path, **{key: value})
    expected = rf"^{path}: weights do not fit the cfg: {key}={value}, but {mismatch}$"
    with pytest.raises(ModelError, match=expected):
        load_model(str(path))
    with pytest.raises(ModelError, match=expected):  # model-info (the workflow's mem_mb) too
        inspect(str(path))


def test_extra_layers_in_the_weights_are_named(tiny_model_path, tmp_path):
    path = _edited(tiny_model_path, tmp_path, encoder_layers=1)
    with pytest.raises(ModelError, match=r"encoder_layers=1, but the state dict holds layers 0\.\.1 .*unexpected layers\.1"):
        load_model(str(path))
