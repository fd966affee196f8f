"""The benchmark harness: its statistics and report helpers (CPU); in the slow suite, end-to-end
runs of the suite's plumbing, the two-build comparison, flush_profile and compile_user (CPU); and
the `--quick` smoke test of every section on a GPU."""
import json
import math
import os
import random
import subprocess
import sys

import pytest

from benchmarks import percall
from benchmarks._common import (beyond_spread, block_us, clean, interleave, md_table, median_ci,
                                paired_ratios, pct_ci, pct_spread, quantile, ratio_summary,
                                summarize, write_json, write_results)

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


def test_block_us_times_n_calls_between_two_syncs():
    events = []
    us = block_us(lambda: events.append("call"), 5, lambda: events.append("sync"))
    assert events == ["sync"] + ["call"] * 5 + ["sync"]
    assert us > 0


def test_ratio_summary_carries_the_ci_of_the_median_ratio():
    times = {"base": [float(i) for i in range(1, 31)], "new": [1.5 * i for i in range(1, 31)]}
    r = ratio_summary(times, "new", "base")
    assert r["median"] == pytest.approx(1.5) and r["n"] == 30
    assert r["ci95"] == pytest.approx((1.5, 1.5))


def test_write_results_puts_json_and_markdown_side_by_side(tmp_path):
    data = {"env": {"gpu": "cpu", "date": "2026-12-01", "command": "python -m benchmarks.x",
                    "torch": "2.13"}, "quick": True, "v": float("nan")}
    paths = write_results(str(tmp_path), "x", data, "| a |\n")
    assert [os.path.basename(p) for p in paths] == ["x.json", "x.md"]
    assert json.loads((tmp_path / "x.json").read_text())["v"] is None
    md = (tmp_path / "x.md").read_text()
    assert md.startswith("# x: cpu (2026-12-01)") and "quick mode" in md and "| torch | 2.13" in md
    assert md.rstrip().endswith("| a |")


def test_ab_rows_pair_builds_by_round_and_subtract_the_bare_loop():
    base = {"syncless@4": [5.0, 6.0, 5.0, 7.0, 5.0, 6.0], "watch/bare": [10.0] * 6,
            "watch/watch": [12.0, 12.0, 13.0, 12.0, 12.0, 12.0], "timer": [4.0] * 6,
            "event_pair": [2.0] * 6}
    cur = {"syncless@4": [x * 0.8 for x in base["syncless@4"]], "watch/bare": [11.0] * 6,
           "watch/watch": [12.0] * 6, "timer": [3.0] * 6, "event_pair": [2.0] * 6}
    rows = percall.ab_rows({"times": {"baseline": base, "current": cur}, "device": "cuda:0"})
    assert rows["syncless@4"]["ratio"]["median"] == pytest.approx(0.8)
    assert rows["syncless@4"]["ratio"]["ci95"] == pytest.approx((0.8, 0.8))
    assert rows["syncless@4"]["published"] == 4.93
    # watch() adds 2 µs/step on the baseline and 1 µs on the current build, per round
    assert rows["added/watch"]["baseline"]["median"] == 2.0
    assert rows["added/watch"]["current"]["median"] == 1.0
    assert rows["added/watch"]["ratio"]["median"] == 0.5
    assert rows["timer/event_pair"]["current"]["median"] == 1.5
    assert rows["timer/event_pair"]["baseline"]["median"] == 2.0
    text = percall.ab_markdown({"ab": {
        "rows": rows, "rounds": 6, "epochs": 1, "errors": {"raw_pair": {"baseline": "gone"}},
        "trees": {"baseline": {"dir": "/b", "label": "a6bb48f"},
                  "current": {"dir": "/c", "label": "new"}}}})
    assert "| syncless log.log(d), K=4" in text and "baseline a6bb48f" in text
    assert "raw_pair (baseline: gone)" in text


@pytest.mark.slow                  # benchmark scripts end to end: 30-80 s each
def test_percall_compares_two_builds_on_cpu(tmp_path):
    """The same tree as both builds: the harness logic end to end (workers, alternation, the
    import check), not a speed claim."""
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.percall", "--quick", "--device", "cpu", "--ks", "1",
         "--rounds", "6", "--table-rounds", "0", "--baseline", ROOT, "--baseline-label", "same",
         "--cores", "1",
         "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "percall.json").read_text())
    ab = res["ab"]
    assert ab["rounds"] == 6 and ab["epochs"] == 1
    tree = os.path.join(ROOT, "python", "syncless")
    assert all(os.path.dirname(p) == tree for p in ab["syncless"].values())
    first = [min(os.sched_getaffinity(0))]                   # both pinned to the same core
    assert ab["worker_cores"] == {"baseline": first, "current": first}
    for build in ("baseline", "current"):
        for name in ("syncless@1", "floor@1", "timer", "watch/bare", "watch/watch"):
            assert len(ab["times"][build][name]) == 6, (build, name)
    assert ab["rows"]["syncless@1"]["ratio"]["n"] == 6
    assert ab["rows"]["added/watch"]["current"]["n"] == 6
    assert ab["errors"]["event_pair"] == {"baseline": "needs CUDA", "current": "needs CUDA"}
    assert "per_call" not in res
    assert "| syncless log.log(d), K=1" in (tmp_path / "percall.md").read_text()


def test_percall_refuses_a_baseline_that_is_not_a_checkout(tmp_path, capsys):
    with pytest.raises(SystemExit):
        percall.main(["--device", "cpu", "--baseline", str(tmp_path)])
    assert "no python/syncless in it" in capsys.readouterr().err


def _run_suite(tmp_path, *args, timeout):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.run", "--out", str(tmp_path), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = sorted(os.listdir(tmp_path))
    (js,) = [f for f in files if f.endswith(".json")]
    with open(tmp_path / js, encoding="utf-8") as f:
        return json.load(f), files, proc.stdout


@pytest.mark.slow                  # benchmark scripts end to end: 30-80 s each
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
    assert sec["per_call"]["timers"]["timer"]["median"] > 0
    assert sec["per_call"]["ratios"]["timer/event_pair"]["median"] > 0
    assert sec["per_call"]["added"]["watch every step"]["n"] == 3
    w = sec["timing"]["workloads"]["matmul 8192² bf16"]
    assert w["host"]["ms"]["median"] < w["events"]["ms"]["median"]
    assert sec["dataloader"]["speedup"]["median"] > 0
    assert sec["launch"]["latency_us"]["graph"]["median"] > 0
    assert len([f for f in files if f.endswith(".png")]) == 3
    assert res["elapsed_s"]["total"] > 0          # the time it took is reported, not asserted


@pytest.mark.slow                  # benchmark scripts end to end: 30-80 s each
def test_flush_profile_smoke_checks_every_row_and_writes_its_stretches(tmp_path):
    """benchmarks/flush_profile.py --smoke (CPU, default compile mode): the four variants run,
    every logged row arrives in order (the script asserts it), and the JSON holds each stretch
    of the period with the differences to no logging and the flush call's pieces."""
    r = subprocess.run([sys.executable, "-m", "benchmarks.flush_profile", "--smoke", "--pieces",
                        "--rounds", "2", "--out", str(tmp_path)], capture_output=True, text=True,
                       timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads((tmp_path / "flush_profile-infer.json").read_text())
    whole = data["stretches"]["whole period"]
    assert set(whole) >= {"no log", "log() inside", "log() inside - no log",
                          "log() inside, delivery='caller' - no log"}
    assert set(data["flush_call_us_by_variant"]) == {"log() inside",
                                                     "log() inside, delivery='caller'"}
    assert whole["no log"]["median"] > 0
    assert data["flush_pieces_us"]["flush(wait=False), whole"]["calls"] >= 2


@pytest.mark.slow                  # benchmark scripts end to end: 30-80 s each
def test_compile_user_gpt_logs_from_inside_the_compiled_model_exactly(tmp_path):
    """benchmarks/compile_user.py --quick (CPU inductor): a nanoGPT-style model, compiled, logs
    loss and accuracy inside its forward with no graph break, and every delivered row equals
    that step's loss and accuracy, as does logging in the loop; each variant is its own graph."""
    r = subprocess.run([sys.executable, "-m", "benchmarks.compile_user", "--quick", "--device",
                        "cpu", "--out", str(tmp_path)], capture_output=True, text=True,
                       timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads((tmp_path / "compile_user-default.json").read_text())["results"]
    inside, loop = res["log() in the model"], res["log() in the loop"]
    assert inside["graph_breaks"] == 0 and inside["graphs"] == 1
    for check in (inside["check"], loop["check"]):
        assert check["exact"] and check["rows"] == check["steps"] == 30 and check["lost"] == 0
