"""A fake model family with a token layout of its own: no BOS, one EOS, a 512-residue window.

Everything the family is lives here, as a family's module must (docs/architecture.md): its
registration (``FAMILY``), ``describe`` (torch-free: Snakemake calls it while parsing the
rules), ``load``/``inspect``, its "sources" (nothing to download) and a deterministic toy
model (:class:`Toy`: a token embedding, then ``LAYERS`` times tanh(x W), each token on its own), so
that the stored vectors of any window equal :func:`reference` on the residues alone; the toy with
another layout is also the family of tests/model/test_model_interface.py. Registered in
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
from embedpipe.model.capabilities import batch_layouts

PREFIX = "layout:"
NAME = "fake-layout"
LETTERS = "ACDEFGHIKLMNPQRSTVWYXBUZO"
PAD, EOS, BOS = 0, 1, 2  # token ids; residues from 3
DIM, LAYERS, WINDOW = 8, 2, 512
LAYOUT = TokenLayout(bos=False, eos=True, window=WINDOW)


@dataclass(frozen=True)
class Toy:
    """A toy family's numbers: its token layout, its letters and the seed of its weights. This
    family is ``TOY``; tests/model/test_model_interface.py builds another (no special tokens)."""

    layout: TokenLayout
    letters: str = LETTERS
    seed: int = 7

    def weights(self) -> tuple[np.ndarray, list[np.ndarray]]:
        rng = np.random.default_rng(self.seed)
        table = rng.normal(size=(3 + len(self.letters), DIM)).astype(np.float32)
        return table, [(rng.normal(size=(DIM, DIM)) / np.sqrt(DIM)).astype(np.float32) for _ in range(LAYERS)]

    def ids(self, seq: str) -> list[int]:
        """The tokens of ``seq``: BOS and EOS where the layout puts them."""
        return [BOS] * self.layout.bos + [3 + self.letters.index(c) for c in seq] + [EOS] * self.layout.eos

    def reference(self, seq: str) -> dict[int, np.ndarray]:
        """Per-residue vectors of every layer, in numpy, on the residues alone (no BOS/EOS row)."""
        table, weights = self.weights()
        x = table[[3 + self.letters.index(c) for c in seq]].astype(np.float64)
        out = {0: x}
        for layer, w in enumerate(weights, start=1):
            x = np.tanh(x @ w)
            out[layer] = x
        return out


TOY = Toy(LAYOUT)
reference = TOY.reference


class Runner:
    """Token embedding, then ``LAYERS`` times tanh(x W): each token on its own."""

    def __init__(self, toy: Toy, policy: Any, device: Any) -> None:
        import torch

        table, weights = toy.weights()
        self.table = torch.from_numpy(table).to(device, policy.weight_dtype)
        self.weights = [torch.from_numpy(w).to(device, policy.weight_dtype) for w in weights]

    @property
    def fp32_layers(self) -> dict[str, str]:
        """No policy keeps a toy layer in fp32 (the Runner interface asks every runner)."""
        return {}

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
    toy: Toy = TOY
    source: str = "fake-layout-weights"
    sha256: str = "1" * 64
    trained: bool = False
    num_layers: int = LAYERS
    embed_dim: int = DIM
    family: str = NAME
    batch_layouts: tuple[str, ...] = batch_layouts(False)  # as describe declares: padded only
    provenance: dict[str, str] = field(default_factory=dict)
    seen_widths: list[int] = field(default_factory=list)  # tokenized widths, for the tests

    @property
    def token_layout(self) -> TokenLayout:
        return self.toy.layout

    @property
    def trained_window(self) -> int:
        return self.toy.layout.window

    def tokenize(self, sequences: Sequence[str]) -> Any:
        """(B, longest + the layout's extra tokens): BOS, the residues, EOS, then padding."""
        import torch

        width = max(map(len, sequences)) + self.toy.layout.extra_tokens
        self.seen_widths.append(width)
        tokens = torch.full((len(sequences), width), PAD, dtype=torch.int64)
        for row, seq in enumerate(sequences):
            ids = self.toy.ids(seq)
            tokens[row, : len(ids)] = torch.tensor(ids)
        return tokens

    def prepare(self, policy: Any, device: Any, attention: str = "sdpa", *, attention_inputs: str = "fp32") -> Runner:
        return Runner(self.toy, policy, device)

    def estimate_memory(self, policy: Any, *, attention_inputs: str = "fp32") -> MemoryEstimate:
        parameters = (3 + len(self.toy.letters)) * DIM + LAYERS * DIM * DIM
        return MemoryEstimate(host_bytes=4 * parameters, weight_bytes=policy.weight_dtype.itemsize * parameters,
                              activation_bytes_per_token=4 * DIM * 2)


def describe(spec: str) -> ModelFacts:
    return ModelFacts(family=NAME, spec=spec, kind="name", name=spec.removeprefix(PREFIX), trained_window=WINDOW,
                      num_layers=LAYERS, embed_dim=DIM, weights_bytes=2**20, trained=False, token_layout=LAYOUT,
                      packs=False)


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
