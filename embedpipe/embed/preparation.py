"""The prepared models of one embedder: a runner per precision policy, prepared once, on the
device it runs on.

Out of memory while preparing is not a batch that is too big (that one is split by the
engine): for the fp32 fallback under ``--fallback-device auto`` the fallback moves to the CPU,
otherwise the run fails with what to do (docs/precision.md, "Where the fallback runs").
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from embedpipe.core.errors import EmbedpipeError
from embedpipe.embed.calibration import prepare_calibrated
from embedpipe.embed.resolved import ResolvedRun
from embedpipe.model.base import EmbeddingModel, Runner
from embedpipe.runtime.fused import use_cache
from embedpipe.runtime.precision import Policy, forward_context

#: the warm-up batch that compiles the main runner before the first real one (two records of
#: different lengths: sizes 1 would specialise the graphs, docs/precision.md "Compiled elementwise work")
WARM_UP = ("MKTAYIAKQRQISFVKSHFSRQ", "MKTAYIAKQRQ")


class Preparation:
    """The runners of the main policy and of its fp32 fallback, and where each lives.

    ``device`` is the job's device, where the main policy runs (and the fallback, unless
    ``--fallback-device`` or an out-of-memory move says otherwise). ``on_moved`` is told, in a
    sentence, when the fallback moved to the CPU; ``tell`` gets the compile-time line.
    """

    def __init__(self, loaded: EmbeddingModel, run: ResolvedRun, on_moved: Callable[[str], None],
                 tell: Callable[[str], None] = lambda line: None) -> None:
        self.loaded, self.run, self.options = loaded, run, run.options
        self.main, self.device = run.policy, run.device
        self.on_moved, self.tell = on_moved, tell
        self.runners: dict[str, Runner] = {}
        self.devices: dict[str, torch.device] = {}  # policy name -> where its runner lives
        #: whether the main runner runs compiled, why, and the seconds compiling took (provenance)
        self.compiled, self.compile_reason, self.compile_s = False, run.compile_reason, 0.0

    def runner(self, policy: Policy) -> Runner:
        """The forward for ``policy``, prepared once, on the device it runs on (``devices``).

        The retry runs after the ``except`` block, so the failed attempt's tensors are freed first.
        """
        if policy.name in self.runners:
            return self.runners[policy.name]
        device = self.planned_device(policy)
        try:
            return self._prepare(policy, device)
        except torch.cuda.OutOfMemoryError:
            pass
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if not self.is_fallback(policy) or self.options.fallback_device != "auto" or device.type == "cpu":
            raise EmbedpipeError(self._oom_message(policy, device))
        self.on_moved(f"the fp32 fallback model of {self.loaded.name} does not fit on {device} beside the "
                      f"{self.main.name} model; fallback records run on the CPU (slower; see docs/precision.md)")
        return self._prepare(policy, torch.device("cpu"))

    def is_fallback(self, policy: Policy) -> bool:
        return policy.name != self.main.name

    def planned_device(self, policy: Policy) -> torch.device:
        """Where ``policy`` is to be prepared: the job's device, or the CPU for a fallback
        under ``--fallback-device cpu``."""
        if self.is_fallback(policy) and self.options.fallback_device == "cpu":
            return torch.device("cpu")
        return self.device

    def device_of(self, policy: Policy) -> torch.device:
        """Where ``policy``'s runner lives (prepared, or planned when not yet prepared)."""
        return self.devices.get(policy.name) or self.planned_device(policy)

    def layout(self, policy: Policy) -> str:
        """``--batch-layout`` for ``policy`` on the device its runner lives on (the run's)."""
        return self.run.layout_for(policy, self.device_of(policy))

    def _prepare(self, policy: Policy, device: torch.device) -> Runner:
        # the run's resolved q/k/v inputs: only the main policy reads them, and it runs on the
        # run's device (the fp32 fallback attends in fp32 wherever it runs)
        self.runners[policy.name] = prepare_calibrated(self.loaded, policy, device, lambda: self.loaded.prepare(
            policy, device, self.options.attention, attention_inputs=self.run.attention_inputs))
        self.devices[policy.name] = device
        if self.run.compiled and not self.is_fallback(policy):
            self._compile(self.runners[policy.name], policy, device)
        return self.runners[policy.name]

    def _compile(self, runner: Runner, policy: Policy, device: torch.device) -> None:
        """Compile the main runner (``--compile``: the CPU's elementwise pieces, CUDA's whole
        layers) and run :data:`WARM_UP` through it, so the compile time is paid and timed here;
        a family without a compiled path (ESM C, T5) stays eager, and says why."""
        use_cache(self.options.compile_cache)
        start = time.perf_counter()
        if device.type == "cpu" and hasattr(runner, "compile_elementwise"):
            self.compiled = bool(runner.compile_elementwise())
        elif device.type != "cpu" and hasattr(runner, "compile_layers"):
            runner.compile_layers()
            self.compiled = True
        if not self.compiled:
            self.compile_reason += f"; {self.loaded.name} under {policy.name} on {device.type} has no compiled path: eager"
            return
        tokens = self.loaded.tokenize(list(WARM_UP)).to(device)
        with forward_context(policy, device):
            runner(tokens, list(self.run.layers))
        self.compile_s = time.perf_counter() - start
        self.tell(f"compiled {self.loaded.name} in {self.compile_s:.1f} s ({self.compile_reason})")

    def _oom_message(self, policy: Policy, device: torch.device) -> str:
        if self.is_fallback(policy):
            return (
                f"the fp32 fallback model of {self.loaded.name} does not fit in memory on {device} beside the "
                f"{self.main.name} model; use --fallback-device cpu (or auto) to re-run fallback records on "
                "the CPU, or a GPU with more memory"
            )
        return (
            f"the {policy.name} model of {self.loaded.name} does not fit in memory on {device} (before any "
            "batch ran); use a lower precision, a smaller model or a GPU with more memory"
        )
