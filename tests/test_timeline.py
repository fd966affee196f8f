"""benchmarks/timeline.py draws the README's picture from the suite's committed H200 results: the
lengths it draws must add up to the medians in that file, step by step."""
import json
import os

import pytest

from benchmarks import timeline

RESULTS = os.path.join(os.path.dirname(timeline.__file__), "results",
                       "nvidia-h200-2026-11-30.json")


def test_segments_add_up_to_the_measured_step_busy_and_host_times():
    with open(RESULTS, encoding="utf-8") as f:
        reg = json.load(f)["sections"]["logging"]["regimes"]["balanced"]
    for name in (timeline.SYNCED, timeline.SYNCLESS):
        v = reg["variants"][name]
        step, busy, n = v["step_ms"]["median"], v["gpu_busy_ms"], round(v["syncs_per_step"])
        host, waits, gpu = timeline.segments(step, busy, reg["cpu_ms"], n, t0=2 * step)
        assert n == (4 if name == timeline.SYNCED else 0)
        assert sum(length for _, length in gpu) == pytest.approx(busy)
        assert sum(length for _, length in host) == pytest.approx(reg["cpu_ms"])
        assert len(waits) == n                       # one wait per .item()
        start, length = gpu[-1]
        assert start + length == pytest.approx(3 * step)   # the step's GPU work ends at its end
        assert min(s for s, _ in host + gpu) >= 2 * step   # nothing drawn before the step began


def test_the_script_writes_the_png(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "t.png"
    timeline.main(["--results", RESULTS, "--out", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
