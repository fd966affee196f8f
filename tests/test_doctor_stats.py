"""--verify's decision: paired runs compared on the log of their ratio (doctor/_stats.py)."""
import math

import pytest

from syncless.doctor import _stats, _verify

HF_PAIRS = [(11.7, 6.0), (12.0, 6.6), (20.3, 8.8)]   # HF Trainer, compile reduce-overhead (H100)


class Runs(_verify.Verifier):
    """A Verifier whose runs are given: the step time of each run, in the order they are made
    (A B, B A, ...). Everything after the run, the pairing and the decision, is the real one."""

    def __init__(self, pairs, min_pairs=3):
        # The runs take no time: the pairs stop on the verdict or at MAX_PAIRS, never on time.
        super().__init__("train.py", [], warmup=1, steps=1, pairs=min_pairs)
        self.given = list(pairs)
        self.made = []

    def paired(self, settings, base=None, more_s=math.inf):
        return super().paired(settings, base, more_s)

    def measure(self, settings):
        i = len(self.made)
        a, b = self.given[(i // 2) % len(self.given)]
        fix_first = (i // 2) % 2 == 1
        ms = b if bool(settings) else a
        assert bool(settings) == ((i % 2 == 0) == fix_first), "A B, then B A"
        self.made.append(ms)
        self.runs += 1
        return ms


def test_the_95_interval_of_a_mean():
    mean, low, high = _stats.t_interval([-5.0, -6.0, -4.0])
    assert mean == -5.0
    assert (low, high) == pytest.approx((-5.0 - 4.303 / 3 ** 0.5, -5.0 + 4.303 / 3 ** 0.5))
    assert _stats.t_interval([-1.0]) == (-1.0, float("-inf"), float("inf")), "one says nothing"


def test_the_hf_pairs_keep_the_fix():
    c = _stats.compare([a for a, _ in HF_PAIRS], [b for _, b in HF_PAIRS])
    assert c.verdict == "win" and c.pairs == 3
    assert c.baseline_ms == 12.0, "the median baseline run"
    # The geometric mean of 0.513, 0.550, 0.433: a 50% win, 6.0 ms of the 12.0-ms median.
    assert c.ratio == pytest.approx(math.exp((math.log(6 / 11.7) + math.log(6.6 / 12)
                                              + math.log(8.8 / 20.3)) / 3))
    assert c.text().startswith(f"{c.win_ms:+.2f} ms/step (-50%) [95%: ")
    assert c.high < 1 and c.low > 0, "an interval on the ratio: never a negative step time"
    v = Runs(HF_PAIRS)
    r = v.paired({"compile": "reduce-overhead"})
    assert r["kept"] is True and r["pairs"] == 3 and v.runs == 6, "clear after 3 pairs: stop"
    assert r["runs"] == {"without": [11.7, 12.0, 20.3], "with": [6.0, 6.6, 8.8]}
    assert r["win"] == c.text() and r["measured_ms"] == pytest.approx(12.0 * c.ratio)


def test_a_30_percent_win_in_every_pair_is_kept_whatever_its_size_spread():
    # One pair's win is so large that the interval on the log ratios crosses zero; every pair
    # still runs at most 70% of its baseline.
    without, with_ = [10.0, 10.0, 10.0], [6.9, 6.8, 1.0]
    assert _stats.t_interval([math.log(b / a) for a, b in zip(without, with_)])[2] > 0
    c = _stats.compare(without, with_)
    assert c.verdict == "win" and "all 3 pairs" in c.why


def test_a_null_fix_is_not_kept():
    # The same loop twice: 1% noise both ways.
    pairs = [(10.0, 10.1), (10.1, 10.0), (10.0, 10.05), (10.05, 10.0), (10.0, 10.1)]
    v = Runs(pairs)
    r = v.paired({"tf32": True})
    assert r["kept"] is False and r["verdict"] == "no win", r
    assert r["ratio_low"] > 0.97 and r["ratio_high"] < 1.03
    assert r["pairs"] == 3, "the interval rules a 3% win out after 3 pairs: stop"


def test_a_losing_fix_is_not_kept():
    c = _stats.compare([10.0, 10.4, 9.8], [13.0, 13.1, 12.6])
    assert c.verdict == "loss" and not c.kept
    assert c.text() == "+2.82 ms/step (+28%) [95%: +23%, +33%]"
    v = Runs([(10.0, 13.0), (10.4, 13.1), (9.8, 12.6)])
    r = v.paired({"tf32": True})
    assert r["verdict"] == "loss" and r["pairs"] == 3
    lines = _verify_line(r)
    assert lines.endswith(": not kept (it loses)"), lines


def _verify_line(result):
    """The report's line for `result`, as verify() writes it for a TF32 fix."""
    from syncless.doctor.diagnose import Diagnosis

    class Given:
        runs, seconds = 0, 0.0

        def paired(self, settings):
            return result
    d = Diagnosis.__new__(Diagnosis)
    d.findings, d.gpu, d.framework = [], True, ""
    d.verdict_kind, d.speedups = "GPU-bound", ["TF32 matmuls"]
    [line] = _verify.verify(d, Given(), {}, cpus=2)
    return line


def test_one_outlier_pair_cannot_flip_a_win():
    # A 2x win, but the third pair's fix run hit a busy host.
    pairs = [(12.0, 6.0), (12.2, 6.2), (12.1, 14.5), (11.9, 6.1), (12.0, 6.0)]
    c3 = _stats.compare([a for a, _ in pairs[:3]], [b for _, b in pairs[:3]])
    assert c3.verdict == "unclear", "three pairs and one against: more pairs, not a rejection"
    v = Runs(pairs)
    r = v.paired({"compile": "reduce-overhead"})
    assert r["kept"] is True and r["pairs"] == 5, r
    assert r["ratio"] == pytest.approx(0.5, abs=0.02), "the outlier left out of the estimate"


def test_one_outlier_pair_cannot_make_a_null_fix_win():
    # No effect, but one baseline run was slow: a 45% "win" in that pair.
    pairs = [(10.0, 10.1), (10.1, 10.0), (18.0, 10.0), (9.9, 10.0), (10.0, 9.9), (10.1, 10.1)]
    for n in range(3, 7):
        c = _stats.compare([a for a, _ in pairs[:n]], [b for _, b in pairs[:n]])
        assert c.verdict != "win", (n, c)
    r = Runs(pairs).paired({"tf32": True})
    assert r["kept"] is False


def test_unclear_pairs_stop_at_the_cap():
    # Wins and losses of 20% in turn: never clear; pairs stop at MAX_PAIRS (the runs take no
    # time here, so the time budget never ends it first).
    pairs = [(10.0, 8.0), (10.0, 12.0)]
    v = Runs(pairs)
    r = v.paired({"tf32": True})
    assert r["verdict"] == "unclear" and r["pairs"] == _stats.MAX_PAIRS and not r["kept"]
    assert v.runs == 2 * _stats.MAX_PAIRS


def test_bad_pairs_are_named():
    with pytest.raises(ValueError, match="3 without the fix and 2 with it"):
        _stats.compare([1.0, 2.0, 3.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="must be positive, got 0.0 ms"):
        _stats.compare([1.0], [0.0])
