"""The doctor's verdict: assess() turns what the phases measured (a Measured) into a Diagnosis
that ranks what costs time with the change that removes it; and the GPU-side measurements the
phases take: the queue-full probe (QueueProbe), the launch cost, the kernel trace's reading
(trace_gpu). The phases themselves are _phases.py; syncless.doctor() is _api.py."""
from __future__ import annotations

import bisect
import json
import math
import statistics
import warnings
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any, Callable, Iterable

import torch

from ._sampler import Line, StackSampler
from ._load import Load
from ._series import Stalls
from ._sweep import Sweep
from .audit import ASYNC_COPY, COPY, SYNC, Audit
from .findings import (LEADS, Finding, is_minor, launch_finding, starvation_finding,
                       sync_findings)
from .monitor import MonitorSummary
from .report import ReportText, render_doctor

__all__ = ["Diagnosis", "Measured", "assess", "QueueProbe", "KernelTime", "trace_gpu"]


@dataclass(repr=False)
class Diagnosis:
    summary: MonitorSummary
    audit: Audit
    warmup: int
    step_ms: float                     # real wall time per step
    gpu: bool
    gpu_busy_ms: float = 0.0           # the monitor's event span per step (GPU work + its gaps)
    gpu_pure_ms: float | None = None   # the probe's queue-full time
    gpu_trace_ms: float | None = None  # kernel time per step from the trace (short gaps in)
    sync_bubble_ms: float | None = None  # GPU idle after the syncs per step, from the trace
    sync_idle_ms: float | None = None  # GPU idle the syncs cause per step, from the trace
    sync_count: float | None = None    # syncs per step in the trace
    gpu_work_ms: float | None = None   # the GPU work the step needs: what no host fix goes below
    gpu_work_source: str = ""
    sync_ms: float = 0.0               # host time blocked in syncs per step
    sync_ms_source: str = ""           # "kernel trace" | "audit"
    host_ms: float | None = None       # the step less the time blocked in syncs
    sync_cost_ms: float = 0.0          # what removing every sync wins back per step
    host_leads: bool = False           # without its syncs the host is well ahead of the GPU
    kernels: float | None = None
    launch_us: float | None = None     # host cost of one small op's launch, measured here
    handoff_ms: float | None = None    # taking one ready batch from a worker, measured here
    load: Load | None = None           # other processes' load on the CPUs over the run
    cpu_split: dict[str, float] = field(default_factory=dict)
    probe_steps: int = 0
    boundary: str = ""
    framework: str = ""                # the loop's: "transformers", "lightning", ... or ""
    findings: list[Finding] = field(default_factory=list)
    minor: list[Finding] = field(default_factory=list)
    minor_notes: list[str] = field(default_factory=list)
    verdict: str = ""
    verdict_kind: str = ""             # "GPU-bound" | "CPU-bound" | "data-bound"
    headroom: str = ""
    headroom_ms: float = 0.0
    speedups: list[str] = field(default_factory=list)
    settings: list[str] = field(default_factory=list)
    lines: list[Line] = field(default_factory=list)
    samples: int = 0
    model_share: float | None = None   # the share of the stack samples in the model (step_part)
    notes: list[str] = field(default_factory=list)
    trace: str | None = None
    kernel_time: KernelTime | None = None   # the trace's figures, as read
    plain_step_ms: float | None = None  # the steady step timed unobserved (boundaries only)
    plain_steps: int = 0
    overhead: float | None = None      # step_ms / plain_step_ms: how much observing slowed it
    periodic: list[Stalls] = field(default_factory=list)   # work apart from the step
    provisional: bool = False
    provisional_why: str = ""
    verify_lines: list[str] = field(default_factory=list)   # --verify's lines, for the report
    verify_runs: tuple[int, float] = (0, 0.0)          # (runs, seconds) --verify took
    verify_where: str = ""                              # where those runs ran
    # Each verifying run (settings, seconds, step ms, ended, fork) and the server's start
    verify_log: dict[str, Any] = field(default_factory=dict)
    verify_load: Load | None = None    # other processes' load on the CPUs over those runs
    _sampled: Any = None               # the sampler's counts by (file, line, via)
    _printed: bool = field(default=False, compare=False)   # doctor() printed the report

    def report(self) -> ReportText:
        return ReportText(render_doctor(self))

    def __str__(self) -> str:
        return self.report()

    def __repr__(self) -> str:
        text = (f"<syncless.Diagnosis: {self.verdict_kind or 'no verdict'}, "
                f"{self.step_ms:.3f} ms/step over {self.summary.steps} step(s)")
        if self.findings:
            top = self.findings[0]
            text += (f"; {len(self.findings)} finding(s), the first: {top.title} (wins back "
                     f"{top.cost_ms:.3f} ms/step)")
        else:
            text += "; no finding"
        return text + "; print() it for the report>"

    # A notebook shows the report once: doctor() printed it already, so the result it returns
    # then shows as its one-line repr; one made with file=None shows as the report.
    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(repr(self) if cycle or self._printed else self.report())

    def _repr_html_(self) -> str | None:
        return None if self._printed else self.report()._repr_html_()

    def finding(self, kind: str) -> Finding | None:
        return next((f for f in self.findings + self.minor if f.kind == kind), None)

    def as_dict(self) -> dict[str, Any]:
        """The numbers and findings as plain data (`python -m syncless doctor --json PATH`)."""
        top = self.findings[0] if self.findings else None
        return {
            "verdict": self.verdict_kind, "verdict_text": self.verdict,
            "headroom_ms": self.headroom_ms, "framework": self.framework,
            "boundary": self.boundary, "steps": self.summary.steps, "step_ms": self.step_ms,
            "plain_step_ms": self.plain_step_ms, "plain_steps": self.plain_steps,
            "overhead": self.overhead, "warmup_steps": self.warmup,
            "provisional": self.provisional, "provisional_why": self.provisional_why,
            "periodic": [s.as_dict() for s in self.periodic],
            "verify": self.verify_lines, "verify_runs": self.verify_runs[0],
            "verify_seconds": self.verify_runs[1], "verify_where": self.verify_where,
            "verify_log": self.verify_log,
            "verify_load": self.verify_load.as_dict() if self.verify_load else None,
            "data_ms": self.summary.data_ms, "cpu_ms": self.summary.cpu_ms,
            "sync_ms": self.sync_ms, "sync_ms_source": self.sync_ms_source,
            "host_ms": self.host_ms, "sync_cost_ms": self.sync_cost_ms,
            "host_leads": self.host_leads,
            "gpu_work_ms": self.gpu_work_ms,
            "gpu_work_source": self.gpu_work_source, "gpu_span_ms": self.gpu_busy_ms,
            "gpu_probe_ms": self.gpu_pure_ms, "gpu_trace_ms": self.gpu_trace_ms,
            "sync_bubble_ms": self.sync_bubble_ms,
            "sync_idle_ms": self.sync_idle_ms, "sync_count": self.sync_count,
            "trace": dict(vars(self.kernel_time)) if self.kernel_time else None,
            "kernels": self.kernels, "launch_us": self.launch_us, "cpu_split": self.cpu_split,
            "handoff_ms": self.handoff_ms,
            "load": self.load.as_dict() if self.load else None,
            "top_predicted_ms": top.predicted_ms if top else None,
            "findings": [f.as_dict() for f in self.findings],
            "minor": [f.as_dict() for f in self.minor], "settings": self.settings,
            "lines": [{"where": line.where, "share": line.samples / self.samples, "via": line.via}
                      for line in self.lines] if self.samples else [],
            "notes": self.notes, "model_share": self.model_share,
            "sampled": [{"where": f"{k[0]}:{k[1]}", "via": k[2], "share": n / self.samples}
                        for k, n in self._sampled.most_common(25) if k] if self.samples else [],
        }

# torch.cuda._sleep and torch.cuda.Event carry no annotations in torch: typed once here.
def _gpu_sleep(cycles: int) -> None:
    torch.cuda._sleep(cycles)  # type: ignore[no-untyped-call]


def _timing_event() -> torch.cuda.Event:
    event: torch.cuda.Event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    return event


def covered(host_ms: float, cover_ms: float) -> bool:
    """Whether a probed step was enqueued while the sleep still held the GPU: a step whose host
    time (a slow batch, say) outlasts the sleep runs its kernels as they come, and timing it would
    read host time as GPU work (a data-bound step read 81 ms queue-full against 12.6 ms of
    kernels). 10% of margin: the sleep may have started before begin() returned."""
    return host_ms <= 0.9 * cover_ms


class QueueProbe:
    """GPU time of steps with their kernels queued back to back: each step is enqueued behind a
    sleep kernel long enough to cover its CPU time (twice over, plus 2 ms, at most 500 ms) and
    timed from the sleep's end. begin() and end() go around a step, on the current stream."""

    def __init__(self, host_ms: float) -> None:
        self.cover_ms = min(500.0, 2.0 * host_ms + 2.0)
        self._cycles_per_ms: float | None = None
        self._start: torch.cuda.Event | None = None
        self._host_t0 = 0.0
        self._pairs: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.uncovered = 0           # steps whose host time outlasted the sleep: not timed

    @staticmethod
    def _calibrate() -> float:
        # The sleep kernel counts clock cycles; a synchronized run converts them to ms. Its first
        # call loads the kernel's module, which inflates the time measured (a "20 ms" sleep
        # calibrated on it ran 0.6 ms on an H200): warm it first, then time 10M cycles.
        _gpu_sleep(1000)
        torch.cuda.synchronize()
        start, end = _timing_event(), _timing_event()
        start.record()
        _gpu_sleep(10_000_000)
        end.record()
        end.synchronize()
        ms: float = start.elapsed_time(end)
        return 10_000_000 / max(ms, 1e-3)

    def begin(self) -> None:
        if self._cycles_per_ms is None:
            self._cycles_per_ms = self._calibrate()
        _gpu_sleep(int(self._cycles_per_ms * self.cover_ms))
        self._start = _timing_event()
        self._start.record()
        self._host_t0 = perf_counter()

    def end(self) -> None:
        if self._start is None:
            return
        end = _timing_event()
        end.record()
        if covered((perf_counter() - self._host_t0) * 1e3, self.cover_ms):
            self._pairs.append((self._start, end))
        else:
            self.uncovered += 1
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
        return float(statistics.median(s.elapsed_time(e) for s, e in self._pairs))


def profiler(gpu: bool, cpu: bool = True) -> "_Quiet":
    """A torch.profiler.profile of the CPU ops (`cpu`), and of the GPU kernels and CUDA calls
    when `gpu` (CUDA alone adds little host time: no op is recorded on the CPU side)."""
    from torch.profiler import ProfilerActivity, profile
    return _Quiet(profile(activities=([ProfilerActivity.CPU] if cpu or not gpu else []) +
                          ([ProfilerActivity.CUDA] if gpu else [])))


class _Quiet:
    """A torch.profiler.profile whose start does not warn "Profiler clears events at the end of
    each cycle" (torch 2.11 says it for a second profile in a process; the doctor reads each
    profile on its own)."""

    def __init__(self, prof: Any) -> None:
        self.prof = prof

    def __enter__(self) -> Any:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*Profiler clears events")
            self.prof.__enter__()
        return self.prof

    def __exit__(self, *exc: object) -> Any:
        return self.prof.__exit__(*exc)

    def export_chrome_trace(self, path: str) -> None:
        self.prof.export_chrome_trace(path)


def launch_cost_us() -> float:
    """Host time of one small torch op on CUDA (dispatch + kernel launch), on an idle GPU: the
    median of 5 rounds of 100 in-place adds."""
    x = torch.zeros(1, device="cuda")
    rounds = []
    for _ in range(6):
        torch.cuda.synchronize()
        t = perf_counter()
        for _ in range(100):
            x.add_(1.0)
        rounds.append((perf_counter() - t) * 1e4)
    torch.cuda.synchronize()
    return statistics.median(rounds[1:])


GRAPH_GAP_US = 0.5
MIN_SHARE_SAMPLES = 20   # stack samples below which the model's share of the step is not read
OUTSIDE_MODEL = 0.5      # under this share of the samples in the model: host work outside it
GPU_BOUND = 0.9      # GPU work at least this share of the step: the verdict is GPU-bound
SATURATED = 0.02     # the trace's GPU waits for launches under 2% of the step: GPU-bound

_SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
               "cudaMemcpy", "cudaFree", "cuStreamSynchronize", "cuCtxSynchronize",
               "cuEventSynchronize")


@dataclass
class KernelTime:
    """What a torch.profiler trace says per step: the GPU's busy time, the GPU idle that follows
    the host-device syncs (from a sync's return until the GPU has work again), the time the host
    spent blocked in them, and the GPU idle they cause in all (the bubble, then every gap while
    the GPU runs right behind the launches, until the host is ahead of it again)."""
    busy_ms: float
    sync_bubble_ms: float | None       # None: the trace holds no CUDA runtime calls
    syncs: float                       # sync calls per step in the trace
    blocked_ms: float | None = None    # host time inside those sync calls per step
    sync_idle_ms: float | None = None  # GPU idle from each sync's return until the host leads
    queued_gap_ms: float | None = None  # gaps > gap_us before an op that was already queued
    launch_wait_ms: float | None = None  # gaps before an op launched after the GPU was free
    queued_ops: float | None = None    # share of the ops queued LEAD_US before the GPU got free
    blocked_threads: dict[str, float] = field(default_factory=dict)   # tid -> blocked ms/step
    # runtime call -> [per step, mean µs]
    calls: dict[str, list[float]] = field(default_factory=dict)


LEAD_US = 10.0     # a kernel launched this long before the GPU got to it: the host is ahead


def trace_gpu(path: str, steps: int, gap_us: float = 3.0) -> KernelTime | None:
    """Read a torch.profiler trace of `steps` steps. Busy: the union of kernel, memcpy and memset
    intervals, counting gaps up to `gap_us` (the GPU's own time between back-to-back kernels) as
    busy. A sync's bubble: the idle gap its return falls in, counted once per gap. Its idle: the
    bubble and the gaps after it, up to the first GPU op that was launched `LEAD_US` before the
    GPU was free to run it (the host has got ahead, the queue holds work) or the next sync."""
    with open(path) as f:
        events = json.load(f).get("traceEvents", [])
    ops = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"]),
                  (e.get("args") or {}).get("correlation")) for e in events
                 if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e)
    if not ops or steps < 1:
        return None
    merged = [[ops[0][0], ops[0][1]]]
    for s, e, _ in ops[1:]:
        if s <= merged[-1][1] + gap_us:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    busy = sum(e - s for s, e in merged)
    runtime = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")
               and "dur" in e]
    if not runtime:
        return KernelTime(busy / 1e3 / steps, None, 0.0)
    # A copy to pageable host memory (what .item() and .cpu() make) returns only once the GPU
    # has run everything before it: the host waits inside cudaMemcpyAsync, not in the
    # cudaStreamSynchronize that follows.
    to_pageable = {(e.get("args") or {}).get("correlation") for e in events
                   if e.get("cat") == "gpu_memcpy" and "DtoH" in str(e.get("name"))
                   and "Pageable" in str(e.get("name"))}
    to_pageable.discard(None)
    launched: dict[Any, float] = {}
    waits = []
    for e in runtime:
        c = (e.get("args") or {}).get("correlation")
        if e.get("name") in _SYNC_CALLS or (c in to_pageable and "Memcpy" in e.get("name", "")):
            waits.append(e)
        elif c is not None:
            launched.setdefault(c, float(e["ts"]))
    starts = [s for s, _ in merged]
    op_starts = [s for s, _, _ in ops]
    returns = []                                      # (return time, blocked µs) of step syncs
    for e in waits:
        t = float(e["ts"]) + float(e["dur"])
        i = bisect.bisect_right(starts, t)            # the first busy interval after the return
        if i == 0 or i == len(merged):
            continue                                  # before the steps, or the final drain
        returns.append((t, float(e["dur"]), i))
    returns.sort()
    bubble = idle = blocked = 0.0
    counted = set()
    for k, (t, dur, i) in enumerate(returns):
        blocked += dur
        if i not in counted and merged[i - 1][1] <= t + gap_us:   # the GPU was done at the return
            counted.add(i)
            bubble += merged[i][0] - merged[i - 1][1]
        stop = returns[k + 1][0] if k + 1 < len(returns) else math.inf
        j = bisect.bisect_left(op_starts, t)
        free = max(t, merged[i - 1][1])               # when the GPU had nothing left to run
        for s, e, c in ops[j:]:
            if s >= stop:
                break
            at = launched.get(c)
            if at is not None and at < free - LEAD_US:
                break                                 # queued ahead: the host leads again
            if s > free + gap_us:
                idle += s - free
            free = max(free, e)
    per = 1e3 * steps
    # A copy's wait and the stream sync right after it (.item()) hold the GPU up once: syncs
    # with no GPU work between them count as one.
    points = len({i for _, _, i in returns})
    # Each gap between ops, by whether the op after it was already queued when the GPU got free
    # (the gap is the GPU's own time between ops) or was launched later (the GPU waited).
    queued_gap = launch_wait = 0.0
    queued = 0
    end = ops[0][1]
    for s, e, c in ops[1:]:
        at = launched.get(c)
        ahead = at is not None and at < end - LEAD_US
        queued += ahead
        if s > end + gap_us:
            if ahead:
                queued_gap += s - end
            else:
                launch_wait += s - end
        end = max(end, e)
    threads: dict[Any, float] = {}
    for e in waits:
        threads[e.get("tid")] = threads.get(e.get("tid"), 0.0) + float(e["dur"]) / per
    seen: dict[str, list[float]] = {}          # runtime call name -> [count, total µs]
    for e in runtime:
        c = seen.setdefault(e.get("name"), [0, 0.0])
        c[0] += 1
        c[1] += float(e["dur"])
    calls = {k: [n / steps, t / n] for k, (n, t) in seen.items()}   # [count/step, mean µs]
    return KernelTime(busy / per, bubble / per, points / steps, blocked / per, idle / per,
                      queued_gap / per, launch_wait / per, queued / max(1, len(ops) - 1),
                      {str(k): v for k, v in threads.items()}, calls)


def _autocast_on() -> bool:
    try:
        return torch.is_autocast_enabled("cuda")
    except TypeError:                              # torch < 2.4
        return torch.is_autocast_enabled()


def _model_info(model: Any, autocast: bool | None) -> tuple[list[str], list[str], bool]:
    """(settings read, GPU-side speedups not yet on, compiled) for the outermost module."""
    if model is None:
        return [], [], False
    compiled = hasattr(model, "_orig_mod") or type(model).__name__ == "OptimizedModule"
    try:
        dtype = next(model.parameters()).dtype
    except (StopIteration, AttributeError, RuntimeError):
        dtype = None
    name = type(getattr(model, "_orig_mod", model)).__name__
    text = f"model {name}: {str(dtype).replace('torch.', '') if dtype else 'no'} parameters"
    if autocast is not None:
        text += f", autocast {'on' if autocast else 'off'}"
    if compiled:
        text += ", torch.compile'd"
    speedups = []
    if dtype == torch.float32 and not autocast:
        speedups.append("bf16 autocast: with torch.autocast('cuda', dtype=torch.bfloat16) around "
                        "the forward and the loss")
        if torch.get_float32_matmul_precision() == "highest":
            speedups.append("TF32 matmuls: torch.set_float32_matmul_precision('high')")
    if not compiled:
        speedups.append("torch.compile(model): fused kernels")
    return [text], speedups, compiled


def _optimizer_setting(opt: Any) -> str:
    d = getattr(opt, "defaults", {})
    keys = [f"{k}={d[k]}" for k in ("fused", "foreach", "capturable") if k in d]
    return f"{type(opt).__name__}({', '.join(keys)})"


def _loader_setting(s: dict[str, Any]) -> str:
    keys = ("num_workers", "pin_memory", "persistent_workers", "prefetch_factor")
    return "DataLoader(" + ", ".join(f"{k}={s.get(k)}" for k in keys) + ")"


@dataclass
class Measured:
    """What the doctor's phases measured: the input of assess(). None: not measured."""
    summary: MonitorSummary
    audit: Audit
    warmup: int
    step_ms: float                          # the real wall time per step
    gpu: bool
    gpu_span_ms: float | None = None        # the monitor's GPU event span per step
    gpu_pure_ms: float | None = None        # the probe's queue-full GPU time
    probe_steps: int = 0
    notes: Iterable[str] = ()               # first in the report's notes
    kernel_time: KernelTime | None = None   # the trace's figures
    launch_us: float | None = None          # host cost of one small op's launch
    sampler: StackSampler | None = None     # the monitored steps' stack samples
    boundary: str = ""                      # what ends a step, in words
    optimizer_ms: float | None = None       # optimizer.step() host time per step
    model: Any = None                       # the outermost module called
    autocast: bool | None = None            # autocast on at its call
    handoff_ms: float | None = None         # taking one ready batch from a worker (measured)
    sweeper: Callable[[float], Sweep | None] | None = None   # the loader's workers, measured

    @property
    def cupti(self) -> bool:
        return self.audit.backend == "cupti"

    def sampled(self) -> StackSampler | None:
        """The sampler, when it took samples."""
        return self.sampler if self.sampler is not None and self.sampler.total else None


def assess(m: Measured) -> Diagnosis:
    """The verdict, the headroom and the findings ranked by what their fix wins back, from the
    measurements: the monitor's summary, the finished audit, the real step time, the GPU span per
    step the monitor read, the probe's queue-full GPU time and the trace's kernel time."""
    d = _figures(m)
    every_step = _sync_time(d, m)
    syncs_matter = d.sync_ms >= 0.01 * m.step_ms
    if m.gpu:
        _gpu_work(d, m, every_step)
    _sync_cost(d, m, every_step, syncs_matter)
    _cpu_split(d, m)
    optimizers = list(m.audit.optimizers)
    model_settings, speedups, compiled = _model_info(m.model, m.autocast)
    _rank(d, m, every_step, optimizers, compiled)
    _verdict(d, m, speedups)
    # What was read and not prescribed.
    d.settings = [_optimizer_setting(o) for o in optimizers]
    if not optimizers and m.boundary and "optimizer" not in m.boundary:
        d.settings.append("no torch optimizer (parameters updated by hand, or inference)")
    if m.summary.loader:
        d.settings.append(_loader_setting(m.summary.loader))
    d.settings += model_settings
    if every_step and m.gpu_pure_ms is not None and d.gpu_trace_ms is None:
        d.notes.append("the step syncs, so the queue-full GPU time includes the host's time "
                       "after each sync; fix the syncs first, then run the doctor again for the "
                       "launch-bound verdict")
    elif m.cupti and m.audit.sites and not syncs_matter and m.gpu_pure_ms is not None:
        d.minor_notes.append(f"the step syncs, but the waits take {d.sync_ms:.3f} ms/step")
    return d


def _figures(m: Measured) -> Diagnosis:
    """The Diagnosis with the measured figures copied in."""
    d = Diagnosis(m.summary, m.audit, m.warmup, m.step_ms, m.gpu, notes=list(m.notes),
                  boundary=m.boundary)
    if m.cupti:
        d.kernels = m.audit.kernels / m.audit.step_count
    d.launch_us, d.handoff_ms = m.launch_us, m.handoff_ms
    d.gpu_busy_ms = m.gpu_span_ms or 0.0
    d.probe_steps = m.probe_steps if m.gpu_pure_ms is not None else 0
    kt = m.kernel_time
    d.gpu_pure_ms, d.gpu_trace_ms = m.gpu_pure_ms, kt.busy_ms if kt else None
    d.sync_bubble_ms = kt.sync_bubble_ms if kt else None
    d.sync_idle_ms = kt.sync_idle_ms if kt else None
    d.sync_count = kt.syncs if kt else None
    d.kernel_time = kt
    sampler = m.sampled()
    if sampler is not None:
        d.samples, d.lines = sampler.total, sampler.top()
        d._sampled = sampler.counts
    return d


def _sync_time(d: Diagnosis, m: Measured) -> bool:
    """Set the host's time blocked in syncs per step (d.sync_ms, and its source); returns whether
    a sync comes every step."""
    audit, kernel_time, sampler = m.audit, m.kernel_time, m.sampled()
    # The trace's figure is the one to trust: the audit's CUPTI callbacks slow every CUDA call
    # down, so by the time the audited host reaches a sync the GPU has often caught up (a
    # Lightning step blocked 0.015 ms/step under the audit and ~2 ms/step without it).
    # The trace and the audit both slow the host down (less so the trace), so by the time the
    # host reaches a sync there the GPU has caught up further than in the monitored steps: the
    # stack samples of the monitored steps at the audited sync lines are the third figure, and
    # the largest of the three the closest (each reads low, none high but by sampling noise).
    sources = [(audit.blocked_ms_per_step(), "audit")] if m.cupti else []
    if kernel_time is not None and kernel_time.blocked_ms is not None:
        sources.append((kernel_time.blocked_ms, "kernel trace"))
    if m.cupti and sampler is not None and audit.sites:
        keys = {(x.site.file, x.site.line, x.site.via) for x in audit.sites.values()
                if not (x.kinds == {ASYNC_COPY} and x.count < audit.step_count)}
        hits = sum(n for k, n in sampler.counts.items() if k in keys)
        sources.append((m.step_ms * hits / sampler.total, "stack samples"))
    d.sync_ms, d.sync_ms_source = max(sources, default=(0.0, ""), key=lambda v: v[0])
    per_step = sum(s.count for s in audit.sites.values() if s.kinds != {ASYNC_COPY}) / \
        audit.step_count if m.cupti else 0.0
    traced_syncs = kernel_time.syncs if kernel_time is not None and \
        kernel_time.sync_bubble_ms is not None else None
    return per_step >= 1 or (traced_syncs is not None and traced_syncs >= 1)


def _gpu_work(d: Diagnosis, m: Measured, every_step: bool) -> None:
    """Set the GPU work a step needs (d.gpu_work_ms, and its source)."""
    # The probe runs the step's kernels back to back, with the GPU's own gaps between them (as
    # a CUDA graph replays them), but a sync inside the step empties the queue and the host's
    # time after it counts too (a Lightning step with one read 18.0 ms queue-full against
    # 16.5 ms of kernels): with a sync every step the trace's kernel time is the one to trust,
    # however little the sync blocks. On a GPU busy through the whole step (the event span
    # fills it, the probe within 20%) the span is the better figure: the probe, taken after an
    # idle sleep, read up to 11% low on an H200 (clocks), which would promise gains that are
    # not there.
    step, span = m.step_ms, m.gpu_span_ms
    order = ((d.gpu_trace_ms, "kernel trace"), (m.gpu_pure_ms, "queue full"))
    if not every_step:
        order = order[::-1]
    d.gpu_work_ms, d.gpu_work_source = next(((v, k) for v, k in order if v is not None),
                                            (None, ""))
    # A GPU whose queue never ran dry in the trace (its waits for launches, after syncs and
    # between steps, under SATURATED of the step) is what the step waits for: the step is its
    # work. Kernel sums and the probe read 1-7% under such steps (an H200: a Lightning step of
    # 30.18 ms against 29.97 ms of kernels, a graph replay of 2.11 against 2.04), and taking
    # them would leave the host "slower" by the difference, whose every data wait and sync
    # would then seem to cost the step. The GPU's own gaps between queued kernels add nothing
    # (0.004-0.009 ms/step over ~400 kernels there): idle beyond the kernels is the GPU waiting
    # for the host. Without the trace's launch times, a GPU busy through the whole step (the
    # event span fills it, the kernels within 20%) stands in.
    # The probe too can read low: behind its idle sleep the clocks are down (a step of 4 large
    # bf16 matmuls on an H200, host blocked in launches with the queue full, probed 21% under
    # its step). With the host not waiting for data the trace's word stands whatever the other
    # figures say; a loop that waits for data keeps them (its three traced steps, after the
    # doctor's own pauses let the workers fill their prefetch, can run from ready batches).
    wait = m.kernel_time.launch_wait_ms if m.kernel_time is not None else None
    if d.gpu_work_ms is None or step <= 0:
        return
    fed = m.summary.data_ms < 0.05 * step
    if wait is not None and wait <= SATURATED * step and (fed or d.gpu_work_ms >= 0.8 * step):
        d.gpu_work_ms, d.gpu_work_source = step, "queue never ran dry"
    elif wait is None and span and span >= 0.9 * step and not every_step and fed and \
            d.gpu_work_ms >= 0.8 * step and span > d.gpu_work_ms:
        d.gpu_work_ms, d.gpu_work_source = min(span, step), "busy all step"


def _sync_cost(d: Diagnosis, m: Measured, every_step: bool, syncs_matter: bool) -> None:
    """Set the host's own time per step and what removing every sync wins back."""
    # The host's own time per step: the step less the time blocked in syncs (data wait in).
    # Without its syncs the host runs ahead of the GPU and the step takes max(host, G); a sync
    # costs the rest: at most the time it blocks (the host still does its own work), at most
    # the GPU idle of the step, and at most the GPU idle the trace sees it cause (from its
    # return until the host leads the GPU again).
    # With the host's own work well under the GPU's and a sync every step, the step's GPU idle
    # is the syncs' (findings.py says why the trace's sync idle does not bound it then).
    G = d.gpu_work_ms
    host_ms = max(0.0, m.step_ms - d.sync_ms)
    d.host_ms = host_ms
    sync_cost = min(d.sync_ms, max(0.0, m.step_ms - (G or 0.0)))
    d.host_leads = bool(m.gpu and G and every_step and syncs_matter and host_ms <= LEADS * G)
    kt = m.kernel_time
    if kt is not None and not d.host_leads:
        caused = kt.sync_idle_ms if kt.sync_idle_ms is not None else kt.sync_bubble_ms
        if caused is not None:
            sync_cost = min(sync_cost, caused)
    d.sync_cost_ms = sync_cost


def _cpu_split(d: Diagnosis, m: Measured) -> None:
    """Where the body's CPU time goes: launches (kernels x the launch cost measured here),
    syncs, and the rest (Python, the framework, host-side data work)."""
    body = m.summary.cpu_ms
    blocked_in_body = min(d.sync_ms, body)
    if m.gpu and d.kernels is not None and m.launch_us:
        launches = min(d.kernels * m.launch_us / 1e3, max(0.0, body - blocked_in_body))
        d.cpu_split = {"launches_ms": launches, "syncs_ms": blocked_in_body,
                       "rest_ms": max(0.0, body - blocked_in_body - launches)}


def _rank(d: Diagnosis, m: Measured, every_step: bool, optimizers: list[Any],
          compiled: bool) -> None:
    """The findings, ranked by what their fix wins back; the minor ones apart."""
    summary, audit, step, G = m.summary, m.audit, m.step_ms, d.gpu_work_ms
    findings: list[Finding] = []
    copy_ms = sum(s.blocked_ns / 1e6 / audit.step_count for s in audit.sites.values()
                  if m.cupti and not s.site.chain and s.kinds & {COPY, ASYNC_COPY, SYNC}
                  and (".to(" in s.site.code or ".cuda(" in s.site.code))
    # A CPU loop's ops run on torch's intra-op threads, which take CPUs a worker would need
    # (2 cores: one worker took a CPU from torch, and the loop fell from 300-396 to 166-191 it/s).
    f = starvation_finding(summary.data_ms, step, G, summary.loader, cuda=m.gpu, copy_ms=copy_ms,
                           data_cpu=summary.data_cpu, host_ms=d.host_ms,
                           trainer_cpus=1 if m.gpu else torch.get_num_threads(),
                           handoff_ms=m.handoff_ms, sweeper=m.sweeper,
                           body_cpu_ms=None if m.gpu else summary.body_cpu_ms)
    if f:
        findings.append(f)
    elif m.handoff_ms is not None and 0.05 <= summary.data_ms <= m.handoff_ms:
        d.notes.append(f"the step waits {summary.data_ms:.2f} ms for data, but taking a batch "
                       f"that a worker has ready costs the training thread {m.handoff_ms:.2f} ms "
                       "here (measured: one worker serving batches of the same shapes): more "
                       "loader workers would not win it back")
    sampler = m.sampled()
    findings += sync_findings(audit, step, G, d.sync_cost_ms,
                              sampler.counts if sampler is not None else None,
                              by_count=d.host_leads)
    # A CUDA graph replays the kernels with less time between them than stream launches leave
    # even with the queue full (the probe): on the H200, replays of 100-400 kernels ran 0.3-0.7 µs
    # per kernel beyond their kernel time.
    graph_ms = G
    if d.gpu_trace_ms is not None and d.kernels:
        graph_ms = min(G or math.inf, d.gpu_trace_ms + d.kernels * GRAPH_GAP_US / 1e3)
    enqueue_ms = max(0.0, summary.cpu_ms - min(d.sync_ms, summary.cpu_ms))
    d.model_share = model_share = sampler.share("model") if sampler is not None and \
        sampler.total >= MIN_SHARE_SAMPLES else None
    f = launch_finding(enqueue_ms, G, d.kernels, step, summary.data_ms, m.launch_us, optimizers,
                       m.optimizer_ms, compiled, graph_ms, d.host_ms,
                       every_step and d.sync_ms > 0, model_share) if m.gpu else None
    if f:
        findings.append(f)
    for f in findings:
        f.ordered()
    findings.sort(key=lambda f: -f.cost_ms)
    d.findings = [f for f in findings if not is_minor(f, step)]
    d.minor = [f for f in findings if is_minor(f, step)]


_WHY_CPU = {"launch-bound": "kernel launches: the CPU enqueues slower than the GPU runs",
            "sync": "a sync leaves the GPU idle while the host works",
            "framework": "syncs in the framework leave the GPU idle while the host works"}


def _verdict(d: Diagnosis, m: Measured, speedups: list[str]) -> None:
    """The verdict and the headroom."""
    step, G, data_ms = m.step_ms, d.gpu_work_ms, m.summary.data_ms
    top = d.findings[0] if d.findings else None
    if not m.gpu or G is None:
        # The wait more workers could shorten: taking a batch a worker has ready (the handoff,
        # measured) the step waits anyway. A tutorial's CPU loop (batch 4, 2 workers) waited
        # 0.88 of 3.76 ms, 0.70 ms of it handoff: its fix wins 0.19 ms, not a data-bound loop.
        waiting = max(0.0, data_ms - (m.handoff_ms or 0.0))
        share = waiting / step if step else 0.0
        d.verdict_kind = "data-bound" if top is not None and top.kind == "starvation" and \
            share >= 0.1 else "CPU-bound"
        d.verdict = (f"{d.verdict_kind}: the loop runs on the CPU; data wait "
                     f"{data_ms:.2f} ms of {step:.2f} ms")
        d.headroom_ms = data_ms
        return
    idle = max(0.0, step - G)
    d.headroom_ms = idle
    d.headroom = (f"the step takes {step:.2f} ms and its GPU work {G:.2f} ms: at most "
                  f"{idle:.2f} ms/step ({_share(idle, step)}) can be won back without making "
                  "the GPU's work itself faster")
    if G >= GPU_BOUND * step:
        d.verdict_kind = "GPU-bound"
        d.verdict = (f"GPU-bound: the GPU works {G / step:.0%} of the step; " + (
            f"of the other {_share(idle, step)}, the first finding below wins back "
            f"{min(idle, top.cost_ms):.2f} ms; beyond that, speedups come from the model's "
            "own GPU work" if top is not None and top.cost_ms > 0 else
            "speedups now come from the model's own GPU work"))
        d.speedups = speedups
    elif top is not None and top.kind == "starvation":
        d.verdict_kind = "data-bound"
        d.verdict = (f"data-bound: the step waits {data_ms:.2f} ms for data while the "
                     f"GPU idles {idle / step:.0%}")
    else:
        d.verdict_kind = "CPU-bound"
        why = _WHY_CPU.get(top.kind, "host work") if top else ""
        if top is not None and top.kind == "launch-bound" and d.model_share is not None and \
                d.model_share < OUTSIDE_MODEL:
            # Most of the host's time outside the model: the launches of its ops are not what
            # outruns the GPU (a Lightning step at batch 1 on an H100: 38% of the samples in the
            # model's forward and backward, the rest Lightning's loop, self.log and data).
            why = (f"host work outside the model: {d.model_share:.0%} of the step's stack "
                   "samples are in the model's forward and backward, the rest in the loop's "
                   "and the framework's Python, the optimizer and data")
        d.verdict = (f"CPU-bound ({why}): the GPU idles "
                     f"{idle / step:.0%} of the step" if top else
                     f"CPU-bound: the GPU idles {idle / step:.0%} of the step; no single fix "
                     "found (see where the host time goes)")


def _share(ms: float, step: float) -> str:
    return f"{ms / step:.0%}" if step > 0 else "-"
