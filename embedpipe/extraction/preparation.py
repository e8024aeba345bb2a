"""The prepared models of one embedder: a runner per precision policy, prepared once, on the
device it runs on.

Where the fp32 fallback runs is the run's (``ResolvedRun.fallback_device``, decided by
``resolve_run`` from the memory estimate); it is read here. Out of memory while preparing is
not a batch that is too big (that one is split by the engine): the estimate was wrong, so a
derived fallback device moves the fp32 model to the CPU; otherwise the run fails with what to
do (docs/precision.md, "Where the fallback runs").
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from embedpipe.core.errors import EmbedpipeError
from embedpipe.extraction.calibration import prepare_calibrated
from embedpipe.extraction.resolved import ResolvedRun
from embedpipe.model.base import EmbeddingModel, Runner
from embedpipe.runtime.precision import Policy


class Preparation:
    """The runners of the main policy and of its fp32 fallback, and where each lives.

    ``device`` is the job's device, where the main policy runs (and the fallback, unless the
    run's fallback device or an out-of-memory move says otherwise). ``on_moved`` is told, in a
    sentence, when the fallback moved to the CPU.
    """

    def __init__(self, loaded: EmbeddingModel, run: ResolvedRun, on_moved: Callable[[str], None]) -> None:
        self.loaded, self.run = loaded, run
        self.main, self.device = run.policy, run.device
        self.on_moved = on_moved
        self.runners: dict[str, Runner] = {}
        self.devices: dict[str, torch.device] = {}  # policy name -> where its runner lives

    def runner(self, policy: Policy) -> Runner:
        """The forward for ``policy``, prepared once, on the device it runs on (``devices``).

        The retry runs after the ``except`` block, so the failed attempt's tensors are freed first.
        """
        if policy.name in self.runners:
            return self.runners[policy.name]
        device = self.planned_device(policy)
        moved = self.is_fallback(policy) and self.run.fallback_derived and self.device.type == "cuda"
        if moved and device.type == "cpu":  # the run resolved it so: said when the first record falls back
            self.on_moved(self._moved_message())
        try:
            return self._prepare(policy, device)
        except torch.cuda.OutOfMemoryError:
            pass
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if not moved or device.type == "cpu":
            raise EmbedpipeError(self._oom_message(policy, device))
        self.on_moved(self._moved_message())
        return self._prepare(policy, torch.device("cpu"))

    def _moved_message(self) -> str:
        return (f"the fp32 fallback model of {self.loaded.name} does not fit on {self.device} beside the "
                f"{self.main.name} model; fallback records run on the CPU (slower; see docs/precision.md)")

    def is_fallback(self, policy: Policy) -> bool:
        return policy.name != self.main.name

    def planned_device(self, policy: Policy) -> torch.device:
        """Where ``policy`` is to be prepared: the job's device, or the CPU for a fallback
        the run resolved there (``fallback_device`` cpu)."""
        if self.is_fallback(policy) and self.run.fallback_device == "cpu":
            return torch.device("cpu")
        return self.device

    def device_of(self, policy: Policy) -> torch.device:
        """Where ``policy``'s runner lives (prepared, or planned when not yet prepared)."""
        return self.devices.get(policy.name) or self.planned_device(policy)

    def layout(self, policy: Policy) -> str:
        """The batch layout for ``policy`` on the device its runner lives on (the run's)."""
        return self.run.layout_for(policy, self.device_of(policy))

    def _prepare(self, policy: Policy, device: torch.device) -> Runner:
        # the run's resolved q/k/v inputs: only the main policy reads them, and it runs on the
        # run's device (the fp32 fallback attends in fp32 wherever it runs)
        self.runners[policy.name] = prepare_calibrated(self.loaded, policy, device, lambda: self.loaded.prepare(
            policy, device, self.run.attention, attention_inputs=self.run.attention_inputs))
        self.devices[policy.name] = device
        return self.runners[policy.name]

    def _oom_message(self, policy: Policy, device: torch.device) -> str:
        if self.is_fallback(policy):
            return (
                f"the fp32 fallback model of {self.loaded.name} does not fit in memory on {device} beside the "
                f"{self.main.name} model; run on a GPU with more memory, or a lower precision, or a smaller "
                "model"
            )
        return (
            f"the {policy.name} model of {self.loaded.name} does not fit in memory on {device} (before any "
            "batch ran); use a lower precision, a smaller model or a GPU with more memory"
        )
