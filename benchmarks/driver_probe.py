"""What the driver calls on the timer's path cost, called straight through ctypes (GPU only).

    python benchmarks/driver_probe.py

Each row is the median over 30 rounds of 2,000 calls, beside the same minus a ctypes call that does
almost nothing (cuDriverGetVersion). It answers where a
timed block's ~4 µs go: the two cuEventRecord calls by event flags, the capture check, the
context lookup.
"""
import ctypes
import statistics
import sys
import time

import torch


def main() -> int:
    if not torch.cuda.is_available():
        print("driver_probe.py needs a CUDA GPU")
        return 2
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    cu = ctypes.CDLL("libcuda.so.1")
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    ctx = ctypes.c_void_p()
    status = ctypes.c_int()

    def event(flags):
        ev = ctypes.c_void_p()
        assert cu.cuEventCreate(ctypes.byref(ev), flags) == 0
        return ev

    blocking, plain, untimed = event(1), event(0), event(2)
    blocking2 = event(1)
    rec = cu.cuEventRecord
    cases = {
        "cuDriverGetVersion (a ctypes call, ~no work)": lambda: cu.cuDriverGetVersion(
            ctypes.byref(status)),
        "cuCtxGetCurrent": lambda: cu.cuCtxGetCurrent(ctypes.byref(ctx)),
        "cuStreamIsCapturing": lambda: cu.cuStreamIsCapturing(stream, ctypes.byref(status)),
        "cuEventRecord, timing + blocking-sync event": lambda: rec(blocking, stream),
        "cuEventRecord, timing event (default flags)": lambda: rec(plain, stream),
        "cuEventRecord, DISABLE_TIMING event": lambda: rec(untimed, stream),
        "two records, timing + blocking-sync (a pair)": lambda: (rec(blocking, stream),
                                                                 rec(blocking2, stream)),
    }
    n, rounds = 2000, 30
    out = {k: [] for k in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            out[name].append((time.perf_counter() - t0) / n * 1e6)
    torch.cuda.synchronize()
    base = statistics.median(out["cuDriverGetVersion (a ctypes call, ~no work)"])
    print(f"{'call':48s} {'µs (raw)':>9s} {'µs (- ctypes)':>14s}")
    for name, xs in out.items():
        m = statistics.median(xs)
        print(f"{name:48s} {m:9.3f} {m - base:14.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
