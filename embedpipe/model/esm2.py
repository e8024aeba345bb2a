"""ESM-2 through fair-esm: building from a checkpoint, tokens, preparing under a policy.

:func:`load_checkpoint` returns an :class:`Esm2Model`, embedpipe's :class:`~embedpipe.model.base.EmbeddingModel`
for fair-esm's ``ESM2``; its runners are :class:`~embedpipe.model.esm2_forward.EsmForward`. A
checkpoint in ESM-1b's layout (ESM-1b, ESM-1v: :mod:`embedpipe.model.esm1b`) becomes an
``Esm2Model`` of family ``esm1b`` around fair-esm's ``ProteinBertModel``, run by the same forward.
Which tensors are ESM-2's fp32 islands and the rotary caches are ESM-2 specific and live
here; the policies themselves, and how they cast a copy, are in :mod:`embedpipe.runtime.precision`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import esm
import numpy as np
import torch
from esm.model.esm1 import ProteinBertModel
from esm.model.esm2 import ESM2
from torch.overrides import TorchFunctionMode

from embedpipe.core.errors import ModelError, out_of_memory
from embedpipe.model import downloads, esm1b, esm1b_spec, esm2_spec, families
from embedpipe.model.base import EmbeddingModel, TokenLayout
from embedpipe.model.capabilities import Capabilities
from embedpipe.model.checkpoint import CONTACT_KEYS, checkpoint_info, load_checkpoint_safely, upgrade_state_dict
from embedpipe.model.downloads import companion_path, one_line
from embedpipe.model.esm2_forward import EsmForward, FairEsmModule
from embedpipe.model.facts import MemoryEstimate, ModelFacts
from embedpipe.runtime.precision import Policy

#: Protein letters with their own ESM-2 token; any other byte maps to <unk>.
PROTEIN_LETTERS = "ACDEFGHIKLMNPQRSTVWYXBUZO"


def esm2_alphabet() -> esm.data.Alphabet:
    return esm.data.Alphabet.from_architecture("ESM-1b")


@dataclass
class Esm2Model:
    """A ready ESM-2 (or ESM-1b): eval mode, fp32, on CPU, no gradients; plus where it came from."""

    model: ESM2 | ProteinBertModel
    alphabet: esm.data.Alphabet
    name: str  # fair-esm name, or the checkpoint file's stem for a path
    source: str  # resolved checkpoint path
    sha256: str  # of the checkpoint file's bytes
    trained: bool  # False for random-weight test models (never present them as real)
    num_layers: int
    embed_dim: int
    attention_heads: int
    # its row's capabilities (embedpipe.model.families: ESM-2's, ESM-1b's, SaProt's; EsmForward packs)
    trained_window: int
    family: str  # the store's model_family (a Hugging Face ESM-2 directory: esm2 too)
    token_layout: TokenLayout
    batch_layouts: tuple[str, ...]
    provenance: Mapping[str, str] = field(
        default_factory=lambda: {"fair_esm_version": getattr(esm, "__version__", "unknown")})
    _lut: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._lut = np.full(256, self.alphabet.unk_idx, dtype=np.int64)  # ASCII byte -> token
        for letter in PROTEIN_LETTERS:
            self._lut[ord(letter)] = self.alphabet.get_idx(letter)

    def tokenize(self, sequences: Sequence[str]) -> torch.Tensor:
        """(B, 2 + longest): <cls>, the residues, <eos>, then <pad>."""
        width = max(len(seq) for seq in sequences) + 2
        tokens = np.full((len(sequences), width), self.alphabet.padding_idx, dtype=np.int64)
        for row, seq in enumerate(sequences):
            tokens[row, 0] = self.alphabet.cls_idx
            tokens[row, 1 : len(seq) + 1] = self._lut[np.frombuffer(seq.encode("ascii"), dtype=np.uint8)]
            tokens[row, len(seq) + 1] = self.alphabet.eos_idx
        return torch.from_numpy(tokens)

    def prepare(self, policy: Policy, device: torch.device, attention: str = "sdpa", *,
                attention_inputs: str = "fp32") -> EsmForward:
        """A runner for ``policy`` on ``device`` (see :func:`prepare_model`); ``attention_inputs``
        (``fp32`` or ``compute``): the mixed policies' q/k/v dtype at the attention kernel.

        The fp32 model itself is moved to ``device``, unless it already serves a runner on
        another accelerator (an amp policy ran it there): then the runner gets a copy.
        """
        home = next(self.model.parameters()).device
        private = home.type != "cpu" and home != device
        return EsmForward(prepare_model(self.model, policy, device, private=private), policy, attention,
                          attention_inputs=attention_inputs)

    def estimate_memory(self, policy: Policy, *, attention_inputs: str = "fp32") -> MemoryEstimate:
        return esm2_spec.estimate_memory(self.num_layers, self.embed_dim, self.attention_heads,
                                         policy.weight_dtype.itemsize, policy.compute_dtype.itemsize,
                                         kind=policy.memory_kind(attention_inputs),
                                         parameters=self.esm1b_parameters)

    @property
    def esm1b_parameters(self) -> int | None:
        """ESM-1b's parameter count (its position table, its first layer norm); None: ESM-2's formula."""
        if self.family != families.ESM1B.name:
            return None
        return esm1b_spec.parameter_count(self.num_layers, self.embed_dim, self.attention_heads,
                                          self.trained_window + 2)


# --------------------------------------------------------------------------- loading


def any_checkpoint_info(data: Mapping[str, Any], *, where: str) -> dict[str, Any]:
    """The config of a fair-esm checkpoint in either layout: ESM-2's ``cfg`` or ESM-1b's ``args``."""
    if esm1b_spec.is_pt_layout(data):
        return esm1b.checkpoint_info(data, where=where)
    return checkpoint_info(data, where=where)


def capabilities_of(info: Mapping[str, Any]) -> Capabilities:
    """What the network ``info`` describes can do: ESM-1b's row's with the window its positions
    allow (``family`` esm1b), else ESM-2's."""
    if info.get("family") == families.ESM1B.name:
        return families.ESM1B.capabilities(esm1b_spec.window(info["max_positions"]))
    return families.ESM2.capabilities()


def load_checkpoint(spec: str, path: Path, sha: str, data: dict[str, Any]) -> Esm2Model:
    """A fresh fp32 CPU ``ESM2`` (or, for a checkpoint in ESM-1b's layout, ``ProteinBertModel``)
    from the fair-esm checkpoint ``data`` read from ``path`` (its bytes' sha256 ``sha``; ``spec``:
    the model as given), by :mod:`embedpipe.model.pt_checkpoint`.

    The contact-regression companion is loaded (safely) when it sits next to the checkpoint,
    and is otherwise not needed (ESM-1v has none).
    """
    info = any_checkpoint_info(data, where=str(path))
    state_dict = upgrade_state_dict(data["model"])
    del data
    state_dict.update(_companion_state(companion_path(path)))
    model, alphabet = build_model(info, state_dict, where=str(path))
    name = spec if downloads.is_model_name(spec) else path.stem
    return from_info(model, alphabet, info, capabilities_of(info), name=name, source=str(path), sha256=sha)


def from_info(model: ESM2 | ProteinBertModel, alphabet: esm.data.Alphabet, info: Mapping[str, Any],
              capabilities: Capabilities, *, name: str, source: str, sha256: str,
              provenance: Mapping[str, str] | None = None, kind: type[Esm2Model] | None = None) -> Esm2Model:
    """An :class:`Esm2Model` (``kind``: a subclass, SaProt's) around a built model, with the
    ``capabilities`` of its row (:mod:`embedpipe.model.families`)."""
    extra: dict[str, Any] = {} if provenance is None else {"provenance": provenance}
    made = kind or Esm2Model
    return made(model=model, alphabet=alphabet, name=name, source=source, sha256=sha256,
                trained=info["trained"], num_layers=info["num_layers"], embed_dim=info["embed_dim"],
                attention_heads=info["attention_heads"], **capabilities.model_fields(), **extra)


def checkpoint_facts(facts: ModelFacts, data: Mapping[str, Any]) -> ModelFacts:
    """A checkpoint path's facts completed from its config (ESM-2's or ESM-1b's) and parameter
    count (:func:`embedpipe.model.pt_checkpoint.inspect`)."""
    info = any_checkpoint_info(data, where=str(Path(facts.spec).expanduser()))
    shape = (info["num_layers"], info["embed_dim"], info["attention_heads"])
    if info.get("family") == families.ESM1B.name:
        parameters = esm1b_spec.parameter_count(*shape, info["max_positions"])
    else:
        parameters = esm2_spec.parameter_count(*shape)
    return replace(facts, **capabilities_of(info).facts_fields(), num_layers=shape[0], embed_dim=shape[1],
                   attention_heads=shape[2], trained=info["trained"], parameters=parameters)


def _companion_state(companion: Path) -> dict[str, Any]:
    """The contact head from ``companion`` ({} when there is none)."""
    if not companion.is_file():
        return {}
    regression = load_checkpoint_safely(companion)
    reg_state = regression.get("model", regression)
    if not isinstance(reg_state, Mapping):
        raise ModelError(f"{companion} is not a contact-regression checkpoint")
    reg_state = upgrade_state_dict(reg_state)
    extra = set(reg_state) - CONTACT_KEYS
    if extra:
        raise ModelError(f"{companion}: unexpected keys {', '.join(sorted(extra)[:6])} in a contact-regression file")
    return reg_state


class _SkipInit(TorchFunctionMode):
    """Inside: ``torch.nn.init`` functions and in-place random or constant fills do nothing."""

    SKIPPED = frozenset({torch.Tensor.uniform_, torch.Tensor.normal_, torch.Tensor.fill_, torch.Tensor.zero_})

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in self.SKIPPED or getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


@contextlib.contextmanager
def skip_random_init() -> Iterator[None]:
    """Module constructors in this block and this thread skip their random init.

    Every parameter is then assigned from the checkpoint (the key check refuses a checkpoint
    that leaves one out), so the init is work thrown away (seconds for a 650M model, minutes
    for 15B). A torch function mode is scoped to the block and thread-local: ``torch.nn.init``
    itself is never changed. Not the meta device: fair-esm computes rotary frequencies in its
    constructor, and meta ops import torch._dynamo (2 s per process with torch 2.13).
    """
    with _SkipInit():
        yield


def build_model(info: Mapping[str, Any], state_dict: dict[str, Any], *, where: str,
                alphabet: esm.data.Alphabet | None = None) -> tuple[ESM2 | ProteinBertModel, esm.data.Alphabet]:
    """An ``ESM2`` from the cfg (a ``ProteinBertModel`` from an ESM-1b ``info``: ``family``
    esm1b) with ``state_dict`` assigned (no second copy of the weights); ``alphabet``: the
    tokens it embeds (ESM-2's unless given: SaProt's pairs)."""
    alphabet = alphabet or esm2_alphabet()
    label = _label(info)
    with skip_random_init():  # parameters allocated, never written; the loaded tensors replace them
        model: ESM2 | ProteinBertModel
        if info.get("family") == families.ESM1B.name:
            model = esm1b.construct(info, alphabet)
        else:
            model = ESM2(num_layers=info["num_layers"], embed_dim=info["embed_dim"],
                         attention_heads=info["attention_heads"], alphabet=alphabet,
                         token_dropout=info["token_dropout"])
    _check_state_dict(model, state_dict, info, where)
    try:
        model.load_state_dict(state_dict, strict=False, assign=True)
    except RuntimeError as exc:  # shape mismatches
        if out_of_memory(exc):  # no refusal: more memory may load it
            raise
        raise ModelError(f"{where}: weights do not fit the configured {label}: {one_line(exc)[:400]}") from None
    model.lm_head.weight = model.embed_tokens.weight  # re-tie
    if not (CONTACT_KEYS <= set(state_dict)):
        # No companion: a real (zeroed) contact head, so that no parameter stays uninitialised.
        # embedpipe never predicts contacts.
        regression = torch.nn.Linear(model.contact_head.regression.in_features, 1, bias=True)
        torch.nn.init.zeros_(regression.weight)
        torch.nn.init.zeros_(regression.bias)
        model.contact_head.regression = regression
    model = model.float().eval()
    model.requires_grad_(False)
    return model, alphabet


def _label(info: Mapping[str, Any]) -> str:
    """The network ``info`` describes, as refusals name it."""
    return "ESM-1b" if info.get("family") == families.ESM1B.name else "ESM-2"


def _listing(names: list[str]) -> str:
    return f"{', '.join(names[:6])}{' ...' if len(names) > 6 else ''}"


def _check_state_dict(model: ESM2 | ProteinBertModel, state_dict: Mapping[str, Any], info: Mapping[str, Any], where: str) -> None:
    """Refuse a state dict that misses or adds keys, holds non-tensors or NaN/inf, or unties
    the LM head from the token embedding."""
    expected, found = set(model.state_dict().keys()), set(state_dict.keys())
    missing, unexpected = sorted((expected - found) - CONTACT_KEYS), sorted(found - expected)
    if missing or unexpected:
        parts = ([f"missing {_listing(missing)}"] if missing else []) + (
            [f"unexpected {_listing(unexpected)}"] if unexpected else [])
        raise ModelError(
            f"{where} does not match an {_label(info)} with {info['num_layers']} layers, dim "
            f"{info['embed_dim']}, {info['attention_heads']} heads: {'; '.join(parts)}"
        )
    for key, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            raise ModelError(f"{where}: state dict entry {key} is not a tensor")
        if value.is_floating_point() and not torch.isfinite(value).all():
            raise ModelError(f"{where}: weights {key} hold NaN or inf")
    # ESM-2 (and ESM-1b) ties the LM head to the token embedding. fair-esm's copy-loading leaves both
    # equal to lm_head.weight; a checkpoint where the two differ was edited inconsistently.
    emb, head = state_dict.get("embed_tokens.weight"), state_dict.get("lm_head.weight")
    if emb is not None and head is not None and not torch.equal(emb, head):
        raise ModelError(
            f"{where}: embed_tokens.weight and lm_head.weight differ, but {_label(info)} ties them "
            f"(fair-esm would silently use lm_head.weight); edit both or neither"
        )


# --------------------------------------------------------------------------- policies


def reset_rotary_caches(model: FairEsmModule) -> None:
    """Drop fair-esm's rotary cos/sin caches.

    fair-esm caches the tables in whatever dtype they were first built in and rebuilds them
    only when the sequence length or device changes, not the dtype: a cache built under one
    precision would otherwise leak into another (including through ``copy.deepcopy``).
    """
    for module in model.modules():
        if hasattr(module, "_cos_cached") and hasattr(module, "_seq_len_cached"):
            module._seq_len_cached = None
            module._cos_cached = None
            module._sin_cached = None


def prepare_model(model: torch.nn.Module, policy: Policy, device: torch.device, *,
                  private: bool = False) -> torch.nn.Module:
    """The model as ``policy`` runs it on ``device``: a private copy whenever weights change dtype
    (or when ``private``), otherwise ``model`` itself moved to ``device``.

    The fp32 source stays fp32 with its values, so it can serve as the fp32 fallback; it is
    changed only by that move (and by the runner, which fuses its q/k/v into one tensor of
    the same values). If the move runs out of memory, the source is moved back before the
    error propagates: it is never left split across devices.
    """
    reset_rotary_caches(model)
    if not policy.copies_weights and not private:
        prepared = _move(model, device)
    else:  # the policy's weight preparation, with ESM-2's island tensors
        prepared = policy.cast_copy(model, device, fp32_tensor_ids(model))
    reset_rotary_caches(prepared)
    prepared.eval()
    for param in prepared.parameters():
        param.requires_grad_(False)
    return prepared


def _move(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """``model.to(device)``, undone on out-of-memory."""
    home = next(model.parameters()).device
    try:
        return model.to(device)
    except torch.cuda.OutOfMemoryError:
        model.to(home)
        raise


def fp32_tensor_ids(model: torch.nn.Module) -> set[int]:
    """ESM-2's islands, the tensors the mixed policies keep in fp32: layer-norm weights and
    rotary ``inv_freq`` (see :meth:`embedpipe.runtime.precision.Policy.cast_copy`)."""
    ids: set[int] = set()
    for module in model.modules():
        if isinstance(module, torch.nn.LayerNorm):
            ids.update(id(p) for p in module.parameters(recurse=False))
        if hasattr(module, "inv_freq"):
            ids.add(id(module.inv_freq))
    return ids


if TYPE_CHECKING:  # mypy checks the family against the interface (docs/architecture.md)
    _model_conforms: type[EmbeddingModel] = Esm2Model
