"""syncless.doctor(): run a training step under the monitor, then the audit, then a GPU probe,
and print one report ranking what costs time with the change that removes it.

Phases (each after `warmup` unmeasured steps, so lazy module loading, cuDNN autotuning and
allocator growth are not blamed on the loop):
  1. monitor   `steps` steps: data wait, CPU time, GPU time per step; the device is drained
               before and after, so wall time / steps is the real step time.
  2. audit     a few steps under CUPTI: every sync with its line and blocked time, kernels/step.
  3. probe     (CUDA) a few steps queued behind a GPU sleep kernel, so the step's kernels run
               back to back: the GPU time the step really needs, without launch gaps.
  4. trace     (trace=path) a torch.profiler trace of 3 steps, Perfetto-compatible.
"""
from __future__ import annotations

import contextlib
import statistics
import sys
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any, Callable, Iterable, TextIO

import torch

from .audit import Audit
from .monitor import MonitorSummary, StepMonitor, loader_settings
from .report import Finding, launch_finding, render_doctor, starvation_finding, sync_findings

__all__ = ["doctor", "Diagnosis", "assess", "QueueProbe", "timed_dataloaders"]


@dataclass
class Diagnosis:
    summary: MonitorSummary
    audit: Audit
    warmup: int
    step_ms: float                     # real wall time per step
    gpu: bool
    gpu_busy_ms: float = 0.0
    gpu_pure_ms: float | None = None
    sync_ms: float = 0.0
    kernels: float | None = None
    probe_steps: int = 0
    findings: list = field(default_factory=list)
    verdict: str = ""
    notes: list = field(default_factory=list)
    trace: str | None = None

    def report(self) -> str:
        return render_doctor(self)

    def __str__(self) -> str:
        return self.report()

    def finding(self, kind: str) -> Finding | None:
        return next((f for f in self.findings if f.kind == kind), None)


@contextlib.contextmanager
def timed_dataloaders(monitor: StepMonitor):
    """Time every DataLoader iterator's next() into `monitor` (for steps that fetch their own
    batches). Restores DataLoader on exit."""
    from torch.utils.data.dataloader import _BaseDataLoaderIter
    original = _BaseDataLoaderIter.__next__

    def timed_next(self):
        t = perf_counter()
        try:
            return original(self)
        finally:
            monitor.add_data_wait(perf_counter() - t)
            if not monitor.loader:
                monitor.loader = loader_settings(self)

    _BaseDataLoaderIter.__next__ = timed_next
    try:
        yield
    finally:
        _BaseDataLoaderIter.__next__ = original


def _cycle(loader: Iterable):
    while True:
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:
            raise ValueError("doctor(): the loader yielded no batches")


def _sync(gpu: bool) -> None:
    if gpu:
        torch.cuda.synchronize()


class QueueProbe:
    """GPU time of steps with their kernels queued back to back: each step is enqueued behind a
    sleep kernel long enough to cover its CPU time (twice over, plus 2 ms, at most 500 ms) and
    timed from the sleep's end. begin() and end() go around a step, on the current stream."""

    def __init__(self, host_ms: float):
        self.cover_ms = min(500.0, 2.0 * host_ms + 2.0)
        self._cycles_per_ms: float | None = None
        self._start = None
        self._pairs: list = []

    @staticmethod
    def _calibrate() -> float:
        # The sleep kernel counts clock cycles; one synchronized run converts them to ms.
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        torch.cuda._sleep(1_000_000)
        end.record()
        end.synchronize()
        return 1_000_000 / max(start.elapsed_time(end), 1e-3)

    def begin(self) -> None:
        if self._cycles_per_ms is None:
            self._cycles_per_ms = self._calibrate()
        torch.cuda._sleep(int(self._cycles_per_ms * self.cover_ms))
        self._start = torch.cuda.Event(enable_timing=True)
        self._start.record()

    def end(self) -> None:
        if self._start is None:
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._pairs.append((self._start, end))
        self._start = None

    @property
    def steps(self) -> int:
        """Steps timed (begin() then end())."""
        return len(self._pairs)

    def median_ms(self) -> float | None:
        """The median over the timed steps (synchronizes), None if no step was timed."""
        if not self._pairs:
            return None
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in self._pairs)


def _probe_gpu(step: Callable[[], None], fetch: Callable[[], Any], host_ms: float,
               n: int) -> float:
    probe = QueueProbe(host_ms)
    for _ in range(n):
        batch = fetch()
        torch.cuda.synchronize()
        probe.begin()
        step(batch)
        probe.end()
    return probe.median_ms()


def profiler(gpu: bool):
    """A torch.profiler.profile of the CPU ops, and of the GPU kernels when `gpu`."""
    from torch.profiler import ProfilerActivity, profile
    return profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else []))


def assess(summary: MonitorSummary, audit: Audit, warmup: int, step_ms: float, gpu: bool,
           gpu_span_ms: float | None = None, gpu_pure_ms: float | None = None,
           probe_steps: int = 0, notes: Iterable[str] = ()) -> Diagnosis:
    """The findings, ranked by what they cost per step, and the verdict, from the measurements:
    the monitor's summary, the finished audit, the real step time, the GPU span per step the
    monitor read and the queue-full GPU time the probe read (None: not probed). `notes` come
    first in the report's notes."""
    d = Diagnosis(summary, audit, warmup, step_ms, gpu, notes=list(notes))
    cupti = audit.backend == "cupti"
    d.sync_ms = audit.blocked_ms_per_step() if cupti else 0.0
    if cupti:
        d.kernels = audit.kernels / audit.step_count
    if gpu:
        span = gpu_span_ms or 0.0
        d.gpu_busy_ms = span
        if gpu_pure_ms is not None:
            d.probe_steps = probe_steps
            d.gpu_pure_ms = gpu_pure_ms
            d.gpu_busy_ms = min(span, gpu_pure_ms) if span else gpu_pure_ms

    idle = max(0.0, 1.0 - d.gpu_busy_ms / step_ms) if gpu and step_ms > 0 else None
    findings = []
    f = starvation_finding(summary.data_ms, step_ms, idle, summary.loader)
    if f:
        findings.append(f)
    findings += sync_findings(audit, step_ms)
    enqueue_ms = max(0.0, summary.cpu_ms - d.sync_ms)
    if gpu and d.gpu_pure_ms is not None:
        f = launch_finding(enqueue_ms, d.gpu_pure_ms, d.kernels, step_ms, audit.optimizers)
        if f:
            findings.append(f)
    d.findings = sorted(findings, key=lambda f: -f.cost_ms)
    # GPU-bound: the GPU is busy nearly all the step, or, with nothing else found, its work
    # outlasts the CPU's enqueue. (In a GPU-bound script on an H200 the probe's queue-full time,
    # taken after an idle sleep, read 11% below the monitored step's wall while the CPU needed
    # 6% of it: likely clocks that drop under sustained load.)
    gpu_bound = idle is not None and (idle < 0.1 or (
        not d.findings and d.gpu_pure_ms is not None and d.gpu_pure_ms >= enqueue_ms))

    if not gpu:
        d.verdict = ("the loop runs on the CPU; data wait is the only stall measured "
                     f"({summary.data_ms:.2f} ms of {step_ms:.2f} ms)")
    elif gpu_bound:
        d.verdict = (f"the GPU is busy {1 - idle:.0%} of the step (GPU-bound): speedups now "
                     "come from the model itself (bf16 autocast, torch.compile, fused kernels)")
    else:
        d.verdict = "no stall costs a significant share of the step"
    if cupti and audit.sites and d.gpu_pure_ms is not None:
        d.notes.append("the step syncs, so the queue-full GPU time includes waits; fix the "
                       "syncs first, then run the doctor again for the launch-bound verdict")
    return d


def doctor(train_step: Callable[..., Any], steps: int = 30, *, loader: Iterable | None = None,
           warmup: int = 3, audit_steps: int | None = None, probe: bool = True,
           trace: str | None = None, file: TextIO | None | str = "stdout") -> Diagnosis:
    """Diagnose a training step: `syncless.doctor(train_step, steps=30)` calls train_step()
    (or train_step(batch) for each batch of `loader`), prints the report to `file` (None: don't)
    and returns the Diagnosis."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    source = _cycle(loader) if loader is not None else None
    fetch = (lambda: next(source)) if source is not None else (lambda: None)
    call = (lambda b: train_step(b)) if loader is not None else (lambda b: train_step())

    for _ in range(warmup):
        call(fetch())
    gpu = torch.cuda.is_available() and torch.cuda.is_initialized()

    # 1. monitor
    mon = StepMonitor(loader=loader, gpu_every=1)
    hook = timed_dataloaders(mon) if loader is None else contextlib.nullcontext()
    with hook:
        _sync(gpu)
        t0 = perf_counter()
        for _ in range(steps):
            if source is not None:
                t = perf_counter()
                batch = fetch()
                mon.add_data_wait(perf_counter() - t)
            else:
                batch = None
            mon.begin()
            call(batch)
            mon.end()
        _sync(gpu)
        wall_ms = (perf_counter() - t0) * 1e3
    mon.close()
    summary = mon.summary()
    step_ms = wall_ms / steps

    # 2. audit
    n_audit = audit_steps or max(3, min(steps, 10))
    a = Audit(steps=n_audit)
    with a:
        for _ in range(n_audit):
            call(fetch())
    _sync(gpu)

    # 3. probe
    n_probe = 3
    span = sum(mon.gpu_ms.values()) / steps if gpu and mon.gpu_ms else 0.0
    pure = _probe_gpu(call, fetch, step_ms, n_probe) if gpu and probe else None
    notes = []
    if loader is None and not summary.loader and summary.data_ms == 0:
        notes.append("data wait not measured: train_step fetches no DataLoader batch; pass "
                     "loader= (train_step(batch) is then called per batch)")
    d = assess(summary, a, warmup, step_ms, gpu, span, pure, n_probe, notes)

    # 4. trace, last: torch.profiler takes CUPTI over
    if trace:
        with profiler(gpu) as prof:
            for _ in range(3):
                call(fetch())
            _sync(gpu)
        prof.export_chrome_trace(trace)
        d.trace = trace

    if file is not None:
        print(d.report(), file=sys.stdout if file == "stdout" else file)
    return d
