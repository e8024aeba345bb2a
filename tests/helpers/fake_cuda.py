"""embedpipe's CUDA path run on a CPU-only torch: a faked GPU, every host sync counted.

``fake_cuda()`` makes ``torch.cuda`` answer like one Hopper GPU (compute capability 9.0),
runs tensor work on ``FakeTensorMode`` (``device="cuda"`` tensors with shapes, dtypes and
devices but no values), and records in a :class:`Trace`:

* host syncs: ``item``/``bool``/``float`` of a device value, data-dependent shapes (``nonzero``,
  bool-mask indexing), blocking or device-to-host copies, a host index tensor on a device tensor;
* every call of the varlen attention op, checked against flash's ``mha_varlen_fwd`` input
  contract (the registered fake kernel checks nothing);
* device mismatches (a host tensor mixed with device tensors), which the fake mode raises.

What it changes in embedpipe is the seam of :mod:`embedpipe.runtime.cuda` only: ``host_side`` blocks
(tokens, offsets, numpy read-back) run on real tensors outside the fake mode, and
``HostCopy.wait`` hands back what the test says the device computed (fake tensors hold no
values): zeros, or NaN in the records a test picks to drive the fp32 fallback.
A sync answered with a dummy value lets the trace go on and find the next one.

Pitfalls of torch 2.13's CPU build worked around: bindings of indexing, ``contiguous``, ``to``
and ``nonzero`` open a CUDA device guard and fail (:class:`_GuardShim` re-expresses them as
aten ops); ``Module.to`` on fake parameters fails; fake ``pin_memory`` is not implemented;
``torch.cuda.Event``/``Stream`` are dummies; a patched ``is_available`` needs ``avoid_device_init``
too; ``.numpy()`` of a real tensor inside the fake mode returns garbage; in inference mode
``.cpu()`` reaches the mode as ``aten.to``, not ``_to_copy``. Not seen: numerics, timing,
streams, syncs inside C++ kernels, the allocator (the GPU acceptance run counts syncs).
"""

from __future__ import annotations

import contextlib
import traceback
import types
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.attention.varlen  # noqa: F401  (registers torch_attn::_varlen_attn)
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import embedpipe
from embedpipe.runtime import cuda as ep_cuda

aten = torch.ops.aten
GiB = 2**30
PACKAGE = str(Path(embedpipe.__file__).parent)
SEAM_NAME = "embedpipe/" + Path(ep_cuda.__file__).relative_to(PACKAGE).as_posix()  # the documented read-back point lives here
VARLEN_OP = torch.ops.torch_attn._varlen_attn.default
DYNAMIC_SHAPE_OPS = {getattr(aten, n).default for n in ("nonzero", "masked_select", "_unique2", "unique_consecutive")
                     if hasattr(aten, n)}
SCALAR_OPS = (aten._local_scalar_dense.default, aten.is_nonzero.default, aten.item.default)


def is_fake_cuda(t: object) -> bool:
    return isinstance(t, FakeTensor) and t.fake_device.type == "cuda"


def _device(t: torch.Tensor) -> torch.device:
    return t.fake_device if isinstance(t, FakeTensor) else t.device


def where() -> str:
    """``file:line (function)`` of the innermost embedpipe frame that led here."""
    frames = [f for f in traceback.extract_stack() if f.filename.startswith(PACKAGE)]
    if not frames:
        return "?"
    f = frames[-1]
    return f"{f.filename[len(PACKAGE) - len('embedpipe'):]}:{f.lineno} ({f.name})"


#: ``Trace.ops`` key counting ``abs`` of a floating tensor on the device
FLOAT_ABS = "aten.abs.default[floating]"


@dataclass
class Trace:
    """What the faked GPU saw."""

    syncs: list[tuple[str, str]] = field(default_factory=list)  # (what, where)
    transfers: list[tuple[str, bool, str]] = field(default_factory=list)  # (H2D|D2H, blocking, where)
    varlen_calls: list[dict] = field(default_factory=list)
    violations: list[tuple[str, str]] = field(default_factory=list)
    mismatches: list[tuple[str, str]] = field(default_factory=list)
    ops: Counter = field(default_factory=Counter)  # aten op -> calls on CUDA tensors
    matmul_dtypes: Counter = field(default_factory=Counter)
    #: (op, shapes of its tensor inputs) of every matmul: fixed row tiles make this set the same for any batching
    matmul_shapes: Counter = field(default_factory=Counter)
    events: list[str] = field(default_factory=list)
    pinned: dict = field(default_factory=dict)  # id -> weakref of tensors pin_memory() returned
    live: dict = field(default_factory=dict)  # storage -> (weakref, bytes), when tracking memory
    peak_bytes: int = 0
    traffic: Counter = field(default_factory=Counter)  # op -> bytes in + out, when tracking traffic
    largest: int = 0  # elements of the largest device tensor an op read or wrote

    def clear(self) -> None:
        """Forget what was seen so far (model preparation), keep the live memory."""
        for name in ("syncs", "transfers", "varlen_calls", "violations", "mismatches", "events", "ops",
                     "matmul_dtypes", "matmul_shapes", "traffic"):
            getattr(self, name).clear()
        self.peak_bytes = self.live_bytes()
        self.largest = 0

    def is_pinned(self, t: torch.Tensor) -> bool:
        ref = self.pinned.get(id(t))
        return ref is not None and ref() is t

    def live_bytes(self) -> int:
        for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            del self.live[key]
        return sum(n for _, n in self.live.values())

    def d2h_outside_seam(self) -> list[tuple[str, bool, str]]:
        return [t for t in self.transfers if t[0] == "D2H" and (t[1] or SEAM_NAME not in t[2])]

    def blocking_h2d(self) -> list[tuple[str, bool, str]]:
        return [t for t in self.transfers if t[0] == "H2D" and t[1]]



def varlen_contract(args: tuple, kwargs: dict) -> list[str]:
    """Breaches of flash's ``mha_varlen_fwd`` input checks by one ``_varlen_attn`` call."""
    q, k, v, cu_q, cu_k, max_q, max_k = args[:7]
    bad = []
    if q.dtype not in (torch.float16, torch.bfloat16):
        bad.append(f"q dtype {q.dtype} (flash: fp16/bf16)")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        bad.append(f"q/k/v dtypes {q.dtype}/{k.dtype}/{v.dtype} differ")
    for name, t in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        if t.dtype != torch.int32:
            bad.append(f"{name} dtype {t.dtype} (flash: int32)")
        if not is_fake_cuda(t):
            bad.append(f"{name} on {_device(t)} (flash: on the device)")
        if not t.is_contiguous():
            bad.append(f"{name} not contiguous")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3:
            bad.append(f"{name} has {t.dim()} dims (varlen: tokens x heads x head_dim)")
        elif t.stride(-1) != 1:
            bad.append(f"{name} last-dim stride {t.stride(-1)} (flash: 1)")
        if not is_fake_cuda(t):
            bad.append(f"{name} not on the device")
    if q.shape[-1] % 8 or q.shape[-1] > 256:
        bad.append(f"head_dim {q.shape[-1]} (flash: a multiple of 8, at most 256)")
    for name, m in (("max_seqlen_q", max_q), ("max_seqlen_k", max_k)):
        if type(m) is not int:
            bad.append(f"{name} is a {type(m).__name__}, not a Python int")
    return bad


class _SyncCounter(TorchDispatchMode):
    """Sees every aten op first: records syncs and transfers, checks varlen calls."""

    def __init__(self, trace: Trace, track_memory: bool = False) -> None:
        super().__init__()
        self.t = trace
        self.track_memory = track_memory
        self.track_traffic = False

    def _sync(self, what: str) -> None:
        self.t.syncs.append((what, where()))

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        flat = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        on_cuda = any(is_fake_cuda(a) for a in flat)
        if on_cuda:
            self.t.ops[str(func)] += 1
            if func is aten.abs.default and flat[0].is_floating_point():
                self.t.ops[FLOAT_ABS] += 1  # a full |x| copy of an activation (an integer abs is bookkeeping)
            answer = self._data_dependent(func, args, kwargs)
            if answer is not NotImplemented:
                return answer
        if func is VARLEN_OP:
            self.t.violations.extend((b, where()) for b in varlen_contract(args, kwargs))
            self.t.varlen_calls.append({"q": (tuple(args[0].shape), args[0].dtype), "offsets": args[3].dtype,
                                        "max_seqlen": args[5]})
        try:
            out = func(*args, **kwargs)
        except Exception as exc:
            if "device" in type(exc).__name__.lower() or "same device" in str(exc):
                self.t.mismatches.append((str(exc).splitlines()[0][:160], where()))
            raise
        self._copies(func, args, kwargs, out)
        if on_cuda:
            self._account(func, name=str(func), flat=flat, out=out)
        return out

    def _data_dependent(self, func, args, kwargs):  # noqa: ANN001
        """A sync answered with a dummy (so the trace goes on), or NotImplemented."""
        x = args[0] if args else None
        if func in SCALAR_OPS:
            self._sync(f"{func.__name__} (item/bool/float of a device value)")
            return False if x.dtype == torch.bool else (1.0 if x.dtype.is_floating_point else 1)
        if func in (aten.equal.default, aten.allclose.default):
            self._sync(str(func))
            return True
        if func in DYNAMIC_SHAPE_OPS:
            self._sync(f"{func} (data-dependent shape)")
            return torch.empty((x.numel(), x.dim()), dtype=torch.long, device=_device(x))
        if func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            self._sync("repeat_interleave without output_size")
            return torch.empty((x.numel(),), dtype=torch.long, device=_device(x))
        if func is aten.index.Tensor:
            indices = [i for i in args[1] if i is not None]
            if any(i.dtype in (torch.bool, torch.uint8) for i in indices):
                self._sync("index with a bool mask (nonzero)")
                return torch.empty((1,) + tuple(x.shape[1:]), dtype=x.dtype, device=_device(x))
            if is_fake_cuda(x) and any(not is_fake_cuda(i) and i.dim() > 0 for i in indices):
                self._sync("host index tensor on a device tensor (blocking copy)")
        return NotImplemented

    def _copies(self, func, args, kwargs, out) -> None:  # noqa: ANN001
        """A copy between host and device: ``_to_copy`` and ``to.*`` (inference mode keeps the
        latter whole), compared by the devices of input and output, or a cross-device ``copy_``."""
        if func is aten.copy_.default:
            src, dst = args[1], args[0]
            non_blocking = bool(kwargs.get("non_blocking", False) or (len(args) > 2 and args[2]))
        elif func is aten._to_copy.default or func.overloadpacket is aten.to:
            src, dst = args[0], out
            non_blocking = bool(kwargs.get("non_blocking", False))
        else:
            return
        if isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor) and _device(src).type != _device(dst).type:
            self._transfer("H2D" if _device(dst).type == "cuda" else "D2H", src, non_blocking)

    def _transfer(self, direction: str, src: torch.Tensor, non_blocking: bool) -> None:
        if direction == "H2D" and non_blocking and not self.t.is_pinned(src):
            non_blocking = False  # from pageable memory non_blocking has no effect
        blocking = not non_blocking
        self.t.transfers.append((direction, blocking, where()))
        if blocking:
            self._sync(f"blocking {direction} copy")

    def _account(self, func, name: str, flat: list, out) -> None:  # noqa: ANN001
        if "mm" in name or "linear" in name:
            self.t.matmul_dtypes[(name, out.dtype if isinstance(out, torch.Tensor) else None)] += 1
            self.t.matmul_shapes[(name, tuple(tuple(a.shape) for a in flat if isinstance(a, torch.Tensor)))] += 1
        outs = [o for o in tree_leaves(out) if is_fake_cuda(o)]
        self.t.largest = max([self.t.largest, *(o.numel() for o in outs), *(a.numel() for a in flat if is_fake_cuda(a))])
        if self.track_traffic and not func.is_view and func not in (aten.detach.default, aten.lift_fresh.default):
            self.t.traffic[name] += sum(o.numel() * o.element_size() for o in outs + [a for a in flat if is_fake_cuda(a)])
        if self.track_memory:
            for o in outs:
                ref = StorageWeakRef(o.untyped_storage())
                self.t.live.setdefault(ref.cdata, (ref, o.untyped_storage().nbytes()))
            self.t.peak_bytes = max(self.t.peak_bytes, self.t.live_bytes())


def _index(x: torch.Tensor, index: object) -> torch.Tensor:
    """``x[index]`` as aten ops (select/slice/unsqueeze/index), as PyTorch's applySlicing does."""
    index = index if isinstance(index, tuple) else (index,)
    out, dim, advanced = x, 0, {}
    for item in index:
        if item is None:
            out, dim = aten.unsqueeze.default(out, dim), dim + 1
        elif item is Ellipsis:
            after = sum(0 if r is None else 1 for r in index[index.index(Ellipsis) + 1:])
            dim = out.dim() - after
        elif isinstance(item, int):
            out = aten.select.int(out, dim, item)
        elif isinstance(item, slice):
            out = aten.slice.Tensor(out, dim, item.start, item.stop, 1 if item.step is None else item.step)
            dim += 1
        elif isinstance(item, torch.Tensor):
            advanced[dim] = item
            dim += item.dim() if item.dtype == torch.bool else 1
        else:
            raise NotImplementedError(f"index {type(item).__name__}")
    if advanced:
        out = aten.index.Tensor(out, [advanced.get(d) for d in range(max(advanced) + 1)])
    return out


class _GuardShim(TorchFunctionMode):
    """Re-expresses Python bindings that open a CUDA device guard (absent in CPU builds)."""

    def __init__(self, trace: Trace) -> None:
        super().__init__()
        self.t = trace

    def __torch_function__(self, func, types_, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        fake = any(isinstance(a, FakeTensor) for a in tree_leaves((args, kwargs)))
        to_cuda = func in (torch.Tensor.to, torch.Tensor.cuda) and any(
            isinstance(a, (str, torch.device)) and torch.device(a).type == "cuda" for a in [*args[1:], *kwargs.values()])
        if not (fake or to_cuda):
            return func(*args, **kwargs)
        if func is torch.Tensor.__getitem__:
            return _index(args[0], args[1])
        if func is torch.Tensor.__setitem__:
            view = _index(args[0], args[1])
            value = args[2]
            return aten.copy_.default(view, value) if isinstance(value, torch.Tensor) else aten.fill_.Scalar(view, value)
        if func is torch.Tensor.contiguous:
            x = args[0]
            return x if x.is_contiguous() else aten.clone.default(x, memory_format=torch.contiguous_format)
        if func in (torch.Tensor.to, torch.Tensor.cuda):
            return self._to(func, args, kwargs)
        if func in (torch.nonzero, torch.Tensor.nonzero):
            return aten.nonzero.default(args[0])
        try:
            return func(*args, **kwargs)
        except RuntimeError as exc:
            if "not linked with support for cuda" not in str(exc):
                raise
        name = getattr(func, "__name__", "").strip("_")
        if name in ("float", "int", "bool", "index", "item", "tolist"):
            value = aten._local_scalar_dense.default(args[0])  # a host read: counted as a sync
            return {"float": float, "int": int, "bool": bool, "index": int}.get(name, lambda v: v)(value)
        name = {"invert": "bitwise_not", "and": "bitwise_and", "or": "bitwise_or"}.get(name, name)
        return getattr(aten, name)(*args, **kwargs)

    @staticmethod
    def _to(func, args, kwargs):  # noqa: ANN001
        x = args[0]
        if func is torch.Tensor.cuda:
            device, dtype, non_blocking, copy = torch.device("cuda", 0), None, kwargs.get("non_blocking", False), False
        else:
            kw = dict(kwargs)
            copy = kw.pop("copy", False)
            device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args[1:], **kw)
        if device is not None and device.type == "cuda" and device.index is None:
            device = torch.device("cuda", 0)
        if (device is None or device == _device(x)) and (dtype is None or dtype == x.dtype) and not copy:
            return x
        return aten._to_copy.default(x, dtype=dtype or x.dtype, device=device or _device(x), non_blocking=non_blocking)


class FakeStream:
    def __init__(self, device: object = None, **_: object) -> None:
        self.device = torch.device(device) if device is not None else torch.device("cuda", 0)

    def wait_stream(self, other: FakeStream) -> None:
        pass


def _event_class(trace: Trace) -> type:
    class FakeEvent:
        def __init__(self, enable_timing: bool = False, **_: object) -> None:
            self.stream = None

        def record(self, stream: FakeStream | None = None) -> None:
            self.stream = stream
            trace.events.append(f"record at {where()}")

        def query(self) -> bool:
            return True

        def synchronize(self) -> None:
            trace.events.append(f"synchronize at {where()}")

        elapsed_time = staticmethod(lambda other: 0.0)

    return FakeEvent


def _module_to(self: torch.nn.Module, *args: object, **kwargs: object) -> torch.nn.Module:
    """``Module.to`` for fake parameters (torch's swaps tensors and fails on fakes); ties kept."""
    device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
    memo: dict = {}

    def convert(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in memo:
            memo[id(t)] = t.to(device=device, dtype=dtype if dtype is not None and t.is_floating_point() else None,
                               non_blocking=non_blocking)
        return memo[id(t)]

    for module in self.modules():
        for key, p in list(module._parameters.items()):
            if p is not None and convert(p) is not p:
                module._parameters[key] = memo.setdefault(("param", id(p)), torch.nn.Parameter(convert(p), False))
        for key, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[key] = convert(b)
    return self


_MISSING = object()

Answer = Callable[[tuple, torch.dtype], torch.Tensor]  # a HostCopy's (shape, dtype) -> what the device "computed"


def zeros(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype)


def _patches(trace: Trace, capability: tuple[int, int], total: int, free: int) -> list[tuple[object, str, object]]:
    props = types.SimpleNamespace(name="NVIDIA H200 (fake)", major=capability[0], minor=capability[1],
                                  total_memory=total, multi_processor_count=132)

    def pin(self: torch.Tensor, *_: object, **__: object) -> torch.Tensor:
        trace.pinned[id(self)] = weakref.ref(self)
        return self

    def record_stream(self: torch.Tensor, stream: object) -> None:
        trace.events.append(f"record_stream at {where()}")

    return [
        (torch.cuda, "is_available", lambda: True), (torch.cuda, "device_count", lambda: 1),
        (torch.cuda, "current_device", lambda: 0), (torch.cuda, "set_device", lambda device: None),
        (torch.cuda, "get_device_capability", lambda device=None: capability),
        (torch.cuda, "get_device_name", lambda device=None: props.name),
        (torch.cuda, "get_device_properties", lambda device=None: props),
        (torch.cuda, "mem_get_info", lambda device=None: (free, total)),
        (torch.cuda, "memory_reserved", lambda device=None: 0), (torch.cuda, "memory_allocated", lambda device=None: 0),
        (torch.cuda, "synchronize", lambda device=None: trace.syncs.append(("torch.cuda.synchronize", where()))),
        (torch.cuda, "empty_cache", lambda: None),
        (torch.cuda, "is_bf16_supported", lambda including_emulation=True: True),
        (torch.cuda, "Event", _event_class(trace)), (torch.cuda, "Stream", FakeStream),
        (torch.cuda, "current_stream", lambda device=None: FakeStream(device)),
        (torch.cuda, "stream", lambda stream: contextlib.nullcontext()),
        (torch.backends.cuda, "is_flash_attention_available", lambda: True),
        (torch.Tensor, "pin_memory", pin), (torch.Tensor, "record_stream", record_stream),
        (torch.nn.Module, "to", _module_to),
        # with is_available() True the fake mode would run small real tensors through CUDA kernels
        (FakeTensorMode, "avoid_device_init", property(lambda self: True)),
    ]


@contextlib.contextmanager
def fake_cuda(*, capability: tuple[int, int] = (9, 0), total: int = 141 * GiB, free: int | None = None,
              answer: Answer = zeros, track_memory: bool = False) -> Iterator[Trace]:
    """Inside: one faked CUDA device; yields the :class:`Trace`. ``answer(shape, dtype)`` is
    what :meth:`embedpipe.runtime.cuda.HostCopy.wait` hands back from the device."""
    trace = Trace()
    free = total - GiB if free is None else free
    original_wait = ep_cuda.HostCopy.wait

    def wait(self: ep_cuda.HostCopy) -> torch.Tensor:
        host = original_wait(self)  # the event's synchronize, the buffer back to the ring
        if not isinstance(host, FakeTensor):
            return host  # a CPU batch (the fallback on the host): real values
        with unset_fake_temporarily():
            return answer(tuple(host.shape), host.dtype)

    patches = [*_patches(trace, capability, total, free), (ep_cuda, "host_side", unset_fake_temporarily),
               (ep_cuda.HostCopy, "wait", wait)]
    saved = [(obj, name, vars(obj).get(name, _MISSING)) for obj, name, _ in patches]
    ep_cuda._COPY_STREAMS.clear()
    try:
        for obj, name, value in patches:
            setattr(obj, name, value)
        with FakeTensorMode(allow_non_fake_inputs=True), _GuardShim(trace), \
                _SyncCounter(trace, track_memory=track_memory) as counter:
            trace.counter = counter
            yield trace
    finally:
        for obj, name, value in reversed(saved):
            if value is _MISSING:
                delattr(obj, name)  # inherited (e.g. from torch._C.TensorBase): the class's own again
            else:
                setattr(obj, name, value)
        ep_cuda._COPY_STREAMS.clear()
