"""The int8 engine a test runs on this CPU: the one it names where that engine is exact here,
else (an engine this CPU or build lacks) the refusal is checked and the fastest exact engine
runs instead, so the suite checks the same properties on every CPU class and skips nothing."""

from __future__ import annotations

import pytest
import torch

from embedpipe.runtime import int8_kernels
from embedpipe.runtime.int8_linear import Int8Linear


def engine_here(engine: str, shape: tuple[int, int] = (64, 96)) -> str:
    """``engine`` when it is exact at some weight range on this CPU; else ``auto``, after checking
    that asking for it is refused in one line naming it (never silently another engine)."""
    if any(int8_kernels.timing_ms(engine, qmax, shape) is not None for qmax in int8_kernels.WEIGHT_RANGES):
        return engine
    with pytest.raises(RuntimeError, match=f"no int8 matmul engine reproduces the exact int32 sums.*{engine}"):
        Int8Linear(torch.randn(*shape), None, engine=engine)
    print(f"{engine} is exact at no weight range on this CPU: checked its refusal, testing the fastest exact engine")
    return "auto"


def assert_engine(layer: Int8Linear, engine: str) -> None:
    """The layer runs the engine asked for (``auto``: one of the engines, the fastest exact)."""
    assert layer.engine == engine if engine != "auto" else layer.engine in int8_kernels.ENGINES
