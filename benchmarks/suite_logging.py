"""Section 1: the logging anti-pattern, in a real training step, in three regimes.

The step: a small transformer language model (bf16 autocast on CUDA), cross-entropy loss, AdamW,
gradient clipping, plus the metrics people log: loss, token accuracy, mean confidence (max softmax
probability) and the gradient norm. Every variant runs the same step; only the bookkeeping differs.

Regimes are found, not assumed: for each model we measure CPU enqueue time (host time to issue one
step, queue empty) and GPU time (CUDA events around the same step while the GPU is held behind a
sleep kernel, so the GPU runs the step back to back with no launch gaps). GPU/CPU << 1 is
launch-bound, >> 1 GPU-bound; the balanced model is picked from a batch-size sweep as the point
closest to 1.

Timing: variants are interleaved in rounds (fresh random order each round); each measurement is a
block of steps between two `synchronize()` calls. Before a block the garbage collector runs, and
after it (outside the timing) the variant's logger or writer hands over what it still holds, so
no block pays for an earlier block's leftovers. Slowdown is the per-round ratio to the
"computed, not logged" baseline in the same round; we report its median, its interquartile range
(the spread: a difference is called real only when the IQR excludes zero) and the 95% confidence
interval of the median (which narrows with more rounds; the ≤ 1% target is judged on it).
"""
from __future__ import annotations

import gc
import math
import os
import random
import tempfile
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._common import (Ctx, beyond_spread, clock, interleave, md_table, num, num_spread, pct,
                      pct_ci, pct_spread, ratio_summary, seed_all, summarize, syncs_per_call)

EVERY = 20      # the pure-PyTorch ring and the syncless Logger both hand rows over every 20 steps

VARIANTS = {
    "none": "no logging",
    "computed": "metrics computed, not logged (baseline)",
    "item1": "1 × .item() per step (loss)",
    "item_end": "4 × .item() at step end",
    "item_where": "4 × .item() where produced",
    "stack_cpu": "torch.stack(4).cpu() per step",
    "torch_ring": f"torch GPU ring, .cpu() every {EVERY}",
    "syncless": "syncless.Logger",
    "syncless_tb": "syncless.tensorboard add_scalar ×4",
    "syncless_wandb": "syncless.wandb.log",
}
BASE = "computed"


@dataclass
class Config:
    d: int
    layers: int
    batch: int
    seq: int
    vocab: int = 4096

    def label(self) -> str:
        return f"d={self.d}, {self.layers} layers, batch {self.batch}×{self.seq}"


class LM(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.d)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(cfg.d, max(1, cfg.d // 64), 4 * cfg.d, dropout=0.0,
                                       activation="gelu", batch_first=True, norm_first=True)
            for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.d)
        self.head = nn.Linear(cfg.d, cfg.vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


class Workload:
    """One model, optimiser and fixed batches; `step(variant)` runs one training step."""

    def __init__(self, ctx: Ctx, cfg: Config, tmp: str):
        self.ctx, self.cfg, self.tmp = ctx, cfg, tmp
        dev = ctx.device
        self.model = LM(cfg).to(dev)
        self.params = [p for p in self.model.parameters()]
        self.opt = torch.optim.AdamW(self.params, lr=1e-4, weight_decay=0.01)
        g = torch.Generator().manual_seed(ctx.seed)
        self.data = [(torch.randint(cfg.vocab, (cfg.batch, cfg.seq), generator=g).to(dev),
                      torch.randint(cfg.vocab, (cfg.batch, cfg.seq), generator=g).to(dev))
                     for _ in range(4)]
        self.k = 0
        self.host = 0.0                     # where the reading variants put what they read
        self.ring = torch.zeros(EVERY, 4, device=dev)
        self.tools: dict = {}               # lazily created logger / writers, closed by close()

    def autocast(self):
        if self.ctx.cuda:
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return torch.autocast("cpu", enabled=False)

    def step(self, variant: str) -> None:
        x, y = self.data[self.k % len(self.data)]
        where = variant == "item_where"
        with self.autocast():
            logits = self.model(x)
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        if where:
            self.host = loss.item()         # splits the step: backward waits for this read
        metrics = None
        if variant != "none":
            with torch.no_grad():
                lg = logits.detach()
                acc = (lg.argmax(-1) == y).float().mean()
                conf = lg.float().softmax(-1).amax(-1).mean()
            if where:
                self.host = acc.item() + conf.item()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        if where:
            self.host = gnorm.item()        # the optimiser step waits for this one
        self.opt.step()
        if variant != "none":
            metrics = {"loss": loss.detach(), "acc": acc, "conf": conf, "gnorm": gnorm}
            self._bookkeeping(variant, metrics)
        self.k += 1

    def _bookkeeping(self, variant: str, m: dict) -> None:
        if variant == "item1":
            self.host = m["loss"].item()
        elif variant == "item_end":
            self.host = sum(v.item() for v in m.values())
        elif variant == "stack_cpu":
            self.host = torch.stack([v.float() for v in m.values()]).cpu()
        elif variant == "torch_ring":
            i = self.k % EVERY
            self.ring[i].copy_(torch.stack([v.float() for v in m.values()]))
            if i == EVERY - 1:
                self.host = self.ring.cpu()
        elif variant == "syncless":
            self.tools["syncless"](**m)
        elif variant == "syncless_tb":
            w = self.tools["syncless_tb"]
            for name, v in m.items():
                w.add_scalar(name, v, self.k)
        elif variant == "syncless_wandb":
            self.tools["syncless_wandb"].log(m, step=self.k)

    def settle(self, variant: str) -> None:
        """Hand over what the variant's logger or writer still holds and wait for its delivery,
        so the next block starts clean."""
        tool = self.tools.get(variant)
        if tool is not None:
            tool.flush()

    def close(self) -> None:
        for name, tool in self.tools.items():
            try:
                if name == "syncless_wandb":
                    tool.finish()
                else:
                    tool.close()
            except Exception as exc:
                print(f"  ! closing {name} failed: {exc}", flush=True)
        self.tools = {}


def make_tools(wl: Workload, variants: list[str], ctx: Ctx, errors: dict) -> None:
    """Create the syncless logger and adapters a workload needs; a missing piece is skipped with
    a note, never a crash (they are written in parallel with this suite)."""
    if "syncless" in variants:
        try:
            import syncless
            wl.tools["syncless"] = syncless.Logger(
                every=EVERY, sinks=[syncless.sinks.Callback(lambda step, t, values: None)])
        except Exception as exc:
            errors["syncless"] = f"unavailable: {type(exc).__name__}: {exc}"
    if "syncless_tb" in variants:
        try:
            from syncless import tensorboard as stb
            wl.tools["syncless_tb"] = stb.SummaryWriter(
                log_dir=os.path.join(wl.tmp, f"tb-{wl.cfg.d}-{wl.cfg.batch}"))
        except Exception as exc:
            errors["syncless_tb"] = f"unavailable: {type(exc).__name__}: {exc}"
    if "syncless_wandb" in variants:
        try:
            import wandb  # noqa: F401  (the adapter needs the real package)
        except Exception:
            errors["syncless_wandb"] = "skipped: wandb is not installed"
        else:
            try:
                from syncless import wandb as swb
                swb.init(project="syncless-bench", mode="offline", dir=wl.tmp)
                wl.tools["syncless_wandb"] = swb
            except Exception as exc:
                errors["syncless_wandb"] = f"unavailable: {type(exc).__name__}: {exc}"


# ---- measurements ------------------------------------------------------------------------------

def probe(ctx: Ctx, wl: Workload, reps: int) -> dict:
    """CPU enqueue time and GPU execution time of one step ('computed' variant)."""
    for _ in range(2):
        wl.step(BASE)
    ctx.sync()
    cpu, gpu = [], []
    sleep = getattr(torch.cuda, "_sleep", None) if ctx.cuda else None
    cycles = 0
    for _ in range(reps):
        if ctx.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if sleep is not None and cycles:
                sleep(cycles)               # hold the GPU so the whole step is queued first
            t0 = clock()
            start.record()
            wl.step(BASE)
            end.record()
            t1 = clock()
            end.synchronize()
            cpu.append(t1 - t0)
            gpu.append(start.elapsed_time(end) / 1e3)
            # Sleep long enough to cover the enqueue (≈2 GHz SM clock, 2× margin, ≤ 0.5 s).
            cycles = int(min(0.5, 2.0 * max(cpu)) * 2e9)
        else:
            t0 = clock()
            wl.step(BASE)
            cpu.append(clock() - t0)
    out = {"cpu_ms": summarize(cpu[1:] if len(cpu) > 2 else cpu)["median"] * 1e3}
    if gpu:
        g = gpu[1:] if sleep is not None else gpu
        out["gpu_ms"] = summarize(g)["median"] * 1e3
        out["gpu_over_cpu"] = out["gpu_ms"] / out["cpu_ms"]
        out["gpu_method"] = ("CUDA events, GPU held behind torch.cuda._sleep while the step is "
                             "queued" if sleep is not None else
                             "CUDA events around the step (upper bound: includes launch gaps)")
    return out


def count_syncs(ctx: Ctx, wl: Workload, variant: str, steps: int) -> float | None:
    """Syncs per step seen by torch's sync-debug mode over `steps` steps (one full ring window)."""
    if not ctx.cuda:
        return None
    wl.step(variant)
    ctx.sync()
    n = syncs_per_call(lambda: wl.step(variant), steps)
    ctx.sync()
    return n


def gpu_busy_ms(ctx: Ctx, wl: Workload, variant: str, steps: int) -> float | None:
    """Mean GPU busy time per step: the union of kernel/memcpy/memset intervals recorded by
    torch.profiler over a short separate run (profiling slows the host, so its wall time is
    not used; the timed run supplies the wall time)."""
    if not ctx.cuda:
        return None
    from torch.profiler import ProfilerActivity, profile
    wl.step(variant)
    ctx.sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            wl.step(variant)
        ctx.sync()
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if str(e.device_type).split(".")[-1] == "CUDA")
    busy, cur_s, cur_e = 0.0, None, None
    for s, e in spans:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        busy += cur_e - cur_s
    return busy / steps / 1e3                 # profiler times are in µs


def configs(ctx: Ctx) -> dict:
    if not ctx.cuda:
        return {"launch": Config(32, 1, 2, 16, 256),
                "sweep": [Config(48, 1, b, 32, 256) for b in (1, 4)],
                "gpu": Config(96, 2, 4, 64, 512)}
    if ctx.quick:
        return {"launch": Config(256, 2, 8, 128),
                "sweep": [Config(512, 4, b, 256) for b in (8, 32)],
                "gpu": Config(1024, 4, 16, 512)}
    return {"launch": Config(256, 2, 8, 128),
            "sweep": [Config(512, 4, b, 256) for b in (2, 4, 8, 16, 32, 64, 128)],
            "gpu": Config(1024, 8, 32, 512)}


def run_regime(ctx: Ctx, name: str, cfg: Config, tmp: str, rng: random.Random,
               syncs: dict, probed: dict | None) -> dict:
    rounds = 3 if ctx.quick else 30
    target_s = 0.03 if ctx.quick else 0.15
    seed_all(ctx.seed)
    wl = Workload(ctx, cfg, tmp)
    errors: dict = {}
    variants = list(VARIANTS)
    make_tools(wl, variants, ctx, errors)
    for e in errors.values():
        print(f"  note: {e}", flush=True)
    try:
        info = probed or probe(ctx, wl, reps=4 if ctx.quick else 8)
        for v in variants:                    # warm every variant (first log binds its ring)
            if v not in errors:
                try:
                    wl.step(v)
                    wl.step(v)
                except Exception as exc:
                    errors[v] = f"{type(exc).__name__}: {exc}"
                    print(f"  ! {v} failed in warm-up: {errors[v]}", flush=True)
        ctx.sync()
        t0 = clock()
        for _ in range(3):
            wl.step(BASE)
        ctx.sync()
        step_s = (clock() - t0) / 3
        steps = max(2, min(200, round(target_s / step_s)))

        def block(v):
            def run():
                gc.collect()
                ctx.sync()
                t = clock()
                for _ in range(steps):
                    wl.step(v)
                ctx.sync()
                took = (clock() - t) / steps
                wl.settle(v)
                return took
            return run

        live = {v: block(v) for v in variants if v not in errors}
        print(f"  {name}: {cfg.label()}, {len(live)} variants × {rounds} rounds × "
              f"{steps} steps", flush=True)
        times = interleave(live, rounds, rng, errors)

        if not syncs and ctx.cuda:            # once per run: the count is regime-independent
            for v in live:
                if v not in errors:
                    syncs[v] = count_syncs(ctx, wl, v, EVERY)
        prof_steps = 2 if ctx.quick else 3
        prof_variants = ([BASE, "item_where", "syncless"] if ctx.quick else list(live))
        out_v = {}
        for v in variants:
            if v in errors and not times.get(v):
                out_v[v] = {"label": VARIANTS[v], "error": errors[v]}
                continue
            st = summarize(times[v])
            rec = {"label": VARIANTS[v], "step_ms": {k: (x * 1e3 if isinstance(x, float) else x)
                                                     for k, x in st.items()},
                   "steps_per_s": 1.0 / st["median"]}
            if v != BASE and times.get(BASE):
                r = ratio_summary(times, v, BASE)
                rec["slowdown"] = r
                rec["beyond_spread"] = beyond_spread(r)
            rec["syncs_per_step"] = syncs.get(v)
            if v in prof_variants and v not in errors:
                try:
                    busy = gpu_busy_ms(ctx, wl, v, prof_steps)
                except Exception as exc:
                    busy = None
                    ctx.note(f"profiler failed for {v}: {exc}")
                if busy is not None:
                    rec["gpu_busy_ms"] = busy
                    rec["gpu_idle"] = max(0.0, 1.0 - busy / rec["step_ms"]["median"])
            if v in errors:
                rec["error"] = errors[v]
            out_v[v] = rec
        base = out_v.get(BASE, {}).get("step_ms", {})
        spread = ((base["p75"] - base["p25"]) / base["median"]) if base.get("median") else None
        return {"config": asdict(cfg), "label": cfg.label(), **info, "rounds": rounds,
                "steps_per_block": steps, "baseline_iqr_rel": spread, "variants": out_v}
    finally:
        wl.close()
        del wl
        if ctx.cuda:
            torch.cuda.empty_cache()


def run(ctx: Ctx) -> dict:
    rng = random.Random(ctx.seed)
    cfgs = configs(ctx)
    syncs: dict = {}
    result: dict = {"every": EVERY, "variants": VARIANTS, "baseline": BASE, "regimes": {},
                    "method": {
                        "slowdown": "per-round step time / baseline step time in the same round; "
                                    "median [IQR] over rounds",
                        "syncs": "torch.cuda.set_sync_debug_mode('warn') over one "
                                 f"{EVERY}-step window (misses torch.cuda.synchronize() and "
                                 "Event.synchronize(); neither is used in the step)",
                        "gpu_idle": "1 - (union of kernel+memcpy intervals per step from a "
                                    "separate torch.profiler run) / (median timed step)",
                    }}
    with tempfile.TemporaryDirectory(prefix="syncless-bench-") as tmp:
        # The balanced regime: the sweep point whose GPU/CPU time ratio is closest to 1.
        sweep = []
        for cfg in cfgs["sweep"]:
            seed_all(ctx.seed)
            wl = Workload(ctx, cfg, tmp)
            p = probe(ctx, wl, reps=4 if ctx.quick else 6)
            del wl
            sweep.append({"config": asdict(cfg), "label": cfg.label(), **p})
            print(f"  sweep {cfg.label()}: cpu {p['cpu_ms']:.2f} ms"
                  + (f", gpu {p['gpu_ms']:.2f} ms, gpu/cpu {p['gpu_over_cpu']:.2f}"
                     if "gpu_ms" in p else ""), flush=True)
        if ctx.cuda:
            torch.cuda.empty_cache()
            pick = min(range(len(sweep)), key=lambda i: abs(math.log(sweep[i]["gpu_over_cpu"])))
            r = sweep[pick]["gpu_over_cpu"]
            if not 0.67 <= r <= 1.5:
                ctx.note(f"no sweep point is balanced; the closest has GPU/CPU = {r:.2f}")
        else:
            pick = len(sweep) // 2
            ctx.note("CPU run: regimes are nominal (there is no GPU to be bound by)")
        result["sweep"] = sweep
        result["balanced_pick"] = sweep[pick]["label"]
        plan = [("launch-bound", cfgs["launch"]), ("balanced", cfgs["sweep"][pick]),
                ("GPU-bound", cfgs["gpu"])]
        for name, cfg in plan:
            reg = run_regime(ctx, name, cfg, tmp, rng, syncs, None)
            result["regimes"][name] = reg
            print("    " + ", ".join(f"{v}: {pct_spread(r['slowdown'])}"
                                     for v, r in reg["variants"].items()
                                     if v in ("item_where", "item1", "syncless")
                                     and "slowdown" in r), flush=True)
    result["target"] = {name: _target(reg) for name, reg in result["regimes"].items()}
    result["syncs_per_step"] = syncs
    return result


def _target(reg: dict) -> str:
    """The issue's bar: syncless.Logger at most 1% slower than not logging the metrics at all."""
    r = reg["variants"].get("syncless", {}).get("slowdown")
    if not r or r.get("median") is None:
        return "not measured"
    ci = r.get("ci95")
    if not ci:
        return f"not shown: median {pct(r['median'])}, too few rounds for a confidence interval"
    if ci[1] <= 1.01:
        return f"met (median {pct(r['median'])}, 95% CI {pct_ci(ci)} below +1%)"
    if ci[0] > 1.01:
        return f"missed: median {pct(r['median'])}, 95% CI {pct_ci(ci)} above +1%"
    return f"not shown: median {pct(r['median'])}, 95% CI {pct_ci(ci)} includes +1%"


# ---- reporting ---------------------------------------------------------------------------------

def markdown(res: dict) -> str:
    parts = ["Step time per variant; slowdown is against *metrics computed, not logged*, as a "
             "per-round paired ratio, median [25th–75th percentile], and the 95% confidence "
             "interval of that median. ✔ marks a difference whose interquartile range excludes "
             "zero; anything else is within the spread.\n"]
    if res.get("sweep"):
        rows = [[s["label"], num(s["cpu_ms"]), num(s.get("gpu_ms")), num(s.get("gpu_over_cpu"))]
                for s in res["sweep"]]
        parts.append(f"Balanced-regime sweep (picked: {res.get('balanced_pick')}):\n\n"
                     + md_table(["model", "CPU enqueue ms", "GPU ms", "GPU/CPU"], rows) + "\n")
    for name, reg in res.get("regimes", {}).items():
        head = (f"**{name}**: {reg['label']}; CPU enqueue {num(reg.get('cpu_ms'))} ms, GPU "
                f"{num(reg.get('gpu_ms'))} ms per step (GPU/CPU {num(reg.get('gpu_over_cpu'))}); "
                f"{reg['rounds']} rounds × {reg['steps_per_block']} steps; baseline "
                f"round-to-round IQR {pct(1 + (reg.get('baseline_iqr_rel') or 0))}.")
        rows = []
        for v, r in reg["variants"].items():
            if "step_ms" not in r:
                rows.append([r["label"], "—", "—", r.get("error", ""), "", "", "", ""])
                continue
            sd = r.get("slowdown")
            rows.append([r["label"], num_spread(r["step_ms"]), num(r["steps_per_s"]),
                         pct_spread(sd) if v != BASE else "—",
                         pct_ci(sd.get("ci95")) if sd else "—",
                         "✔" if r.get("beyond_spread") else "",
                         num(r.get("syncs_per_step")), num(r.get("gpu_idle"), 2)])
        parts.append(head + "\n\n" + md_table(
            ["variant", "step ms [IQR]", "steps/s", "slowdown [IQR]", "median 95% CI", "real?",
             "syncs/step", "GPU idle"], rows) + "\n")
    if res.get("target"):
        parts.append("Target, syncless.Logger ≤ 1% slowdown: " + "; ".join(
            f"{name}: {t}" for name, t in res["target"].items()) + ".\n")
    if res.get("method"):
        parts.append("Method: " + " ".join(f"*{k}*: {v}." for k, v in res["method"].items())
                     + "\n")
    return "\n".join(parts)


def headline(res: dict) -> list[list[str]]:
    rows = []
    regs = res.get("regimes", {})
    for name, reg in regs.items():
        v = reg["variants"]
        for key, seed in (("item_where", "+27% (RTX 5060)"), ("item1", "~3%"),
                          ("syncless", "target ≤ 1%")):
            r = v.get(key, {})
            if "slowdown" in r:
                if r["slowdown"]["n"] < 5:
                    mark = f" ({r['slowdown']['n']} rounds: not claimed)"
                else:
                    mark = "" if r.get("beyond_spread") else " (within spread)"
                ci = r["slowdown"].get("ci95")
                rows.append([f"{VARIANTS[key]}, {name}", seed, pct_spread(r["slowdown"]) + mark
                             + (f"; median CI {pct_ci(ci)}" if ci else "")])
    return rows
