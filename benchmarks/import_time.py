"""What `import syncless` costs on top of torch, in fresh interpreters (issue 37, item 5).

    python -m benchmarks.import_time [--tree LABEL=PYTHONPATH ...] [--rounds 21] [--out DIR]

Each round starts one fresh interpreter per tree, in a shuffled order, that runs
`import torch; import syncless` under `python -X importtime` and reads syncless's cumulative
import time (torch, imported first, is not in it) and the modules the import added. Without
--tree it measures this checkout (`python/`). Writes import_time.md into DIR when --out is given,
else prints it (and the rounds' values into import_time.json).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import time

from ._common import median_ci

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBE = ("import sys, torch; before = set(sys.modules); import syncless; "
         "print(len(set(sys.modules) - before)); "
         "print(','.join(sorted(m for m in set(sys.modules) - before if m.startswith("
         "('syncless.doctor', 'lightning', 'transformers', 'wandb', 'tensorboard')))))")


def one(path: str) -> tuple[float, int, str]:
    """(syncless's cumulative import µs, modules added, heavy modules added) in a fresh process."""
    env = dict(os.environ, PYTHONPATH=path)
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", PROBE], env=env,
                          capture_output=True, text=True, check=True)
    us = None
    for line in done.stderr.splitlines():
        # "import time: self [us] | cumulative | imported package"; the package's own line
        parts = [p.strip() for p in line.split("|")]
        if len(parts) == 3 and parts[2] == "syncless":
            us = float(parts[1])
    if us is None:
        raise RuntimeError(f"no import time for syncless in:\n{done.stderr[-2000:]}")
    added, heavy = done.stdout.splitlines()[:2] if done.stdout.count("\n") >= 2 else \
        (done.stdout.strip(), "")
    return us, int(added), heavy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", default=[],
                    help="LABEL=PYTHONPATH of a tree with syncless built in place (repeatable)")
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="a directory for import_time.md")
    args = ap.parse_args()
    trees = dict(t.split("=", 1) for t in args.tree) or {"this tree": os.path.join(ROOT, "python")}
    rng = random.Random(args.seed)
    ms: dict[str, list[float]] = {label: [] for label in trees}
    seen: dict[str, tuple[int, str]] = {}
    for _ in range(args.rounds):
        order = list(trees)
        rng.shuffle(order)
        for label in order:
            us, added, heavy = one(trees[label])
            ms[label].append(us / 1e3)
            seen[label] = (added, heavy)
    first = next(iter(ms))
    lines = ["| tree | median ms [95% CI] | p10 ms | p90 ms | ratio to the first, per round: "
             "median [95% CI] | modules added | of them the doctor's / a framework's |",
             "|---|---|---|---|---|---|---|"]
    for label, xs in ms.items():
        q = statistics.quantiles(xs, n=10)
        ci = median_ci(xs) or (math.nan, math.nan)
        ratios = [x / y for x, y in zip(xs, ms[first])]      # the same round: the same load
        rci = median_ci(ratios) or (math.nan, math.nan)
        added, heavy = seen[label]
        names = [m for m in heavy.split(",") if m]
        doctor = sum(m.startswith("syncless.doctor") for m in names)
        frameworks = ", ".join(m for m in names if not m.startswith("syncless.doctor")) or "none"
        lines.append(f"| {label} | {statistics.median(xs):.1f} [{ci[0]:.1f}, {ci[1]:.1f}] | "
                     f"{q[0]:.1f} | {q[-1]:.1f} | {statistics.median(ratios):.2f} "
                     f"[{rci[0]:.2f}, {rci[1]:.2f}] | {added} | {doctor} / {frameworks} |")
    table = "\n".join(lines)
    if args.out is None:
        print(table)
        return
    commit = subprocess.run(["git", "-C", ROOT, "describe", "--always", "--dirty"],
                            capture_output=True, text=True).stdout.strip() or "unknown"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    command = "python -m benchmarks.import_time " + " ".join(
        f"--tree '{t}'" for t in args.tree) + f" --rounds {args.rounds} --out {args.out}"
    import torch
    text = (f"# `import syncless` on top of torch\n\nCommand: `{command.replace('  ', ' ')}`\n\n"
            f"Provenance: this tree at {commit}, {time.strftime('%Y-%m-%d', time.gmtime())}; "
            f"{platform.machine()} host, {os.cpu_count()} cores (load average {load:.1f} at the "
            f"end: shared with other jobs, hence the spread), Python {sys.version.split()[0]}, "
            f"torch {torch.__version__}.\n\n"
            f"{args.rounds} rounds, each a fresh interpreter "
            "per tree in a shuffled order; the time is syncless's cumulative line of "
            "`python -X importtime -c 'import torch; import syncless'` (torch excluded); the ratio "
            "compares the two trees within each round, which shared its load.\n\n"
            f"{table}\n")
    with open(os.path.join(args.out, "import_time.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "import_time.json"), "w") as f:
        json.dump({"provenance": {"commit": commit, "command": command, "load": load},
                   "trees": trees, "ms_per_round": ms}, f, indent=1)
        f.write("\n")
    print(text)


if __name__ == "__main__":
    main()
