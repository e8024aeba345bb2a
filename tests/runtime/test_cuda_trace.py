"""The CUDA branches of ``Engine.embed``, executed on a CPU-only torch (issue 20, §1).

Each policy runs the real worker, model preparation, forward, pooling and read-back on a
faked Hopper GPU (tests/helpers/fake_cuda.py). The model is prepared first (its weights go to the
device with blocking copies: that is preparation, not the launch path), the trace is cleared,
then the records are embedded. What the launch path must never do, and what flash's varlen
kernel needs of its inputs, is asserted in :func:`problems`; the planted defects at the end
show that the trace catches each of them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from embedpipe.core.options import POLICY_NAMES
from embedpipe.extraction.engine import Engine
from embedpipe.model import load_model
from embedpipe.model.random_hf import make_hf_test_model
from embedpipe.runtime import cuda as ep_cuda
from embedpipe.runtime.precision import FP32
from helpers.engine import embedder_for
from helpers.fake_cuda import FLOAT_ABS, SEAM_NAME, Trace, fake_cuda, is_fake_cuda

CUDA = torch.device("cuda", 0)
LENGTHS = [30, 75, 120, 200, 41, 1500]  # the 1500 one is cut into windows


def _records() -> list[tuple[str, str]]:
    rng = np.random.default_rng(0)
    amino = np.array(list("ACDEFGHIKLMNPQRSTVWY"))
    return [(f"r{i}", "".join(rng.choice(amino, n))) for i, n in enumerate(LENGTHS)]


@pytest.fixture(scope="module")
def model_path(model_factory):
    return model_factory(layers=2, dim=64, heads=4, seed=1)  # head_dim 16: flash's multiple of 8


class NanAnswer:
    """The device's answer: zeros, with NaN as the largest activation of summary row ``row``
    of the first batch read back (the record's check fails, so it is re-run in fp32)."""

    def __init__(self, row: int | None) -> None:
        self.row = row

    def __call__(self, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        out = torch.zeros(shape, dtype=dtype)
        if self.row is not None and len(shape) == 2:
            out[self.row, -1] = float("nan")
            self.row = None
        return out


def _weights(runner) -> list[torch.Tensor]:
    """The tensors a prepared runner computes with: an ESM-2 module's parameters, or T5's dict."""
    return list(runner.model.parameters()) if hasattr(runner, "model") else list(runner.w.values())


def trace_embed(model_path, *, nan_row: int | None = None, pooling: tuple[str, ...] = ("mean", "bos"),
                **options) -> tuple[Engine, dict, Trace, dict]:
    """Embed the records on the faked GPU: (embedder, results, trace of the launch path, facts
    read while the GPU was faked)."""
    loaded = load_model(str(model_path))
    options = dict(device="cuda", per_residue=True, pooling=pooling, layers=(1, -1), **options)  # engine keys: the override
    with fake_cuda(answer=NanAnswer(nan_row)) as trace:
        embedder = embedder_for(loaded, options, CUDA)
        embedder.runner(embedder.policy)
        if nan_row is not None:
            embedder.runner(FP32)  # the fallback model: preparation too
        preparation = list(trace.syncs)
        trace.clear()
        results = dict(embedder.embed(_records()))
        facts = {"preparation": preparation, "attention_path": embedder.attention_path,
                 "fallback_device": embedder.fallback_device,
                 "runner_devices": {name: sorted({str(p.fake_device) if is_fake_cuda(p) else str(p.device)
                                                  for p in _weights(runner)})
                                    for name, runner in embedder.prepared.runners.items()}}
    return embedder, results, trace, facts


def problems(trace: Trace) -> list[str]:
    """Everything the launch path must not do, as lines (empty: all is well)."""
    out = [f"host sync: {what} at {where}" for what, where in trace.syncs]
    out += [f"device-to-host copy outside {SEAM_NAME}'s HostCopy (blocking={b}) at {w}"
            for _, b, w in trace.d2h_outside_seam()]
    out += [f"blocking host-to-device copy at {w}" for _, _, w in trace.blocking_h2d()]
    out += [f"varlen contract: {what} at {where}" for what, where in trace.violations]
    out += [f"device mismatch: {what} at {where}" for what, where in trace.mismatches]
    return out


CASES = {
    "bf16-mixed": (dict(precision="bf16-mixed"), "packed-varlen-flash"),
    "fp16-mixed": (dict(precision="fp16-mixed"), "packed-varlen-flash"),
    "fp16": (dict(precision="fp16"), "packed-varlen-flash"),
    "amp-bf16": (dict(precision="amp-bf16"), "packed-varlen-flash"),
    "fp32": (dict(precision="fp32"), "padded-sdpa"),
    "fp32-packed": (dict(precision="fp32", batch_layout="packed"), "packed-sdpa-per-sequence"),
    "bf16-mixed-padded": (dict(precision="bf16-mixed", batch_layout="padded"), "padded-sdpa"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_launch_path_makes_no_sync_and_meets_the_varlen_contract(model_path, case):
    options, path = CASES[case]
    embedder, results, trace, facts = trace_embed(model_path, **options)
    assert facts["attention_path"] == path
    assert sorted(results) == list(range(len(LENGTHS)))
    assert problems(trace) == []
    d2h = [t for t in trace.transfers if t[0] == "D2H"]
    assert d2h and all(SEAM_NAME in where and not blocking for _, blocking, where in d2h)
    assert any("synchronize" in e and SEAM_NAME in e for e in trace.events)  # the read-back point waits
    assert facts["runner_devices"][options["precision"]] == ["cuda:0"]
    # preparing the runner itself copies nothing from the host (only the weights' move does),
    # and the largest-activation checks read each hidden state once: no |x| copy on the device
    assert [s for s in facts["preparation"] if "esm2_forward.py" in s[1]] == []
    assert "aten.abs.default" not in trace.ops
    windows = sum(1 for _ in embedder.plan(_records()).batches for _ in _)
    if path == "packed-varlen-flash":
        assert len(trace.varlen_calls) == embedder.stats["batches"] * 2  # one per layer
        assert all(c["offsets"] == torch.int32 and type(c["max_seqlen"]) is int for c in trace.varlen_calls)
        assert "aten._scaled_dot_product_flash_attention.default" not in trace.ops
        assert "aten.clone.default" not in trace.ops  # q/k/v passed as strided views: flash needs only stride(-1) == 1
    else:
        assert trace.varlen_calls == []
    assert windows > len(LENGTHS)  # the long record ran as windows through the same path


def test_a_record_whose_check_fails_is_rerun_in_fp32_on_the_device(model_path):
    embedder, results, trace, facts = trace_embed(model_path, precision="fp16", nan_row=1)
    assert problems(trace) == []
    assert embedder.stats["fallback"] == 1 and embedder.stats["fallback:nonfinite"] == 1
    assert facts["fallback_device"] == "cuda:0"
    assert facts["runner_devices"] == {"fp16": ["cuda:0"], "fp32": ["cuda:0"]}
    assert sum(1 for r in results.values() if r.precision_used == "fp32") == 1
    fp32_matmuls = sum(n for (op, dtype), n in trace.matmul_dtypes.items() if dtype == torch.float32)
    assert fp32_matmuls > 0  # the fp32 re-run computed on the (faked) device
    assert len(trace.varlen_calls) >= 2  # the fp16 batches still took the varlen kernel


# -- every family: the same launch-path contract ----------------------------------------------

#: every family in its own on-disk format; the T5 encoders have no BOS and run padded (their
#: relative-position bias is added to every score, so no varlen kernel); ESM C packs like ESM-2
FAMILIES = {"esm2-pt": ("mean", "bos"), "hf-esm": ("mean", "bos"), "prot-t5": ("mean",), "ankh": ("mean",),
            "esmc": ("mean", "bos")}
GPU_POLICIES = [name for name in POLICY_NAMES if name != "int8-mixed"]  # int8-mixed is CPU-only


@pytest.fixture(scope="module")
def family_paths(model_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("trace-families")
    paths = {"esm2-pt": model_path}
    for family in ("hf-esm", "prot-t5", "ankh", "esmc"):
        paths[family] = make_hf_test_model(root / family, family=family, layers=2, dim=64, heads=4, seed=1)
    return paths


@pytest.mark.parametrize("precision", GPU_POLICIES)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_launches_without_a_sync_under_every_gpu_policy(family_paths, family, precision):
    embedder, results, trace, facts = trace_embed(family_paths[family], pooling=FAMILIES[family], precision=precision)
    assert sorted(results) == list(range(len(LENGTHS)))
    assert problems(trace) == []
    d2h = [t for t in trace.transfers if t[0] == "D2H"]
    assert d2h and all(SEAM_NAME in where and not blocking for _, blocking, where in d2h)
    assert facts["runner_devices"][precision] == ["cuda:0"]
    assert FLOAT_ABS not in trace.ops  # the largest-activation checks make no |x| copy (T5's bucket table is integer)
    if FAMILIES[family] == ("mean",):  # T5: padded SDPA-free attention, never the varlen kernel
        assert facts["attention_path"] == "padded-sdpa" and trace.varlen_calls == []
    elif precision != "fp32":
        assert facts["attention_path"] == "packed-varlen-flash"
        assert len(trace.varlen_calls) == embedder.stats["batches"] * 2  # one per layer


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_reruns_a_failing_record_in_fp32_on_the_device(family_paths, family):
    embedder, results, trace, facts = trace_embed(family_paths[family], pooling=FAMILIES[family], precision="fp16",
                                                  nan_row=0)  # T5's first read-back holds one record
    assert problems(trace) == []
    assert embedder.stats["fallback"] == 1 and embedder.stats["fallback:nonfinite"] == 1
    assert facts["runner_devices"] == {"fp16": ["cuda:0"], "fp32": ["cuda:0"]}
    assert sum(1 for r in results.values() if r.precision_used == "fp32") == 1
    assert sum(n for (op, dtype), n in trace.matmul_dtypes.items() if dtype == torch.float32) > 0


# -- planted defects: the trace must catch each -------------------------------------------------

def _plant(monkeypatch, change) -> None:
    """Wrap the varlen call of the forward (embedpipe.runtime.cuda's seam) with ``change``."""
    original = ep_cuda.varlen_attention

    def planted(q, k, v, cu_seqlens, max_len):
        return original(*change(q, k, v, cu_seqlens, max_len))

    monkeypatch.setattr(ep_cuda, "varlen_attention", planted)


def _nan_check(q, k, v, cu, m):
    if bool(torch.isnan(q).any()):  # a host sync inside the forward, once per layer
        raise RuntimeError("nan")
    return q, k, v, cu, m


def _round_trip(q, k, v, cu, m):
    return q.cpu().to(q.device), k, v, cu, m  # a device-to-host copy and back inside the forward


def _int64_offsets(q, k, v, cu, m):
    return q, k, v, cu.long(), m


@pytest.mark.parametrize("plant, expected, at", [
    (_nan_check, "host sync: is_nonzero", "runtime/packed.py"),
    (_round_trip, "device-to-host copy outside", "runtime/packed.py"),
    (_int64_offsets, "varlen contract: cu_seqlens_q dtype torch.int64", "cuda.py"),
], ids=["host-sync", "device-to-host-round-trip", "int64-offsets"])
def test_the_trace_catches_a_planted_defect(model_path, monkeypatch, plant, expected, at):
    _plant(monkeypatch, plant)
    *_, trace, _facts = trace_embed(model_path, precision="bf16-mixed")
    found = problems(trace)
    caught = [line for line in found if line.startswith(expected)]
    assert caught, "\n".join(found)
    assert all(at in line for line in caught), caught  # located where it was planted (the kernel's call for the offsets)


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp32"])
@pytest.mark.parametrize("family", ["esm2-pt", "prot-t5"])
def test_every_matmul_shape_is_fixed_whatever_the_batching(family_paths, family, precision):
    """Issue 32 on the CUDA path: the linear layers run in fixed row tiles, so the set of matmul
    shapes is the same for one batch of every record and for many small ones, and every
    projection's rows are exactly one tile (docs/precision.md, "Reproducibility")."""
    from embedpipe.runtime.packed_linear import tile_rows

    pooling = FAMILIES[family]
    shapes = []
    for budget in ("auto", 700):
        embedder, results, trace, _ = trace_embed(family_paths[family], pooling=pooling, precision=precision,
                                                  tokens_per_batch=budget)
        assert sorted(results) == list(range(len(LENGTHS)))
        shapes.append(set(trace.matmul_shapes))
    assert embedder.stats["batches"] > 1  # the second batching really is another one
    assert shapes[0] == shapes[1]
    linears = [inputs for op, inputs in shapes[0] if op == "aten.linear.default"]
    assert len(linears) >= 3, sorted(shapes[0])  # q/k/v or their fused projection, out projection, feed-forward
    assert {inputs[0] for inputs in linears} <= {(tile_rows(CUDA), width) for width in (64, 128, 256)}, sorted(shapes[0])
