"""Logger(gpu_time=True) against CUDA events, on the GPU only (issue 12, part 2).

    python benchmarks/gpu_time.py [--out benchmarks/results] [--steps 400]

The gather kernel stamps every row with %globaltimer. Three checks:
  1. GPU step time: on a GPU-bound loop (one matmul chain per step, one log() per step), the
     rows' gpu/step_ms against the elapsed time between CUDA events recorded right after each
     log() call on the same stream: median and p90 of the per-step relative difference.
  2. Lag on a launch-bound loop (tiny kernels, the GPU waits for the CPU): gpu/lag_ms stays ~0.
  3. Lag on a GPU-bound loop: gpu/lag_ms grows with the queue depth (steps enqueued ahead),
     until the launch queue is full and the host blocks.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import syncless  # noqa: E402
from benchmarks._common import env_info, quantile  # noqa: E402


class Keep:
    def __init__(self):
        self.rows = []

    def write(self, rows):
        self.rows.extend(rows)


def gpu_bound_step_times(steps: int, n: int) -> dict:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    keep = Keep()
    log = syncless.Logger(every=50, sinks=[keep], gpu_time=True)
    events = [torch.cuda.Event(enable_timing=True) for _ in range(steps)]
    for _ in range(5):                                   # warm: JIT, ring, cuBLAS
        (a @ a).sum()
    torch.cuda.synchronize()
    for i in range(steps):
        y = a
        for _ in range(4):
            y = y @ a
        log(loss=y.float().mean())
        events[i].record()
    log.close()
    torch.cuda.synchronize()
    ev = [events[i - 1].elapsed_time(events[i]) for i in range(1, steps)]
    gp = [r.values["gpu/step_ms"] for r in keep.rows[1:]]
    rel = [abs(g - e) / e for g, e in zip(gp, ev)]
    lag = [r.values["gpu/lag_ms"] for r in keep.rows]
    return {"steps": steps, "events_ms_median": statistics.median(ev),
            "gpu_step_ms_median": statistics.median(gp),
            "rel_diff_median": statistics.median(rel), "rel_diff_p90": quantile(rel, 0.9),
            "rel_diff_of_medians": abs(statistics.median(gp) - statistics.median(ev))
            / statistics.median(ev),
            "lag_ms_first10": lag[:10], "lag_ms_max": max(lag), "lag_ms_last": lag[-1]}


def launch_bound_lag(steps: int) -> dict:
    x = torch.zeros(16, device="cuda")
    keep = Keep()
    log = syncless.Logger(every=50, sinks=[keep], gpu_time=True)
    torch.cuda.synchronize()
    for _ in range(steps):
        for _ in range(20):
            x.add_(1.0)                                  # ~20 launches of ~2 us GPU work
        log(x=x[0])
    log.close()
    lag = [r.values["gpu/lag_ms"] for r in keep.rows]
    step = [r.values["gpu/step_ms"] for r in keep.rows[1:]]
    return {"steps": steps, "lag_ms_median": statistics.median(lag),
            "lag_ms_p90": quantile(lag, 0.9), "gpu_step_ms_median": statistics.median(step)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--n", type=int, default=4096, help="matmul size of the GPU-bound step")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_time.py needs a CUDA GPU")
        return 2
    res = {"env": env_info(torch.device("cuda"), sys.argv, prog="benchmarks/gpu_time.py"),
           "gpu_bound": gpu_bound_step_times(args.steps, args.n),
           "launch_bound": launch_bound_lag(args.steps)}
    g, lb = res["gpu_bound"], res["launch_bound"]
    lines = [
        "# Logger(gpu_time=True) vs CUDA events (benchmarks/gpu_time.py)", "",
        "| check | result |", "|---|---|",
        f"| GPU-bound step: events median / gpu/step_ms median | {g['events_ms_median']:.3f} / "
        f"{g['gpu_step_ms_median']:.3f} ms (medians differ {100 * g['rel_diff_of_medians']:.2f}%) |",
        f"| per-step difference, median / p90 | {100 * g['rel_diff_median']:.2f}% / "
        f"{100 * g['rel_diff_p90']:.2f}% |",
        f"| GPU-bound lag, first 10 rows (ms) | {', '.join(f'{v:.1f}' for v in g['lag_ms_first10'])} |",
        f"| GPU-bound lag, max / last (ms) | {g['lag_ms_max']:.1f} / {g['lag_ms_last']:.1f} |",
        f"| launch-bound lag, median / p90 (ms) | {lb['lag_ms_median']:.3f} / "
        f"{lb['lag_ms_p90']:.3f} (GPU step {lb['gpu_step_ms_median']:.3f} ms) |",
    ]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_time.json"), "w") as f:
        json.dump(res, f, indent=1)
    with open(os.path.join(args.out, "gpu_time.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
