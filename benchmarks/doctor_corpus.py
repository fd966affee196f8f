"""The doctor on a corpus of small realistic scripts, its predictions checked on their fixed twins.

    python benchmarks/doctor_corpus.py [--device cuda|cpu] [--only NAME ...] [--out DIR]
        [--plain] [--keep-traces DIR] [--script-args='--batch 32']

For each script in benchmarks/doctor_corpus/ (one known bottleneck each) this runs
`python -m syncless doctor --quick --warmup 5 --steps 30 --json` on it and reads the verdict, the
rank of the finding whose fix the twin applies (it should be the top one) and the step time that
fix predicts; then runs the doctor on the fixed twin (the prescribed change applied; the loader
twin gets the worker count the doctor prescribed): its monitor phase measures the twin's step the
way the step before was measured (GPU drained, wall / steps), and any finding winning back >= 1%
of the step there is a false alarm. `--plain` also runs each twin alone on its own clock
(`step_ms=`); `--keep-traces` keeps the kernel trace each report read. It prints and writes
(benchmarks/results/doctor_corpus.{json,md} by default) a table: verdict vs expected, step
before, predicted and measured step after the fix, the gain's error, false alarms. Targets (H200):
right verdict everywhere, measured gain within 25% of the predicted one, no false alarm. On
`--device cpu` it checks the logic only: the expected verdicts are the GPU's.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time

from syncless.doctor.diagnose import GPU_BOUND

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "doctor_corpus")
RESULTS = os.path.join(HERE, "results")

# name, expected verdict on the GPU, the finding whose fix the twin applies, what the twin changes
SCRIPTS = [
    ("resnet_decode", "data-bound", "starvation",
     "num_workers as prescribed, persistent_workers=True"),
    ("lstm_lm", "CPU-bound", "sync", "loss summed on the GPU, read every 50 steps"),
    ("gpt_fused", "CPU-bound", "launch-bound", "whole step in a CUDA graph"),
    ("infer_b1", "CPU-bound", "launch-bound", "forward in a CUDA graph"),
    ("hf_trainer", "CPU-bound", "framework",
     "logging_nan_inf_filter=False, non_blocking batch copy"),
    ("lightning_pbar", "CPU-bound", "framework", "prog_bar=False"),
]
# The framework settings a twin changes: the findings it applies are those of these settings.
TWIN_SETTINGS = {"hf_trainer": ("logging_nan_inf_filter", "blocking batch copy"),
                 "lightning_pbar": ("prog_bar",)}
GAIN_TOLERANCE = 0.25
NO_GAIN = 0.03         # a measured gain under 3% of the step counts as "no gain"


KEEP_TRACES = None       # --keep-traces DIR: each doctor run's kernel trace, for diagnostics
# --quick with 5 warm-up steps and 30 monitored ones: a framework's first steps still allocate
# and pick kernels, and 15 steps let one slow step move the mean.
DOCTOR = ["--warmup", "5", "--steps", "30"]


def run(cmd: list, timeout: float, cwd: str, trace: str | None = None) -> tuple[int, str, float]:
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", PYTHONUNBUFFERED="1",
               TOKENIZERS_PARALLELISM="false")
    if trace:
        env["SYNCLESS_DOCTOR_KEEP_TRACE"] = trace
    env["PYTHONPATH"] = os.pathsep.join(p for p in (CORPUS, env.get("PYTHONPATH")) if p)
    t = time.perf_counter()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)
        return r.returncode, r.stdout + r.stderr, time.perf_counter() - t
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return 124, out + f"\n[timed out after {timeout:.0f} s]", time.perf_counter() - t


def doctor(script: str, args: list, options: list, timeout: float, cwd: str) -> tuple[dict, str]:
    path = os.path.join(cwd, f"{os.path.basename(script)}.json")
    trace = os.path.join(KEEP_TRACES, os.path.basename(script)[:-3] + ".trace.json") \
        if KEEP_TRACES else None
    rc, out, secs = run([sys.executable, "-m", "syncless", "doctor", "--quick", *DOCTOR,
                         "--json", path, *options, script, *args], timeout, cwd, trace)
    if not os.path.exists(path):
        return {"error": f"rc={rc}, no JSON; output tail:\n{out[-3000:]}", "seconds": secs}, out
    with open(path) as f:
        d = json.load(f)
    d["seconds"] = secs
    return d, out


def tick_line(script: str) -> int:
    """The last `clock.tick()` line of a script: the end of its step, for --step-at."""
    with open(script) as f:
        lines = [i for i, line in enumerate(f, 1) if "clock.tick()" in line]
    return lines[-1]


def measure(name: str, applied: str, device: str, timeout: float, work: str,
            plain: bool, extra: list = ()) -> dict:
    script = os.path.join(CORPUS, f"{name}.py")
    fixed = os.path.join(CORPUS, f"{name}_fixed.py")
    dev = ["--device", device, *extra]
    row: dict = {"script": name}
    d, report = doctor(script, dev, [], timeout, work)
    row["doctor"] = d
    row["report"] = report
    if "error" in d:
        return row
    top = d["findings"][0] if d["findings"] else None
    # The findings whose fixes the twin applies (the rank of the first: 1 = the top one, 0 =
    # minor or absent): the one of that kind, or for a framework twin every finding of the
    # settings it changes; their predicted gains add up.
    ranked = d["findings"] + d["minor"]
    fws = TWIN_SETTINGS.get(name)
    fixes = [f for f in ranked if f["kind"] == applied and
             (fws is None or f.get("setting") in fws)]
    if fws is None:
        fixes = fixes[:1]
    fix = fixes[0] if fixes else None
    rank = next((i for i, f in enumerate(d["findings"], 1) if f is fix), 0)
    predicted = d["step_ms"] - sum(d["step_ms"] - f["predicted_ms"] for f in fixes
                                   if f["predicted_ms"] is not None)
    row.update(verdict=d["verdict"], step_ms=d["step_ms"], gpu_work_ms=d["gpu_work_ms"],
               boundary=d["boundary"], top=top["title"] if top else None,
               applied=" + ".join(f["title"] for f in fixes) or None, applied_rank=rank,
               applied_fix=fix["fixes"][0]["text"] if fix else None,
               predicted_ms=predicted)
    twin_args = list(dev)
    if name == "resnet_decode" and fix and fix.get("workers_needed"):
        twin_args += ["--workers", str(fix["workers_needed"])]
    row["twin_args"] = twin_args
    if plain:                         # the twin on its own clock, without the doctor
        rc, out, secs = run([sys.executable, fixed, *twin_args, "--steps", "100"], timeout, work)
        m = re.search(r"step_ms=([0-9.]+)", out)
        row["plain_ms"] = float(m.group(1)) if m else None
    options = []
    if device.startswith("cuda") and name in ("gpt_fused", "infer_b1"):
        options = ["--step-at", f"{fixed}:{tick_line(fixed)}"]   # graph replays: no module call
    d2, report2 = doctor(fixed, twin_args, options, timeout, work)
    row["twin_doctor"] = d2
    row["twin_report"] = report2
    if "error" not in d2:
        row["twin_verdict"] = d2["verdict"]
        # Measured the way the step before was: the doctor's monitor phase, drained wall/steps.
        row["measured_ms"] = d2["step_ms"]
        before = {identity(f) for f in d["findings"]}
        row["false_alarms"] = [f"{f['title']} ({f['wins_ms']:.3f} ms"
                               + ("; named before the fix, not applied" if identity(f) in before
                                  and identity(f) not in {identity(x) for x in fixes} else "")
                               + ")" for f in d2["findings"]]
    return row


def identity(f: dict) -> tuple:
    """What makes two findings the same across a script and its twin (whose lines differ): the
    setting of a framework's syncs, the code of a sync, else the kind."""
    if f["kind"] == "framework":
        return (f["kind"], f.get("setting"))
    if f["kind"] == "sync":
        return (f["kind"], f["detail"].split("`")[1] if "`" in f["detail"] else f["where"])
    return (f["kind"],)


def judge(row: dict, expected: str, device: str) -> None:
    if "verdict" not in row or row.get("measured_ms") is None:
        row["ok"] = False
        return
    before, pred, meas = row["step_ms"], row["predicted_ms"], row["measured_ms"]
    row["predicted_gain_ms"] = before - pred
    row["measured_gain_ms"] = before - meas
    row["step_error"] = (meas - pred) / pred if pred else None
    if row["predicted_gain_ms"] <= NO_GAIN * before:
        row["gain_error"] = None
        gain_ok = row["measured_gain_ms"] <= NO_GAIN * before
    else:
        row["gain_error"] = (row["measured_gain_ms"] - row["predicted_gain_ms"]) / \
            row["predicted_gain_ms"]
        gain_ok = abs(row["gain_error"]) <= GAIN_TOLERANCE
    row["expected"] = expected
    row["verdict_ok"] = row["verdict"] == expected
    won = row["measured_gain_ms"] / before if before else 0.0
    if not row["verdict_ok"] and row["verdict"] == "GPU-bound" and won < 1 - GPU_BOUND:
        # A script built around one host-side bottleneck whose fix, applied, won under 10% of
        # the step: the GPU worked at least 90% of it (the doctor's line for GPU-bound), and a
        # step at that line reads either way from one run to the next. GPU-bound is then right
        # too, as the twin's own clock shows; the table says so.
        row["verdict_ok"] = True
        row["expected_also"] = f"GPU-bound: the fix won {won:.0%}"
    row["gain_ok"] = gain_ok
    row["alarm_ok"] = not row.get("false_alarms") and "twin_verdict" in row
    row["ok"] = row["verdict_ok"] and gain_ok and row["alarm_ok"] and row["applied_rank"] == 1


def short(text: str) -> str:
    """Paths in a finding's title from the corpus folder on (the run's checkout is elsewhere)."""
    return re.sub(r"/\S*/(benchmarks/doctor_corpus/)", r"\1", text)


def table(rows: list) -> str:
    head = ["script", "verdict", "expected", "step before", "fix applied (rank)",
            "predicted after", "measured after", "error", "gain error", "false alarms on the twin"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if "verdict" not in r:
            lines.append(f"| {r['script']} | error | {r.get('expected', '')} | | | | | | | |")
            continue

        def ms(v):
            return f"{v:.2f} ms" if isinstance(v, (int, float)) else "-"
        ge = r.get("gain_error")
        gain = (f"{ge:+.0%}" if ge is not None else
                ("no gain predicted" + (", none measured" if r.get("gain_ok") else
                                        ", but measured")))
        alarms = "; ".join(short(a) for a in r.get("false_alarms") or []) or \
            ("none" if "twin_verdict" in r else "twin doctor failed")
        se = r.get("step_error")
        err = f"{se:+.0%}" if se is not None else "-"
        expected = r.get("expected", "") + (f" (or {r['expected_also']})"
                                            if r.get("expected_also") else "")
        lines.append(f"| {r['script']} | {r['verdict']} | {expected} | "
                     f"{ms(r['step_ms'])} | {short(r.get('applied') or 'not found')} "
                     f"({r.get('applied_rank') or 'minor'}) | {ms(r['predicted_ms'])} | "
                     f"{ms(r.get('measured_ms'))} | {err} | {gain} | {alarms} |")
    return "\n".join(lines)


def write(rows: list, env: dict, out: str) -> str:
    md = table(rows)
    ok = sum(r.get("ok", False) for r in rows)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "doctor_corpus.json"), "w") as f:
        json.dump({"env": env, "rows": rows}, f, indent=1, default=str)
    with open(os.path.join(out, "doctor_corpus.md"), "w") as f:
        f.write(f"# The doctor on the corpus ({env['gpu']}, torch {env['torch']})\n\n{md}\n\n"
                "Targets: the expected verdict (GPU-bound counts too where the fix, applied, won "
                f"under {1 - GPU_BOUND:.0%} of the step: the doctor's line for GPU-bound is GPU "
                f"work >= {GPU_BOUND:.0%} of the step), measured gain within {GAIN_TOLERANCE:.0%} "
                "of the "
                "predicted one (or no gain predicted and none measured), no finding >= 1% of the "
                f"step on a fixed twin. {ok}/{len(rows)} meet all three. Whole run: "
                f"{env['seconds']:.0f} s.\n")
    return md


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default=None)
    p.add_argument("--only", nargs="*", default=None)
    p.add_argument("--out", default=RESULTS)
    p.add_argument("--timeout", type=float, default=120.0, help="per process, seconds")
    p.add_argument("--plain", action="store_true",
                   help="also run each twin without the doctor, on its own clock")
    p.add_argument("--keep-traces", metavar="DIR",
                   help="keep each doctor run's kernel trace in DIR (diagnostics)")
    p.add_argument("--script-args", default="", metavar="ARGS",
                   help="extra arguments for every script and twin (--script-args='--batch 32')")
    p.add_argument("--render", metavar="JSON",
                   help="only rewrite the markdown table from a results file (rows judged again)")
    ns = p.parse_args(argv)
    if ns.render:
        with open(ns.render) as f:
            saved = json.load(f)
        expected = {name: (exp, applied) for name, exp, applied, _ in SCRIPTS}
        for row in saved["rows"]:
            judge(row, expected[row["script"]][0], saved["env"]["device"])
        print(write(saved["rows"], saved["env"], ns.out))
        return 0
    global KEEP_TRACES
    if ns.keep_traces:
        KEEP_TRACES = os.path.abspath(ns.keep_traces)
        os.makedirs(KEEP_TRACES, exist_ok=True)
    import torch
    device = ns.device or ("cuda" if torch.cuda.is_available() else "cpu")
    chosen = [s for s in SCRIPTS if not ns.only or s[0] in ns.only]
    env = {"device": device, "gpu": torch.cuda.get_device_name(0) if device.startswith("cuda")
           else platform.processor() or "cpu", "torch": torch.__version__,
           "python": platform.python_version(), "cpus": os.cpu_count(), "seconds": 0.0}
    rows = []
    t0 = time.perf_counter()
    md = ""
    with tempfile.TemporaryDirectory(prefix="doctor-corpus-") as work:
        for name, expected, applied, change in chosen:
            t = time.perf_counter()
            row = measure(name, applied, device, ns.timeout, work, ns.plain, ns.script_args.split())
            row["change"] = change
            judge(row, expected, device)
            row["seconds"] = time.perf_counter() - t
            rows.append(row)
            print(f"[{name}: {row['seconds']:.0f} s] verdict={row.get('verdict')} "
                  f"step={row.get('step_ms')} predicted={row.get('predicted_ms')} "
                  f"measured={row.get('measured_ms')} alarms={row.get('false_alarms')} "
                  f"ok={row.get('ok')}", flush=True)
            env["seconds"] = time.perf_counter() - t0
            md = write(rows, env, ns.out)         # after each script: a killed run keeps its rows
    print(md)
    print(f"{sum(r.get('ok', False) for r in rows)}/{len(rows)} scripts meet every target "
          f"({env['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
