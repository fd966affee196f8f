"""What a Logger(gpu_time=True) tells watch() for free: the GPU's pace and how far it trails.

Every row the gather kernel writes carries the GPU clock (%globaltimer) at that moment, so the
rows watch() logs once a step give, with no event and no extra launch, the GPU time from one
step's end to the next (its pace, busy or not) and the lag between the host's log() call and
the GPU reaching it (Logger.gpu_steps()). The lag is the launch queue's depth: near 0 the GPU
catches up with the host every step and waits for it; a lag of a step or more means work is
always queued, so the GPU never waits and its pace is its own work per step.
"""
from __future__ import annotations

import statistics
from typing import Any, NamedTuple

__all__ = ["GpuClock", "gpu_clock"]

SATURATED = 1.0      # lag >= this many steps: the queue never runs dry, the GPU sets the pace
CAUGHT_UP = 0.1      # lag <= this share of a step: the GPU waits for the host every step


class GpuClock(NamedTuple):
    steps: int           # steps whose GPU pace was read
    pace_ms: float       # median GPU time per step, end of one step's rows to the next
    lag_ms: float        # median lag of the newer half of those steps (the steady state)

    @property
    def queue_steps(self) -> float:
        return self.lag_ms / self.pace_ms if self.pace_ms > 0 else 0.0

    def verdict(self) -> str:
        q = self.queue_steps
        if q >= SATURATED:
            return (f"the GPU trails the host by {self.lag_ms:.2f} ms ({q:.1f} steps queued): "
                    "it never waits, so it sets the pace (GPU-bound)")
        if q <= CAUGHT_UP:
            return (f"the GPU catches up with the host every step (lag {self.lag_ms:.3f} ms): "
                    "it waits for the CPU or the data")
        return (f"the GPU trails the host by {self.lag_ms:.2f} ms ({q:.2f} of a step): "
                "it sometimes waits for the host")


def gpu_clock(log: Any, first_step: int = 0) -> GpuClock | None:
    """The GPU clock of `log`'s steps from `first_step` on; None when the logger keeps none
    (not a syncless Logger, gpu_time off, host rows only, or fewer than two steps)."""
    read = getattr(log, "gpu_steps", None)
    if read is None:
        return None
    steps = [(s, gpu, lag) for s, gpu, lag in read() if s >= first_step]
    paces = [gpu for _, gpu, _ in steps if gpu is not None]
    lags = [lag for _, _, lag in steps[len(steps) // 2:] if lag is not None]
    if not paces or not lags:
        return None
    return GpuClock(len(paces), statistics.median(paces), statistics.median(lags))
