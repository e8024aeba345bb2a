"""A fake model family with a token layout of its own: no BOS, one EOS, a 512-residue window.

Everything the family is lives here, as a family's module must (docs/architecture.md): its
registration (``FAMILY``), ``describe`` (torch-free: Snakemake calls it while parsing the
rules), ``load``/``inspect``, its "sources" (nothing to download) and a deterministic toy
model: a token embedding, then ``LAYERS`` times tanh(x W), each token on its own, so that the
stored vectors of any window equal :func:`reference` on the residues alone. Registered in
any process through ``EMBEDPIPE_MODEL_FAMILIES=helpers.fake_family_layout`` (tests/ on PYTHONPATH):
the CLI and the workflow run it with no change to embedpipe.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from embedpipe.model import Family, MemoryEstimate, ModelFacts, TokenLayout

PREFIX = "layout:"
NAME = "fake-layout"
LETTERS = "ACDEFGHIKLMNPQRSTVWYXBUZO"
PAD, EOS = 0, 1
DIM, LAYERS, WINDOW = 8, 2, 512
LAYOUT = TokenLayout(bos=False, eos=True, window=WINDOW)


def _weights() -> tuple[np.ndarray, list[np.ndarray]]:
    rng = np.random.default_rng(7)
    table = rng.normal(size=(2 + len(LETTERS), DIM)).astype(np.float32)
    return table, [(rng.normal(size=(DIM, DIM)) / np.sqrt(DIM)).astype(np.float32) for _ in range(LAYERS)]


def ids(seq: str) -> list[int]:
    return [2 + LETTERS.index(c) for c in seq]


def reference(seq: str) -> dict[int, np.ndarray]:
    """Per-residue vectors of every layer, in numpy, on the residues alone (no EOS row)."""
    table, weights = _weights()
    x = table[ids(seq)].astype(np.float64)
    out = {0: x}
    for layer, w in enumerate(weights, start=1):
        x = np.tanh(x @ w)
        out[layer] = x
    return out


class Runner:
    def __init__(self, policy: Any, device: Any) -> None:
        import torch

        table, weights = _weights()
        self.table = torch.from_numpy(table).to(device, policy.weight_dtype)
        self.weights = [torch.from_numpy(w).to(device, policy.weight_dtype) for w in weights]

    def __call__(self, tokens: Any, layers: list[int]) -> Any:
        import torch

        from embedpipe.model.base import ForwardOutput, masked_max_abs

        keep = tokens.ne(PAD)
        x = self.table[tokens]
        hidden, max_abs = {0: x}, masked_max_abs(x, keep)
        for layer, w in enumerate(self.weights, start=1):
            x = torch.tanh(x @ w)
            hidden[layer] = x
            max_abs = torch.maximum(max_abs, masked_max_abs(x, keep))
        return ForwardOutput(hidden={k: hidden[k] for k in layers}, max_abs=max_abs)


@dataclass
class Model:
    name: str
    source: str = "fake-layout-weights"
    sha256: str = "1" * 64
    trained: bool = False
    num_layers: int = LAYERS
    embed_dim: int = DIM
    trained_window: int = WINDOW
    token_layout: TokenLayout = LAYOUT
    family: str = NAME
    batch_layouts: tuple[str, ...] = ("padded",)
    provenance: dict[str, str] = field(default_factory=dict)
    seen_widths: list[int] = field(default_factory=list)  # tokenized widths, for the tests

    def tokenize(self, sequences: Sequence[str]) -> Any:
        """(B, longest + 1): the residues, EOS, then padding."""
        import torch

        width = max(map(len, sequences)) + 1
        self.seen_widths.append(width)
        tokens = torch.full((len(sequences), width), PAD, dtype=torch.int64)
        for row, seq in enumerate(sequences):
            tokens[row, : len(seq) + 1] = torch.tensor(ids(seq) + [EOS])
        return tokens

    def prepare(self, policy: Any, device: Any, attention: str = "sdpa", *, attention_inputs: str = "fp32") -> Runner:
        return Runner(policy, device)

    def estimate_memory(self, policy: Any, *, attention_inputs: str = "fp32") -> MemoryEstimate:
        parameters = (2 + len(LETTERS)) * DIM + LAYERS * DIM * DIM
        return MemoryEstimate(host_bytes=4 * parameters, weight_bytes=policy.weight_dtype.itemsize * parameters,
                              activation_bytes_per_token=4 * DIM * 2)


def describe(spec: str) -> ModelFacts:
    return ModelFacts(family=NAME, spec=spec, kind="name", name=spec.removeprefix(PREFIX), trained_window=WINDOW,
                      num_layers=LAYERS, embed_dim=DIM, weights_bytes=2**20, trained=False, token_layout=LAYOUT)


def load(spec: str) -> Model:
    return Model(name=spec.removeprefix(PREFIX))


def inspect(facts: ModelFacts) -> ModelFacts:
    return facts


def download_problem(name: str) -> str | None:
    return None  # nothing to download


def fetch_model(name: str, dest: Path | None = None) -> Path:
    return Path("fake-layout-weights")


def _claims(spec: str) -> bool:
    return spec.startswith(PREFIX)


FAMILY = Family(NAME, _claims, describe, _claims, __name__, __name__)
