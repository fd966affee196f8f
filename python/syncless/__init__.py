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
from . import sinks
from ._C import CudaError
from .doctor import StepMonitor, SyncError, audit, doctor, step, watch
from .logger import Logger, LoggerStats, Row
from .progress import tqdm
from .timer import bench, load_ipython_extension, timer, timers

__version__ = "0.1.0"

__all__ = [
    "Logger", "LoggerStats", "Row", "sinks",         # sync-free metrics
    "timer", "timers", "bench",                      # GPU timing that cannot be read early
    "audit", "watch", "StepMonitor", "doctor", "SyncError", "step",   # what stalls the loop
    "tqdm", "CudaError", "load_ipython_extension", "__version__",
]
