"""``--overflow-margin`` watches the pre-norm residual stream of every layer, the last included
(issue 19, E): the last layer's largest activation was taken after ``emb_layer_norm_after``,
which hides a 6e4 activation in its feed-forward."""

from __future__ import annotations

import pytest
import torch

from embedpipe.core.options import EmbedOptions
from embedpipe.model import load_model
from helpers.engine import embedder_for

RECORDS = [("a", "ACDEFGHIKLMNPQRSTVWY"), ("b", "MKTAYIAKQRQISFVKSHFSRQ")]


def _bias(layer: int):
    def edit(state: dict[str, torch.Tensor]) -> None:
        state[f"layers.{layer}.fc2.bias"][3] = 6e4  # one channel of the FFN's output: 6e4, finite in fp16
    return edit


@pytest.mark.parametrize("layer", [0, 1], ids=["first-layer", "last-layer"])
def test_a_large_feed_forward_activation_is_caught_in_every_layer(model_factory, layer):
    path = model_factory(layers=2, dim=32, heads=4, seed=31, edit=_bias(layer))
    options = EmbedOptions(precision="fp16", overflow_margin=0.5, device="cpu", layers=(-1,))
    embedder = embedder_for(load_model(str(path)), options, torch.device("cpu"))
    records = dict(embedder.embed(RECORDS))
    for record in records.values():
        assert record.max_abs_activation >= 0.5 * 65504  # what the fp16 forward saw
        assert record.precision_used == "fp32"
        assert "overflow-margin" in record.fallback_reason or "nonfinite" in record.fallback_reason
    if layer == 1:  # the last layer: the stream is finite, so the margin is the reason
        assert {r.fallback_reason for r in records.values()} == {"overflow-margin"}


def test_without_the_margin_the_last_layer_activation_is_kept(model_factory):
    """The control: fp16 holds 6e4, so without a margin nothing falls back."""
    path = model_factory(layers=2, dim=32, heads=4, seed=31, edit=_bias(1))
    options = EmbedOptions(precision="fp16", device="cpu", layers=(-1,))
    records = dict(embedder_for(load_model(str(path)), options, torch.device("cpu")).embed(RECORDS))
    assert {r.precision_used for r in records.values()} == {"fp16"}
