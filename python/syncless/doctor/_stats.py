"""Does a fix win? Paired runs (one without the fix, one with it, interleaved) compared on the
log of their ratio, with a verdict that one outlier run cannot flip.

Why the log of the ratio: a host that drifts or gets busier slows both runs of a pair by a factor,
not by a fixed number of milliseconds (the HF Trainer's baselines ran 11.7, 12.0 and 20.3 ms with
its fix at 6.0, 6.6 and 8.8 ms: differences of 5.7, 5.4 and 11.5 ms, ratios of 0.51, 0.55 and
0.43). A t-interval on raw differences let the one slow pair hide a 2x win in all three; on the
log ratios the three agree.

Why an outlier cannot flip the verdict:
- With three pairs the t quantile (4.30 for 2 degrees of freedom) asks all three to agree: one
  pair against the other two widens the interval past zero, so one run cannot make a fix kept.
- From four pairs on, the pair farthest from the median log ratio is also left out, and the
  verdict is taken only where the interval with it and the interval without it agree; otherwise
  the comparison is unclear and more pairs are run (while the time allows).
- A fix that runs at most MARGIN of its baseline in every pair (three or more) is kept whatever
  one pair's size does to the interval (a win so large in one pair that the others look small
  beside it): a sign test made stricter by its size. Under no effect each pair's sign is a coin
  toss (three of three: 1 in 8), and each must also be a 30% swing the same way, with the fix's
  run first in some pairs and second in others.

Pairs are added one at a time and the verdict is looked at after each (a sequential test): it
stops as soon as the fix clearly wins, clearly loses or clearly wins less than NEGLIGIBLE. Looking
after every pair raises the chance of a false win a little above 5%, which the pair cap
(MAX_PAIRS) bounds."""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

__all__ = ["Comparison", "compare", "t_interval", "MAX_PAIRS"]

MARGIN = 0.7          # a fix whose every pair runs at most 70% of its baseline is kept
NEGLIGIBLE = 0.03     # an interval that rules out a win of 3% or more: no win, stop
MAX_PAIRS = 8         # pairs one fix may get while its comparison is unclear
# Student's t, two-sided 95%, by degrees of freedom.
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
        9: 2.262, 10: 2.228, 11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131}


def t_interval(values: list[float]) -> tuple[float, float, float]:
    """Mean and 95% interval of the mean of `values` (t distribution); (-inf, inf) for one."""
    n = len(values)
    mean = statistics.fmean(values)
    if n < 2:
        return mean, -math.inf, math.inf
    half = _T95.get(n - 1, 1.96) * statistics.stdev(values) / math.sqrt(n)
    return mean, mean - half, mean + half


@dataclass
class Comparison:
    """What `pairs` paired runs say. `ratio` is the fix's step over the baseline's (0.49: 51%
    faster) and `low`, `high` its 95% interval; `verdict` is "win", "loss", "no win" (the
    interval rules out a win of NEGLIGIBLE or more) or "unclear" (run more pairs)."""
    pairs: int
    baseline_ms: float          # the median baseline run
    ratio: float
    low: float
    high: float
    verdict: str
    why: str                    # how the verdict was reached, in words

    @property
    def decided(self) -> bool:
        return self.verdict != "unclear"

    @property
    def kept(self) -> bool:
        return self.verdict == "win"

    @property
    def fix_ms(self) -> float:
        return self.baseline_ms * self.ratio

    @property
    def win_ms(self) -> float:
        """The step time the fix wins back (negative: faster)."""
        return self.fix_ms - self.baseline_ms

    def text(self) -> str:
        """`-7.49 ms/step (-51%) [95%: -62%, -38%]`: the win and its interval, both as changes
        of the step (never a bracket that reads as a step time)."""
        def pct(r: float) -> str:
            return "-inf%" if r == 0 else f"{(r - 1) * 100:+.0f}%"
        return (f"{self.win_ms:+.2f} ms/step ({pct(self.ratio)}) "
                f"[95%: {pct(self.low)}, {pct(self.high)}]")

    def as_dict(self) -> dict[str, object]:
        return {"pairs": self.pairs, "verdict": self.verdict, "why": self.why,
                "win_ms": self.win_ms, "ratio": self.ratio, "ratio_low": self.low,
                "ratio_high": self.high}


def _verdict(low: float, high: float) -> str:
    if high < 0:
        return "win"
    if low > 0:
        return "loss"
    if low > math.log(1 - NEGLIGIBLE):
        return "no win"
    return "unclear"


def compare(without_ms: list[float], with_ms: list[float]) -> Comparison:
    """The verdict of paired runs: `without_ms[i]` and `with_ms[i]` are one pair's step times."""
    if len(without_ms) != len(with_ms) or not without_ms:
        raise ValueError(f"paired runs: {len(without_ms)} without the fix and {len(with_ms)} "
                         "with it; need the same number, at least one")
    if min(without_ms + with_ms) <= 0:
        raise ValueError("paired runs: a step time must be positive, got "
                         f"{min(without_ms + with_ms)} ms")
    logs = [math.log(b / a) for a, b in zip(without_ms, with_ms)]
    n = len(logs)
    base = statistics.median(without_ms)
    mean, low, high = t_interval(logs)
    verdict = _verdict(low, high)
    why = f"t-interval of the log ratios of {n} pairs"
    if n >= 4:
        # The pair farthest from the median, left out: the verdict stands only where both agree.
        middle = statistics.median(logs)
        far = max(range(n), key=lambda i: abs(logs[i] - middle))
        rest = logs[:far] + logs[far + 1:]
        mean, low, high = t_interval(rest)
        robust = _verdict(low, high)
        if robust != verdict:
            verdict = "unclear"
        why += f", and of {n - 1} without the pair farthest from the median"
    if n >= 3 and max(logs) <= math.log(MARGIN):
        verdict, why = "win", f"the fix ran at most {MARGIN:.0%} of its baseline in all {n} pairs"
    return Comparison(n, base, math.exp(mean), math.exp(low), math.exp(high), verdict, why)
