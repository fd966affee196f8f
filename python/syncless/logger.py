"""Logger: per-step metrics off the training loop's critical path.

The data path, top to bottom:

    Logger.__call__ / log()     validate the step, map names to columns (a dict lookup each)
      -> _C.Ring.gather()       one kernel launch writes the row; no sync (CUDA metrics)
         or a host row          CPU tensors and numbers read at once (no GPU involved)
    every `every` calls:
      -> _C.Ring.copy_to(win)   one async D2H copy of the ring into pinned memory + one event
      -> delivery thread        waits on the event (sleeping, GIL released), decodes the rows
                                and hands them to the sinks in step order

The training thread only waits when every pinned window is still undelivered (the sinks fell
behind): then it waits for one rather than drop data, and counts the wait in `stats.waits`.
"""
from __future__ import annotations

import atexit
import logging
import math
import queue
import threading
import time
import weakref
from typing import Any, Iterable, Mapping, NamedTuple

import torch

from ._torch import MAX_CELLS as _MAX_PER_CALL, _C

__all__ = ["Logger", "Row", "LoggerStats"]

_log = logging.getLogger("syncless")

_CAPTURED = _C.CAPTURED_TAG          # tag bit of a row written by a graph replay
_COLUMN_BLOCK = _C.COLUMN_BLOCK      # the ring grows its columns in blocks of one mask word

# CUDA graphs that captured a gather keep writing into that ring on every replay, even after
# the logger closed; keeping such rings alive (a few KB each) makes a late replay harmless.
_captured_rings: list = []
_live: "weakref.WeakSet[Logger]" = weakref.WeakSet()


class Row(NamedTuple):
    """One logged step as sinks receive it: plain Python floats, never tensors."""
    step: int
    time: float                      # host wall time (time.time()) of the log() call
    values: dict                     # {metric name: float}; absent metrics are absent


class LoggerStats(NamedTuple):
    steps: int                       # log() calls accepted
    delivered: int                   # rows handed to the sinks
    windows: int                     # device-to-host copies (CUDA) or host windows handed over
    waits: int                       # times log() waited because every window was undelivered
    nonfinite: dict                  # {metric: count of NaN/Inf values delivered}
    lost: int                        # rows overwritten before a flush (graph replays only)
    sink_errors: int                 # exceptions raised by sinks (each sink reported once)


class _Generation:
    """One device ring (it is replaced by a wider one when new metrics outgrow its columns)."""

    def __init__(self, device: int, capacity: int, columns: int):
        nbytes = _C.ring_nbytes(capacity, columns)
        self.memory = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{device}")
        self.ring = _C.Ring(device, self.memory.data_ptr(), capacity, columns)
        self.ring.clear()                                    # async memset, ordered first
        self.nbytes = nbytes
        self.next_seq = 0                                    # owned by the delivery thread
        self.captured = False


class _Window:
    __slots__ = ("pinned", "win", "nbytes")

    def __init__(self, device: int, nbytes: int):
        # Pinned memory: an async copy into pageable memory would block the caller.
        self.pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.win = _C.Window(device, self.pinned.data_ptr(), nbytes)
        self.nbytes = nbytes


class Logger:
    """Collect per-step metrics with zero host-device syncs and deliver them to sinks.

    >>> log = syncless.Logger(every=100, sinks=[syncless.sinks.JSONL("runs/m.jsonl")])
    >>> log(loss=loss, acc=acc)          # or log.log({"loss": loss}, step=step)
    >>> log.close()                      # or use `with syncless.Logger(...) as log:`

    Values are 0-dim or one-element tensors (CUDA or CPU, any real dtype, requires_grad fine)
    or Python numbers. The value recorded is the tensor's value at the call, in stream order.
    """

    def __init__(self, every: int = 100, sinks: Iterable[Any] | Any = (), *,
                 device: str | int | torch.device | None = None, capacity: int | None = None,
                 windows: int = 4, reduce: str | Mapping[str, str] | None = None,
                 sinks_on: str = "rank0"):
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be a positive int, got {every!r}")
        if windows < 1:
            raise ValueError(f"windows must be >= 1, got {windows!r}")
        if capacity is not None and capacity < every:
            raise ValueError(f"capacity ({capacity}) must hold at least one window ({every} rows)")
        if hasattr(sinks, "write"):
            sinks = [sinks]
        if sinks_on not in ("rank0", "all"):
            raise ValueError(f"sinks_on must be 'rank0' or 'all', got {sinks_on!r}")
        self._reducer = None
        if reduce is not None:
            from ._reduce import Reducer
            self._reducer = Reducer(reduce)
        self.rank = _rank()
        if sinks_on == "rank0" and self.rank != 0:
            sinks = []                   # data-parallel: rank 0 writes, the others only reduce
        self.every = every
        self.sinks = list(sinks)
        self.capacity = capacity or max(2 * every, 64)
        self._nwindows = windows
        self._columns: dict[str, int] = {}
        self._names: list[str] = []
        self._next_step = 0
        self._last_step = -1
        self._calls = 0
        self._since_flush = 0
        self._flush_due = False
        self._closed = False
        self._host_rows: list[Row] = []
        self._device = -1
        self._gen: _Generation | None = None
        self._ring = None                     # self._gen.ring, kept at hand for the hot path
        self._free: list[_Window] = []
        self._outstanding = 0                 # windows handed to the delivery thread
        self._cond = threading.Condition()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        # Statistics; the delivery thread owns the delivery-side counters.
        self._windows = 0
        self._waits = 0
        self._delivered = 0
        self._lost = 0
        self._nonfinite: dict[str, int] = {}
        self._sink_errors = 0
        self._failed_sinks: set[int] = set()
        self.latest: dict[str, float] = {}
        self.latest_step = -1
        _live.add(self)
        if device is not None:
            dev = torch.device(device)
            if dev.type == "cuda":
                self._bind(dev.index if dev.index is not None else torch.cuda.current_device())
            elif dev.type != "cpu":
                raise ValueError(f"device must be cpu or cuda, got {dev}")

    # ---- the hot path ------------------------------------------------------------------------

    def __call__(self, step: int | None = None, /, **metrics: Any) -> None:
        """log(loss=..., acc=...) logs at the next step; log(step, loss=...) or
        log(loss=..., step=7) at a given one."""
        if "step" in metrics:
            step = metrics.pop("step")
        self.log(metrics, step)

    def log(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Log one row: {name: value} at `step` (default: the step after the last one)."""
        if self._closed:
            raise ValueError("this Logger is closed; create a new one to log again")
        if type(metrics) is not dict:
            metrics = dict(metrics)
        step = self._next_step if step is None else self._take_step(step)
        ring = self._ring
        if ring is not None:
            try:
                captured = ring.gather(metrics, self._columns, self._calls, step, time.time())
            except KeyError:
                self._add_columns(metrics)
                captured = self._ring.gather(metrics, self._columns, self._calls, step,
                                             time.time())
        else:
            self._log_host(metrics, step)
            return
        self._calls += 1
        self._next_step = step + 1
        self._last_step = step
        if captured:
            self._gen.captured = True
            return                                   # nothing else may happen under capture
        self._since_flush += 1
        if self._since_flush >= self.every or self._flush_due:
            self._flush_window()

    def _log_host(self, metrics: dict, step: int) -> None:
        """Before any CUDA metric: values are read now and kept as host rows."""
        if len(metrics) > _MAX_PER_CALL:                 # the same limit as the kernel's
            raise ValueError(f"at most {_MAX_PER_CALL} metrics per call (got {len(metrics)}); "
                             "split them over two calls with the same step")
        device, values = _C.read_host_values(metrics)
        if values is None:                               # the first CUDA metric binds the ring
            self._bind(device)
            self.log(metrics, step)
            return
        self._add_columns(metrics)
        self._host_rows.append(Row(step, time.time(), values))
        self._calls += 1
        self._next_step = step + 1
        self._last_step = step
        self._since_flush += 1
        if self._since_flush >= self.every:
            self._flush_window()

    def _take_step(self, step: Any) -> int:
        if step is None:
            return self._next_step
        if isinstance(step, bool) or not isinstance(step, int):
            try:
                step = int(step.__index__())         # numpy ints; tensors raise (no sync)
            except (AttributeError, TypeError):
                raise TypeError(f"step must be an int, got {type(step).__name__}") from None
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if step < self._last_step:
            raise ValueError(f"step {step} is before the last logged step {self._last_step}; "
                             "steps must not go backwards")
        return step

    def _add_columns(self, metrics: Mapping[str, Any]) -> None:
        for name in metrics:
            if not isinstance(name, str):
                raise TypeError(f"metric names must be str, got {name!r}")
        new = [n for n in metrics if n not in self._columns]
        if self._gen is not None and len(self._names) + len(new) > self._gen.ring.columns:
            self._grow(len(self._names) + len(new))
        for name in new:
            self._columns[name] = len(self._names)
            self._names.append(name)

    # ---- device ring -------------------------------------------------------------------------

    def _bind(self, device: int) -> None:
        if self._gen is not None:
            return
        with torch.cuda.device(device):
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    "syncless.Logger: the first CUDA log() happened during CUDA graph capture; "
                    "its device ring must be allocated before capture. Call log() once before "
                    "capturing (warm-up), or create the logger with device='cuda'.")
            self._hand_over_host_rows()
            columns = max(_COLUMN_BLOCK, -(-len(self._names) // _COLUMN_BLOCK) * _COLUMN_BLOCK)
            self._gen = _Generation(device, self.capacity, columns)
            self._ring = self._gen.ring
        self._device = device

    def _grow(self, needed: int) -> None:
        gen = self._gen
        if gen.captured:
            raise ValueError(
                f"cannot add metric #{needed}: the ring is full and a CUDA graph captured it, so "
                "it cannot move. Log every metric name once before capturing.")
        with torch.cuda.device(self._device):
            if self._since_flush:
                self._flush_window()
            columns = -(-needed // _COLUMN_BLOCK) * _COLUMN_BLOCK * 2
            self._gen = _Generation(self._device, self.capacity, columns)
            self._ring = self._gen.ring
            self._free = []                          # old windows are too small; let them go

    def _take_window(self) -> _Window:
        with self._cond:
            while not self._free and self._outstanding >= self._nwindows:
                self._waits += 1                     # backpressure: wait, never drop
                self._cond.wait()
            self._outstanding += 1
            if self._free:
                return self._free.pop()
        return _Window(self._device, self._gen.nbytes)

    def _flush_window(self) -> None:
        """Hand the rows since the last flush to the delivery thread. Never waits on the GPU."""
        self._flush_due = False
        if self._gen is None:
            self._hand_over_host_rows()
            return
        if self._since_flush == 0 and not self._gen.captured:
            return
        ring = self._gen.ring
        with torch.cuda.device(self._device):
            if ring.capturing():
                self._flush_due = True               # no copies inside a capture: next call
                return
            if self._reducer is not None:        # enqueued before the copy, same stream
                self._reducer.reduce_ring(self._gen.memory, ring.capacity, ring.columns,
                                          self._names)
            w = self._take_window()
            ring.copy_to(w.win)
        self._since_flush = 0
        self._windows += 1
        self._submit(("window", self._gen, w, time.time()))

    def _hand_over_host_rows(self) -> None:
        if not self._host_rows:
            return
        rows, self._host_rows = self._host_rows, []
        self._since_flush = 0
        if self._reducer is not None:
            rows = self._reducer.reduce_rows(rows, self._names)
        with self._cond:
            while self._outstanding >= self._nwindows:
                self._waits += 1
                self._cond.wait()
            self._outstanding += 1
        self._windows += 1
        self._submit(("rows", rows))

    def _submit(self, job: tuple) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._deliver_loop, name="syncless-delivery",
                                            daemon=True)
            self._thread.start()
        self._jobs.put(job)

    # ---- delivery (its own thread) -----------------------------------------------------------

    def _deliver_loop(self) -> None:
        while True:
            job = self._jobs.get()
            kind = job[0]
            if kind == "stop":
                return
            if kind == "marker":
                job[1].set()
                continue
            try:
                if kind == "rows":
                    rows = job[1]
                    for row in rows:
                        self._count_nonfinite(row.values)
                else:
                    rows = self._decode(*job[1:])
                self._emit(rows)
            except BaseException as exc:             # never let the thread die silently
                _log.exception("syncless: delivery failed: %s", exc)
            finally:
                if kind == "window":
                    gen, w = job[1], job[2]
                    with self._cond:
                        if gen is self._gen and w.nbytes >= gen.nbytes:
                            self._free.append(w)
                        self._outstanding -= 1
                        self._cond.notify()
                else:
                    with self._cond:
                        self._outstanding -= 1
                        self._cond.notify()

    def _count_nonfinite(self, values: dict) -> None:
        for name, v in values.items():
            if not math.isfinite(v):
                self._nonfinite[name] = self._nonfinite.get(name, 0) + 1

    def _decode(self, gen: _Generation, w: _Window, flushed_at: float) -> list[Row]:
        w.win.wait()
        counter, raw = w.win.decode(gen.next_seq, self._names, self._nonfinite)
        oldest = max(gen.next_seq, counter - gen.ring.capacity)
        self._lost += oldest - gen.next_seq
        gen.next_seq = counter
        # A graph replay's step was computed on the device (capture step + replay index); the
        # host saw no call, so its time is that of the flush that found the row.
        rows = [Row(step, flushed_at if tag & _CAPTURED else t, values)
                for _seq, tag, step, t, _gpu_ns, values in raw]
        return rows

    def _emit(self, rows: list[Row]) -> None:
        if not rows:
            return
        for i, sink in enumerate(self.sinks):
            try:
                sink.write(rows)
            except Exception as exc:
                self._sink_failed(i, sink, exc)
        self._delivered += len(rows)
        last = rows[-1]
        for row in rows:
            self.latest.update(row.values)
        self.latest_step = last.step

    def _sink_failed(self, i: int, sink: Any, exc: BaseException) -> None:
        self._sink_errors += 1
        if i not in self._failed_sinks:
            self._failed_sinks.add(i)
            _log.error("syncless: sink %r raised %s: %s (reported once; the other sinks go on)",
                       sink, type(exc).__name__, exc)

    # ---- draining ----------------------------------------------------------------------------

    def flush(self, wait: bool = True) -> None:
        """Hand over every row logged so far; with wait=True (default), return once the sinks
        have them. wait=False only enqueues the copy (useful between CUDA graph replays)."""
        if self._closed:
            return
        if self._gen is not None and self._gen.ring.capturing():
            raise RuntimeError("flush() inside CUDA graph capture: flush after capture ends")
        self._flush_window()
        if wait:
            self._drain()

    def _drain(self) -> None:
        if self._thread is None:
            return
        done = threading.Event()
        self._jobs.put(("marker", done))
        done.wait()
        for sink in self.sinks:
            flush = getattr(sink, "flush", None)
            if flush is not None:
                try:
                    flush()
                except Exception as exc:
                    self._sink_failed(self.sinks.index(sink), sink, exc)

    def close(self) -> None:
        """Deliver everything, close the sinks and stop the delivery thread. Idempotent."""
        if self._closed:
            return
        if self._gen is not None and self._gen.ring.capturing():
            # Refused before anything changes: the logger stays open and loses nothing.
            raise RuntimeError("close() inside CUDA graph capture: close after capture ends")
        try:
            self._flush_window()
            self._drain()
        finally:
            self._closed = True
            if self._thread is not None:
                self._jobs.put(("stop",))
                self._thread.join()
            for i, sink in enumerate(self.sinks):
                close = getattr(sink, "close", None)
                if close is not None:
                    try:
                        close()
                    except Exception as exc:
                        self._sink_failed(i, sink, exc)
            if self._gen is not None and self._gen.captured:
                _captured_rings.append(self._gen.memory)
            self._gen = self._ring = None
            self._free = []
            _live.discard(self)

    def __enter__(self) -> "Logger":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def last_step(self) -> int:
        """The step of the last log() call; -1 before the first."""
        return self._last_step

    @property
    def stats(self) -> LoggerStats:
        return LoggerStats(self._calls, self._delivered, self._windows, self._waits,
                           dict(self._nonfinite), self._lost, self._sink_errors)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu") if self._device < 0 else torch.device("cuda", self._device)

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self._calls} steps"
        return f"<syncless.Logger on {self.device}, every={self.every}, {state}>"


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


@atexit.register
def _close_all() -> None:
    for log in list(_live):
        try:
            log.close()
        except Exception as exc:
            _log.error("syncless: closing %r at exit failed: %s", log, exc)
