"""The benchmark suite: its statistics and report helpers (CPU), a fast end-to-end run of the
plumbing (CPU), and the `--quick` smoke test of every section on a GPU."""
import json
import math
import os
import random
import subprocess
import sys

import pytest

from benchmarks._common import (beyond_spread, clean, interleave, md_table, median_ci,
                                paired_ratios, pct_ci, pct_spread, quantile, summarize,
                                write_json)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_quantile_matches_linear_interpolation():
    xs = [4.0, 1.0, 3.0, 2.0]
    assert quantile(xs, 0.0) == 1.0
    assert quantile(xs, 1.0) == 4.0
    assert quantile(xs, 0.5) == 2.5
    assert quantile(xs, 0.25) == pytest.approx(1.75)
    assert math.isnan(quantile([], 0.5))


def test_summarize_reports_median_and_spread_and_ignores_nan():
    s = summarize([5.0, 1.0, 3.0, float("nan"), 2.0, 4.0])
    assert s == {"n": 5, "median": 3.0, "p25": 2.0, "p75": 4.0, "min": 1.0, "max": 5.0}
    assert summarize([])["median"] is None


def test_median_ci_is_order_statistics_with_95_percent_coverage():
    assert median_ci(range(1, 31)) == (10.0, 21.0)      # n=30: x(10), x(21)
    assert median_ci([3.0, 1.0, 2.0, 5.0, 4.0, 6.0]) == (1.0, 6.0)   # n=6: only min–max
    assert median_ci([1.0, 2.0, 3.0, 4.0, 5.0]) is None  # n=5 cannot reach 95%
    assert pct_ci((0.997, 1.011)) == "[-0.3, +1.1]" and pct_ci(None) == "n/a"
    rng = random.Random(1)                              # it covers the true median ~95% of
    hits = 0                                            # the time, whatever the distribution
    for _ in range(2000):
        lo, hi = median_ci([rng.expovariate(1.0) for _ in range(30)])
        hits += lo <= math.log(2) <= hi
    assert 0.94 <= hits / 2000 <= 0.98


def test_paired_ratios_pair_by_round_and_spread_decides_claims():
    times = {"base": [1.0, 2.0, 4.0, 1.0, 2.0], "slow": [1.1, 2.2, 4.4, 1.1, 2.2]}
    r = summarize(paired_ratios(times, "slow", "base"))
    assert r["median"] == pytest.approx(1.1)
    assert beyond_spread(r)                       # the same +10% in every round: real
    noisy = summarize([0.8, 1.3, 0.9, 1.2, 1.05])
    assert not beyond_spread(noisy)               # IQR straddles 1: within the spread
    assert not beyond_spread(summarize([1.2, 1.2, 1.2]))   # too few rounds to claim anything
    assert pct_spread(r) == "+10.0% [+10.0, +10.0]"


def test_interleave_shuffles_each_round_and_drops_a_failing_variant():
    calls = []

    def make(name):
        def f():
            calls.append(name)
            if name == "bad":
                raise RuntimeError("boom")
            return 1.0
        return f
    errors = {}
    out = interleave({n: make(n) for n in ("a", "b", "c", "bad")}, 6, random.Random(1), errors)
    assert out["a"] == out["b"] == out["c"] == [1.0] * 6
    assert out["bad"] == [] and errors == {"bad": "RuntimeError: boom"}
    assert calls.count("bad") == 1
    rounds = [tuple(c for c in calls if c != "bad")[i:i + 3] for i in range(0, 18, 3)]
    assert len(set(rounds)) > 1                   # the order changes between rounds


def test_md_table_and_json_are_well_formed(tmp_path):
    table = md_table(["a", "bb"], [[1, None], ["xyz", 2.5]])
    lines = table.splitlines()
    assert lines[0] == "| a   | bb  |"
    assert lines[1] == "|-----|-----|"
    assert lines[2] == "| 1   |     |"
    assert clean({"x": float("nan"), "y": (1, float("inf")), 3: object}) == {
        "x": None, "y": [1, None], "3": str(object)}
    path = tmp_path / "r.json"
    write_json(str(path), {"v": float("nan"), "w": [1.5]})
    assert json.loads(path.read_text()) == {"v": None, "w": [1.5]}


def _run_suite(tmp_path, *args, timeout):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.run", "--out", str(tmp_path), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = sorted(os.listdir(tmp_path))
    (js,) = [f for f in files if f.endswith(".json")]
    with open(tmp_path / js, encoding="utf-8") as f:
        return json.load(f), files, proc.stdout


def test_cpu_plumbing_writes_json_markdown_and_headline(tmp_path):
    res, files, out = _run_suite(tmp_path, "--quick", "--device", "cpu",
                                 "--only", "timing,launch", timeout=300)
    assert res["env"]["torch"] and res["env"]["command"].startswith("python -m benchmarks.run")
    assert res["sections"]["timing"] == {"skipped": "needs CUDA"}
    launch = res["sections"]["launch"]
    assert launch["latency_us"]["eager"]["median"] > 0
    assert launch["errors"]["graph"] == "skipped: needs CUDA"
    assert any(f.endswith("-quick.md") for f in files)
    assert "== Headline" in out


@pytest.mark.cuda
def test_quick_suite_runs_every_section_on_gpu(tmp_path):
    res, files, out = _run_suite(tmp_path, "--quick", timeout=180)
    sec = res["sections"]
    assert set(sec) == {"logging", "per_call", "timing", "dataloader", "launch"}
    for name, s in sec.items():
        assert "error" not in s, (name, s.get("error"))
    assert res["env"]["gpu"] and (res["env"].get("driver") or res["env"].get("driver_cuda_api"))
    regimes = sec["logging"]["regimes"]
    assert list(regimes) == ["launch-bound", "balanced", "GPU-bound"]
    syncs = sec["logging"]["syncs_per_step"]
    assert syncs["syncless"] == 0
    assert syncs["item_where"] >= 4 and syncs["item1"] >= 1
    assert sec["per_call"]["results"]["4"]["syncless"]["us"]["median"] > 0
    w = sec["timing"]["workloads"]["matmul 8192² bf16"]
    assert w["host"]["ms"]["median"] < w["events"]["ms"]["median"]
    assert sec["dataloader"]["speedup"]["median"] > 0
    assert sec["launch"]["latency_us"]["graph"]["median"] > 0
    assert len([f for f in files if f.endswith(".png")]) == 3
    assert res["elapsed_s"]["total"] < 60
