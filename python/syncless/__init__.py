"""syncless: take the host-device syncs out of a PyTorch training loop's bookkeeping.

    log = syncless.Logger(every=100, sinks=[syncless.sinks.JSONL("runs/metrics.jsonl")])
    log(loss=loss, acc=acc)          # one kernel launch, zero syncs
    log.close()                      # delivers everything

Importing syncless never initialises CUDA: DataLoader workers and forked children import it safely.
"""
from . import sinks
from ._C import CudaError
from .logger import Logger, LoggerStats, Row

__version__ = "0.1.0"

__all__ = ["Logger", "LoggerStats", "Row", "CudaError", "sinks", "__version__"]
