"""Precision policies as objects: each owns its capability check, its weight preparation
and its linear layer (docs/precision.md).

Why objects: the forward passes (``model/esm2_forward.py``, ``model/t5_forward.py``) ask the
policy what to do (which dtype the residual stream lives in, how a norm or a linear runs,
what q/k/v are attended in) instead of branching on fields, so a new policy is one class
here. The names come from ``options.POLICY_KINDS``, the one list of them; which tensors of
a model are "islands" (kept fp32 by the mixed policies) is the model family's business.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from embedpipe.core.errors import EmbedpipeError
from embedpipe.core.options import POLICY_KINDS
from embedpipe.runtime import advice, cpu_features
from embedpipe.runtime.packed_linear import pack_linear, row_tiled

#: Native arithmetic on CUDA, by compute capability. bfloat16 starts with Ampere (8.0):
#: current torch's ``torch.cuda.is_bf16_supported()`` answers True on older GPUs too, where
#: bfloat16 is emulated (slowly, through fp32), so it cannot be the test. fp16: 5.3.
CUDA_CAPABILITY = {torch.bfloat16: (8, 0), torch.float16: (5, 3)}
BF16_CAPABILITY = CUDA_CAPABILITY[torch.bfloat16]

#: a linear layer as a policy prepared it (``y = x W^T + b``, GELU'd when asked)
Packed = Callable[..., torch.Tensor]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Policy:
    """A plain policy: weights, matmuls and everything else in ``weight_dtype`` (fp32, or a
    plain cast as ``.half()`` does). The other kinds override what they change.

    ``weight_dtype``: dtype of the model copy's weights. ``compute_dtype``: dtype of the
    matmuls (projections, feed-forward).
    """

    name: str
    weight_dtype: torch.dtype
    compute_dtype: torch.dtype

    #: rotary tables, attention softmax, layer norms, the residual stream and pooling in fp32
    fp32_islands: ClassVar[bool] = False

    @property
    def is_reference(self) -> bool:
        """fp32 is the reference: no fallback is ever needed for it."""
        return self.compute_dtype == torch.float32

    # -- capability ------------------------------------------------------------------------
    def check_device(self, device: torch.device, cpu: cpu_features.CpuFeatures | None = None) -> list[str]:
        """Refuse what cannot work on ``device``; return warnings for what is merely slow.
        ``cpu``: the CPU's features (detected when not given; tests pass mocked ones)."""
        if device.type == "cuda":
            self._check_cuda(device)
        elif device.type == "cpu":  # emulated 16 bits, or measured not worth it here (runtime/advice.py)
            note = advice.cpu_note(self.name, self.compute_dtype, cpu or cpu_features.detect())
            return [note] if note else []
        return []

    def _check_cuda(self, device: torch.device) -> None:
        need = CUDA_CAPABILITY.get(self.compute_dtype)
        if need is None:
            return
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < need:
            name, low = torch.cuda.get_device_name(device), dtype_name(self.compute_dtype)
            era = "pre-Ampere GPU" if self.compute_dtype == torch.bfloat16 else "GPU older than compute capability 5.3"
            other = "fp16-mixed or fp32" if self.compute_dtype == torch.bfloat16 else "fp32"
            raise EmbedpipeError(
                f"precision {self.name!r} needs {low}, which {name} (compute capability "
                f"{major}.{minor}) does not support natively ({era}); use {other}"
            )

    # -- provenance ------------------------------------------------------------------------
    def provenance(self) -> dict[str, str]:
        """Root attributes of a store made with this policy (docs/store-format.md)."""
        return {"precision_policy": self.name, "weight_dtype": dtype_name(self.weight_dtype),
                "compute_dtype": dtype_name(self.compute_dtype), "island_dtype": self.island_name}

    def runner_provenance(self, fp32_layers: Mapping[str, str]) -> dict[str, str]:
        """Root attributes of what a prepared runner decided (int8-mixed: the layers kept fp32);
        none for the other policies."""
        return {}

    @property
    def island_name(self) -> str:
        """dtype of rotary tables, attention, norms and the residual stream, in words."""
        return "float32" if self.fp32_islands else dtype_name(self.compute_dtype)

    @property
    def overflow_limit(self) -> float:
        """The largest value the low-precision activations can hold (``--overflow-margin``)."""
        return float(torch.finfo(self.compute_dtype).max)

    def memory_kind(self, attention_inputs: str) -> str:
        """Which activation estimate of ``model/esm2_spec.py`` applies."""
        return "plain"

    # -- weight preparation ----------------------------------------------------------------
    @property
    def copies_weights(self) -> bool:
        """Whether the model runs on a cast copy (otherwise on the fp32 model itself)."""
        return self.weight_dtype != torch.float32

    def tensor_dtype(self, island: bool) -> torch.dtype:
        """dtype of one weight tensor; ``island``: the family marks it as kept fp32 by mixed policies."""
        return torch.float32 if island and self.fp32_islands else self.weight_dtype

    def cast_copy(self, model: torch.nn.Module, device: torch.device, islands: set[int]) -> torch.nn.Module:
        """Copy ``model`` with its tensors already in their target dtypes, on ``device``;
        ``islands``: ids of the tensors the family keeps fp32 under the mixed policies.

        Casting while copying (through ``deepcopy``'s memo) never holds a second fp32 copy of
        the weights: for a 15B model that is 60 GB of host memory saved; each tensor is made on
        ``device`` directly. A plain cast converts everything, as ``.half()`` would.
        """
        memo: dict[int, torch.Tensor] = {}
        for param in model.parameters():
            dtype = self.tensor_dtype(id(param) in islands)
            memo[id(param)] = torch.nn.Parameter(param.detach().to(device, dtype, copy=True), requires_grad=False)
        for buffer in model.buffers():
            if buffer.is_floating_point():
                memo[id(buffer)] = buffer.detach().to(device, self.tensor_dtype(id(buffer) in islands), copy=True)
            else:
                memo[id(buffer)] = buffer.detach().to(device, copy=True)
        return copy.deepcopy(model, memo).to(device)  # any tensor not listed above

    def cast_weights(self, weights: Mapping[str, torch.Tensor], device: torch.device,
                     island: Callable[[str], bool]) -> dict[str, torch.Tensor]:
        """Named ``weights`` in the policy's dtypes on ``device`` (the islands in fp32 for mixed policies)."""
        return {name: tensor.to(device, self.tensor_dtype(island(name))) for name, tensor in weights.items()}

    # -- the forward -------------------------------------------------------------------------
    def context(self, device: torch.device) -> contextlib.AbstractContextManager[object]:
        """What a forward pass runs inside (inference mode; autocast for the amp policies)."""
        return torch.inference_mode()

    @property
    def stream_dtype(self) -> torch.dtype:
        """dtype of the residual stream (fp32 under the islands; the weights' under a plain cast)."""
        return torch.float32 if self.fp32_islands else self.weight_dtype

    def table_dtype(self, weights_dtype: torch.dtype) -> torch.dtype:
        """dtype rotary tables are built in: the weights' under a plain cast (as fair-esm does
        after ``.half()``), fp32 under the islands."""
        return torch.float32 if self.fp32_islands else weights_dtype

    def layer_norm(self, norm: torch.nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = norm(x)  # through the module: its hooks run
        return out

    def attention_dtype(self, attention_inputs: str) -> torch.dtype:
        """dtype of q, k and v at the attention kernel (under autocast: the dtype autocast casts
        to). ``attention_inputs`` (resolved: ``fp32`` or ``compute``) matters to mixed policies only."""
        return self.weight_dtype

    def attention_qk(self, q: torch.Tensor, k: torch.Tensor, attention_inputs: str) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k after the rotation, as they enter the attention kernel."""
        return q, k

    def kernel_inputs(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q/k/v as a kernel that ignores autocast (the varlen kernel) must get them."""
        return tensors

    def packs(self, prepack: bool) -> bool:
        """Whether the forward prepares its linear layers with :meth:`pack` (on the CPU)."""
        return prepack

    def pack(self, weight: torch.Tensor, bias: torch.Tensor | None) -> Packed | None:
        """A linear layer prepared once (oneDNN's blocked layout), or None: use ``F.linear``."""
        return pack_linear(weight, bias)

    def calibration_records(self) -> Sequence[tuple[str, str]]:
        """Records a freshly prepared runner must see before it embeds (int8-mixed smoothing:
        :mod:`embedpipe.extraction.calibration`); none for the other policies."""
        return ()

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               packed: Packed | None = None, *, gelu: bool = False) -> torch.Tensor:
        """How a linear layer runs under this policy: the input in the weights' dtype (a no-op
        except at an fp32 island's edge), through ``packed`` when there is one; every policy's
        rows in fixed-size tiles (:func:`~embedpipe.runtime.packed_linear.row_tiled`), so a
        record's numbers do not depend on its batch (docs/precision.md, "Reproducibility")."""
        x = x.to(weight.dtype)
        if packed is not None:
            return row_tiled(lambda rows: packed(rows, gelu=gelu), x)
        # Unfused GELU runs in the matmul dtype: PyTorch evaluates it in fp32 internally and
        # rounds once, where an fp32 GELU's output would be rounded anyway before the next matmul.
        h = row_tiled(lambda rows: F.linear(rows, weight, bias), x)
        return F.gelu(h) if gelu else h


@dataclass(frozen=True)
class AutocastPolicy(Policy):
    """fp32 weights under ``torch.autocast(compute_dtype)``: PyTorch picks the dtype per op."""

    @property
    def island_name(self) -> str:
        return "per-op (autocast)"

    def memory_kind(self, attention_inputs: str) -> str:
        return "autocast"

    def context(self, device: torch.device) -> contextlib.AbstractContextManager[object]:
        stack = contextlib.ExitStack()
        stack.enter_context(torch.inference_mode())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            ctx = torch.autocast(device_type=device.type, dtype=self.compute_dtype)
        stack.enter_context(ctx)
        return stack

    def attention_dtype(self, attention_inputs: str) -> torch.dtype:
        return self.compute_dtype

    def kernel_inputs(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # SDPA would cast under autocast; the varlen kernel does not
        return tuple(t.to(self.compute_dtype) for t in tensors)

    def packs(self, prepack: bool) -> bool:
        return False

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               packed: Packed | None = None, *, gelu: bool = False) -> torch.Tensor:
        h = row_tiled(lambda rows: F.linear(rows, weight, bias), x)  # autocast casts
        return F.gelu(h) if gelu else h


@dataclass(frozen=True)
class MixedPolicy(Policy):
    """16-bit weights and matmuls with fp32 islands (rotary, attention, norms, residual stream)."""

    fp32_islands: ClassVar[bool] = True

    def memory_kind(self, attention_inputs: str) -> str:
        return "fp32-islands" if attention_inputs == "compute" else "fp32-islands-fp32-attention"

    def layer_norm(self, norm: torch.nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), norm.normalized_shape, norm.weight.float(), norm.bias.float(), norm.eps)

    def attention_dtype(self, attention_inputs: str) -> torch.dtype:
        return self.compute_dtype if attention_inputs == "compute" else torch.float32

    def attention_qk(self, q: torch.Tensor, k: torch.Tensor, attention_inputs: str) -> tuple[torch.Tensor, torch.Tensor]:
        # rotated in fp32, attended in the compute dtype: tensor-core kernels, which accumulate
        # scores and softmax in fp32 (docs/precision.md, "Attention inputs")
        if attention_inputs == "compute":
            return q.to(self.compute_dtype), k.to(self.compute_dtype)
        return q, k


POLICIES: dict[str, Policy] = {}


def add_policies(kind: str, cls: type[Policy]) -> None:
    """Build ``kind``'s policies (:data:`POLICY_KINDS`) as ``cls`` into :data:`POLICIES`.

    The int8 kind's class lives in :mod:`embedpipe.runtime.int8_policy` (it subclasses
    :class:`MixedPolicy`), which adds its policies when imported; the package
    (``embedpipe/runtime/__init__.py``) imports it, so whatever module of ``runtime`` is
    imported first, every policy is there and neither module imports the other's importer."""
    for name, (its_kind, low) in POLICY_KINDS.items():
        if its_kind == kind:
            dtype = getattr(torch, low)
            POLICIES[name] = cls(name, torch.float32 if kind in ("autocast", "int8") else dtype, dtype)


for _kind, _cls in (("plain", Policy), ("autocast", AutocastPolicy), ("mixed", MixedPolicy)):
    add_policies(_kind, _cls)
FP32 = POLICIES["fp32"]


def resolve_attention_inputs(option: str, device: torch.device) -> str:
    """The attention inputs ``auto`` -> ``compute`` on CUDA (tensor-core attention), else ``fp32``."""
    if option == "auto":
        return "compute" if device.type == "cuda" else "fp32"
    return option


def attention_dtype(policy: Policy, attention_inputs: str) -> torch.dtype:
    """dtype of q, k and v at the attention kernel (see :meth:`Policy.attention_dtype`)."""
    return policy.attention_dtype(attention_inputs)


def get_policy(name: str) -> Policy:
    """The policy called ``name``; a clear error listing the valid names otherwise."""
    try:
        return POLICIES[name]
    except KeyError:
        raise EmbedpipeError(
            f"unknown precision policy {name!r}; choose one of: {', '.join(POLICIES)}"
        ) from None


def check_policy_on_device(policy: Policy, device: torch.device,
                           cpu: cpu_features.CpuFeatures | None = None) -> list[str]:
    """Refuse combinations that cannot work; return warnings for ones that are merely slow."""
    return policy.check_device(device, cpu)


@contextlib.contextmanager
def true_fp32_matmuls() -> Iterator[None]:
    """fp32 means fp32: no TF32 (CUDA) or reduced-precision fp32 matmuls, whatever the process
    enabled globally; the settings are restored afterwards.

    These are process-wide flags, so the worker enters this once per run, not per batch.
    The legacy flags, not torch 2.13's ``fp32_precision`` ones: once both APIs are in use,
    torch refuses to read the legacy flags that callers may still use.
    """
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
             torch.get_float32_matmul_precision())
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[0], saved[1]
        torch.set_float32_matmul_precision(saved[2])


@contextlib.contextmanager
def forward_context(policy: Policy, device: torch.device) -> Iterator[None]:
    """The policy's context (inference mode, autocast for the amp policies). Run inside
    :func:`true_fp32_matmuls`, which keeps the reference (and every fp32 island) in true fp32."""
    with policy.context(device):
        yield


@contextlib.contextmanager
def exact_fp32(device: torch.device) -> Iterator[None]:
    """Plain fp32 inside any policy's forward context: autocast off (it would run an einsum in
    16 bits). For pooling, whose sums over a thousand residues overflow fp16."""
    with torch.autocast(device_type=device.type, enabled=False):
        yield
