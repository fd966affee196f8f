"""Does a Logger ever swallow a Ctrl-C? An A/B under load (issue 27, item 7: "a single SIGINT
that never raised, 4 times in suite runs under load").

    python -m benchmarks.sigint_ab [--old TREE] [--repeats 4] [--trials 10] [--load N]

A trial: a logging loop (every=2, windows=1, a sink that takes 1 ms, so hand-overs, waits for a
free window and deliveries all happen all the time) and a thread that sends one SIGINT after a
random 1-50 ms, to the process (the kernel picks a thread that does not block it) or to the main
thread, alternately. The loop runs until KeyboardInterrupt or 5 s: an interrupt that did not raise
by then is counted lost. The latency is from the send to the exception. Variants: `none` (the same
loop with no logger), `new` (this tree), `old` (TREE: a checkout with the signal deferral, e.g.
commit ac7b7bb, built in place), each with delivery "thread" and "caller". Each repeat runs every
variant once, in a shuffled order, as a fresh process of `trials` trials; N busy-loop processes
(default: one per core) load the host meanwhile. Each process also reports the signal masks
(SigBlk) of its threads after logging: the deferral left the delivery thread with the
asynchronous signals blocked.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORKER = textwrap.dedent("""
    import glob, json, os, random, signal, sys, threading, time
    import torch

    mode, delivery, trials, seed = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    if mode != "none":
        import syncless
    random.seed(seed)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    main = threading.main_thread().ident

    class Sink:
        def write(self, rows):
            time.sleep(0.001)

    def masks():
        out = set()
        for path in glob.glob("/proc/self/task/*/status"):
            try:
                with open(path) as f:
                    out.add(next(l.split()[1] for l in f if l.startswith("SigBlk")))
            except OSError:
                pass
        return sorted(out)

    out, blocked = [], None
    for t in range(trials):
        target = ("process", "thread")[t % 2]
        delay = random.uniform(0.001, 0.05)
        sent = []

        def send():
            time.sleep(delay)
            sent.append(time.perf_counter())
            if target == "process":
                os.kill(os.getpid(), signal.SIGINT)
            else:
                signal.pthread_kill(main, signal.SIGINT)

        log = None
        if mode != "none":
            log = syncless.Logger(every=2, windows=1, sinks=[Sink()], delivery=delivery)
        kept = []
        latency = None
        deadline = time.perf_counter() + 5.0
        sender = threading.Thread(target=send, daemon=True)
        try:
            sender.start()                        # a busy host may be slow here: inside the try
            i = 0
            while time.perf_counter() < deadline:
                x = torch.tensor(float(i))
                if log is not None:
                    log(x=x)
                else:
                    kept.append(x)
                    if len(kept) == 2:
                        time.sleep(0.001)
                        kept = []
                i += 1
        except KeyboardInterrupt:
            latency = time.perf_counter() - sent[0]
        if blocked is None:                       # the logger's threads are alive here
            sender.join()
            time.sleep(0.02)                      # glibc blocks all signals in an ending thread
            blocked = masks()
        if log is not None:
            log.close()
        out.append([target, latency])
    print(json.dumps({"trials": out, "sigblk": blocked}))
""")


def busy(n: int) -> list:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def run(tree: str | None, mode: str, delivery: str, trials: int, seed: int) -> dict:
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = os.path.join(tree, "python") + os.pathsep + tree
    r = subprocess.run([sys.executable, "-c", WORKER, mode, delivery, str(trials), str(seed)],
                       capture_output=True, text=True, env=env, timeout=60 + 10 * trials)
    if r.returncode != 0:
        raise RuntimeError(f"{mode}/{delivery} failed: {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--old", help="a checkout with the signal deferral, built in place")
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--trials", type=int, default=10, help="trials per process")
    p.add_argument("--load", type=int, default=os.cpu_count() or 2,
                   help="busy-loop processes meanwhile")
    args = p.parse_args()
    variants = [("none", "-", None)]
    for delivery in ("thread", "caller"):
        variants.append(("new", delivery, ROOT))
        if args.old:
            variants.append(("old", delivery, os.path.abspath(args.old)))
    results: dict = {(m, d): {"lat": [], "lost": 0, "n": 0, "sigblk": set()}
                     for m, d, _ in variants}
    load = busy(args.load)
    try:
        for rep in range(args.repeats):
            order = variants[:]
            random.Random(rep).shuffle(order)
            for mode, delivery, tree in order:
                got = run(tree, "none" if mode == "none" else mode,
                          "thread" if delivery == "-" else delivery, args.trials, rep)
                res = results[(mode, delivery)]
                res["sigblk"].update(got["sigblk"])
                for _target, latency in got["trials"]:
                    res["n"] += 1
                    if latency is None:
                        res["lost"] += 1
                    else:
                        res["lat"].append(latency * 1e3)
            print(f"repeat {rep + 1}/{args.repeats} done", file=sys.stderr, flush=True)
    finally:
        for proc in load:
            proc.kill()
            proc.wait()
    print(f"SIGINT A/B, {args.load} busy-loop processes on {os.cpu_count()} cores, "
          f"{args.repeats} x {args.trials} trials per variant")
    print(f"{'variant':<16}{'trials':>7}{'lost':>6}{'median ms':>11}{'p90 ms':>9}{'max ms':>9}"
          f"  thread masks (SigBlk) after logging")
    for mode, delivery, _ in variants:
        res = results[(mode, delivery)]
        lat = sorted(res["lat"])
        med = statistics.median(lat) if lat else float("nan")
        p90 = lat[int(0.9 * (len(lat) - 1))] if lat else float("nan")
        top = lat[-1] if lat else float("nan")
        name = mode if delivery == "-" else f"{mode}/{delivery}"
        print(f"{name:<16}{res['n']:>7}{res['lost']:>6}{med:>11.2f}{p90:>9.2f}{top:>9.2f}  "
              f"{', '.join(sorted(res['sigblk']))}")


if __name__ == "__main__":
    main()
