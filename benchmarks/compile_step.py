"""log() inside a compiled training step: the custom op against no logging and a graph break.

    python benchmarks/compile_step.py [--quick] [--device cuda|cpu] [--sections S] [--variants V]
                                      [--turns N] [--rounds N] [--out [DIR]]

Sections, each an MLP's forward and loss compiled with torch.compile (mode="reduce-overhead"
on a GPU): an inference step (no_grad: the whole step is one CUDA graph) and a training step
(then loss.backward(), whose compiled graph is CUDA-graphed too, and a foreach SGD step). Seven
variants of the compiled forward, each with its own model copy and Logger:
  no log           the forward and loss alone: the floor
  no log, again    a second copy of the floor (its own model copy and compiled function):
                   its ratio to "no log" is the benchmark's own spread between two variants
                   that do the same work, the resolution below which no ratio here means much
  metrics returned the same plus the metrics (accuracy, logit scale) computed and returned as
                   outputs, not logged: what the metrics themselves cost
  log() inside     log(loss=, acc=, scale=, lr=) inside the compiled forward: the
                   syncless::log custom op, captured in the CUDA graph (0 graph breaks);
                   log.flush(wait=False) once per flush period (100 steps, --flush-every), since
                   replays do not flush: the rows reach the sink while the loop runs
  log() inside, delivery='caller'
                   the same with Logger(delivery="caller"): no delivery thread; the flush
                   delivers the previous period's rows (their copy has landed) on the loop's
                   own thread, so nothing competes with it for the GIL
  log(), delivered apart
                   the same op, but the block's rows are flushed and delivered after its clock
                   stopped (flush(), waiting): the op's own cost in the graph, without the
                   delivery. A diagnostic, not a way to use the logger
  graph break      the same log() wrapped in torch.compiler.disable: what a graph break
                   amounts to (the graph splits around an eager log() call, as before the op)
Interleaved rounds: each round runs one flush period (--flush-every steps) of every variant,
cut into --turns turns (default 4) that the variants take in turn (a shuffled order, reversed
every other turn), synchronising before and after each turn, with the garbage collector off
inside a round (collected between them: a collection landing in one variant's steps is noise,
not its cost). The H200's host switches between two speeds about every second; turns of a
quarter period put every variant under both alike, where a whole period per variant (--turns 1)
let one variant's block fall on the fast speed and another's on the slow. Every round of a
logging variant carries exactly one flush (mid-period) and its delivery, so --flush-every 1000
shows what the delivery costs per flush against per row. Medians over rounds, and per-round
ratios to "no log" and to "metrics returned" with the 95% confidence interval of their median.
Per variant also the training thread's CPU time per step and, for the loggers, the delivery
thread's CPU time per row (it shares the GIL with the training thread), all of it and the part
spent inside Delivery._decode (waiting for the copy, then making the rows). The host log()
calls of a variant (Logger.stats.steps) show whether the gather was replayed inside the CUDA
graph (a few calls: warm-up and recording) or ran on the host every step. Graph breaks are
counted by torch._dynamo.explain on a copy of each forward; the Dynamo guards that each call
runs before the graph are timed apart (µs per check). Each variant's forward has a code object
of its own (own_code): one compiled function, as in a user's script. Every logged row is
checked: steps 0..n-1 in order, none lost, and the last row's loss equal to the last step's.

Also the eager per-call cost: log.log(4 CUDA metrics) (the direct C call, with the compile hook
in front of it), the same row through the custom op called eagerly (the dispatcher's cost), and
the hook's check alone. --out writes compile_step.json and compile_step.md (default directory:
benchmarks/results).
"""
from __future__ import annotations

import argparse
import copy
import gc
import os
import random
import sys
import time
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from benchmarks._common import (env_info, md_table, median_ci, num, paired_ratios,  # noqa: E402
                                pct, pct_ci, summarize, write_json)

FLUSH_EVERY = 100
flush_every = FLUSH_EVERY                # --flush-every: the flush period of this run
DELIVERED_APART = "log(), delivered apart"
CALLER = "log() inside, delivery='caller'"
NO_LOG_AGAIN = "no log, again"
NAMES = ["no log", NO_LOG_AGAIN, "metrics returned", "log() inside", CALLER, DELIVERED_APART,
         "graph break"]
KEYS = dict(zip(("nolog", "again", "returned", "inside", "caller", "apart", "break"), NAMES))
names = NAMES                             # --variants: the variants of this run ("no log" first)
LOGGING = ("log() inside", CALLER, DELIVERED_APART, "graph break")
FLUSHED = ("log() inside", CALLER)        # flush(wait=False) mid-period, delivered in the loop

SECTION_TITLES = {"train": "training step: compiled forward+loss, eager backward (its compiled "
                           "graph) and foreach SGD",
                  "infer": "inference step (no_grad): the whole compiled step, one CUDA graph"}


class Rows:
    """A sink that keeps (step, loss) only: the check, without I/O in the timed loop."""

    def __init__(self):
        self.steps = []
        self.last = None

    def write(self, rows):
        self.steps.extend(r.step for r in rows)
        self.last = rows[-1]


def make_model(device, width, depth):
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    layers.append(torch.nn.Linear(width, 10))
    return torch.nn.Sequential(*layers).to(device)


def make_forward(model, log, name):
    """The function torch.compile sees: forward + loss, with log() as the variant says."""
    eager_log = torch.compiler.disable(lambda **kw: log(**kw))
    how = "no log" if name == NO_LOG_AGAIN else name

    def forward(x, y):
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits, y)
        if how == "no log":
            return loss
        acc = (logits.argmax(1) == y).float().mean()
        scale = logits.abs().mean()
        if how == "metrics returned":
            return loss, acc, scale
        (eager_log if how == "graph break" else log)(loss=loss, acc=acc, scale=scale, lr=0.01)
        return loss

    return own_code(forward, name)


def own_code(fn, name):
    """fn with a code object of its own. Dynamo keeps its compiled graphs per code object and,
    since parameters are graph inputs, guards on a module's structure, not its identity: the
    closures of one function, compiled apart, would share one cache (walked at each call) and
    the two no-log copies one graph, whose cudagraph tree then holds one root per copy, tried
    in order at every call (measured: the second copy +4% on the inference step, the A/A bias
    of compile_step-aa.md). A user's step is one compiled function; so is each variant here."""
    tag = "".join(c if c.isalnum() else "_" for c in name)
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{tag}",
                               co_qualname=f"{fn.__qualname__}_{tag}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__,
                              fn.__closure__)


def graph_breaks(model, how, x, y):
    import syncless
    with syncless.Logger() as log:
        explanation = torch._dynamo.explain(make_forward(copy.deepcopy(model), log, how))(x, y)
    torch._dynamo.reset()
    # break_reasons, not graph_break_count: a break with no op after it adds no graph, and
    # graph_break_count counts graphs beyond the first.
    return len(explanation.break_reasons), explanation.graph_count


class Variant:
    def __init__(self, name, base, device, mode, train):
        import syncless
        self.name = name
        self.train = train
        self.model = copy.deepcopy(base)
        if not train:
            self.model.requires_grad_(False)
        self.sink = Rows()
        self.log = None
        if name in LOGGING:
            self.log = syncless.Logger(every=flush_every, sinks=self.sink,
                                       capacity=4 * flush_every,
                                       delivery="caller" if name == CALLER else "thread")
        self.decode_cpu = 0.0                  # delivery thread CPU inside _decode (wait + rows)
        if self.log is not None:
            delivery, inner = self.log._delivery, self.log._delivery._decode

            def timed(*job):
                c0 = time.thread_time()
                try:
                    return inner(*job)
                finally:
                    self.decode_cpu += time.thread_time() - c0
            delivery._decode = timed
        self.fn = torch.compile(make_forward(self.model, self.log, name), mode=mode)
        self.params = [p for p in self.model.parameters()]
        self.steps = 0
        self.last_loss = None
        self.flush_s = []

    def sink_rows(self):
        return len(self.sink.steps)

    def step(self, x, y, flush=False):
        torch.compiler.cudagraph_mark_step_begin()
        if self.train:
            loss = self.fn(x, y)
            if isinstance(loss, tuple):
                loss = loss[0]
            loss.backward()
            with torch.no_grad():
                grads = [p.grad for p in self.params]
                torch._foreach_add_(self.params, grads, alpha=-0.01)
                for p in self.params:
                    p.grad = None
        else:
            with torch.no_grad():
                loss = self.fn(x, y)
            if isinstance(loss, tuple):
                loss = loss[0]
        self.steps += 1
        if flush and self.name in FLUSHED:
            t0 = time.perf_counter()
            self.log.flush(wait=False)                   # enqueues one copy; never waits
            self.flush_s.append(time.perf_counter() - t0)
        return loss

    def delivery_cpu(self):
        """CPU seconds the Logger's delivery thread used so far (0 before it started)."""
        thread = getattr(self.log._handover, "thread", None) if self.log is not None else None
        if thread is None or not hasattr(time, "pthread_getcpuclockid"):
            return 0.0
        try:
            return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
        except OSError:
            return 0.0


def block(variant, batches, sync, flush=True, last=True):
    """Seconds (wall) and the training thread's CPU seconds over one turn of steps, between two
    synchronizes; `flush`: the logging variants flush mid-turn; `last`: the flush period ends
    here (the variant delivered apart delivers, after the clock)."""
    mid = len(batches) // 2
    sync()
    c0 = time.thread_time()
    t0 = time.perf_counter()
    loss = None
    for i, (x, y) in enumerate(batches):
        loss = variant.step(x, y, flush=flush and i == mid)
    sync()
    t1 = time.perf_counter()
    c1 = time.thread_time()
    variant.last_loss = float(loss.detach())   # now: a later replay may overwrite the output
    if last and variant.name == DELIVERED_APART:
        variant.log.flush()                              # after the clock: delivered apart
    return t1 - t0, c1 - c0


def period(variants, order, batches, sync, turns):
    """One flush period of every variant (FLUSH_EVERY steps each), interleaved in `turns` turns
    so that a change of the host's speed (the H200's host switches between two speeds about
    every second) falls on every variant alike: µs per step and CPU µs per step per variant.
    The garbage collector is collected before and off inside a period."""
    n = len(batches)
    cut = [n * k // turns for k in range(turns + 1)]
    wall = dict.fromkeys(order, 0.0)
    cpu = dict.fromkeys(order, 0.0)
    gc.collect()
    gc.disable()
    try:
        for k in range(turns):
            for name in (order if k % 2 == 0 else order[::-1]):
                w, c = block(variants[name], batches[cut[k]:cut[k + 1]], sync,
                             flush=k == turns // 2, last=k == turns - 1)
                wall[name] += w
                cpu[name] += c
    finally:
        gc.enable()
    return ({name: t / n * 1e6 for name, t in wall.items()},
            {name: t / n * 1e6 for name, t in cpu.items()})


def guard_us(variant, x, y, calls=2000, repeats=7):
    """µs per check of the Dynamo guards that every call of the variant's compiled forward
    runs before its graph (private API: None where it is not there)."""
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
        fn = variant.fn._torchdynamo_orig_callable
        entries = _debug_get_cache_entry_list(fn.__code__)
        frame = {"x": x, "y": y, **{n: c.cell_contents for n, c in
                                    zip(fn.__code__.co_freevars, fn.__closure__ or ())}}
        with torch.set_grad_enabled(variant.train):
            check = entries[0].guard_manager.check
            if not check(frame):
                return None
            best = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                for _ in range(calls):
                    check(frame)
                best.append((time.perf_counter() - t0) / calls * 1e6)
        return min(best)
    except Exception:                                    # private API: report, do not fail
        return None


def tree_state(device):
    """cudagraph trees' own counters: graphs recorded, warm-up runs, slow-path falls."""
    if device.type != "cuda":
        return None
    try:
        from torch._inductor import cudagraph_trees
        manager = cudagraph_trees.get_container(device.index or 0).tree_manager
    except Exception as exc:                             # private API: report, do not fail
        return {"error": f"{type(exc).__name__}: {exc}"}
    if manager is None:
        return {"manager": None}

    def nxt(counter):                                    # itertools.count's next value
        return int(repr(counter)[6:-1].split(",")[0])
    return {"recorded": nxt(manager.graph_counter),
            "warmups": -1 - nxt(manager.warmup_node_counter),
            "fast_path_fails": getattr(manager, "debug_fail_counter", None),
            "checkpoints": getattr(manager, "debug_checkpointing_counter", None),
            # roots per compiled function: more than one is tried in order at every call
            "most_roots_per_function": max((len(r) for r in manager.roots.values()),
                                           default=0)}


def section(kind, base, batches, device, mode, rounds, sync, train, turns):
    """One interleaved comparison of the variants: a round is one flush period of each, in
    `turns` interleaved turns."""
    from torch._dynamo.utils import counters
    with torch.set_grad_enabled(train):
        breaks = {name: graph_breaks(base, name, *batches[0]) for name in names}
    for name, (b, g) in breaks.items():
        print(f"  [{kind}] {name}: {b} graph breaks, {g} graphs", flush=True)
    variants = {name: Variant(name, base, device, mode, train) for name in names}
    skips = {}
    for name, v in variants.items():                     # compile, warm up, record the graphs
        before = counters["inductor"]["cudagraph_skips"]
        block(v, batches[:3], sync)
        skips[name] = counters["inductor"]["cudagraph_skips"] - before
        if v.log is not None:
            v.log.flush()                                # rows of the warm-up: not timed
    guards = {name: guard_us(v, *batches[0]) for name, v in variants.items()}
    trees_before = tree_state(device)
    rng = random.Random(0)
    per_step = {name: [] for name in names}
    cpu_step = {name: [] for name in names}
    delivery = {name: [variants[name].delivery_cpu(), variants[name].sink_rows(),
                       variants[name].decode_cpu] for name in names}
    for r in range(rounds):
        order = names[:]
        rng.shuffle(order)
        wall, cpu = period(variants, order, batches, sync, turns)
        for name in names:
            per_step[name].append(wall[name])
            cpu_step[name].append(cpu[name])
        if r == 0 or (r + 1) % 10 == 0:
            print(f"  [{kind}] round {r + 1}/{rounds}: " + ", ".join(
                f"{n} {per_step[n][-1]:.1f} µs" for n in names), flush=True)
    decode_cpu = {}
    for name in names:
        v = variants[name]
        if v.log is not None:
            v.log.flush()
        cpu0, rows0, dec0 = delivery[name]
        rows = v.sink_rows() - rows0
        threaded = v.log is not None and hasattr(v.log._handover, "thread")
        delivery[name] = (v.delivery_cpu() - cpu0) / rows * 1e6 if rows and threaded else None
        decode_cpu[name] = (v.decode_cpu - dec0) / rows * 1e6 if rows else None
    print(f"  [{kind}] delivery CPU µs per row, all (its thread's) / inside _decode (copy wait "
          "and rows): " + ", ".join(f"{n} {num(delivery[n])} / {num(decode_cpu[n])}"
                               for n in names if decode_cpu.get(n) is not None), flush=True)
    trees_after = tree_state(device)
    results = {"cudagraph_trees": {"after_warmup": trees_before, "after_rounds": trees_after}}
    for name in names:
        v = variants[name]
        s = summarize(per_step[name])
        ratios = paired_ratios(per_step, name, "no log")
        ci = median_ci(ratios)
        to_metrics = (paired_ratios(per_step, name, "metrics returned")
                      if "metrics returned" in names else [])
        ci_metrics = median_ci(to_metrics)
        r = results[name] = {"step_us": s, "ratio_to_no_log": summarize(ratios),
                             "ratio_ci95": list(ci) if ci else None,
                             "ratio_to_metrics": summarize(to_metrics),
                             "ratio_to_metrics_ci95": list(ci_metrics) if ci_metrics else None,
                             "cpu_us_per_step": summarize(cpu_step[name]),
                             "delivery_cpu_us_per_row": delivery[name],
                             "decode_cpu_us_per_row": decode_cpu.get(name),
                             "flush_call_us": summarize([t * 1e6 for t in v.flush_s])
                             if v.flush_s else None,
                             "graph_breaks": breaks[name][0], "graphs": breaks[name][1],
                             "guard_check_us": guards[name],
                             "cudagraph_skips": skips[name] if device.type == "cuda" else None}
        if v.log is not None:
            captured = v.log._gen is not None and v.log._gen.captured
            v.log.close()
            st = v.log.stats
            r["rows"] = {"delivered": len(v.sink.steps), "steps_taken": v.steps,
                         "host_calls": st.steps, "captured": captured,
                         "steps_exact": v.sink.steps == list(range(v.steps)), "lost": st.lost,
                         "last_loss_exact": v.sink.last is not None
                         and v.sink.last.values["loss"] == v.last_loss
                         and v.sink.last.values["lr"] == 0.01}
    if CALLER in names and "log() inside" in names:
        to_thread = paired_ratios(per_step, CALLER, "log() inside")
        ci_thread = median_ci(to_thread)
        results[CALLER]["ratio_to_thread"] = summarize(to_thread)
        results[CALLER]["ratio_to_thread_ci95"] = list(ci_thread) if ci_thread else None
    return results


def section_table(results, cuda):
    rows = []
    for name in names:
        r = results[name]
        c = r.get("rows")
        d = r.get("delivery_cpu_us_per_row")
        row = [name, num(r["step_us"]["median"]),
               "1" if name == "no log" else pct(r["ratio_to_no_log"]["median"], 2),
               "" if name == "no log" else pct_ci(r["ratio_ci95"]),
               "" if name in ("no log", NO_LOG_AGAIN, "metrics returned")
               or "metrics returned" not in names else
               f"{pct(r['ratio_to_metrics']['median'], 2)} {pct_ci(r['ratio_to_metrics_ci95'])}",
               num(r["cpu_us_per_step"]["median"]),
               "" if d is None else num(d),
               r["graph_breaks"], r["graphs"], num(r.get("guard_check_us"))]
        if cuda:
            row.append(r["cudagraph_skips"])
        row.append("" if c is None else
                   f"{c['delivered']}/{c['steps_taken']}, exact="
                   f"{c['steps_exact'] and c['last_loss_exact']}, lost={c['lost']}, "
                   f"host calls={c['host_calls']}")
        rows.append(row)
    return md_table(["variant", "µs per step (median)", "vs no log", "95% CI",
                     "vs metrics returned (95% CI)", "training thread CPU µs per step",
                     "delivery thread CPU µs per row", "graph breaks", "graphs",
                     "guard check µs per call (min)"]
                    + (["cudagraph skips"] if cuda else [])
                    + ["rows (delivered/steps, host log() calls)"], rows)


def eager_costs(device, calls, rounds):
    """µs per call: log.log(4 metrics) eagerly, the same through the custom op, the hook check."""
    import syncless
    from syncless import _compile

    values = [torch.full((), float(i), device=device) for i in range(4)]
    metrics = dict(zip(("loss", "acc", "scale", "gnorm"), values))
    log = syncless.Logger(every=1000, capacity=2000)
    log.log(metrics)
    site = _compile._site(id(log), tuple(metrics), tuple(str(v.device) for v in values))
    token = getattr(_compile._by_site, f"t{site}")
    op = torch.ops.syncless.log.default

    def direct():
        for _ in range(calls):
            log.log(metrics)

    def through_op():
        for _ in range(calls):
            op(token, values, [], site, None)

    def check():
        tracing = _compile.tracing
        for _ in range(calls):
            tracing()

    def empty():
        for _ in range(calls):
            pass

    fns = {"log.log() eager (C call)": direct, "custom op, called eagerly": through_op,
           "compile hook check": check, "empty loop": empty}
    out = {name: [] for name in fns}
    rng = random.Random(1)
    for _ in range(rounds):
        order = list(fns)
        rng.shuffle(order)
        for name in order:
            t0 = time.perf_counter()
            fns[name]()
            out[name].append((time.perf_counter() - t0) / calls * 1e6)
            log.flush()
    log.close()
    loop = summarize(out["empty loop"])["median"]
    res = {name: summarize([v - loop for v in vs]) for name, vs in out.items()
           if name != "empty loop"}
    return res


SECTIONS = {
    # kind: (title, train, width, depth, batch, rounds, steps per block)
    # Host-bound blocks vary by several percent from one to the next on the H200's host: many
    # rounds are cheap there (a block of the training step is 0.12 s) and narrow the CI.
    "infer": (SECTION_TITLES["infer"], False, 512, 4, 256, 60, FLUSH_EVERY),
    "train": (SECTION_TITLES["train"], True, 512, 4, 256, 60, FLUSH_EVERY),
    "train-gpu-bound": ("training step, GPU-bound (MLP 4×4096, batch 512): the GPU, not the "
                        "host, sets the pace, as in most real training", True, 4096, 4, 512, 8,
                        FLUSH_EVERY // 2),
    "train-default": ("training step as `train`, compiled in the default mode (no CUDA graphs): "
                      "the compiled code calls the op, and so the eager gather, on every step",
                      True, 512, 4, 256, 30, FLUSH_EVERY),
}
DEFAULT_MODE = {"train-default"}           # sections compiled without mode="reduce-overhead"


def write_out(out, env, args_used, sections, eager, verdict, tables, etable, mode):
    os.makedirs(out, exist_ok=True)
    write_json(os.path.join(out, "compile_step.json"),
               {"env": env, "sections": sections, "eager_us": eager, "verdict": verdict})
    with open(os.path.join(out, "compile_step.md"), "w", encoding="utf-8") as f:
        f.write(f"# log() inside torch.compile — {env.get('gpu')}, torch {env['torch']}, "
                f"{env['date']}\n\n"
                f"Compiled forward+loss (mode={mode!r} unless a section says otherwise); "
                f"interleaved rounds, each a block of "
                f"steps per variant (`{env['command']}`).\n\n"
                + "".join(f"## {SECTIONS[k][0]}\n\n{t}\n\n" for k, t in tables.items())
                + (f"## eager per-call cost\n\n{etable}\n\n" if etable else "")
                + "\n".join(f"- {v}" for v in verdict) + "\n")


def section_verdict(kind, res):
    """One line: each variant of the run against no logging, with the checks that matter."""
    def vs(name):
        r = res[name]
        return f"{pct(r['ratio_to_no_log']['median'], 2)}, 95% CI {pct_ci(r['ratio_ci95'])}"

    def exact(name):
        c = res[name]["rows"]
        return f"rows exact={c['steps_exact'] and c['last_loss_exact']}, lost={c['lost']}"

    parts = []
    if "log() inside" in res:
        inside = res["log() inside"]
        parts.append(f"log() inside {vs('log() inside')} vs no logging (target: within 1%), "
                     f"{inside['graph_breaks']} graph breaks, {inside['rows']['host_calls']} "
                     f"host log() calls for {inside['rows']['steps_taken']} rows, "
                     f"{exact('log() inside')}")
    if NO_LOG_AGAIN in res:
        parts.append(f"the floor against a second copy of itself {vs(NO_LOG_AGAIN)}")
    if CALLER in res:
        caller = res[CALLER]
        to_thread = (f" ({pct(caller['ratio_to_thread']['median'], 2)} vs the delivery "
                     f"thread, 95% CI {pct_ci(caller['ratio_to_thread_ci95'])})"
                     if "ratio_to_thread" in caller else "")
        parts.append(f"with delivery='caller' {vs(CALLER)}{to_thread}, {exact(CALLER)}")
    if "log() inside" in res and "metrics returned" in res:
        inside = res["log() inside"]
        parts.append(f"{pct(inside['ratio_to_metrics']['median'], 2)} vs the metrics computed "
                     f"and returned, 95% CI {pct_ci(inside['ratio_to_metrics_ci95'])}")
    if DELIVERED_APART in res:
        parts.append(f"the op without the rows' delivery {vs(DELIVERED_APART)}")
    if "log() inside" in res:
        parts.append(f"delivery thread {num(res['log() inside']['delivery_cpu_us_per_row'])} "
                     "µs CPU per row")
    if "graph break" in res:
        parts.append(f"graph-breaking log() {vs('graph break')}, "
                     f"{res['graph break']['graph_breaks']} graph break(s)")
    return f"{kind}: " + "; ".join(parts)


def main(argv=None):
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="few rounds, small models: a smoke test")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--rounds", type=int, default=None, help="rounds of every section")
    p.add_argument("--sections", default="infer,train,train-gpu-bound,train-default",
                   help="comma-separated: " + ", ".join(SECTIONS))
    p.add_argument("--turns", type=int, default=4,
                   help="turns a round's flush period of each variant is split into, interleaved "
                        "(default 4; 1: a block of the whole period per variant)")
    p.add_argument("--out", nargs="?", const=os.path.join(here, "results"),
                   help="directory for compile_step.json/.md (default benchmarks/results); "
                        "rewritten after every section")
    p.add_argument("--flush-every", type=int, default=FLUSH_EVERY,
                   help=f"steps per flush period (default {FLUSH_EVERY}): a round's block of "
                        "each variant, and how often the logging variants flush")
    p.add_argument("--variants", default=",".join(KEYS),
                   help="comma-separated, of " + ", ".join(f"{k} ({v})" for k, v in KEYS.items())
                        + "; no log always runs. Fewer variants put a turn of no log closer in "
                          "time to every other variant's")
    args = p.parse_args(argv)
    global flush_every, names
    flush_every = args.flush_every
    chosen = [k for k in args.variants.split(",") if k]
    for k in chosen:
        if k not in KEYS:
            p.error(f"unknown variant {k!r}; choose from {', '.join(KEYS)}")
    names = [n for n in NAMES if n == "no log" or n in {KEYS[k] for k in chosen}]
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    mode = "reduce-overhead" if cuda else None
    kinds = [k for k in args.sections.split(",") if k]
    for k in kinds:
        if k not in SECTIONS:
            p.error(f"unknown section {k!r}; choose from {', '.join(SECTIONS)}")
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    argv_used = sys.argv[1:] if argv is None else argv
    env = env_info(device, ["compile_step", *argv_used])
    env["command"] = " ".join(["python", "-m", "benchmarks.compile_step", *argv_used])
    env.update(mode=mode, flush_every=flush_every, sections_config={
        k: dict(zip(("title", "train", "width", "depth", "batch", "rounds", "steps"), v))
        for k, v in SECTIONS.items() if k in kinds})

    sections, tables, verdict = {}, {}, []
    for kind in kinds:
        _, train, width, depth, batch, rounds, steps = SECTIONS[kind]
        steps = steps * flush_every // FLUSH_EVERY
        if args.quick:
            width, depth, batch, rounds, steps = min(width, 64), 1, min(batch, 32), 4, 20
        rounds = args.rounds or rounds
        base = make_model(device, width, depth)
        gen = torch.Generator(device="cpu").manual_seed(1)
        batches = [(torch.randn(batch, width, generator=gen).to(device),
                    torch.randint(0, 10, (batch,), generator=gen).to(device))
                   for _ in range(steps)]
        res = section(kind, base, batches, device, None if kind in DEFAULT_MODE else mode,
                      rounds, sync, train, max(1, min(args.turns, steps)))
        res["config"] = {"width": width, "depth": depth, "batch": batch, "rounds": rounds,
                         "steps_per_block": steps, "turns": max(1, min(args.turns, steps))}
        sections[kind] = res
        torch._dynamo.reset()
        tables[kind] = section_table(res, cuda)
        verdict.append(section_verdict(kind, res))
        print(f"[{kind}]\n{tables[kind]}\n- {verdict[-1]}", flush=True)
        if args.out:
            write_out(args.out, env, argv_used, sections, None, verdict, tables, None, mode)

    eager = eager_costs(device, 2000 if not args.quick else 300, 15 if not args.quick else 4)
    etable = md_table(["eager call", "µs per call (median)", "p25–p75"],
                      [[k, num(v["median"]), f"{num(v['p25'])}–{num(v['p75'])}"]
                       for k, v in eager.items()])
    verdict.append(
        f"eager log.log() {num(eager['log.log() eager (C call)']['median'])} µs per call vs the "
        f"custom op called eagerly {num(eager['custom op, called eagerly']['median'])} µs; "
        f"the hook's check {num(eager['compile hook check']['median'] * 1e3)} ns")
    print(etable)
    print("\n".join(verdict))
    if args.out:
        write_out(args.out, env, argv_used, sections, eager, verdict, tables, etable, mode)
    return sections


if __name__ == "__main__":
    main()
