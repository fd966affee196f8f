"""Where does log() inside a reduce-overhead step spend its time? (diagnostics, GPU)

    python -m benchmarks.compile_diag [--device cuda|cpu] [--rounds N] [--out DIR]

Variants of one compiled MLP step (forward+loss; inference: no_grad, training: + backward and
SGD outside the compiled code), interleaved:
  no log            the floor
  metrics returned  the metrics computed and returned, not logged
  log() inside      log(loss, acc, scale, lr) inside; flush(wait=False) every 100 steps in the loop
  log(), flush out  the same, but the flush and its delivery happen between timed blocks
  noop op           an op registered as syncless::log (a mutated static token, 4 tensors)
                    that does nothing: the op's plumbing without the gather and without rows
Per variant: wall µs per step (synchronised blocks), host µs per step (the loop before the
final sync), GPU kernels and their time per step (torch.profiler), host API calls per step, and
a cProfile diff (functions whose call counts differ from "metrics returned").
"""
from __future__ import annotations

import argparse
import copy
import cProfile
import io
import json
import os
import pstats
import random
import time

import torch

from benchmarks._common import summarize, median_ci, paired_ratios  # noqa: E402
from benchmarks.compile_step import FLUSH_EVERY, Rows, make_model
from benchmarks.compile_step import make_forward as step_forward


def noop_op():
    """An op registered as syncless::log is (torch.library.Library, a CompositeExplicitAutograd
    kernel, SymInt site and step) whose kernel does nothing."""
    ns = getattr(torch.ops, "syncless_diag", None)
    if ns is None or not hasattr(ns, "noop"):
        lib = torch.library.Library("syncless_diag", "FRAGMENT")
        lib.define("noop(Tensor(a!) token, Tensor[] values, SymInt site, SymInt? step) -> ()")
        lib.impl("noop", lambda token, values, site, step: None, "CompositeExplicitAutograd")
        torch.library.register_fake("syncless_diag::noop", lambda token, values, site, step: None,
                                    lib=lib)
        _libraries.append(lib)
    return torch.ops.syncless_diag.noop.default


_libraries: list = []                    # a Library's registrations live as long as it does


def slug(name):
    return name.replace(" ", "_").replace("()", "").replace(",", "")


def make_forward(model, log, how, op, token):
    """compile_step's forward (its log() variants all log inside), or the no-op op's."""
    if how != "noop op":
        return step_forward(model, log, "log() inside" if how.startswith("log()") else how)

    def forward(x, y):
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits, y)
        acc = (logits.argmax(1) == y).float().mean()
        scale = logits.abs().mean()
        lr = torch.full((), 0.01, dtype=torch.float64, device=x.device)
        op(token, [loss, acc, scale, lr], 0, None)
        return loss
    return forward


class Variant:
    def __init__(self, name, base, device, mode, train, op, token):
        import syncless
        self.name = name
        self.train = train
        self.model = copy.deepcopy(base)
        if not train:
            self.model.requires_grad_(False)
        self.sink = Rows()
        self.log = None
        if name.startswith("log()"):
            self.log = syncless.Logger(every=FLUSH_EVERY, sinks=self.sink,
                                       capacity=4 * FLUSH_EVERY)
        self.fn = torch.compile(make_forward(self.model, self.log, name, op, token), mode=mode)
        self.params = list(self.model.parameters())
        self.steps = 0

    def step(self, x, y):
        torch.compiler.cudagraph_mark_step_begin()
        if self.train:
            loss = self.fn(x, y)
            if isinstance(loss, tuple):
                loss = loss[0]
            loss.backward()
            with torch.no_grad():
                torch._foreach_add_(self.params, [p.grad for p in self.params], alpha=-0.01)
                for p in self.params:
                    p.grad = None
        else:
            with torch.no_grad():
                loss = self.fn(x, y)
        self.steps += 1
        if self.name == "log() inside" and self.steps % FLUSH_EVERY == 0:
            self.log.flush(wait=False)
        return loss

    def between(self):
        if self.name == "log(), flush out":
            self.log.flush()


def block(v, batches, sync):
    sync()
    t0 = time.perf_counter()
    for x, y in batches:
        v.step(x, y)
    t1 = time.perf_counter()
    sync()
    t2 = time.perf_counter()
    v.between()
    n = len(batches)
    return (t2 - t0) / n * 1e6, (t1 - t0) / n * 1e6


def profile_kernels(v, batches, sync, n):
    from torch.profiler import ProfilerActivity, profile
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for x, y in batches[:n]:
            v.step(x, y)
        sync()
    kernels, kernel_us, api = 0, 0.0, {}
    for e in prof.events():
        dev = getattr(e, "device_type", None)
        if dev is not None and dev.name == "CUDA" or getattr(e, "is_kernel", False):
            kernels += 1
            kernel_us += (e.device_time_total if hasattr(e, "device_time_total")
                          else e.cuda_time_total)
        elif e.name.startswith("cuda") or e.name.startswith("cu"):
            api[e.name] = api.get(e.name, 0) + 1
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    return {"gpu_events_per_step": kernels / n, "gpu_us_per_step": kernel_us / n,
            "api_per_step": {k: c / n for k, c in sorted(api.items())}}, table


def cprofile_counts(v, batches, n):
    pr = cProfile.Profile()
    pr.enable()
    for i in range(n):
        x, y = batches[i % len(batches)]
        v.step(x, y)
    pr.disable()
    st = pstats.Stats(pr)
    counts = {}
    for (fname, line, func), (cc, nc, tt, ct, callers) in st.stats.items():
        key = f"{os.path.basename(fname)}:{line}:{func}"
        counts[key] = (nc / n, tt / n * 1e6)
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
    return counts, s.getvalue()


def tree_nodes(device):
    try:
        from torch._inductor import cudagraph_trees
        m = cudagraph_trees.get_container(device.index or 0).tree_manager
        out = []
        for fid, nodes in m.roots.items():
            stack = list(nodes)
            while stack:
                node = stack.pop()
                out.append({
                    "fn": str(fid),
                    "inputs": len(getattr(node, "static_input_data_ptrs", [])),
                    "static_input_idxs": list(node.static_input_idxs),
                    "outputs": len(node.outputs_metadata),
                    "non_managed_static": list(getattr(node, "non_managed_static_input_idxs",
                                                       []))})
                for kids in node.children.values():
                    stack.extend(kids)
        return out
    except Exception as exc:
        return [f"{type(exc).__name__}: {exc}"]


def section(kind, base, batches, device, mode, rounds, sync, names, op, token, out, prof):
    train = kind == "train"
    variants = {}
    for name in names:
        with torch.set_grad_enabled(train):
            t0 = time.perf_counter()
            variants[name] = Variant(name, base, device, mode, train, op, token)
            block(variants[name], batches[:3], sync)
        print(f"  [{kind}] {name}: compiled in {time.perf_counter() - t0:.1f} s", flush=True)
    rng = random.Random(0)
    wall = {n: [] for n in names}
    host = {n: [] for n in names}
    for r in range(rounds):
        order = names[:]
        rng.shuffle(order)
        for name in order:
            w, h = block(variants[name], batches, sync)
            wall[name].append(w)
            host[name].append(h)
    res = {}
    for name in names:
        ratios = paired_ratios(wall, name, names[0])
        rm = paired_ratios(wall, name, "metrics returned") if "metrics returned" in names else []
        res[name] = {"wall_us": summarize(wall[name])["median"],
                     "host_us": summarize(host[name])["median"],
                     "vs_no_log": summarize(ratios)["median"], "ci": median_ci(ratios),
                     "vs_metrics": summarize(rm)["median"] if rm else None}
        vm = "" if not rm else f"{100 * (res[name]['vs_metrics'] - 1):+.2f}%"
        print(f"  [{kind}] {name:18s} wall {res[name]['wall_us']:8.1f} us  host "
              f"{res[name]['host_us']:8.1f} us  vs no log "
              f"{100 * (res[name]['vs_no_log'] - 1):+.2f}% "
              f"CI {res[name]['ci']}  vs metrics {vm}", flush=True)
    if prof:
        for name in names:
            try:
                k, table = profile_kernels(variants[name], batches, sync, 20)
                res[name]["profile"] = k
                print(f"  [{kind}] {name}: {json.dumps(k)}", flush=True)
                with open(os.path.join(out, f"prof_{kind}_{slug(name)}.txt"), "w") as f:
                    f.write(table)
            except Exception as exc:
                print(f"  profile {name} failed: {exc!r}", flush=True)
        counts = {}
        for name in names:
            c, text = cprofile_counts(variants[name], batches, 200)
            counts[name] = c
            with open(os.path.join(out, f"cprof_{kind}_{slug(name)}.txt"), "w") as f:
                f.write(text)
        ref = counts.get("metrics returned", {})
        for name in names:
            if name == "metrics returned":
                continue
            diff = []
            for key, (nc, tt) in counts[name].items():
                base_nc, base_tt = ref.get(key, (0.0, 0.0))
                if abs(nc - base_nc) > 0.01 or tt - base_tt > 0.3:
                    diff.append((tt - base_tt, key, nc, base_nc, tt, base_tt))
            diff.sort(reverse=True)
            lines = [f"{d:+8.2f} us/step  {key}  calls/step {nc:.2f} vs {bnc:.2f}  "
                     f"tottime {tt:.2f} vs {btt:.2f}"
                     for d, key, nc, bnc, tt, btt in diff[:40]]
            res[name]["cprofile_diff"] = lines
            print(f"  [{kind}] cProfile diff {name} vs metrics returned:\n    "
                  + "\n    ".join(lines[:25]), flush=True)
    res["tree_nodes"] = tree_nodes(device)
    print(f"  [{kind}] tree nodes: {res['tree_nodes']}", flush=True)
    for v in variants.values():
        if v.log is not None:
            v.log.close()
            st = v.log.stats
            res[v.name]["rows"] = {"delivered": len(v.sink.steps), "steps": v.steps,
                                   "exact": v.sink.steps == list(range(v.steps)),
                                   "lost": st.lost, "host_calls": st.steps}
            print(f"  [{kind}] {v.name} rows: {res[v.name]['rows']}", flush=True)
    return res


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--sections", default="infer,train")
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--out", default=os.environ.get("RESULTS", "/tmp/compile_diag"))
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    mode = "reduce-overhead" if cuda else None
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    for key in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, key):
            setattr(torch._dynamo.config, key, 64)
    op = noop_op()
    token = torch.zeros(1, dtype=torch.uint8, device=device)
    torch._dynamo.mark_static_address(token, guard=True)
    base = make_model(device, 512, 4)
    gen = torch.Generator(device="cpu").manual_seed(1)
    batches = [(torch.randn(256, 512, generator=gen).to(device),
                torch.randint(0, 10, (256,), generator=gen).to(device))
               for _ in range(args.steps)]
    results = {}
    all_names = ["no log", "metrics returned", "log() inside", "log(), flush out", "noop op"]
    for kind in args.sections.split(","):
        names = all_names if kind == "infer" else ["no log", "metrics returned", "log() inside",
                                                   "noop op"]
        results[kind] = section(kind, base, batches, device, mode, args.rounds, sync, names, op,
                                token, args.out, not args.no_profile)
        torch._dynamo.reset()
        with open(os.path.join(args.out, "compile_diag.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
