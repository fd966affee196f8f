"""Section 5: launch overhead. Batch-1 inference of a small MLP (8 × Linear+LayerNorm+GELU,
24 kernels): eager vs CUDA graph replay vs torch.compile(mode="reduce-overhead").

Two numbers per variant, interleaved in rounds:
- latency: one forward from an idle GPU to its result (synchronize, clock, forward, synchronize,
  clock), median over the calls of a round;
- pipelined: n forwards back to back between two synchronize() calls, divided by n.

torch.compile can take a long time to compile, so the suite runs this section in a child process
with a time limit; if compilation fails or the child runs out of time, the error is recorded and
eager vs graph is measured in-process.

    python -m benchmarks.suite_launch --device cuda [--quick] [--no-compile] --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile

import torch
import torch.nn as nn

from ._common import Ctx, clock, md_table, num, num_spread, seed_all, summarize

LABELS = {"eager": "eager", "graph": "CUDA graph replay",
          "compiled": 'torch.compile(mode="reduce-overhead")'}
COMPILE_LIMIT_S = 150


def mlp(d: int = 512, layers: int = 8) -> nn.Module:
    mods = []
    for _ in range(layers):
        mods += [nn.Linear(d, d), nn.LayerNorm(d), nn.GELU()]
    return nn.Sequential(*mods)


def measure(ctx: Ctx, with_compile: bool) -> dict:
    seed_all(ctx.seed)
    dev = ctx.device
    model = mlp().to(dev).eval()
    x = torch.randn(1, 512, device=dev)
    fns = {"eager": lambda: model(x)}
    errors = {}
    out = {"model": "MLP d=512, 8 × (Linear, LayerNorm, GELU), batch 1, fp32", "errors": errors}
    torch.backends.cuda.matmul.allow_tf32 = True
    with torch.no_grad():
        if ctx.cuda:
            try:
                static_x = x.clone()
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):          # warm up off the capture stream
                    for _ in range(3):
                        model(static_x)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    static_y = model(static_x)
                fns["graph"] = lambda: graph.replay()
                graph.replay()
                out["graph_matches_eager"] = bool(torch.allclose(static_y, model(x), atol=1e-4))
            except Exception as exc:
                errors["graph"] = f"{type(exc).__name__}: {exc}"
        else:
            errors["graph"] = "skipped: needs CUDA"
        if with_compile:
            try:
                compiled = torch.compile(model, mode="reduce-overhead")
                mark = getattr(torch.compiler, "cudagraph_mark_step_begin", None)

                def comp():
                    if mark is not None:
                        mark()
                    return compiled(x)
                t = clock()
                for _ in range(5):                     # compile, record, then replay
                    comp()
                ctx.sync()
                out["compile_s"] = clock() - t
                fns["compiled"] = comp
            except Exception as exc:
                errors["compiled"] = f"{type(exc).__name__}: {str(exc)[:500]}"
        else:
            errors.setdefault("compiled", "skipped")

        for fn in fns.values():
            for _ in range(5):
                fn()
        ctx.sync()
        rounds = 3 if ctx.quick else 10
        n = 50 if ctx.quick else 200
        rng = random.Random(ctx.seed + 5)
        lat = {k: [] for k in fns}
        pipe = {k: [] for k in fns}
        for _ in range(rounds):
            order = list(fns)
            rng.shuffle(order)
            for k in order:
                fn = fns[k]
                one = []
                for _ in range(n // 5):
                    ctx.sync()
                    t = clock()
                    fn()
                    ctx.sync()
                    one.append(clock() - t)
                lat[k].append(summarize(one)["median"] * 1e6)
                ctx.sync()
                t = clock()
                for _ in range(n):
                    fn()
                ctx.sync()
                pipe[k].append((clock() - t) / n * 1e6)
    out["latency_us"] = {k: summarize(v) for k, v in lat.items()}
    out["pipelined_us"] = {k: summarize(v) for k, v in pipe.items()}
    e = out["latency_us"]["eager"]["median"]
    out["speedup_latency"] = {k: e / v["median"] for k, v in out["latency_us"].items()}
    return out


def run(ctx: Ctx) -> dict:
    if not ctx.cuda:
        print("  CUDA graphs: skipped: needs CUDA; torch.compile skipped on CPU", flush=True)
        r = measure(ctx, with_compile=False)
        r["errors"]["compiled"] = "skipped: needs CUDA"
        return r
    if ctx.quick:
        ctx.note("torch.compile skipped in --quick (compilation alone can exceed the budget)")
        r = measure(ctx, with_compile=False)
        r["errors"]["compiled"] = "skipped in --quick"
        return r
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "launch.json")
        cmd = [sys.executable, "-m", "benchmarks.suite_launch", "--device", str(ctx.device),
               "--seed", str(ctx.seed), "--json", path]
        try:
            proc = subprocess.run(cmd, cwd=os.path.dirname(os.path.dirname(__file__)),
                                  timeout=COMPILE_LIMIT_S, capture_output=True, text=True)
            if proc.returncode == 0 and os.path.exists(path):
                with open(path, encoding="utf-8") as f:
                    return json.load(f)
            err = f"child exited {proc.returncode}: {(proc.stderr or '')[-800:]}"
        except subprocess.TimeoutExpired:
            err = f"torch.compile section did not finish within {COMPILE_LIMIT_S} s"
    ctx.note(f"launch section with torch.compile failed ({err.splitlines()[0][:200]}); "
             "measuring eager vs CUDA graph in-process")
    r = measure(ctx, with_compile=False)
    r["errors"]["compiled"] = err
    return r


def markdown(res: dict) -> str:
    rows = []
    for k, label in LABELS.items():
        if k in res.get("latency_us", {}):
            rows.append([label, num_spread(res["latency_us"][k]),
                         num_spread(res["pipelined_us"][k]), f"{res['speedup_latency'][k]:.2f}×"])
        else:
            rows.append([label, "—", "—", res.get("errors", {}).get(k, "")[:160]])
    text = (f"{res['model']}. Time per forward, µs, median [IQR] over rounds:\n\n"
            + md_table(["variant", "latency (synced)", "pipelined", "speedup (latency)"], rows))
    if "compile_s" in res:
        text += f"\n\ntorch.compile: first five calls (compile + record) took {res['compile_s']:.1f} s."
    return text + "\n"


def headline(res: dict) -> list[list[str]]:
    rows = []
    lat = res.get("latency_us", {})
    for k in ("graph", "compiled"):
        if k in lat:
            rows.append([f"batch-1 MLP latency, {LABELS[k]} vs eager",
                         "2–4× (seed); 559 → 57 µs (H200)" if k == "graph" else "2–4× (seed)",
                         f"{num(lat['eager']['median'])} → {num(lat[k]['median'])} µs "
                         f"({res['speedup_latency'][k]:.1f}×)"])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    ctx = Ctx(torch.device(a.device), quick=a.quick, seed=a.seed)
    res = measure(ctx, with_compile=not a.no_compile)
    with open(a.json, "w", encoding="utf-8") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main()
