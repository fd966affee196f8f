"""Where the microseconds of log() and timer() go, piece by piece (CUDA only).

    python benchmarks/hotpath_probe.py

Each row: median over 20 blocks of 500 calls, GPU idle at each block's start, synchronize outside
the clock. A diagnostic for tuning, not a comparison with peers (see log_overhead.py for that).
"""
import statistics
import time

import torch

import syncless
from syncless import _C
from syncless.timer import _auto_device


def cost(fn, calls=500, blocks=20):
    out = []
    for _ in range(blocks + 2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(out[2:])


def main():
    x = torch.zeros((), device="cuda")
    m4 = {f"m{i}": torch.randn((), device="cuda") for i in range(4)}
    m64 = {f"m{i}": torch.randn((), device="cuda") for i in range(64)}
    log = syncless.Logger(every=100, device="cuda")
    log.log(m64)
    ring, cols = log._ring, log._columns
    pair = _C.EventPair(0)
    rows = [
        ("torch x.zero_() (one torch launch)", lambda: x.zero_()),
        ("ring.gather, K=0 (bare gather launch)", lambda: ring.gather({}, cols, 0, 0, 0.0)),
        ("ring.gather, K=4", lambda: ring.gather(m4, cols, 0, 0, 0.0)),
        ("ring.gather, K=64", lambda: ring.gather(m64, cols, 0, 0, 0.0)),
        ("log.log(K=4)", lambda: log.log(m4)),
        ("log(**K=4)", lambda: log(**m4)),
        ("log.log(K=64)", lambda: log.log(m64)),
        ("_C.read_host_values(K=4 CUDA) (reads only)", lambda: _C.read_host_values(m4)),
        ("EventPair(0)", lambda: _C.EventPair(0)),
        ("pair.start()", pair.start),
        ("pair.start(); pair.stop()", lambda: (pair.start(), pair.stop())),
        ("_auto_device()", _auto_device),
        ("with syncless.timer()", lambda: syncless.timer().__enter__() and None),
    ]

    def timed_block():
        with syncless.timer():
            pass

    rows[-1] = ("with syncless.timer(): pass", timed_block)
    for name, fn in rows:
        print(f"{name:42s} {cost(fn):7.2f} µs")
    log.close()


if __name__ == "__main__":
    main()
