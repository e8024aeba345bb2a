"""``EMBEDPIPE_ENGINE``, the one expert override of the engine choices (docs/precision.md, "Engine
choices"): parsed in one place (embedpipe/runtime/engine_override.py), each bad spelling one
line naming the variable, and the derived rules when it is unset. Expectations written by hand."""

from __future__ import annotations

import pytest

from embedpipe.core.errors import EmbedpipeError
from embedpipe.runtime.engine_override import VARIABLE, EngineChoice, from_environment, parse


def test_unset_or_empty_is_the_derived_rules() -> None:
    derived = EngineChoice(attention="sdpa", batch_layout="auto", attention_inputs="auto", fallback_device="auto")
    assert from_environment({}) == derived
    assert from_environment({VARIABLE: ""}) == derived
    assert parse(" , ") == derived


def test_every_key_and_spaces_around_it() -> None:
    got = parse("attention=math, batch_layout=padded ,attention_inputs = fp32,fallback_device=cpu")
    assert got == EngineChoice(attention="math", batch_layout="padded", attention_inputs="fp32", fallback_device="cpu")
    assert from_environment({VARIABLE: "fallback_device=same"}) == EngineChoice(fallback_device="same")


@pytest.mark.parametrize(("text", "message"), [
    ("attention=flash", "EMBEDPIPE_ENGINE: attention must be one of sdpa, math, fair-esm, not 'flash'"),
    ("batch_layout=ragged", "EMBEDPIPE_ENGINE: batch_layout must be one of auto, packed, padded, not 'ragged'"),
    ("attention_inputs=fp16", "EMBEDPIPE_ENGINE: attention_inputs must be one of auto, fp32, compute, not 'fp16'"),
    ("fallback_device=gpu", "EMBEDPIPE_ENGINE: fallback_device must be one of auto, same, cpu, not 'gpu'"),
    ("compile=on", "EMBEDPIPE_ENGINE: 'compile=on' is not KEY=VALUE with KEY one of attention, batch_layout, "
                   "attention_inputs, fallback_device"),
    ("math", "EMBEDPIPE_ENGINE: 'math' is not KEY=VALUE with KEY one of attention, batch_layout, "
             "attention_inputs, fallback_device"),
    ("attention=math,attention=sdpa", "EMBEDPIPE_ENGINE: attention given twice"),
    ("batch_layout=packed,attention=fair-esm",
     "EMBEDPIPE_ENGINE: batch_layout=packed attends with sdpa; attention=fair-esm runs padded batches only"),
])
def test_a_bad_override_is_one_line_naming_the_variable(text: str, message: str) -> None:
    with pytest.raises(EmbedpipeError) as refused:
        from_environment({VARIABLE: text})
    assert str(refused.value) == message


def test_fair_esm_refuses_exactly_the_policies_with_fp32_islands() -> None:
    fair = EngineChoice(attention="fair-esm")
    refused = {name for name in ("fp32", "fp16", "bf16", "amp-fp16", "amp-bf16", "fp16-mixed", "bf16-mixed",
                                 "int8-mixed") if fair.refusal(name)}
    assert refused == {"fp16-mixed", "bf16-mixed", "int8-mixed"}
    assert all(EngineChoice(attention=kernel).refusal("bf16-mixed") is None for kernel in ("sdpa", "math"))
