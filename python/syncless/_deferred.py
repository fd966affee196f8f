"""The drop-in adapters' shared core: host-side records whose tensors a private Logger gathers.

`put(tensors, record)` logs the record's tensors as one row (one kernel launch, no sync; the row's
step is the record's sequence number) and keeps the record itself on the host. On the logger's
delivery thread, `replay(record, row)` runs for every row, in call order, with the values read.
syncless.tensorboard and syncless.wandb are this plus the call that writes to their backend.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable

from .logger import Logger, Row


class _Rows:
    """A Logger sink that hands whole windows to one function."""
    __slots__ = ("write",)

    def __init__(self, write: Callable[[list], None]):
        self.write = write


class Deferred:
    def __init__(self, replay: Callable[[Any, Row], None], every: int = 50,
                 max_delay: float | None = 2.0):
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be a positive int, got {every!r}")
        self.every = every
        self.max_delay = max_delay          # seconds after which a put() hands rows over anyway
        self._replay = replay
        self._lock = threading.Lock()       # callers may log from several threads
        self._pending: dict[int, Any] = {}  # sequence number -> record
        self._seq = 0
        self._handed = time.monotonic()
        self._logger: Logger | None = None

    def put(self, tensors: dict, record: Any) -> None:
        with self._lock:
            log = self._logger
            if log is None:
                log = self._logger = Logger(every=self.every, sinks=[_Rows(self._deliver)])
            seq = self._seq
            self._pending[seq] = record
            try:
                log.log(tensors, seq)
            except BaseException:
                del self._pending[seq]
                raise
            self._seq = seq + 1
            if self.max_delay is not None:
                now = time.monotonic()
                if now - self._handed >= self.max_delay:
                    self._handed = now
                    log.flush(wait=False)           # enqueues one copy; never waits

    def _deliver(self, rows: list) -> None:
        for row in rows:
            record = self._pending.pop(row.step, None)
            if record is not None:                  # None: a CUDA graph replay, no host record
                self._replay(record, row)

    def flush(self) -> None:
        """Replay everything put so far (waits for the GPU to reach it)."""
        with self._lock:
            if self._logger is not None:
                self._logger.flush(wait=True)

    def close(self) -> None:
        """Replay everything and stop the private logger (a later put() starts a new one)."""
        with self._lock:
            log, self._logger = self._logger, None
        if log is not None:
            log.close()
