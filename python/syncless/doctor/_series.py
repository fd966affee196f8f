"""A run of step durations, split into the steady step and the work that comes now and then.

Per-epoch and every-N-steps work (workers restarting, a checkpoint, an evaluation, a logging
interval's print) lands in a few steps. Averaged in, it makes the step look slower than the one
the user runs, and its cost is blamed on whatever the steady step does (a GAN example with a
16-batch epoch: 70 ms "per step" against 17-30 ms measured with two timestamps). So: a stall is a
step longer than SPIKE times the median and at least FLOOR_MS over it; stalls of one size (within
a factor of SAME of each other) are one kind of work, periodic when they come at a regular
interval; the steady step is the mean of the other steps."""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Collection

__all__ = ["Stalls", "Series", "split"]

SPIKE = 2.0          # a stall takes more than twice the median step ...
FLOOR_MS = 1.0       # ... and at least 1 ms more (a 0.2-ms step's 0.5-ms jitter is no stall)
SAME = 3.0           # stalls within 3x of each other's extra time are one kind of work


@dataclass
class Stalls:
    """Stalls of one kind: at `steps` (indices into the series), `ms_each` over the steady step."""
    steps: list[int]
    ms_each: float
    every_steps: int | None          # None: not periodic (seen once, or irregular)
    share: float                     # of the window's wall time
    what: str = ""                   # what the stalled steps did (the monitor's attribution)

    def as_dict(self) -> dict[str, Any]:
        return {"what": self.what, "every_steps": self.every_steps, "ms_each": self.ms_each,
                "share": self.share, "seen": len(self.steps)}


@dataclass
class Series:
    steady_ms: float                 # mean of the steps that are not stalls
    mean_ms: float                   # mean of every step (what wall / steps says)
    median_ms: float
    steps: int
    stalls: list[Stalls] = field(default_factory=list)     # [Stalls], the largest share first

    @property
    def stalled(self) -> set[int]:
        return {i for s in self.stalls for i in s.steps}


def _period(steps: list[int]) -> int | None:
    """The interval of stalls at `steps` when it is regular (3 of 4 gaps within 10% or one step of
    the median gap), else None; two stalls give their one gap."""
    if len(steps) < 2:
        return None
    gaps = [b - a for a, b in zip(steps, steps[1:])]
    p = statistics.median_low(gaps)
    tol = max(1, round(0.1 * p))
    regular = sum(abs(g - p) <= tol for g in gaps)
    return p if p > 1 and regular >= 0.75 * len(gaps) else None


def split(durations_ms: list[float], steady: Collection[int] = frozenset()) -> Series:
    """The steady step and the stalls of a run of step durations (ms); the steps in `steady`
    are never stalls."""
    n = len(durations_ms)
    if n == 0:
        return Series(0.0, 0.0, 0.0, 0)
    median = statistics.median(durations_ms)
    spikes = [i for i, d in enumerate(durations_ms)
              if d > SPIKE * median and d - median >= FLOOR_MS and i not in steady]
    spiked = set(spikes)
    rest = [d for i, d in enumerate(durations_ms) if i not in spiked]
    steady_ms = statistics.fmean(rest) if rest else median
    total = sum(durations_ms)
    # Group the stalls by size: sorted by their extra time, a new group where it jumps by SAME.
    groups: list[list[int]] = []
    for i in sorted(spikes, key=lambda i: durations_ms[i]):
        extra = durations_ms[i] - steady_ms
        if groups and extra <= SAME * (durations_ms[groups[-1][0]] - steady_ms):
            groups[-1].append(i)
        else:
            groups.append([i])
    stalls = []
    for g in groups:
        g.sort()
        extra_ms = [durations_ms[i] - steady_ms for i in g]
        stalls.append(Stalls(g, statistics.fmean(extra_ms), _period(g),
                             sum(extra_ms) / total if total > 0 else 0.0))
    stalls.sort(key=lambda s: -s.share)
    return Series(steady_ms, total / n, median, n, stalls)
