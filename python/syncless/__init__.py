"""syncless: take the host-device syncs out of a PyTorch training loop's bookkeeping.

    log = syncless.Logger(every=100, sinks=[syncless.sinks.JSONL("runs/metrics.jsonl")])
    log(loss=loss, acc=acc)              # one kernel launch, zero syncs; delivered every 100 steps
    log.close()                          # delivers everything (so do `with`, and interpreter exit)

    with syncless.timer() as t: y = model(x)
    t.ms                                 # GPU milliseconds, waiting for the end event: never early

    syncless.doctor(train_step, steps=30)    # where the step's time goes, and what to change

Drop-ins: `from syncless.tensorboard import SummaryWriter`, `import syncless.wandb as wandb`,
`syncless.tqdm(loader, log=log)`. Importing syncless never initialises CUDA, so DataLoader
workers and forked children import it safely; the doctor and the framework integrations
(`syncless.lightning`, `syncless.hf`) are imported at their first use.
"""
import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

from . import sinks
from ._C import CudaError
from .logger import Logger, LoggerStats, Row
from .progress import tqdm
from .timer import Report, Stats, Timer, Timing, bench, timer, timers

if TYPE_CHECKING:                  # at run time imported at first use: see __getattr__
    from . import hf, lightning, tensorboard, wandb
    from .doctor import (Diagnosis, Finding, MonitorSummary, StepMonitor, Watch, doctor, step,
                         watch)
    from .doctor.audit import Audit, SyncError, audit

__version__ = "0.1.0"          # the one place the version is written (pyproject reads it)

__all__ = [
    # sync-free metrics: Logger(...)(**metrics); sinks get Row(step, time, values); log.stats
    "Logger", "Row", "LoggerStats", "sinks",
    # GPU timing that cannot be read early: timer() -> Timer, `with` -> Timing; bench -> Stats
    "timer", "timers", "bench", "Timer", "Timing", "Stats", "Report",
    # finding what stalls the loop: audit() -> Audit, watch() -> Watch, doctor() -> Diagnosis
    "audit", "Audit", "SyncError", "watch", "Watch", "StepMonitor", "MonitorSummary",
    "doctor", "Diagnosis", "Finding", "step",
    "tqdm", "CudaError", "load_ipython_extension", "__version__",
]

# Imported at first use, so `import syncless` loads neither the doctor (the larger half of the
# package) nor a framework: the diagnosis names from .doctor, and the drop-ins and integrations
# as modules (syncless.lightning, .hf, .wandb, .tensorboard; each imports its framework itself).
_LAZY = dict.fromkeys(["audit", "Audit", "SyncError", "watch", "Watch", "StepMonitor",
                       "MonitorSummary", "doctor", "Diagnosis", "Finding", "step"], ".doctor")
_MODULES = ("hf", "lightning", "tensorboard", "wandb")


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        return importlib.import_module(f".{name}", __name__)   # binds itself here
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module 'syncless' has no attribute {name!r}")
    value = getattr(importlib.import_module(where, __name__), name)
    globals()[name] = value        # also rebinds `doctor`, which the import bound to the package
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | set(_MODULES))


class _Package(types.ModuleType):
    """`syncless.doctor` is the function, whoever imports the package `syncless.doctor` first
    (`from syncless.doctor import audit` makes the import system bind the package here)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if not (name == "doctor" and isinstance(value, types.ModuleType)):
            super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def load_ipython_extension(ipython: Any) -> None:
    """`%load_ext syncless`: the %gputime / %%gputime and %gputimeit / %%gputimeit magics.
    IPython is imported only here, so syncless never needs it."""
    from ._magics import TimerMagics
    ipython.register_magics(TimerMagics)
