"""The doctor: find what stalls a training loop, name the line and the fix.

    with syncless.audit() as a: ...              # every host-device sync, with its line
    for batch in syncless.watch(loader): ...     # always-on: data wait, CPU and GPU per step
    syncless.doctor(train_step, steps=30)        # all of it, plus a GPU probe: one ranked report
    python -m syncless doctor script.py          # the same for a whole script
    syncless.step()                              # marks a step's end for the script doctor
"""
from ._boundary import step
from .audit import Audit, SyncError, SyncSite, audit
from ._api import doctor
from .diagnose import Diagnosis
from .findings import Finding, Fix
from .monitor import MonitorSummary, StepMonitor, Watch, watch

__all__ = ["audit", "Audit", "SyncError", "SyncSite", "watch", "Watch", "StepMonitor",
           "MonitorSummary", "doctor", "Diagnosis", "Finding", "Fix", "step"]
