"""When, inside a flush period, log() in a compiled step costs its time (CUDA only).

    python -m benchmarks.flush_profile [--section infer|train] [--rounds N] [--out [DIR]]

compile_step.py measures what log() inside a reduce-overhead step costs per period; this says
where in the period it falls. Four of compile_step's variants (the same models, steps and
Logger): "no log", "log() inside" (flush(wait=False) at step 50 of every 100, its rows
delivered by the logger's thread while the loop runs), the same with delivery='caller' (that
flush delivers the previous period's rows on the loop's thread) and "log(), delivered apart"
(the same op, its rows flushed and delivered after the clock). Each round runs one period of each, in a
shuffled order, the garbage collector off; every step's end is stamped with perf_counter (no
synchronize: on a host-bound step the host's pace is the step's). Per variant and per stretch of
the period (the steps before the flush, the flush's own step, the steps after it), the median
over rounds of the stretch's time, and the differences to "no log" (median of the per-round
differences, 95% CI). A cost spread evenly over the steps is the op's; one at the flush's step
is the flush call; one in the steps after it is the delivery, whose thread shares the GIL.
"""
from __future__ import annotations

import argparse
import collections
import gc
import os
import random
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from benchmarks import compile_step as cs  # noqa: E402
from benchmarks._common import env_info, md_table, median_ci, num, write_json  # noqa: E402


def med(xs):
    """{median, lo, hi}: the median and its 95% confidence interval (None: too few values)."""
    ci = median_ci(xs) or (None, None)
    return {"median": statistics.median(xs), "lo": ci[0], "hi": ci[1]}

PERIOD = cs.FLUSH_EVERY
FLUSH_AT = PERIOD // 2
# [start, end) steps of the period; the flush runs at the end of step FLUSH_AT
STRETCHES = [("steps 0-49 (before the flush)", 0, FLUSH_AT),
             ("step 50 (the flush call)", FLUSH_AT, FLUSH_AT + 1),
             ("steps 51-52", FLUSH_AT + 1, FLUSH_AT + 3),
             ("steps 53-57", FLUSH_AT + 3, FLUSH_AT + 8),
             ("steps 58-69", FLUSH_AT + 8, FLUSH_AT + 20),
             ("steps 70-99", FLUSH_AT + 20, PERIOD)]
NAMES = ["no log", "log() inside", cs.CALLER, cs.DELIVERED_APART]


def time_pieces(log):
    """Wrap the calls log.flush(wait=False) makes in timers: {piece: [ns, ...]}. The rest of
    the call (torch.cuda.device's context, attribute work) is the whole less these."""
    spent = collections.defaultdict(list)

    def wrap(owner, name, label):
        fn = getattr(owner, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[label].append(time.perf_counter_ns() - t0)
        setattr(owner, name, timed)

    class Ring:                                  # the C ring's methods, timed where flush calls
        def __init__(self, ring):
            self._ring = ring

        def __getattr__(self, name):
            return getattr(self._ring, name)
    cuda = log._gen is not None
    if cuda:
        log._gen.ring = Ring(log._gen.ring)
    for owner, name, label in [(log._handover.pool, "wait", "Pool.wait"),
                               (log._handover.pool, "reuse", "Pool.reuse"),
                               *([(log._gen.ring, "capturing", "ring.capturing()"),
                                  (log._gen.ring, "copy_to", "ring.copy_to (copy + event)")]
                                 if cuda else []),
                               (log._handover, "_submit", "Handover._submit (queue put)"),
                               (log, "flush", "flush(wait=False), whole")]:
        wrap(owner, name, label)
    return spent


def run_period(v, batches, sync):
    """One period of variant v: the end time of every step (perf_counter ns), from a synced
    start."""
    stamps = [0] * (len(batches) + 1)
    sync()
    stamps[0] = time.perf_counter_ns()
    for i, (x, y) in enumerate(batches):
        v.step(x, y, flush=i == FLUSH_AT)
        stamps[i + 1] = time.perf_counter_ns()
    sync()
    if v.name == cs.DELIVERED_APART:
        v.log.flush()                                    # after the clock
    return [(b - a) / 1e3 for a, b in zip(stamps, stamps[1:])]


def main(argv=None):
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--section", default="infer", choices=["infer", "train"])
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--out", nargs="?", const=os.path.join(here, "results"))
    p.add_argument("--pieces", action="store_true",
                   help="also time the calls inside log.flush(wait=False), in the loop")
    p.add_argument("--smoke", action="store_true",
                   help="without CUDA: the default compile mode on the CPU, tiny model")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        sys.exit("flush_profile needs CUDA (reduce-overhead's CUDA graphs); --smoke runs it "
                 "on the CPU")
    device = torch.device("cuda" if cuda else "cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    mode = "reduce-overhead" if cuda else None
    _, train, width, depth, batch, _, _ = cs.SECTIONS[args.section]
    if not cuda:
        width, depth, batch = 32, 1, 8
    base = cs.make_model(device, width, depth)
    gen = torch.Generator(device="cpu").manual_seed(1)
    batches = [(torch.randn(batch, width, generator=gen).to(device),
                torch.randint(0, 10, (batch,), generator=gen).to(device))
               for _ in range(PERIOD)]
    with torch.set_grad_enabled(train):
        variants = {n: cs.Variant(n, base, device, mode, train) for n in NAMES}
        for v in variants.values():                      # compile, warm up, record the graphs
            run_period(v, batches[:3], sync)
            if v.log is not None:
                v.log.flush()
        pieces = time_pieces(variants["log() inside"].log) if args.pieces else None
        per = {n: [] for n in NAMES}                     # per round: µs per step
        rng = random.Random(0)
        for r in range(args.rounds):
            order = NAMES[:]
            rng.shuffle(order)
            gc.collect()
            gc.disable()
            try:
                for n in order:
                    per[n].append(run_period(variants[n], batches, sync))
            finally:
                gc.enable()
            if (r + 1) % 50 == 0:
                print(f"  round {r + 1}/{args.rounds}", flush=True)
    for v in variants.values():
        if v.log is not None:
            v.log.flush()
            got = v.sink.steps
            assert got == list(range(len(got))), f"{v.name}: rows not 0..n-1"
    stretches = STRETCHES + [("whole period", 0, PERIOD)]
    result = {}
    rows = []
    for label, a, b in stretches:
        sums = {n: [sum(s[a:b]) for s in per[n]] for n in NAMES}
        entry = {n: med(sums[n]) for n in NAMES}
        for n in NAMES[1:]:
            entry[f"{n} - no log"] = med([x - y for x, y in zip(sums[n], sums["no log"])])
        entry[f"{cs.CALLER} - log() inside"] = med(
            [x - y for x, y in zip(sums[cs.CALLER], sums["log() inside"])])
        result[label] = entry
        cells = [label, str(b - a)] + [num(entry[n]["median"]) for n in NAMES]
        for n in [f"{n} - no log" for n in NAMES[1:]] + [f"{cs.CALLER} - log() inside"]:
            d = entry[n]
            cells.append(f"{num(d['median'])} [{num(d['lo'])}, {num(d['hi'])}]")
        rows.append(cells)
    table = md_table(["stretch", "steps"] + [f"{n} µs" for n in NAMES]
                     + [f"{n} − no log, µs (95% CI)" for n in NAMES[1:]]
                     + ["delivery='caller' − thread, µs (95% CI)"], rows)
    print(table)
    flushes = {n: med([s * 1e6 for s in variants[n].flush_s]) for n in cs.FLUSHED}
    calls = "; ".join(f"{n}: {num(m['median'])} µs [{num(m['lo'])}, {num(m['hi'])}]"
                      for n, m in flushes.items())
    print(f"flush(wait=False) call alone: {calls}")
    fl = flushes["log() inside"]
    piece_us = {}
    if pieces:
        # The signal functions are shared by every Logger: only this one flushes inside the
        # loop, the others after their clock (their calls are counted too).
        piece_us = {k: med([t / 1e3 for t in v]) | {"calls": len(v)} for k, v in pieces.items()}
        for k, m in piece_us.items():
            print(f"  {k:32s} {num(m['median'])} µs [{num(m['lo'])}, {num(m['hi'])}] "
                  f"({m['calls']} calls)")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        env = env_info(device, ["flush_profile", *(argv or sys.argv[1:])])
        write_json(os.path.join(args.out, f"flush_profile-{args.section}.json"),
                   {"env": env, "stretches": result, "flush_call_us": fl,
                    "flush_call_us_by_variant": flushes, "flush_pieces_us": piece_us})
        with open(os.path.join(args.out, f"flush_profile-{args.section}.md"), "w") as f:
            f.write(f"# flush_profile --section {args.section} --rounds {args.rounds} — "
                    f"{torch.cuda.get_device_name() if cuda else 'CPU'}, torch {torch.__version__}\n\n{table}\n\n"
                    f"flush(wait=False) call alone: {calls}\n")


if __name__ == "__main__":
    main()
