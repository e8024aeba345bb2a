"""What the workflow and the worker need to know about a model, and its memory arithmetic.

Torch-free on purpose: Snakemake parses ``workflows/rules/common.smk`` (which asks for these
facts) in every job, and importing torch costs 2.5 s there.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from embedpipe.model.layout import ESM2_LAYOUT, TokenLayout

#: Host memory of a job that loads the model: this slack plus a few copies of the fp32
#: weights (the loaded checkpoint, the fp32 model, a cast copy; docs/precision.md).
HOST_SLACK_BYTES = 2048 * 2**20
HOST_WEIGHT_COPIES = 3
#: Weights assumed when nothing is known yet (a test model the workflow has not written).
UNKNOWN_WEIGHTS_BYTES = 50 * 2**20
#: Snakemake's mem_mb is rounded up to this many MiB.
MEM_MB_STEP = 512


def host_bytes(weights_bytes: int | None) -> int:
    """Host memory for a job that loads weights of ``weights_bytes`` (None: unknown yet)."""
    weights = UNKNOWN_WEIGHTS_BYTES if weights_bytes is None else weights_bytes
    return HOST_SLACK_BYTES + HOST_WEIGHT_COPIES * weights


@dataclass(frozen=True)
class MemoryEstimate:
    """Memory one model needs under one precision policy (rough, for budgets, not limits)."""

    host_bytes: int  # host memory of a job that loads the model (see host_bytes())
    weight_bytes: int  # the weights as the policy holds them on the device
    activation_bytes_per_token: int  # working memory of one forward pass per padded token
    hidden_itemsize: int = 4  # bytes per value of a hidden state the forward returns
    widest_values_per_token: int = 0  # values per token of the forward's largest tensor (0: unknown)


@dataclass(frozen=True)
class ModelFacts:
    """A model spec described without loading weights (``embedpipe model-info``).

    ``kind`` is ``"name"`` (a registered name, resolved and fetched by the family) or
    ``"path"`` (a checkpoint file). Shape fields are ``None`` when they cannot be known
    without reading the checkpoint (a path, before :func:`embedpipe.model.inspect`).
    ``token_layout`` and ``packs``: the family's capabilities, from its row (:mod:`embedpipe.model.families`).
    ``weights_bytes``: fp32 weights for a name, the file's size for a path, ``None`` when
    the file does not exist yet.
    """

    family: str
    spec: str
    kind: str
    name: str
    trained_window: int
    num_layers: int | None = None
    embed_dim: int | None = None
    attention_heads: int | None = None
    parameters: int | None = None
    weights_bytes: int | None = None
    trained: bool | None = None
    token_layout: TokenLayout = ESM2_LAYOUT  # the family's special tokens (shard budgets follow it)
    #: whether the family prepares a packed runner, as its row declares (the workflow's checks read
    #: it); None: a family whose ``describe`` does not say (its loaded model's ``batch_layouts`` do)
    packs: bool | None = None

    def host_mem_mb(self, attempt: int = 1) -> int:
        """Snakemake ``mem_mb`` of a job that loads this model, scaled by the retry attempt."""
        mib = host_bytes(self.weights_bytes) / 2**20
        return int(math.ceil(mib * attempt / MEM_MB_STEP) * MEM_MB_STEP)

    def to_dict(self) -> dict[str, Any]:
        """The facts plus the memory the workflow asks for (``model-info --json``)."""
        return asdict(self) | {"token_layout": self.token_layout.to_dict(), "host_mem_mb": self.host_mem_mb()}
