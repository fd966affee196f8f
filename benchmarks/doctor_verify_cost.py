"""What `syncless doctor` costs with its verification on, and what it leaves behind, on CPU loops
the size of the doctor's own tests: two source trees (before and after a change), the same
scripts, run one after the other per case (before, after), so that a host's load drifts over both.

    python benchmarks/doctor_verify_cost.py --tree before=/path/to/old/python \\
        --tree after=python [--rounds 1] [--out benchmarks/results/doctor_verify_cost.json]

Per run: the doctor's wall time, the runs --verify made and their seconds, its lines, and how many
lines the script's ./starts.txt holds afterwards (it appends one at each start: one is the
doctor's own run, more are runs that wrote into the user's folder). The scripts are the tests':
data_bound_sleep (tests/test_doctor_harm.py STARTS: 3-ms examples, no workers) and
lightning_slow_data (tests/test_doctor_verify.py: a Lightning Trainer over 10-ms examples)."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))


def cases() -> dict[str, str]:
    import test_doctor_harm as harm
    import test_doctor_verify as verify
    starts = 'with open("starts.txt", "a") as f:\n    f.write("started\\n")\n'
    return {"data_bound_sleep": textwrap.dedent(harm.STARTS),
            "lightning_slow_data": starts + textwrap.dedent(verify.LIGHTNING_SLOW_DATA)}


def run(tree: str, text: str, options: list[str], timeout: float) -> dict:
    folder = tempfile.mkdtemp(prefix="doctor-cost-")
    try:
        with open(os.path.join(folder, "train.py"), "w") as f:
            f.write(text)
        t = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "syncless", "doctor", *options, "--json",
                            "d.json", "train.py"], cwd=folder, capture_output=True, text=True,
                           timeout=timeout, env=dict(os.environ, PYTHONPATH=tree))
        wall = time.perf_counter() - t
        try:
            with open(os.path.join(folder, "d.json")) as f:
                d = json.load(f)
        except (OSError, ValueError):
            d = {}
        starts = os.path.join(folder, "starts.txt")
        lines = open(starts).read().count("\n") if os.path.exists(starts) else None
        return {"wall_s": round(wall, 1), "rc": r.returncode, "verify_runs": d.get("verify_runs"),
                "verify_seconds": d.get("verify_seconds"), "verify": d.get("verify"),
                "starts_lines": lines, "load_1min": os.getloadavg()[0]}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tree", action="append", required=True, metavar="NAME=PATH")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--only", default="")
    p.add_argument("--timeout", type=float, default=1500)
    p.add_argument("--out", default=os.path.join(HERE, "results", "doctor_verify_cost.json"))
    ns = p.parse_args()
    trees = dict(t.split("=", 1) for t in ns.tree)
    rows = []
    for name, text in cases().items():
        if ns.only and name not in ns.only.split(","):
            continue
        for options in (["--quick", "--verify"], []):
            for r in range(ns.rounds):
                for tree, path in trees.items():
                    row = {"case": name, "options": " ".join(options) or "(default)",
                           "tree": tree, "round": r,
                           **run(os.path.abspath(path), text, options, ns.timeout)}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    with open(ns.out, "w") as f:
                        json.dump({"command": " ".join(sys.argv), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
