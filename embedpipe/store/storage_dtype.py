"""What a storage dtype can hold and how it rounds: the one place the engine's overflow check
and ``validate``'s mean check read a storage dtype's limits from.

Floats answer from ``np.finfo``; signed integer storage (a quantized store) from ``np.iinfo``,
where a cast to the nearest integer errs by half a unit at most, and by nothing relative.
Unsigned integers hold no negative values and other dtypes no numbers: both are refused in one
line rather than guessed at.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import DTypeLike

from embedpipe.core.errors import StoreError


@dataclass(frozen=True)
class StorageLimits:
    """The numeric facts of one storage dtype."""

    dtype: np.dtype
    max_abs: float  # the largest |value| it holds, either sign (a signed integer: its max; -min is one more)
    relative_rounding: float  # a cast's largest relative error (unit roundoff, eps / 2; 0 for integers)
    absolute_rounding: float  # a cast's largest absolute error near zero (half a subnormal; 0.5 for integers)


def storage_limits(dtype: DTypeLike) -> StorageLimits:
    """The limits of ``dtype`` (a name such as ``"float16"``, or a numpy dtype)."""
    dt = np.dtype(dtype)
    if np.issubdtype(dt, np.floating):
        info = np.finfo(dt)
        return StorageLimits(dt, float(info.max), float(info.eps) / 2, float(info.smallest_subnormal) / 2)
    if np.issubdtype(dt, np.signedinteger):
        return StorageLimits(dt, float(np.iinfo(dt).max), 0.0, 0.5)
    if np.issubdtype(dt, np.unsignedinteger):
        raise StoreError(f"storage dtype {dt} holds no negative values; embeddings need a float or signed integer type")
    raise StoreError(f"storage dtype {dt} is not a float or integer type; embeddings cannot be stored in it")
