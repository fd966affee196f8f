"""Run the whole benchmark suite and write <out>/<gpu>-<date>.json, .md and PNG plots.

    python -m benchmarks.run                      # full suite, ~5 minutes on one H200
    python -m benchmarks.run --quick              # smoke test, < 60 s (files get a -quick suffix)
    python -m benchmarks.run --only logging,timing

Sections: logging (the anti-pattern in a training step), per_call (cost of one logging call,
the timer and watch(): benchmarks/percall.py, which also compares two builds),
timing (timing pitfalls), dataloader (starvation), launch (eager vs CUDA graphs vs compile).
A section that fails is recorded with its error; the others still run.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

import torch

if __package__ in (None, ""):              # run as a script: python benchmarks/run.py
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import benchmarks  # noqa: F401
    __package__ = "benchmarks"

from . import percall, suite_dataloader, suite_launch, suite_logging, suite_timing
from ._common import Ctx, env_info, env_table, md_table, seed_all, slug, write_json
from .plots import make_plots

SECTIONS = {
    "logging": (suite_logging, "1. The logging anti-pattern in a training step"),
    "per_call": (percall, "2. Cost of one logging call"),
    "timing": (suite_timing, "3. Timing pitfalls"),
    "dataloader": (suite_dataloader, "4. DataLoader starvation"),
    "launch": (suite_launch, "5. Launch overhead"),
}


def headline(results: dict) -> str:
    rows = []
    for key, (mod, _) in SECTIONS.items():
        res = results["sections"].get(key)
        if res and "error" not in res and "skipped" not in res:
            try:
                rows += mod.headline(res)
            except Exception as exc:
                rows.append([key, "", f"headline failed: {exc}"])
    gpu = results["env"].get("gpu", "?")
    return md_table(["measurement", "seed / earlier probe", f"this run ({gpu})"], rows)


def markdown(results: dict, plots: list[str]) -> str:
    env = results["env"]
    lines = [f"# syncless benchmarks: {env.get('gpu')} ({env['date']})", "",
             f"`{env['command']}`" + ("  (quick mode: smoke-test sizes, not for quoting)"
                                     if results["quick"] else ""), ""]
    lines += [env_table(env), ""]
    lines += ["## Headline", "", results["headline"], ""]
    for key, (mod, title) in SECTIONS.items():
        res = results["sections"].get(key)
        if res is None:
            continue
        lines += [f"## {title}", "", f"_{results['elapsed_s'].get(key, 0):.0f} s_", ""]
        if "error" in res:
            lines += [f"Failed: `{res['error']}`", ""]
        else:
            lines += [mod.markdown(res), ""]
    if results["notes"]:
        lines += ["## Notes", ""] + [f"- {n}" for n in results["notes"]] + [""]
    if plots:
        lines += ["## Plots", ""] + [f"![{p}]({p})" for p in plots] + [""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke-test sizes (< 60 s)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", default=None, help="comma-separated sections: " + ",".join(SECTIONS))
    ap.add_argument("--no-plots", action="store_true")
    a = ap.parse_args(argv)

    os.environ.setdefault("WANDB_SILENT", "true")
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    seed_all(a.seed)
    ctx = Ctx(device, quick=a.quick, seed=a.seed)
    only = list(SECTIONS) if not a.only else [s.strip() for s in a.only.split(",") if s.strip()]
    unknown = [s for s in only if s not in SECTIONS]
    if unknown:
        ap.error(f"unknown sections {unknown}; choose from {list(SECTIONS)}")

    env = env_info(device, argv)
    print(f"syncless benchmarks on {env['gpu']} (torch {env['torch']}), "
          f"{'quick' if a.quick else 'full'} run", flush=True)
    if not ctx.cuda:
        ctx.note("no CUDA device: CPU plumbing run; GPU-only measurements are skipped")
    results = {"env": env, "quick": a.quick, "seed": a.seed, "sections": {}, "elapsed_s": {},
               "notes": ctx.notes}
    t_all = time.perf_counter()
    for key in only:
        mod, title = SECTIONS[key]
        print(f"\n== {title}", flush=True)
        t = time.perf_counter()
        seed_all(a.seed)
        try:
            results["sections"][key] = mod.run(ctx)
        except Exception as exc:
            traceback.print_exc()
            results["sections"][key] = {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            if ctx.cuda:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
        results["elapsed_s"][key] = time.perf_counter() - t
        print(f"   ({results['elapsed_s'][key]:.1f} s)", flush=True)
    results["elapsed_s"]["total"] = time.perf_counter() - t_all
    results["headline"] = headline(results)

    os.makedirs(a.out, exist_ok=True)
    stem = f"{slug(env['gpu'])}-{env['date']}" + ("-quick" if a.quick else "")
    prefix = os.path.join(a.out, stem)
    plots = [] if a.no_plots else make_plots(results, prefix)
    results["plots"] = plots
    write_json(prefix + ".json", results)
    with open(prefix + ".md", "w", encoding="utf-8") as f:
        f.write(markdown(results, plots))
    print(f"\n== Headline ({results['elapsed_s']['total']:.0f} s in all)\n")
    print(results["headline"])
    print(f"\nwrote {prefix}.json, {prefix}.md" + "".join(f", {p}" for p in plots))
    return 0


if __name__ == "__main__":
    sys.exit(main())
