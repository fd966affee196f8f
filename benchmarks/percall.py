"""The cost of one call: log.log() with K = 1, 4, 16, 64 scalars against the ways PyTorch users
keep metrics, syncless.timer() against a raw event pair, and watch()'s host cost per step.

    python -m benchmarks.percall [--quick] [--device cpu] [--out [DIR]]
    python -m benchmarks.percall --baseline DIR [--baseline-label REV] ...

A block is n calls of one method: synchronize, clock, n calls, clock, synchronize. The GPU is
idle at the start and the clock stops before the closing synchronize, so the number is what the
call costs the host (a method that reads a value, like .item(), pays its sync inside the block).
A watch() block is a loop of one tiny kernel per step, bare or watched (doctor_overhead.run); the
cost watch() adds is the watched block minus the bare one of the same round. Rounds interleave:
each round times every method once, in a shuffled order. Medians over rounds, [IQR] beside them,
and for ratios the 95% confidence interval of the median per-round ratio.

--baseline DIR compares two builds of syncless in one run: DIR is another checkout, built in
place (python3 setup.py build_ext --inplace). One process cannot hold two builds (both are the
module `syncless`), so each build gets a worker process: this file with PYTHONPATH=<tree>/python,
which checks it imported the build it was given, sets up every method, warms up and waits. Each
round, the driver sends both workers the same shuffled list of methods, one worker after the
other, the first alternating between rounds; the idle worker blocks on a pipe, so the GPU and the
host serve one build at a time; both run pinned to the same cores (--cores), so neither gets the
better core or memory node. current/baseline is taken per round and per method. Workers are
replaced every rounds/epochs rounds, so that one process's luck (heap layout, say) is not taken
for a build's. Rows that do not touch syncless (a bare torch launch, a raw
torch.cuda.Event pair, perf_counter) are controls: their ratio should include 1. Then the full
method table (every peer) is measured in this process, on the current tree.
"""
from __future__ import annotations

import gc
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

import torch

from . import doctor_overhead
from ._common import (Ctx, arg_parser, block_us, calls_for, env_info, interleave, md_table, num,
                      num_spread, pick_device, ratio_summary, seed_all, summarize, write_results)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KS = (1, 4, 16, 64)
CALLS = 200               # calls per block of the fast methods (the queue never fills)
RING_EVERY = 100

METHODS = {               # per K; the first two are measured on both builds in an A/B run
    "syncless": "syncless log.log(d)",
    "floor": "floor: one torch kernel launch (x.zero_())",
    "syncless_tb": "syncless.tensorboard add_scalar ×K",
    "syncless_wandb": "syncless.wandb.log(K)",
    "ring_stack": f"torch ring: ring[i].copy_(stack(K)), .cpu() every {RING_EVERY}",
    "ring_each": f"torch ring: ring[i, j].copy_(m) ×K, .cpu() every {RING_EVERY}",
    "torchmetrics": "torchmetrics MeanMetric.update ×K",
    "tb_native": "TensorBoard add_scalar(tensor) ×K",
    "wandb_native": "wandb.log({k: v.item()}) (offline)",
    "item": ".item() per metric",
}
AB_METHODS = ("syncless", "floor")
TIMERS = {                # µs per enter+exit of an empty block
    "timer": "syncless.timer()",
    "timer_named": "syncless.timer(name)",
    "event_pair": "torch.cuda.Event pair, reused: .record() ×2",
    "event_pair_new": "torch.cuda.Event pair, new each time",
    "raw_pair": "_C.EventPair start()+stop() (two cuEventRecord, the floor)",
    "sync_clock": "synchronize() + perf_counter, twice",
    "timer_cpu": "syncless.timer(device='cpu')",
    "clock": "perf_counter() pair",
}
WATCH = {                 # µs per step of a one-kernel step; doctor_overhead's variants
    "bare": "bare loop (one tiny kernel per step)",
    "watch": "watch(), GPU timed on a sample of steps",
    "watch every step": "watch(gpu_every=1): two events and a poll per step",
    "watch, no GPU": "watch(gpu=False): the Python side alone",
}
CONTROLS = ("floor", "event_pair", "event_pair_new", "sync_clock", "clock", "watch/bare")
PUBLISHED = {             # 11-30: results/archive/{log,timer}_overhead.md, doctor_overhead.json
    "syncless@1": 6.19, "syncless@4": 4.93, "syncless@16": 7.64, "syncless@64": 11.39,
    "floor@4": 6.11, "timer": 6.34, "timer_named": 10.06, "event_pair": 14.43,
    "event_pair_new": 18.34, "watch/watch": 1.45, "watch/watch every step": 8.33,
    "watch/watch, no GPU": 1.02,
}


def label(name: str) -> str:
    if "@" in name:
        m, k = name.split("@")
        return f"{METHODS[m]}, K={k}"
    if name.startswith("watch/"):
        return WATCH[name[6:]]
    return TIMERS[name]


class Bench:
    """Every method as a no-argument block that returns µs per call (per step for watch())."""

    def __init__(self, ctx: Ctx, ks=KS, peers: bool = True):
        self.ctx, self.errors, self.blocks = ctx, {}, {}
        self.tmp = tempfile.mkdtemp(prefix="syncless-percall-")
        self._close = [lambda: shutil.rmtree(self.tmp, ignore_errors=True)]
        self.target_s = 0.001 if ctx.quick else 0.003
        self.watch_steps = 400 if ctx.quick else 2000
        self._wandb = None
        if peers:
            self._start_wandb()
        for k in ks:
            self._per_k(k, peers)
        self._timers()
        self._watch()

    def _add(self, name: str, make, calls: int | None = CALLS) -> None:
        """Register `name` built by make(); calls=None: calibrated to target_s per block."""
        try:
            fn = make()
            n = calls or calls_for(fn, self.target_s, self.ctx.sync)
            self.blocks[name] = lambda: block_us(fn, n, self.ctx.sync)
        except Exception as exc:                      # a missing backend is a note, not a crash
            self.errors[name] = f"{type(exc).__name__}: {exc}"

    def _per_k(self, k: int, peers: bool) -> None:
        import syncless
        dev = self.ctx.device
        vals = [torch.rand((), device=dev) for _ in range(k)]
        metrics = {f"m{j}": v for j, v in enumerate(vals)}
        scratch = torch.zeros((), device=dev)

        def logger():
            log = syncless.Logger(every=RING_EVERY, device=dev)
            self._close.append(log.close)
            return lambda: log.log(metrics)
        self._add(f"syncless@{k}", logger)
        self._add(f"floor@{k}", lambda: scratch.zero_)
        if not peers:
            return
        ring = torch.zeros(RING_EVERY, k, device=dev)
        pos = [0]

        def ring_write(each: bool):
            def write():
                i = pos[0] % RING_EVERY
                if each:
                    row = ring[i]
                    for j, v in enumerate(vals):
                        row[j].copy_(v)
                else:
                    ring[i].copy_(torch.stack(vals))
                pos[0] += 1
                if i == RING_EVERY - 1:
                    self.host = ring.cpu()
            return write
        self._add(f"ring_stack@{k}", lambda: ring_write(False), None)
        self._add(f"ring_each@{k}", lambda: ring_write(True), None)
        self._add(f"item@{k}", lambda: lambda: [v.item() for v in vals], None)

        def torchmetrics():
            import torchmetrics
            mms = [torchmetrics.MeanMetric().to(dev) for _ in range(k)]

            def update():
                for m, v in zip(mms, vals):
                    m.update(v)
            return update
        self._add(f"torchmetrics@{k}", torchmetrics, None)

        def writer(cls, sub: str):
            w = cls(log_dir=os.path.join(self.tmp, f"{sub}-{k}"))
            self._close.append(w.close)
            step = [0]

            def add():
                step[0] += 1
                for n, v in metrics.items():
                    w.add_scalar(n, v, step[0])
            return add

        def tb_native():
            from torch.utils.tensorboard import SummaryWriter
            return writer(SummaryWriter, "tb")

        def syncless_tb():
            from syncless.tensorboard import SummaryWriter
            return writer(SummaryWriter, "stb")
        self._add(f"tb_native@{k}", tb_native, None)
        self._add(f"syncless_tb@{k}", syncless_tb, None)

        def wandb(native: bool):
            if self._wandb is None:
                raise RuntimeError(self._wandb_error)
            if native:
                return lambda: self._wandb.log({n: v.item() for n, v in metrics.items()})
            from syncless import wandb as swb
            return lambda: swb.log(metrics)
        self._add(f"wandb_native@{k}", lambda: wandb(True), None)
        self._add(f"syncless_wandb@{k}", lambda: wandb(False), None)

    def _start_wandb(self) -> None:
        """One offline run for both wandb methods: syncless.wandb.init returns the real run (two
        inits would finish the first)."""
        if self.ctx.quick and not self.ctx.cuda:
            self._wandb_error = "skipped in --quick on CPU (wandb startup takes seconds)"
            return
        try:
            import wandb  # noqa: F401
            from syncless import wandb as swb
            os.environ.setdefault("WANDB_SILENT", "true")
            self._wandb = swb.init(project="syncless-bench", mode="offline", dir=self.tmp)
            self._close.append(swb.finish)
        except Exception as exc:
            self._wandb_error = f"wandb unavailable: {type(exc).__name__}: {exc}"

    def _timers(self) -> None:
        from syncless import _C, timer, timers
        clock = time.perf_counter

        def empty(make):
            def block():
                with make():
                    pass
            return block
        self._add("timer", lambda: empty(timer))
        self._add("timer_named", lambda: empty(lambda: timer("percall")))
        self._close.append(lambda: timers.reset("percall"))
        self._add("timer_cpu", lambda: empty(lambda: timer(device="cpu")))

        def two_clocks():
            t0 = clock()
            return clock() - t0
        self._add("clock", lambda: two_clocks)
        if not self.ctx.cuda:
            for name in ("event_pair", "event_pair_new", "raw_pair", "sync_clock"):
                self.errors[name] = "needs CUDA"
            return
        Event, dev = torch.cuda.Event, self.ctx.device.index

        def reused():
            start, end = Event(enable_timing=True), Event(enable_timing=True)
            return lambda: (start.record(), end.record())

        def new():
            start, end = Event(enable_timing=True), Event(enable_timing=True)
            start.record()
            end.record()

        def raw():
            pair = _C.EventPair(dev)                 # AttributeError where a build lacks it
            return lambda: (pair.start(), pair.stop())

        def sync_clock():
            torch.cuda.synchronize()
            t0 = clock()
            torch.cuda.synchronize()
            return clock() - t0
        self._add("event_pair", reused)
        self._add("event_pair_new", lambda: new)
        self._add("raw_pair", raw)
        self._add("sync_clock", lambda: sync_clock)

    def _watch(self) -> None:
        dev = self.ctx.device.type
        step = doctor_overhead.make_step("tiny", dev)
        for v in WATCH:
            try:
                doctor_overhead.run(v, step, 20, dev, {})        # warm-up: the event pool
                self.blocks[f"watch/{v}"] = (
                    lambda v=v: doctor_overhead.run(v, step, self.watch_steps, dev, {}) * 1e3)
            except Exception as exc:
                self.errors[f"watch/{v}"] = f"{type(exc).__name__}: {exc}"

    def warm(self) -> None:
        for name in list(self.blocks):
            try:
                self.blocks[name]()
            except Exception as exc:
                self.errors[name] = f"{type(exc).__name__}: {exc}"
                del self.blocks[name]
        # What exists now lives as long as the benchmark: out of the collector's sight, so the
        # gc.collect() before each watch() block costs milliseconds, not a heap walk.
        gc.collect()
        gc.freeze()

    def close(self) -> None:
        gc.unfreeze()
        for close in reversed(self._close):
            try:
                close()
            except Exception as exc:
                print(f"  ! close failed: {exc}", file=sys.stderr, flush=True)
        self._close = []


def summarize_samples(times: dict) -> dict:
    """Medians of each method, the cost watch() adds per step (paired with the bare loop of the
    same round), and the timer against a raw event pair."""
    out = {name: summarize(v) for name, v in times.items() if v}
    bare = times.get("watch/bare") or []
    for v in WATCH:
        if v != "bare" and times.get(f"watch/{v}") and bare:
            out[f"added/{v}"] = summarize(a - b for a, b in zip(times[f"watch/{v}"], bare))
    for name, base in (("timer", "event_pair"), ("timer", "raw_pair"),
                       ("timer_named", "event_pair")):
        if times.get(name) and times.get(base):
            out[f"{name}/{base}"] = ratio_summary(times, name, base)
    return out


def run(ctx: Ctx, rounds: int | None = None, ks: tuple | None = None) -> dict:
    """The whole table in this process (benchmarks.run's per_call section)."""
    rounds = rounds or (3 if ctx.quick else 10)
    ks = ks or ((1, 4) if ctx.quick and not ctx.cuda else KS)
    bench = Bench(ctx, ks)
    try:
        bench.warm()
        times = interleave(bench.blocks, rounds, random.Random(ctx.seed + 2), bench.errors)
    finally:
        bench.close()
    stats = summarize_samples(times)
    res = {"ks": list(ks), "methods": METHODS, "rounds": rounds, "results": {},
           "timers": {n: stats[n] for n in TIMERS if n in stats},
           "watch": {v: stats[f"watch/{v}"] for v in WATCH if f"watch/{v}" in stats},
           "added": {v: stats[f"added/{v}"] for v in WATCH if f"added/{v}" in stats},
           "ratios": {n: s for n, s in stats.items() if n.startswith("timer") and "/" in n},
           "errors": sorted({e for e in bench.errors.values()})}
    for k in ks:
        res["results"][str(k)] = {m: ({"us": stats[f"{m}@{k}"]} if f"{m}@{k}" in stats
                                      else {"error": bench.errors.get(f"{m}@{k}", "not run")})
                                  for m in METHODS}
    k = 4 if 4 in ks else ks[-1]
    print(f"  K={k}: " + ", ".join(f"{m} {r['us']['median']:.1f}µs"
                                   for m, r in res["results"][str(k)].items() if "us" in r),
          flush=True)
    return res


def markdown(res: dict) -> str:
    ks = res["ks"]
    rows = [[label] + [num_spread(res["results"][str(k)][m].get("us")) if
                       "us" in res["results"][str(k)][m] else "—" for k in ks]
            for m, label in METHODS.items()]
    text = (f"Host µs per logging call, median [IQR] over {res['rounds']} interleaved rounds "
            "(metric tensors already on the device):\n\n"
            + md_table(["method"] + [f"K={k}" for k in ks], rows) + "\n\n")
    rows = [[TIMERS[n], num_spread(s)] for n, s in res["timers"].items()]
    rows += [[f"{WATCH[v]}: µs/step", num_spread(s)] for v, s in res["watch"].items()]
    rows += [[f"added by {WATCH[v]}: µs/step", num_spread(s)] for v, s in res["added"].items()]
    rows += [[f"ratio {a} / {b}", num_spread(s)]
             for (a, _, b), s in ((n.partition("/"), s) for n, s in res["ratios"].items())]
    text += ("Timer enter+exit (µs) and watch() per step:\n\n"
             + md_table(["measurement", "median [IQR]"], rows) + "\n")
    if res.get("errors"):
        text += "\nSkipped or failed: " + "; ".join(res["errors"]) + "\n"
    return text


def headline(res: dict) -> list[list[str]]:
    r4 = res["results"].get("4", {})
    rows = []
    for name, seed in (("syncless", "≤ 5 µs, 0 syncs (design bar)"),
                       ("tb_native", "342 µs, 4 syncs (H200)"),
                       ("torchmetrics", "795 µs, 8 syncs (H200)"),
                       ("ring_stack", "27 µs (H200)")):
        if "us" in r4.get(name, {}):
            rows.append([f"per call, K=4: {METHODS[name]}", seed, num_spread(r4[name]["us"]) + " µs"])
    if "timer/raw_pair" in res.get("ratios", {}):
        rows.append(["syncless.timer() / raw event pair", "target ≤ 2.5 µs vs ~1.5 µs",
                     num_spread(res["ratios"]["timer/raw_pair"]) + "×"])
    return rows


# ---- two builds in one run -----------------------------------------------------------------

def _worker(argv: list[str]) -> int:
    """`percall.py --worker TREE DEVICE QUICK KS CORES`: set up, say ready, then run passes."""
    tree, device, quick = argv[0], argv[1], argv[2] == "1"
    ks = tuple(int(k) for k in argv[3].split(","))
    if argv[4]:                          # before any thread starts: they inherit the set
        os.sched_setaffinity(0, {int(c) for c in argv[4].split(",")})
    wire = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)                                      # whatever else prints goes to stderr
    import syncless
    where = os.path.realpath(syncless.__file__)
    if not where.startswith(os.path.realpath(tree) + os.sep):
        wire.write(json.dumps({"error": f"imported syncless from {where}, not from {tree}"}) + "\n")
        return 1
    ctx = Ctx(pick_device(device), quick=quick)
    seed_all(0)
    bench = Bench(ctx, ks, peers=False)
    bench.warm()
    wire.write(json.dumps({"ready": sorted(bench.blocks), "errors": bench.errors,
                           "syncless": where, "cores": sorted(os.sched_getaffinity(0))}) + "\n")
    for line in sys.stdin:
        names = json.loads(line)
        if names is None:
            break
        out = {}
        for name in names:
            try:
                out[name] = bench.blocks[name]()
            except Exception as exc:
                out[name] = f"{type(exc).__name__}: {exc}"
        wire.write(json.dumps(out) + "\n")
    bench.close()
    return 0


class Worker:
    def __init__(self, tree: str, device: str, quick: bool, ks: tuple, cores: str):
        env = dict(os.environ, NCCL_NVLS_ENABLE="0", WANDB_SILENT="true",
                   PYTHONPATH=os.pathsep.join([os.path.join(tree, "python"), ROOT]))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.percall", "--worker", tree, device,
             "1" if quick else "0", ",".join(map(str, ks)), cores], cwd=ROOT, env=env, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker exited with {self.proc.wait()} (its stderr is above)")
        msg = json.loads(line)
        if "error" in msg:
            raise RuntimeError(msg["error"])
        return msg

    def ask(self, names: list[str]) -> dict:
        self.proc.stdin.write(json.dumps(names) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("null\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def compare(trees: dict, device: str, quick: bool, ks: tuple, rounds: int, epochs: int,
            rng: random.Random, cores: str = "") -> dict:
    """Interleaved rounds of the same methods on two builds; see the module docstring."""
    labels = list(trees)
    times = {t: {} for t in labels}
    errors: dict = {}
    epochs = max(1, min(epochs, rounds))
    done = 0
    for epoch in range(epochs):
        workers = {t: Worker(trees[t], device, quick, ks, cores) for t in labels}   # start in parallel
        try:
            ready = {t: w.read() for t, w in workers.items()}
            for t, msg in ready.items():
                for name, e in msg["errors"].items():
                    errors.setdefault(name, {})[t] = e
            names = sorted(set(ready[labels[0]]["ready"]) & set(ready[labels[1]]["ready"]))
            n = (rounds - done) // (epochs - epoch)
            print(f"  epoch {epoch + 1}/{epochs}: {n} rounds × {len(names)} methods × 2 builds",
                  flush=True)
            for r in range(done, done + n):
                order = names[:]
                rng.shuffle(order)
                for t in (labels if r % 2 == 0 else labels[::-1]):
                    for name, v in workers[t].ask(order).items():
                        if isinstance(v, str):           # dropped from here on, for both
                            errors.setdefault(name, {})[t] = v
                            names = [x for x in names if x != name]
                        else:
                            times[t].setdefault(name, []).append(v)
            done += n
        finally:
            for w in workers.values():
                w.close()
    return {"times": times, "errors": errors, "rounds": done, "epochs": epochs, "device": device,
            "cores": cores,
            "syncless": {t: ready[t]["syncless"] for t in labels},
            "worker_cores": {t: ready[t]["cores"] for t in labels}}


def ab_rows(ab: dict, base: str = "baseline", cur: str = "current") -> dict:
    """Per measurement: both builds' medians and the per-round ratio current/baseline."""
    st = {t: summarize_samples(ab["times"][t]) for t in (base, cur)}
    added = {t: {n[6:]: [a - b for a, b in zip(ab["times"][t][n], ab["times"][t]["watch/bare"])]
                 for n in ab["times"][t] if n.startswith("watch/") and n != "watch/bare"
                 and "watch/bare" in ab["times"][t]} for t in (base, cur)}
    rows = {}
    for name in st[cur]:
        if name not in st[base] or "/" in name and not name.startswith(("watch/", "added/")):
            continue
        if name.startswith("added/"):
            v = name[6:]
            pair = {base: added[base].get(v, []), cur: added[cur].get(v, [])}
        else:
            pair = {base: ab["times"][base][name], cur: ab["times"][cur][name]}
        rows[name] = {"baseline": st[base][name], "current": st[cur][name],
                      "ratio": ratio_summary(pair, cur, base),
                      "published": PUBLISHED.get(name.replace("added/", "watch/"))
                      if ab.get("device", "").startswith("cuda") else None}
    for name in ("timer/event_pair", "timer/raw_pair"):
        if name in st[cur] and name in st[base]:
            rows[name] = {"baseline": st[base][name], "current": st[cur][name]}
    return rows


def ab_markdown(res: dict) -> str:
    ab = res["ab"]
    ks = sorted({int(n.split("@")[1]) for n in ab["rows"] if "@" in n})
    order = ([f"syncless@{k}" for k in ks] + ["timer", "timer_named", "timer_cpu", "raw_pair"]
             + [f"added/{v}" for v in WATCH if v != "bare"] + ["timer/event_pair",
                                                               "timer/raw_pair"]
             + [f"floor@{k}" for k in ks] + [c for c in CONTROLS if not c.startswith("floor")])
    rows = []
    for name in order:
        r = ab["rows"].get(name)
        if r is None:
            continue
        if name.startswith("added/"):
            what = f"added by {WATCH[name[6:]]}, µs/step"
        elif "/" in name and not name.startswith("watch/"):
            a, _, b = name.partition("/")
            what = f"ratio {TIMERS[a]} / {TIMERS[b]}"
        else:
            what = label(name) + (" (control)" if name in CONTROLS or name.startswith("floor")
                                  else "")
        ratio = r.get("ratio")
        ci = ratio.get("ci95") if ratio else None
        rows.append([what, num(r.get("published")), num_spread(r["baseline"]),
                     num_spread(r["current"]), num(ratio["median"]) if ratio else "—",
                     f"[{num(ci[0])}, {num(ci[1])}]" if ci else "—"])
    b, c = ab["trees"]["baseline"], ab["trees"]["current"]
    text = (f"**Two builds in one run**: baseline `{b['label']}` ({b['dir']}) against current "
            f"`{c['label']}`, {ab['rounds']} interleaved rounds in {ab['epochs']} pairs of "
            f"worker processes, both on cores {ab.get('cores') or 'unpinned'}. µs per call (per step for watch()), median [IQR]; current/"
            "baseline is the median per-round ratio with its 95% CI. Published: the README's "
            "numbers of 2026-11-30 (another run).\n\n"
            + md_table(["measurement", "published", f"baseline {b['label']}",
                        f"current {c['label']}", "current / baseline", "95% CI"], rows) + "\n")
    if ab["errors"]:
        text += "\nNot compared: " + "; ".join(
            f"{n} ({', '.join(f'{t}: {m}' for t, m in e.items())})"
            for n, e in sorted(ab["errors"].items())) + "\n"
    return text


def _cores(spec: str) -> str:
    if spec == "all":
        return ""
    if "," in spec:
        return spec
    mine = sorted(os.sched_getaffinity(0))
    return ",".join(map(str, mine[:max(1, int(spec))]))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return _worker(argv[1:])
    p = arg_parser(__doc__, rounds=42)
    p.add_argument("--baseline", help="another checkout of syncless, built in place")
    p.add_argument("--baseline-label", help="what to call it (default: the folder's name)")
    p.add_argument("--current-label", default="this tree")
    p.add_argument("--epochs", type=int, default=None,
                   help="pairs of worker processes over the A/B rounds (default 3; 1 in --quick)")
    p.add_argument("--table-rounds", type=int, default=None,
                   help="rounds of the full method table in this process (default 10; 3 quick; "
                        "0: no table)")
    p.add_argument("--ks", default=None, help="comma-separated K values (default 1,4,16,64)")
    p.add_argument("--cores", default="4",
                   help="both workers run on the same N cores (the first N this process may "
                        "use; default 4), or on the cores listed (e.g. 0,1); 'all': unpinned")
    p.add_argument("--name", default="percall", help="results file stem (default percall)")
    a = p.parse_args(argv)
    device = pick_device(a.device)
    ks = tuple(int(k) for k in a.ks.split(",")) if a.ks else None
    os.environ.setdefault("WANDB_SILENT", "true")
    seed_all(a.seed)
    ctx = Ctx(device, quick=a.quick, seed=a.seed)
    res = {"env": env_info(device, argv, "benchmarks.percall"), "quick": a.quick}
    t0 = time.perf_counter()
    if a.baseline:
        base = os.path.abspath(a.baseline)
        if not os.path.isdir(os.path.join(base, "python", "syncless")):
            p.error(f"--baseline {a.baseline}: no python/syncless in it (a checkout, built in place)")
        trees = {"baseline": base, "current": ROOT}
        try:
            ab = compare(trees, str(device), a.quick, ks or KS,
                         a.rounds or (10 if a.quick else 42), a.epochs or (1 if a.quick else 3),
                         random.Random(a.seed + 7), _cores(a.cores))
        except Exception as exc:                  # the table below still runs
            res["ab_error"] = f"{type(exc).__name__}: {exc}"
            print(f"  ! A/B failed: {res['ab_error']}", flush=True)
        else:
            ab["trees"] = {"baseline": {"dir": base, "label": a.baseline_label or
                                        os.path.basename(base.rstrip(os.sep))},
                           "current": {"dir": ROOT, "label": a.current_label}}
            ab["rows"] = ab_rows(ab)
            res["ab"] = ab
            write_results(a.out, a.name, res, ab_markdown(res), echo=False)  # if the table fails
        print(f"  A/B: {time.perf_counter() - t0:.1f} s", flush=True)
    if a.table_rounds != 0:
        res["per_call"] = run(ctx, a.table_rounds, ks)
    res["elapsed_s"] = time.perf_counter() - t0
    text = "\n".join(([ab_markdown(res)] if "ab" in res else [])
                     + ([markdown(res["per_call"])] if "per_call" in res else []))
    write_results(a.out, a.name, res, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
