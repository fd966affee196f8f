"""`python -m syncless doctor script.py [args]`: the doctor for a whole script.

Steps are the script's optimizer steps (a global optimizer post-step hook marks each boundary),
data wait is the time spent in DataLoader iterators' next(). After `--warmup` + `--steps`
monitored steps and `--audit-steps` audited ones, the script is stopped and the report printed.
"""
from __future__ import annotations

import argparse
import os
import runpy
import sys

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from .audit import Audit
from .diagnose import Diagnosis, timed_dataloaders
from .monitor import StepMonitor
from .report import sync_findings, starvation_finding


class _Done(BaseException):
    """Stops the script once enough steps were seen (BaseException: `except Exception` in the
    script must not swallow it)."""


class ScriptSession:
    def __init__(self, warmup: int, steps: int, audit_steps: int):
        self.warmup, self.steps, self.audit_steps = warmup, steps, audit_steps
        self.monitor = StepMonitor()
        self.audit = Audit(steps=audit_steps)
        self.seen = 0
        self.auditing = False

    def on_step(self, optimizer, args, kwargs) -> None:
        self.seen += 1
        mon = self.monitor
        if self.seen <= self.warmup + self.steps:
            mon.end()
            if self.seen < self.warmup + self.steps:
                mon.begin()
            else:
                self.audit.__enter__()
                self.auditing = True
            return
        if self.seen >= self.warmup + self.steps + self.audit_steps:
            self.stop_audit()
            raise _Done

    def stop_audit(self) -> None:
        if self.auditing:
            self.auditing = False
            self.audit.__exit__(None, None, None)

    def diagnosis(self) -> Diagnosis:
        self.monitor.drain()
        m = self.monitor.summary(skip=self.warmup)
        gpu = torch.cuda.is_available() and torch.cuda.is_initialized()
        d = Diagnosis(m, self.audit, self.warmup, m.step_ms, gpu)
        d.gpu_busy_ms = m.gpu_ms or 0.0
        if self.audit.backend == "cupti":
            d.sync_ms = self.audit.blocked_ms_per_step()
            d.kernels = self.audit.kernels / max(1, self.audit.step_count)
        findings = sync_findings(self.audit, m.step_ms)
        f = starvation_finding(m.data_ms, m.step_ms, m.idle if gpu else None, m.loader)
        if f:
            findings.append(f)
        d.findings = sorted(findings, key=lambda f: -f.cost_ms)
        d.verdict = "no stall costs a significant share of the step"
        if m.steps == 0:
            d.notes.append("no optimizer step was seen: steps are counted at optimizer.step()")
        if gpu:
            d.notes.append("launch-bound check: run syncless.doctor(train_step) (it replays steps "
                           "behind a GPU sleep to measure the GPU work alone)")
        return d


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m syncless doctor",
                                description="Run a training script and diagnose its loop.")
    p.add_argument("--steps", type=int, default=30, help="monitored steps (default 30)")
    p.add_argument("--warmup", type=int, default=3, help="unmeasured first steps (default 3)")
    p.add_argument("--audit-steps", type=int, default=10, help="audited steps (default 10)")
    p.add_argument("script")
    p.add_argument("args", nargs=argparse.REMAINDER)
    ns = p.parse_args(argv)
    session = ScriptSession(ns.warmup, ns.steps, ns.audit_steps)
    hook = register_optimizer_step_post_hook(session.on_step)
    sys.argv = [ns.script, *ns.args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(ns.script)))
    session.monitor.begin()
    try:
        with timed_dataloaders(session.monitor):
            runpy.run_path(ns.script, run_name="__main__")
    except _Done:
        pass
    finally:
        hook.remove()
        session.stop_audit()
    if session.monitor._t0 is not None:          # the script ended inside a step
        session.monitor._t0 = None
    print(session.diagnosis().report())
    return 0
