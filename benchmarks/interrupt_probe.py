"""Where do rows of returned calls go missing when a SIGALRM handler raises at random moments
of a CUDA logging loop? The loop of tests/test_reliability_interrupts.py's "raises anywhere"
test (600 trials, every=2, windows=1, a sink with Python code between rows), with the handler's
stack kept per trial: the trials whose steps were lost print where their interrupt landed.

    python benchmarks/interrupt_probe.py [--delivery caller|thread] [--contend N]

--contend N runs N other processes of back-to-back CUDA matmuls meanwhile: on an H100 shared
with 3 other test processes that test lost 36 of 995 rows (caller, tensor) where alone it lost
none (1,003 calls caller, 2,047 thread; 2026-12-06). The test's interrupts come 10-400 us into a
trial; here they come 0.25-40 calls' time in, the call timed first: with 3 matmul processes
each call waits for the GPU's time slice, and the test's window ended every trial before its
first call (a run on an H100 made 0 calls). Not run on a GPU since that change."""
import argparse
import collections
import multiprocessing
import random
import signal
import traceback


def _hog(stop):
    import torch
    a = torch.randn(4096, 4096, device="cuda")
    while not stop.is_set():
        for _ in range(20):
            a = (a @ a).tanh_()
        torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--delivery", default="caller", choices=("caller", "thread"))
    p.add_argument("--contend", type=int, default=0)
    p.add_argument("--trials", type=int, default=600)
    ns = p.parse_args()
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    hogs = [ctx.Process(target=_hog, args=(stop,), daemon=True) for _ in range(ns.contend)]
    for h in hogs:
        h.start()
    import torch
    import syncless
    torch.zeros(1, device="cuda")

    class Interrupt(BaseException):
        pass

    where: list[str] = []

    def handler(signum, frame):
        stack = traceback.extract_stack(frame)[-6:]
        where.append(" < ".join(f"{f.name}:{f.lineno}" for f in reversed(stack)))
        raise Interrupt()

    got = []

    class RowByRow:
        def write(self, rows):
            for r in rows:
                got.append(r.step)

    log = syncless.Logger(every=2, windows=1, sinks=[RowByRow()], delivery=ns.delivery)
    # The interrupts land within the first ~40 calls of a trial: uniform over 0.25 to 40 calls'
    # time, measured here (alone a call takes ~10 us; with --contend's processes sharing the GPU,
    # each waits for a time slice: a fixed 10-400 us window then ended every trial before its
    # first call returned, and a run of 600 trials made 0 calls).
    import time
    t = time.perf_counter()
    for _ in range(50):
        log(x=torch.tensor(float(log.stats.steps), device="cuda"))
    call_s = (time.perf_counter() - t) / 50
    print(f"one call: {call_s * 1e6:.1f} us", flush=True)
    signal.signal(signal.SIGALRM, handler)
    random.seed(36)
    trials = []
    for _ in range(ns.trials):
        first, n = log.stats.steps, len(where)
        try:
            signal.setitimer(signal.ITIMER_REAL, random.uniform(0.25, 40) * call_s)
            for _ in range(20000):
                log(x=torch.tensor(float(log.stats.steps), device="cuda"))
        except Interrupt:
            pass
        trials.append((first, log.stats.steps, where[n] if len(where) > n else None))
    signal.setitimer(signal.ITIMER_REAL, 0)
    log.close()
    stop.set()
    lost = sorted(set(range(log.stats.steps)) - set(got))
    print(f"delivery={ns.delivery} contend={ns.contend}: {log.stats.steps} calls, {len(lost)} "
          f"lost, {len(got) - len(set(got))} twice, in order {got == sorted(got)}; {log.stats}")
    at = collections.Counter()
    for first, end, w in trials:
        here = [s for s in lost if first <= s < end + 3]
        if here:
            at[w] += 1
            print(f"  trial of steps {first}-{end}: lost {here}, interrupted at {w}")
    for w, n in at.most_common():
        print(f"{n:4d} trials with losses interrupted at {w}")
    for h in hogs:
        h.join(timeout=10)


if __name__ == "__main__":
    main()
