"""The corpus scripts' own step clock: wall time per step over the steps after a warm-up, with the
GPU drained at both ends (what the scripts print as `step_ms=`, for doctor_corpus.py)."""
import time

import torch


class StepClock:
    # 60 warm-up steps: the corpus' doctor runs stop a script after 47 steps, so the clock's
    # synchronize never lands in the doctor's measured steps (in a GPU-bound twin it drained the
    # queue once and left the GPU idle while the host restarted: ~0.3 ms/step of 15).
    def __init__(self, device: str, warmup: int = 60):
        self.cuda = str(device).startswith("cuda")
        self.warmup = warmup
        self.n = 0
        self.t0 = None

    def tick(self) -> None:
        """Call once at the end of every step."""
        self.n += 1
        if self.n == self.warmup:
            if self.cuda:
                torch.cuda.synchronize()
            self.t0 = time.perf_counter()

    def report(self) -> None:
        if self.t0 is None or self.n <= self.warmup:
            return
        if self.cuda:
            torch.cuda.synchronize()
        ms = (time.perf_counter() - self.t0) * 1e3 / (self.n - self.warmup)
        print(f"step_ms={ms:.4f} steps={self.n - self.warmup}", flush=True)
