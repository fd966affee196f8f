"""syncless: take the host-device syncs out of a PyTorch training loop's bookkeeping.

    log = syncless.Logger(every=100, sinks=[syncless.sinks.JSONL("runs/metrics.jsonl")])
    log(loss=loss, acc=acc)              # one kernel launch, zero syncs; delivered every 100 steps
    log.close()                          # delivers everything (so do `with`, and interpreter exit)

    with syncless.timer() as t: y = model(x)
    t.ms                                 # GPU milliseconds, waiting for the end event: never early

    syncless.doctor(train_step, steps=30)    # where the step's time goes, and what to change

Drop-ins: `from syncless.tensorboard import SummaryWriter`, `import syncless.wandb as wandb`,
`syncless.tqdm(loader, log=log)`. Importing syncless never initialises CUDA, so DataLoader
workers and forked children import it safely.
"""
from typing import Any

from . import sinks
from ._C import CudaError
from .doctor import (Audit, Diagnosis, Finding, MonitorSummary, StepMonitor, SyncError, Watch,
                     audit, doctor, step, watch)
from .logger import Logger, LoggerStats, Row
from .progress import tqdm
from .timer import Report, Stats, Timer, Timing, bench, timer, timers

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


def load_ipython_extension(ipython: Any) -> None:
    """`%load_ext syncless`: the %gputime / %%gputime and %gputimeit / %%gputimeit magics.
    IPython is imported only here, so syncless never needs it."""
    from ._magics import TimerMagics
    ipython.register_magics(TimerMagics)
