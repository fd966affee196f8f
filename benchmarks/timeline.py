"""A training step's timeline with and without the syncs, drawn from a suite results file.

    python -m benchmarks.timeline [--results benchmarks/results/nvidia-h200-2026-11-30.json]
                                  [--regime balanced] [--steps 3] [--out PNG]

No new measurement: every length comes from the medians `python -m benchmarks.run` recorded in
its logging section for one regime: the step time of each variant, the GPU's busy time per step
(the union of kernel and copy intervals, torch.profiler) and the host's time to enqueue one step
(measured with the GPU held behind a sleep). What the file does not hold is where inside a step
the waits fall, so that is drawn schematically: the host waits once at each `.item()`, and the GPU
idles once after each wait, while the host refills its queue; the totals per step are to scale.
Default output: <results file without .json>-timeline.png.
"""
from __future__ import annotations

import argparse
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT = os.path.join(HERE, "results", "nvidia-h200-2026-11-30.json")
SYNCED, SYNCLESS = "item_where", "syncless"


def segments(step_ms: float, busy_ms: float, host_ms: float, syncs: int, t0: float):
    """(host_blocks, host_waits, gpu_busy) as (start, length) lists for one step from t0."""
    host, waits, gpu = [], [], []
    if syncs == 0:                      # the host queues the step and runs ahead of the GPU
        host.append((t0, host_ms))
        gpu.append((t0 + step_ms - busy_ms, busy_ms))
        return host, waits, gpu
    parts = syncs + 1
    h, b, g = host_ms / parts, busy_ms / parts, (step_ms - busy_ms) / syncs
    t = t0
    for k in range(parts):
        idle = g if k else 0.0          # the GPU idles after each sync while the host refills it
        seg = idle + b
        host.append((t, min(h, seg)))
        if k < syncs:                   # the host waits in .item() until the GPU drains
            waits.append((t + min(h, seg), seg - min(h, seg)))
        gpu.append((t + idle, b))
        t += seg
    return host, waits, gpu


def draw(res: dict, regime: str, steps: int, out: str, source: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reg = res["sections"]["logging"]["regimes"][regime]
    host_ms = reg["cpu_ms"]
    fig, axes = plt.subplots(2, 1, figsize=(10, 3.6), sharex=True)
    for ax, name in zip(axes, (SYNCED, SYNCLESS)):
        v = reg["variants"][name]
        step, busy, n = v["step_ms"]["median"], v["gpu_busy_ms"], round(v["syncs_per_step"])
        for i in range(steps):
            host, waits, gpu = segments(step, busy, host_ms, n, i * step)
            ax.broken_barh(host, (1.1, 0.7), color="tab:blue")
            ax.broken_barh(waits, (1.1, 0.7), color="tab:red")
            ax.broken_barh(gpu, (0.1, 0.7), color="tab:green")
            ax.axvline(i * step, color="grey", linewidth=0.5, linestyle=":")
        ax.set_yticks([0.45, 1.45])
        ax.set_yticklabels(["GPU", "CPU"])
        ax.set_title(f"{v['label']}: {n} syncs/step, {step:.2f} ms/step, GPU idle "
                     f"{100 * (1 - busy / step):.0f}%", fontsize=9, loc="left")
    axes[-1].set_xlabel("ms")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in ("tab:blue", "tab:red", "tab:green")]
    fig.legend(handles, ["host enqueues work", "host waits in .item()", "GPU busy"],
               fontsize=7, loc="upper right", ncol=1, frameon=False)
    env = res["env"]
    fig.suptitle(f"{reg['label']} ({regime}), {env['gpu']}, {env['date']}", fontsize=10,
                 x=0.02, ha="left")
    fig.text(0.01, 0.01, f"lengths: medians from {source}; where the waits fall inside a step is "
             "schematic", fontsize=7, color="dimgrey")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(out, dpi=110)
    print(out)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.timeline", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", default=DEFAULT, help="a benchmarks.run JSON file")
    p.add_argument("--regime", default="balanced", help="launch-bound, balanced or GPU-bound")
    p.add_argument("--steps", type=int, default=3, help="steps drawn per timeline")
    p.add_argument("--out", help="PNG path (default: next to the results file)")
    a = p.parse_args(argv)
    with open(a.results, encoding="utf-8") as f:
        res = json.load(f)
    out = a.out or a.results[:-len(".json")] + "-timeline.png"
    source = os.path.relpath(a.results, os.path.dirname(HERE))
    draw(res, a.regime, a.steps, out, source)


if __name__ == "__main__":
    main()
