"""python -m syncless doctor [options] script.py [args]: the doctor for a whole script.

A step is what runs between two optimizer.step() calls (a global optimizer post-step hook marks
each boundary); data wait is the time spent in DataLoader iterators' next(). The script runs
through these phases, one after another, at its step boundaries:

  warm-up  --warmup steps, not measured (lazy loading, autotuning, allocator growth)
  monitor  --steps steps: data wait, CPU time and GPU time of every step; the GPU is drained
           at both ends, so wall time / steps is the real step time
  probe    (CUDA) --probe-steps steps, each queued behind a GPU sleep kernel so that its kernels
           run back to back: the GPU work a step needs, for the launch-bound verdict
  audit    --audit-steps steps under CUPTI: every sync with its line, kernels per step
  trace    (--trace PATH) --trace-steps steps under torch.profiler, written to PATH for
           https://ui.perfetto.dev; last, because torch.profiler takes CUPTI over

Then the script is stopped and the report printed. A script that ends sooner gets the report of
what was measured, with a note naming the phases that did not run.
"""
from __future__ import annotations

import argparse
import os
import runpy
import sys
from time import perf_counter

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from .audit import Audit
from .diagnose import Diagnosis, QueueProbe, assess, profiler, timed_dataloaders
from .monitor import StepMonitor

PHASES = ("warm-up", "monitor", "probe", "audit", "trace")


class _Done(BaseException):
    """Stops the script once enough steps were seen (BaseException: `except Exception` in the
    script must not swallow it)."""


def _cuda() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


class ScriptSession:
    """Runs a script, moving through the phases at its optimizer steps."""

    def __init__(self, warmup: int = 3, steps: int = 30, probe_steps: int = 3,
                 audit_steps: int = 10, trace: str | None = None, trace_steps: int = 3):
        self.plan = {"warm-up": warmup, "monitor": steps, "probe": probe_steps,
                     "audit": audit_steps, "trace": trace_steps if trace else 0}
        self.done = dict.fromkeys(PHASES, 0)     # finished steps per phase
        self.entered: list[str] = []
        self.phase: str | None = None
        self.trace = trace
        self.traced = False
        self.seen = 0
        self.monitor = StepMonitor(gpu_every=1)
        self.audit = Audit()
        self.probe: QueueProbe | None = None
        self.step_ms: float | None = None        # drained wall / monitored steps
        self.gpu_pure_ms: float | None = None
        self._profile = None
        self._t0 = 0.0
        self._hook = None

    # ---- running --------------------------------------------------------------------------------

    def run(self, path: str, args: list[str]) -> None:
        """Run the script as __main__ until the last phase is done or the script ends."""
        saved_argv, saved_path = sys.argv, sys.path[:]
        sys.argv = [path, *args]
        sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
        self._hook = register_optimizer_step_post_hook(self.on_step)
        try:
            self._enter(self._after(None))
            self._open_step()
            with timed_dataloaders(self.monitor):
                runpy.run_path(path, run_name="__main__")
        except _Done:
            pass
        finally:
            self._hook.remove()
            sys.argv, sys.path[:] = saved_argv, saved_path
            if self.phase is not None:
                self._leave(finished=False)

    def on_step(self, optimizer, args, kwargs) -> None:
        if torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing():
            return                  # a step recorded into a CUDA graph does not run now
        self.seen += 1
        if self.phase is None:
            return
        self._close_step()
        self.done[self.phase] += 1
        if self.done[self.phase] < self.plan[self.phase]:
            self._open_step()
            return
        self._leave(finished=True)
        following = self._after(self.entered[-1])
        if following is None:
            raise _Done
        self._enter(following)
        self._open_step()

    def _after(self, phase: str | None) -> str | None:
        rest = PHASES[PHASES.index(phase) + 1:] if phase else PHASES
        return next((p for p in rest if self.plan[p] > 0), None)

    def _open_step(self) -> None:
        if self.phase in ("warm-up", "monitor"):
            self.monitor.begin()
        elif self.phase == "probe":
            self.probe.begin()

    def _close_step(self) -> None:
        if self.phase in ("warm-up", "monitor"):
            self.monitor.end()
        elif self.phase == "probe":
            self.probe.end()

    def _drained_clock(self) -> float:
        if _cuda():
            torch.cuda.synchronize()
        return perf_counter()

    def _enter(self, phase: str) -> None:
        self.phase = phase
        self.entered.append(phase)
        if phase == "monitor":
            self._t0 = self._drained_clock()
        elif phase == "probe":
            self.probe = QueueProbe(self.step_ms)
        elif phase == "audit":
            self.audit.__enter__()
            # torch iterates the global hooks while it calls this one, and removing a hook it has
            # not reached yet raises "OrderedDict mutated during iteration": keep ours the last
            # one, since the audit's __exit__ (called from ours) removes the audit's hook.
            self._hook.remove()
            self._hook = register_optimizer_step_post_hook(self.on_step)
        elif phase == "trace":
            self._profile = profiler(_cuda())
            self._profile.__enter__()

    def _leave(self, finished: bool) -> None:
        phase, self.phase = self.phase, None
        if phase == "monitor" and finished:
            self.step_ms = (self._drained_clock() - self._t0) * 1e3 / self.done["monitor"]
            if not _cuda():
                self.plan["probe"] = 0
        elif phase == "probe":
            self.gpu_pure_ms = self.probe.median_ms()
        elif phase == "audit":
            self.audit.__exit__(None, None, None)
            self.audit.steps = max(1, self.done["audit"])
        elif phase == "trace":
            if _cuda():
                torch.cuda.synchronize()
            self._profile.__exit__(None, None, None)
            self._profile.export_chrome_trace(self.trace)
            self.traced = True

    # ---- the report -----------------------------------------------------------------------------

    def diagnosis(self) -> Diagnosis:
        """The Diagnosis of what was measured (call after run())."""
        self.monitor.drain()
        warmup = self.plan["warm-up"]
        m = self.monitor.summary(skip=warmup)
        gpu = _cuda()
        if not gpu:
            self.plan["probe"] = 0
        notes = []
        if self.seen == 0:
            notes.append("no optimizer step was seen: steps are counted at optimizer.step()")
        else:
            missed = self._missed()
            if missed:
                notes.append(f"the script ended after {self.seen} optimizer steps: {missed}; "
                             f"all phases take {sum(self.plan.values())} steps (lower --steps "
                             "or --audit-steps, or let the script run longer)")
        if "audit" not in self.entered:
            self.audit.reason = "the script ended before the audit"
        step_ms = self.step_ms if self.step_ms is not None else m.step_ms
        d = assess(m, self.audit, min(self.seen, warmup), step_ms, gpu, m.gpu_ms,
                   self.gpu_pure_ms, self.probe.steps if self.probe else 0, notes)
        if self.traced:
            d.trace = self.trace
        return d

    def _missed(self) -> str:
        parts = []
        for phase in PHASES:
            want, got = self.plan[phase], self.done[phase]
            if got < want:
                parts.append(f"the {phase} ran {got} of {want} steps" if phase in self.entered
                             else f"the {phase} did not run")
        return ", ".join(parts)


def _count(least: int):
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if n < least:
            raise argparse.ArgumentTypeError(f"must be at least {least}, got {n}")
        return n
    return parse


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m syncless doctor", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--warmup", type=_count(0), default=3, metavar="N",
                   help="unmeasured first steps (default 3)")
    p.add_argument("--steps", type=_count(1), default=30, metavar="N",
                   help="monitored steps (default 30)")
    p.add_argument("--probe-steps", type=_count(1), default=3, metavar="N",
                   help="steps queued behind a GPU sleep, CUDA only (default 3)")
    p.add_argument("--audit-steps", type=_count(1), default=10, metavar="N",
                   help="audited steps (default 10)")
    p.add_argument("--trace", metavar="PATH",
                   help="write a torch.profiler trace (Chrome/Perfetto JSON) of the last steps")
    p.add_argument("--trace-steps", type=_count(1), default=3, metavar="N",
                   help="traced steps with --trace (default 3)")
    p.add_argument("script", help="the training script, run as __main__")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    ns = p.parse_args(argv)
    if not os.path.isfile(ns.script):
        p.error(f"script not found: {ns.script}")
    if ns.trace:
        folder = os.path.dirname(os.path.abspath(ns.trace))
        if not os.path.isdir(folder):
            p.error(f"--trace: folder {folder} does not exist")
    return ns


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    session = ScriptSession(ns.warmup, ns.steps, ns.probe_steps, ns.audit_steps, ns.trace,
                            ns.trace_steps)
    try:
        session.run(ns.script, ns.args)
    finally:
        # Also when the script fails or exits: the report of what was measured, then its error.
        print(session.diagnosis().report(), flush=True)
    return 0
