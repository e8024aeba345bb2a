"""The time budget of benchmarks/gpu_acceptance.py: what was measured predicts what is left.

A shape may start only if it is expected to finish inside the budget: its seconds are
estimated from the slowest rate measured so far (seconds per forward FLOP of a shape's whole
section, correctness and speed) times its own FLOPs. The proxy gets an estimate from the
650M bf16-mixed speed row and a hard limit: it is stopped when the budget runs out. A
module, not a script.
"""

from __future__ import annotations

from collections.abc import Callable

from _harness import now, run_process

#: seconds kept for what runs after the shapes: the overflow check and the 20,000-record proxy
RESERVE_SECONDS = 150.0
#: seconds the overflow check takes at most (tiny model), kept out of the proxy's share
OVERFLOW_SECONDS = 20.0
#: the proxy is a whole process: start-up, model load and the store write on top of the forward
PROXY_OVERHEAD = 1.5


class Budget:
    """The run's clock and the rate its shapes ran at; ``minutes`` None: no budget."""

    def __init__(self, minutes: float | None, clock: Callable[[], float] = now) -> None:
        self.minutes = minutes
        self.clock = clock
        self.started = clock()
        self.rate: float | None = None  # seconds per FLOP, the slowest shape so far
        self.rate_from: str | None = None

    def elapsed(self) -> float:
        return self.clock() - self.started

    def left(self) -> float | None:
        """Seconds left of the budget, the reserve for overflow check and proxy not deducted."""
        return None if self.minutes is None else self.minutes * 60 - self.elapsed()

    def measured(self, key: str, flops: float, seconds: float) -> None:
        """A shape's section took ``seconds`` for ``flops`` forward FLOPs."""
        if flops > 0 and (self.rate is None or seconds / flops > self.rate):
            self.rate, self.rate_from = seconds / flops, key

    def estimate(self, flops: float) -> float | None:
        """Expected seconds of a shape's section with ``flops`` (None before any shape ran)."""
        return None if self.rate is None else self.rate * flops

    def shape_skip(self, flops: float) -> str | None:
        """Why a shape of ``flops`` does not start (None: it may)."""
        left = self.left()
        if left is None:
            return None
        elapsed = self.elapsed()
        if left - RESERVE_SECONDS <= 0:
            return (f"time budget: {elapsed:.0f} s elapsed of {self.minutes:g} min, {RESERVE_SECONDS:.0f} s kept for "
                    "the overflow check and the proxy (--budget-minutes, --shapes)")
        expected = self.estimate(flops)
        if expected is not None and expected > left - RESERVE_SECONDS:
            return (f"time budget: estimated {expected:.0f} s ({self.rate_from}'s measured rate x the FLOPs ratio) "
                    f"but {left - RESERVE_SECONDS:.0f} s left of {self.minutes:g} min after {RESERVE_SECONDS:.0f} s "
                    "kept for the overflow check and the proxy (--budget-minutes, --shapes)")
        return None

    def proxy_limit(self, residues: int, residues_per_s: float | None) -> tuple[float | None, str | None]:
        """(seconds the proxy may run, why it does not start): the budget left after the
        overflow check; refused up front when the measured rate says it cannot finish."""
        left = self.left()
        if left is None:
            return None, None
        limit = left - OVERFLOW_SECONDS
        if limit <= 0:
            return None, f"time budget: nothing left of {self.minutes:g} min for the proxy"
        if residues_per_s:
            expected = PROXY_OVERHEAD * residues / residues_per_s
            if expected > limit:
                return None, (f"time budget: the proxy would take about {expected:.0f} s (650M bf16-mixed rate x "
                              f"{PROXY_OVERHEAD:g} for start-up and writing), {limit:.0f} s left")
        return limit, None


def timed_with_limit(cmd: list[str], env: dict[str, str], limit: float | None) -> tuple[float | None, float, str | None]:
    """(wall seconds, peak RSS MiB, why it was stopped) of one child process, killed (its whole
    process group) once it runs ``limit`` seconds; a failure of the child raises."""
    done = run_process(cmd, env=env, limit=limit)
    if done.returncode == -9:
        return None, done.peak_rss_mib, f"time budget: the proxy was stopped after {limit:.0f} s"
    return done.seconds, done.peak_rss_mib, None
