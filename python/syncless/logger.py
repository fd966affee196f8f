"""Logger: per-step metrics off the training loop's critical path.

The data path, top to bottom:

    Logger.__call__ / log()     validate the step, map names to columns (a dict lookup each)
      -> _C.Ring.gather()       one kernel launch writes the row; no sync (CUDA metrics)
         or a host row          CPU tensors and numbers read at once (no GPU involved)
    every `every` calls:
      -> _handover.Handover     one async D2H copy of the ring into a pinned window + one event
      -> _delivery.Delivery     on its own thread: waits on the event (sleeping, GIL released),
                                decodes the rows and hands them to the sinks in step order;
                                with delivery="caller", on this thread at the next flush, once
                                the event says the copy landed (never waiting for it)

This module is the training thread's side (schema, steps, ring, capture); `_handover` owns the
windows, backpressure and the driver, `_delivery` what happens to the rows after. The training
thread only waits when every pinned window is still undelivered (the sinks fell behind): then it
waits for one rather than drop data (`stats.waits`). How interrupts are kept from losing or
repeating rows is told in `_handover`'s docstring.
"""
from __future__ import annotations

import atexit
import functools
import logging
import os
import sys
import _thread
import threading
import time
import weakref
from types import FrameType
from typing import (TYPE_CHECKING, Any, Callable, Iterable, Mapping, NamedTuple, NoReturn,
                    TypeVar)

import torch

from . import _compile
from ._delivery import Delivery
from ._handover import CallerHandover, Handover, ThreadHandover
from ._late import Late
from ._ring import DeviceRing
from ._torch import MAX_CELLS as _MAX_PER_CALL, _C
from ._checks import LOGGER_EVERY, check_every, check_max_delay
from .rows import RESERVED, Row, check_sinks

if TYPE_CHECKING:
    from ._ranks import Stragglers

__all__ = ["Logger", "Row", "LoggerStats"]

_log = logging.getLogger("syncless")

_COLUMN_BLOCK = _C.COLUMN_BLOCK      # the ring grows its columns in blocks of one mask word

# CUDA graphs that captured a gather keep writing into that ring on every replay, even after
# the logger closed; keeping such rings alive (a few KB each) makes a late replay harmless.
_captured_rings: list[torch.Tensor] = []
_get_ident = threading.get_ident
_UNOWNED, _SHARED = -1, -2                   # Logger._owner before the first call / threads=True
_DELIVERING = -3                             # ... while delivery="caller" runs the sinks
_live: "weakref.WeakSet[Logger]" = weakref.WeakSet()
_INF = float("inf")
_NO_TIMEOUT: Any = object()
_T = TypeVar("_T")


class LoggerStats(NamedTuple):
    steps: int                       # log() calls accepted
    delivered: int                   # rows of those calls handed to the sinks
    windows: int                     # device-to-host copies (CUDA) or host windows handed over
    waits: int                       # times log() waited because every window was undelivered
    nonfinite: dict[str, int]        # {metric: count of NaN/Inf values delivered}
    lost: int                        # rows overwritten before a flush (graph replays only)
    sink_errors: int                 # exceptions raised by sinks (each sink reported once)
    late_errors: int                 # attached values that failed, were refused or collided
    missing: int = 0                 # late values (attach(), timers) and device copies that
                                     # close() stopped waiting for after close_timeout


def _check_options(every: Any, windows: Any, capacity: Any, max_delay: Any, sinks_on: Any,
                   delivery: Any, reduce_on: Any = "host") -> None:
    check_every(every)
    check_every(windows, "windows")
    check_max_delay(max_delay)
    if capacity is not None:
        if isinstance(capacity, bool) or not isinstance(capacity, int):
            raise ValueError(f"capacity must be an int, got {capacity!r}")
        if capacity < every:
            raise ValueError(f"capacity ({capacity}) must hold at least one window "
                             f"({every} rows)")
    if sinks_on not in ("rank0", "all"):
        raise ValueError(f"sinks_on must be 'rank0' or 'all', got {sinks_on!r}")
    if reduce_on not in ("host", "device"):
        raise ValueError(f"reduce_on must be 'host' (the delivered rows are reduced on a gloo "
                         f"group, off the training stream) or 'device' (an all-reduce on the "
                         f"training stream at each flush), got {reduce_on!r}")
    if delivery not in ("thread", "caller"):
        raise ValueError(f"delivery must be 'thread' (a thread of the logger's calls the "
                         f"sinks) or 'caller' (the logging thread does, at its flushes), "
                         f"got {delivery!r}")


def _check_step(given: Any) -> int:
    step: int
    if isinstance(given, bool):
        raise TypeError(f"step must be an int, got the bool {given!r}")
    if isinstance(given, int):
        step = given
    else:
        if isinstance(given, torch.Tensor):
            raise TypeError("step must be a Python int, got a tensor: reading it would sync "
                            "the GPU; pass the loop's own int counter (or omit step)")
        try:
            step = int(given.__index__())        # numpy ints
        except (AttributeError, TypeError):
            raise TypeError(f"step must be an int, got {type(given).__name__}") from None
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return step


def _check_name(name: Any, attached: bool = False) -> None:
    if not isinstance(name, str):
        raise TypeError(f"metric names must be str, got {name!r}")
    if name in RESERVED:
        fix = "pick another name" if attached else f"rename the metric, e.g. 'train/{name}'"
        raise ValueError(f"metric name {name!r} is reserved: every row has its own step and "
                         f"time (the JSONL and CSV sinks write them as fields); {fix}")


def _make_reducer(reduce: str | Mapping[str, str]) -> Any:
    from ._reduce import Reducer         # torch.distributed's side: only when asked for
    return Reducer(reduce)


def _make_ranks(reduce: str | Mapping[str, str], every: int, max_delay: float | None) -> Any:
    from ._ranks import Ranks
    # A rank with nothing new still joins an exchange this often, so the others' rows go on.
    heartbeat = min(1.0, max(0.05, 1.0 if max_delay is None else max_delay))
    return Ranks(reduce, every, heartbeat)


def _cuda_index(device: str | int | torch.device | None) -> int | None:
    """The CUDA device index of Logger(device=...), None for the CPU (or no device given)."""
    if device is None:
        return None
    dev = torch.device(device)
    if dev.type == "cuda":
        return dev.index if dev.index is not None else torch.cuda.current_device()
    if dev.type != "cpu":
        raise ValueError(f"device must be cpu or cuda, got {dev}")
    return None


class _Readings:
    """What a Logger shows its user: its settings (sinks, max_delay), what it delivered and how
    (latest, stats, gpu_steps, the steps), and its refusal to be copied. Logger's own state,
    read through properties so that the hot path keeps plain attributes."""
    every: int
    _closed: bool
    _calls: int
    _last_step: int
    _device: int
    _gen: DeviceRing | None
    _max_delay: float
    _max_delay_given: float | None
    _delivery: Delivery
    _handover: Handover
    _ranks: Any                          # _ranks.Ranks of a Logger(reduce=...) on the host

    @property
    def sinks(self) -> list[Any]:
        return self._delivery.sinks

    @sinks.setter
    def sinks(self, sinks: Iterable[Any]) -> None:
        self._delivery.sinks = check_sinks(sinks)      # a new list: the next batch uses it

    @property
    def max_delay(self) -> float | None:
        """Seconds after a window's first row at which the next call hands it over (None: no
        bound). Settable; a new value applies from the next window.

        A row reaches the sinks about `max_delay` after its call at the latest, even when
        `every` calls take longer (slow steps): the first call at or past that time after the
        window's first row hands the window over early, as the `every`-th call would (one copy,
        no sync; the test is a comparison with the clock reading each call already makes). The
        clock is only read in calls: rows logged before the loop stops calling (a long
        evaluation) wait for the next call, flush() or close(); call `log.flush(wait=False)`
        before such a pause to send them (no wait). With delivery="caller" rows reach the sinks
        one flush later, so about twice `max_delay`. Calls inside torch.compile'd code and CUDA
        graph replays are not bounded (no host code runs)."""
        return self._max_delay_given

    @max_delay.setter
    def max_delay(self, max_delay: float | None) -> None:
        check_max_delay(max_delay)
        self._max_delay_given = max_delay
        self._max_delay = _INF if max_delay is None else float(max_delay)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def last_step(self) -> int:
        """The step of the last log() call; -1 before the first. Once a CUDA graph captured a
        call (steps_on_device()), the last step the host assigned: replays and the eager calls
        after them take steps counted on the GPU."""
        return self._last_step

    def steps_on_device(self) -> bool:
        """True once a CUDA graph captured one of this logger's calls: from then on the GPU
        counts the steps of calls without step= (every replay takes the next one) and the host
        no longer knows the last one; `last_step` is then the last step the host assigned."""
        return self._gen is not None and self._gen.captured

    @property
    def delivered_step(self) -> int:
        """The step of the last row handed to the sinks; -1 before the first."""
        return self._delivery.delivered_step

    @property
    def latest(self) -> dict[str, float]:
        """The last delivered value of each metric (a few steps behind the loop)."""
        return self._delivery.latest

    def gpu_steps(self) -> list[tuple[int, float | None, float | None]]:
        """[(step, gpu_ms, lag_ms)] for the recent delivered steps of a Logger(gpu_time=True)
        (up to 8192; [] otherwise), read from the GPU timestamps of each step's last row.
        gpu_ms: the GPU's time from the previous step's last row to this one's, per step when
        steps were skipped (None for the first); the GPU's pace, whatever it spent it on.
        lag_ms: how far the GPU trailed the host at that row (None for a graph replay)."""
        return self._delivery.clock.table()

    @property
    def stats(self) -> LoggerStats:
        d, h = self._delivery.stats(), self._handover.stats()
        r = self._ranks
        waits, lost = (0, 0) if r is None else (r.waits, r.lost)
        return LoggerStats(self._calls, d.delivered, h.windows, h.waits + waits, d.nonfinite,
                           d.lost + lost, d.sink_errors, d.late_errors, len(d.missing))

    def stragglers(self) -> "Stragglers | None":
        """Which rank has been slowest, by how much, since which step (a `Stragglers`), from
        the ranks' own step times in the reduced rows; None before the first of them. Only for
        a Logger(reduce=...) reducing on the host (the default)."""
        r = self._ranks
        if r is None:
            raise ValueError("stragglers() needs Logger(reduce=...) with reduce_on='host' (the "
                             "default): the step times come from the exchange across ranks")
        found: Stragglers | None = r.stragglers()
        return found

    @property
    def device(self) -> torch.device:
        return torch.device("cpu") if self._device < 0 else torch.device("cuda", self._device)

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self._calls} steps"
        return f"<syncless.Logger on {self.device}, every={self.every}, {state}>"

    # A copy would share the queue and the sinks but not the step counters (two loggers
    # writing one run with steps that go back), and a pickle cannot carry a thread, device
    # buffers or open files: refused, with the fix, the moment anything tries.
    def __copy__(self, *args: Any) -> NoReturn:
        raise _not_copyable(self)

    __deepcopy__ = __reduce_ex__ = __copy__


class Logger(_Readings):
    """Collect per-step metrics with zero host-device syncs and deliver them to sinks.

        >>> log = syncless.Logger(every=100, sinks=[syncless.sinks.JSONL("runs/m.jsonl")])
        >>> log(loss=loss, acc=acc)          # or log.log({"loss": loss}, step=step)
        >>> log.close()                      # or use `with syncless.Logger(...) as log:`

    Values are 0-dim or one-element tensors (CUDA or CPU, any real dtype, requires_grad fine)
    or Python numbers. The value recorded is the tensor's value at the call, in stream order.
    A Logger belongs to the thread that logs first; a call from another thread raises, unless
    the Logger was made with `threads=True`: then calls from every thread are serialised under a
    lock (~0.3 us more per call) and rows keep the order in which the calls took their steps.
    `gpu_time=True` adds `gpu/step_ms` (GPU time between consecutive rows) and `gpu/lag_ms` (how
    far the GPU trails the CPU) to every row, and keeps the GPU clock per step (gpu_steps()).

    `max_delay` (seconds, default 2.0; None: no bound): a row reaches the sinks about
    `max_delay` after its call at the latest, even when `every` calls take longer (see the
    `max_delay` property).

    `delivery="thread"` (default): a thread of the logger's decodes the rows and calls the sinks.
    `delivery="caller"`: the logging thread does it itself, at each flush, for the copies that
    have landed by then (an event query; it waits only when every window is undelivered), so
    rows reach the sinks one flush later and no second thread competes for the GIL: the choice
    for a host-bound loop (a small compiled or graphed step) with quick sinks. The sinks' time
    is then the loop's. On the main thread each sink call runs on a helper thread of the
    logger's while the loop waits for it: a Ctrl-C stops the wait, never the sink's write(), and
    the rows of every call that returned reach every sink once.

    `close_timeout` (seconds, default 30; None: no bound): how long close() and interpreter
    exit wait for late values and device copies (see close()), and, reducing, for the other
    ranks' last rows.

    `reduce` ("mean", "sum", "min", "max" or {metric: op}): deliver rows reduced across the
    ranks of torch.distributed. `reduce_on="host"` (default): the delivered rows are reduced on
    a gloo group of the Logger's, by a thread of its own, aligned by step: the training loop
    enqueues no collective and never waits for another rank; each row also gets the ranks' step
    times (ranks/step_ms/min|median|max, ranks/slowest; see stragglers()). `reduce_on="device"`:
    one all-reduce per window on the training stream, before the copy (needs max_delay=None,
    so that every rank hands its windows over at the same steps). See docs/logger.md.

    Signals: the Logger never blocks a signal or changes a handler, so processes a sink starts
    take SIGTERM and Ctrl-C as usual. A signal handler may call flush() or close() while the
    loop it interrupted is inside log(), flush() or close(), or a delivery (either mode): every
    row accepted is delivered once and is out when the handler's call returns, and close()
    interrupted (a second Ctrl-C) is finished by the next close() or at exit. A KeyboardInterrupt
    raised by a sink or an attach() fn is reported, and raised again by the next flush() or
    close() after its work.
    """

    def __init__(self, every: int = LOGGER_EVERY, sinks: Iterable[Any] | Any = (), *,
                 device: str | int | torch.device | None = None, capacity: int | None = None,
                 windows: int = 4, reduce: str | Mapping[str, str] | None = None,
                 sinks_on: str = "rank0", gpu_time: bool = False, threads: bool = False,
                 delivery: str = "thread", max_delay: float | None = 2.0,
                 close_timeout: float | None = 30.0, reduce_on: str = "host"):
        _check_options(every, windows, capacity, max_delay, sinks_on, delivery, reduce_on)
        sinks = check_sinks(sinks)
        self.close_timeout = _check_timeout(close_timeout, "close_timeout")
        self._reducer = self._ranks = None
        if reduce is not None and reduce_on == "device":
            if max_delay is not None:
                raise ValueError(
                    "Logger(reduce=..., reduce_on='device') needs max_delay=None: max_delay hands "
                    "a window over at a time each rank reads on its own clock, so the ranks would "
                    "all-reduce different steps, or wait for each other forever (the default, "
                    "reduce_on='host', has no such limit)")
            self._reducer = _make_reducer(reduce)
        elif reduce is not None:
            self._ranks = _make_ranks(reduce, every, max_delay)
        self.rank = _rank()
        if sinks_on == "rank0" and self.rank != 0:
            sinks = []                   # data-parallel: rank 0 writes, the others only reduce
        self.every = every
        self.max_delay = max_delay            # sets _max_delay, read by the hot path
        self._deadline = float("inf")         # the open window's hand-over time (see log())
        self.capacity = capacity or max(2 * every, 64)
        self._columns: dict[str, int] = {}
        self._names: list[str] = []
        self._next_step, self._last_step = 0, -1
        self._calls = self._since_flush = 0
        self._flush_due = False
        self._closed = False                  # log() refuses from here on
        self._finished = self._forked = False  # close() ran to its end; os.fork() closed it
        self._host_rows: list[Row] = []
        self._device = -1
        self._gen: DeviceRing | None = None
        self._ring: Any = None                # self._gen.ring, kept at hand for the hot path
        # used by threads=True, flush() and close(); re-entrant, for a signal handler's flush()
        self._lock = threading.RLock()
        self._owner = _SHARED if threads else _UNOWNED
        self._shared = bool(threads)
        self._delivery = Delivery(sinks, self._names, bool(gpu_time), self._ranks)
        self._handover = ThreadHandover(self._delivery, windows, self._lock) \
            if delivery == "thread" else \
            CallerHandover(self._delivery, windows, self._lock, _unowned(self))
        if self._ranks is not None:
            self._ranks.start(self._handover.submit_reduced)
        self._pid = os.getpid()
        _live.add(self)
        _compile.track(self)
        index = _cuda_index(device)
        if index is not None:
            self._bind(index)

    # ---- the hot path ------------------------------------------------------------------------

    def __call__(self, *args: int, **metrics: Any) -> None:
        """log(loss=..., acc=...) logs at the next step; log(step, loss=...) or
        log(loss=..., step=7) at a given one."""
        step = None
        if args:
            if len(args) > 1:
                raise TypeError(f"log() takes at most one positional argument (the step), got "
                                f"{len(args)}")
            step = args[0]
            if "step" in metrics:
                raise TypeError(f"log() got the step twice: {step!r} and step={metrics['step']!r}")
        elif "step" in metrics:
            step = metrics.pop("step")
        self.log(metrics, step)

    def log(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Log one row: {name: value} at `step` (default: the step after the last one)."""
        if _compile.tracing():               # inside torch.compile: one custom op in the graph
            _compile.log(self, metrics, step)
            return
        if self._closed:
            self._handover.refuse_on_thread("log()")
            self._refuse_closed()
        if type(metrics) is not dict:
            metrics = dict(metrics)
        if _get_ident() != self._owner:          # ~0.1 us; a lock would cost several times more
            self._log_from_elsewhere(metrics, step)
            return
        if self._since_flush >= self.capacity:
            # The rows since the last hand-over fill the ring: its flushes were cut short (an
            # exception out of each flush's wait for room, a signal handler's, while the calls
            # went on), and this row would overwrite one that no copy holds yet. The hand-over
            # comes first, waiting for room; cut short again, this call raises before it counts
            # or writes. Never true otherwise: a window is handed over at its `every`-th row.
            self._flush_window()
        calls, nxt, last = self._calls, self._next_step, self._last_step
        if step is None:
            step, given = nxt, -1                # -1: the ring's next step, counted on the GPU
        else:
            step = given = self._take_step(step)
        ring = self._ring
        if ring is None:                     # host rows (no CUDA metric yet)
            host_now = self._log_host(metrics, step)
            if host_now is None:
                return                       # it bound the ring and logged through it
            now = host_now
        else:
            now = time.time()
            if self._closed:                 # a signal handler closed it since the check above
                self._refuse_closed()
            # Counted before the launch: a signal that arrived during the C call is handled as
            # it returns, and the exception its handler raises must find the row counted (else
            # the host would trail the ring by a step). A gather that raised before it launched
            # (a bad value) takes the call back; one that found a new metric launched nothing
            # and says so.
            self._calls, self._next_step, self._last_step = calls + 1, step + 1, step
            try:
                captured = ring.gather(metrics, self._columns, calls, given, now)
            except BaseException:
                if not ring.wrote(calls):
                    self._calls, self._next_step, self._last_step = calls, nxt, last
                raise
            if captured:
                if captured is not True:             # _C.GATHER_NEW_COLUMN: nothing launched
                    # Taken back here, before any call: a handler can run at a function's
                    # start, and one that closed the logger there found the call counted and
                    # no row for it (delivered 0 of 1 step; H100, 1 trial in 500).
                    self._calls, self._next_step, self._last_step = calls, nxt, last
                    self._new_metric(metrics, None if given < 0 else step)
                    return
                self._gen.captured = True            # type: ignore[union-attr]
                return                               # nothing else may happen under capture
        # The window's trigger (the one for host rows and ring rows alike): hand the window over
        # at its `every`-th row, or at the first call `max_delay` after its first row.
        since = self._since_flush
        if not since:                                # the window's first row sets its deadline
            self._deadline = -_INF if self._flush_due else now + self._max_delay
        self._since_flush = since + 1
        if since + 1 >= self.every or now >= self._deadline:
            self._flush_window()

    def _new_metric(self, metrics: dict[str, Any], step: int | None) -> None:
        """The hot path's gather found a metric without a column (nothing launched, the call
        taken back): the column is added (the ring may grow), and the call made again, through
        the hot path (the one place that counts, gathers and triggers a flush)."""
        if all(name in self._columns for name in metrics):
            raise RuntimeError(f"syncless: metrics {sorted(metrics)} have no column in the "
                               "logger's device ring after it was widened (a bug: please "
                               "report)")
        self._add_columns(metrics)
        self.log(metrics, step)

    def _log_from_elsewhere(self, metrics: dict[str, Any], step: int | None) -> None:
        """The first call (which makes its thread the owner), a call from another thread, or
        any call of a Logger(threads=True), which serialises them all under one lock."""
        self._handover.refuse_on_thread("log()")
        owner = self._owner
        if self._shared:
            with self._lock:
                self._owned_by(_get_ident(), self.log, metrics, step)
            return
        if owner != _UNOWNED:
            raise RuntimeError(
                "syncless.Logger: log() from a second thread; this Logger belongs to the thread "
                "that logged first (unsynchronised calls would reorder or drop rows). Give each "
                "thread its own Logger, or create it with Logger(..., threads=True) to "
                "serialise calls from every thread under a lock.")
        self._owner = _get_ident()
        self.log(metrics, step)

    def _owned_by(self, owner: int, fn: Callable[..., _T], *args: Any) -> _T:
        """fn(*args) with `owner` as the thread the hot path takes for its own: the caller of a
        Logger(threads=True), or none while delivery="caller" runs the sinks (a sink's log() is
        then refused as a call from elsewhere, and never recurses)."""
        before, self._owner = self._owner, owner
        try:
            return fn(*args)
        finally:
            self._owner = before

    def attach(self, name: str, resolve: Callable[[], float], step: int | None = None) -> None:
        """Add a value that becomes known later to the row of `step` (default: the last logged
        step). `resolve()` runs on the delivery thread when that row is delivered, may wait
        there (never in the training loop) and returns a float. With delivery="caller" it runs
        for the loop, at a flush, which waits for it: one with a `poll()` method (None until the value is known, as
        a timer's reader has) holds the row back to a later flush instead of being waited for.
        Values attached under one name for one step add up. If the step's row already went to
        the sinks, the value comes as a row of its own at that step (`row.late` is True).

        resolve() returns what log() takes (a real number or a one-element tensor; a CUDA one
        is read where resolve runs, with a sync there). A value log() would refuse (a string,
        a complex), and an exception from resolve(), are reported once per name and counted in
        `stats.late_errors`; the row goes out without it. A name is either logged or attached:
        one log() already wrote is refused here, and if log() writes it at that step later, the
        logged value is kept and the attached one reported and counted the same way. close()
        waits for a value `close_timeout` seconds at most (see Logger)."""
        if self._closed:
            self._refuse_closed()
        _check_name(name, attached=True)
        if name in self._columns:
            raise ValueError(f"metric {name!r} is written by log(); an attached value under the "
                             "same name would be mixed into it: attach it under another name "
                             f"(e.g. {name + '/late'!r})")
        if not callable(resolve):
            raise TypeError(f"attach({name!r}, ...) needs a callable that returns the value")
        if step is None:
            self._refuse_device_steps("attach() without step=")
            step = self._last_step
        else:
            step = _check_step(step)
        self._handover.attach(Late(max(step, 0), name, resolve))

    def _refuse_device_steps(self, what: str) -> None:
        if self.steps_on_device():
            raise ValueError(
                f"{what}: a CUDA graph captured a log() of this Logger, so its steps are counted "
                "on the GPU (each replay takes the next one) and the host cannot tell which step "
                "is the last; pass step= (the loop's own counter)")

    def _refuse_closed(self) -> None:
        if self._forked:
            raise RuntimeError("this Logger belongs to the process that forked this one; create "
                               "a new Logger in the child to log from it")
        raise ValueError("this Logger is closed; create a new one to log again")

    def _log_host(self, metrics: dict[str, Any], step: int) -> float | None:
        """Before any CUDA metric: values are read now and kept as a host row, counted; the
        row's time is returned for the hot path's trigger. The first CUDA metric binds the
        device ring and makes the call through it instead (None: nothing left to do)."""
        if len(metrics) > _MAX_PER_CALL:                 # the same limit as the kernel's
            raise ValueError(f"at most {_MAX_PER_CALL} metrics per call (got {len(metrics)}); "
                             "split them over two calls with the same step")
        device, values = _C.read_host_values(metrics)
        if values is None:                               # the first CUDA metric binds the ring
            self._bind(device)
            self.log(metrics, step)
            return None
        self._add_columns(metrics)
        now = time.time()
        row = Row(step, now, values)
        if self._closed:                     # a signal handler closed it since the check above
            self._refuse_closed()
        # From here to the append no handler runs (plain assignments, see above): the row is
        # counted and kept whole, or the call raised before either.
        self._calls += 1
        self._next_step = step + 1
        self._last_step = step
        self._host_rows.append(row)
        return now

    def _take_step(self, given: Any) -> int:
        step = _check_step(given)
        if step < self._last_step:
            raise ValueError(f"step {step} is before the last logged step {self._last_step}; "
                             "steps must not go backwards")
        return step

    def _add_columns(self, metrics: Mapping[str, Any]) -> None:
        new = [n for n in metrics if n not in self._columns]
        if not new:
            return                           # (the host path's every call: keep it short)
        for name in new:                     # names with a column passed this already
            _check_name(name)
        if self._gen is not None and len(self._names) + len(new) > self._gen.ring.columns:
            self._grow(self._gen, len(self._names) + len(new))
        for name in new:
            self._columns[name] = len(self._names)
            self._names.append(name)

    # ---- device ring -------------------------------------------------------------------------

    def device_ring(self, device: int | None = None) -> DeviceRing | None:
        """The logger's device ring (the GPU buffer its CUDA rows are written to); None before
        the first CUDA log() and once closed. Given a CUDA device index, the ring is made there
        first if there is none yet, as the first CUDA log() would make it. Used by syncless's
        torch.compile support (which makes the ring at trace time); a training loop never needs
        it."""
        if device is not None and self._gen is None and not self._closed:
            self._bind(device)
        return self._gen

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
            gen = DeviceRing(device, self.capacity, len(self._names), self._next_step)
            # One statement (no interrupt lands inside it): bound whole, or not at all.
            self._gen, self._ring, self._device = gen, gen.ring, device
            self._handover.reserve(gen)          # no flush allocates pinned memory

    def _grow(self, gen: DeviceRing, needed: int) -> None:
        if gen.captured:
            raise ValueError(
                f"cannot add metric #{needed}: the ring is full and a CUDA graph captured it, so "
                "it cannot move. Log every metric name once before capturing.")
        with torch.cuda.device(self._device):
            if self._since_flush:
                self._flush_window()
            columns = -(-needed // _COLUMN_BLOCK) * _COLUMN_BLOCK * 2
            wider = DeviceRing(self._device, self.capacity, columns, self._next_step)
            # gen's windows are too small now: let them go (current False); one statement.
            gen.current, self._gen, self._ring = False, wider, wider.ring
            self._handover.reserve(wider)

    def _flush_window(self) -> None:
        """Hand the rows since the last flush over. Never waits on the GPU, only for a free
        window (backpressure)."""
        self._flush_due = False
        gen = self._gen
        if gen is None:
            self._hand_over_host_rows()
            return
        calls = self._calls
        if self._since_flush == 0 and calls == self._handover.sent_calls and not gen.captured:
            return
        with torch.cuda.device(self._device):
            if gen.ring.capturing():
                # No copies inside a capture: the next eager call hands the window over.
                self._flush_due, self._deadline = True, -_INF
                return
            reduce = None if self._reducer is None else functools.partial(
                self._reducer.reduce_ring, gen.memory, gen.ring.capacity, gen.ring.columns,
                self._names)
            self._handover.send_window(gen, calls, reduce)
        # After an interrupt between the hand-over and this count, the next flush sends a copy
        # again: its decode starts after the rows delivered, so nothing comes twice.
        self._since_flush = 0

    def _hand_over_host_rows(self) -> None:
        rows = self._host_rows
        if not rows:
            return
        out = rows if self._reducer is None else self._reducer.reduce_rows(rows, self._names)
        self._handover.send_rows(rows, out, self._calls)
        self._host_rows = []                 # handed over again after an interrupt: see above
        self._since_flush = 0

    # ---- draining ----------------------------------------------------------------------------

    def flush(self, wait: bool = True) -> None:
        """Hand over every row logged so far; with wait=True (default), return once the sinks
        have them. wait=False only enqueues the copy (useful between CUDA graph replays)."""
        self._handover.refuse_on_thread("flush()")
        if self._closed:
            if not self._finished and wait:
                self.close()                 # a close() an interrupt cut short: finish it
            return
        with self._lock:
            if self._gen is not None and self._gen.ring.capturing():
                raise RuntimeError("flush() inside CUDA graph capture: flush after capture ends")
            self._flush_window()
            upto = self._last_step
        if wait:
            self._handover.drain(upto)
        self._raise_users()

    def _raise_users(self) -> None:
        """Raise the KeyboardInterrupt (or other BaseException that is no Exception) that a
        sink or an attach() fn raised, here on the training thread where the user can act on it:
        it was reported when it came, the rows went on, and this call did its work first."""
        exc = self._delivery.pop_raised()
        if exc is not None:
            raise exc

    def close(self, timeout: Any = _NO_TIMEOUT) -> None:
        """Deliver everything, close the sinks and stop the delivery thread. Idempotent, and
        resumable: a close() an interrupt cut short (a second Ctrl-C) is finished by the next
        call, or at interpreter exit. Late values (attach(), timers) and device copies are
        waited for `timeout` seconds at most (default: the Logger's close_timeout, 30 s; None:
        no bound): an attach() fn, a timer on a stream that never completes, a copy that never
        lands. Those that did not come by then are left out of the rows, counted in
        stats.missing and named in one warning, and close() returns; a sink's call that did not
        return within a second more is left running and reported. A KeyboardInterrupt (or other
        BaseException) that a sink or an attach() fn raised is reported when it comes and raised
        again here (or by flush()), after the work is done."""
        self._close(timeout)
        self._raise_users()

    def _close(self, timeout: Any = _NO_TIMEOUT) -> None:
        """close() without raising what the user's code raised (the exit hook, a finalizer)."""
        self._handover.refuse_on_thread("close()")
        if self._finished:
            return
        timeout = self.close_timeout if timeout is _NO_TIMEOUT else _check_timeout(timeout)
        with self._lock:
            if self._gen is not None and self._gen.ring.capturing():
                # Refused before anything changes: the logger stays open and loses nothing.
                raise RuntimeError("close() inside CUDA graph capture: close after capture ends")
            # From here on late values are waited for until the deadline at most (with
            # delivery="caller", the hand-over below already delivers).
            self._handover.start_closing(timeout)
            self._closed = True
            self._flush_window()
        ranks = self._ranks
        if ranks is not None:               # every rank's last rows, reduced (see _ranks)
            deadline = self._handover.deadline
            ranks.closing_by(deadline)
            self._handover.drain(_INF, deadline)    # this rank's rows all reach the exchange
            ranks.finish(deadline)
        self._handover.close(timeout)       # deliver, stop the driver, close the sinks
        if self._gen is not None and self._gen.captured:
            _captured_rings.append(self._gen.memory)
        self._gen = self._ring = None
        self._finished = True
        _live.discard(self)
        missing = self._delivery.stats().missing
        if missing:
            _log.warning("syncless: close() stopped waiting after %s s for %s; the rows went out "
                         "without them (counted in stats.missing)", timeout, ", ".join(missing))
        if ranks is not None and ranks.error is not None:
            raise ranks.error

    def __enter__(self) -> "Logger":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        _finalize(self)



def _not_copyable(log: object) -> TypeError:
    """The error for a copy or pickle of `log`, naming where it is held when the caller is a
    deepcopy (the attribute or key holding it) or Lightning's save_hyperparameters()."""
    held, owner, lightning = None, None, False
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        local = frame.f_locals
        code = frame.f_code
        if held is None and local.get("value") is log and isinstance(local.get("key"), str) and \
                code.co_filename.endswith("copy.py"):
            held = local["key"]                      # copy._deepcopy_dict / _reconstruct
        elif held is not None and owner is None and code.co_name == "_reconstruct" and \
                isinstance(local.get("state"), dict) and local["state"].get(held) is log:
            owner = type(local.get("x")).__name__    # the object whose attribute it is
        if code.co_name == "save_hyperparameters" and "lightning" in code.co_filename:
            lightning = True
            break
        frame = frame.f_back
    del frame
    what = "syncless.Logger cannot be copied or pickled: it owns a delivery thread, device " \
           "buffers and open sinks, and a copy would write one run with two step counters."
    if lightning:
        name = repr(held) if held is not None else "'<the Logger argument>'"
        return TypeError(f"{what} Lightning's save_hyperparameters() copies every __init__ "
                         f"argument, and {name} is a Logger: call "
                         f"self.save_hyperparameters(ignore=[{name}]) and keep it as a plain "
                         "attribute")
    where = ""
    if held is not None:
        where = f" It is {owner}.{held}, being deep-copied." if owner else \
            f" It is the value of {held!r} in what is being deep-copied."
    return TypeError(f"{what}{where} Share the one Logger instead of copying it: keep it out "
                     "of modules and configs that get copied or saved (pass it to the training "
                     "loop), or copy around it: copy.deepcopy(model, {id(log): log}) keeps the "
                     "same Logger in the copy (an EMA model); for torch.save, save the "
                     "state_dict()")


def _unowned(log: Logger) -> Callable[[Callable[[], None]], None]:
    """For CallerHandover: run its deliveries with `log` owned by no thread (see _owned_by).
    A weak reference: the Logger stays free of cycles, so one dropped without close() is
    closed by its finalizer at once."""
    ref = weakref.ref(log)

    def unowned(fn: Callable[[], None]) -> None:
        log = ref()
        if log is None:                      # a finalizer run by the cycle collector
            fn()
        else:
            log._owned_by(_DELIVERING, fn)
    return unowned


def _finalize(log: Logger) -> None:
    """Logger.__del__. A Logger dropped without close() (a local in a function) still delivers
    its rows; one that reduces across ranks cannot (closing is a collective every rank must
    join)."""
    if getattr(log, "_finished", True) or getattr(log, "_pid", None) != os.getpid():
        return
    if log._ranks is not None:
        log._ranks.stop()
    if log._reducer is not None or log._ranks is not None:
        pending = log._calls - log._delivery.stats().delivered
        if pending:
            _log.warning("syncless: a Logger(reduce=...) was dropped without close(): %d rows "
                         "(steps after %d) were not delivered; close it on every rank",
                         pending, log._delivery.delivered_step)
        log._closed = log._finished = True
        log._handover.stop()
        return
    # A Ctrl-C landing in a finalizer would be printed and dropped ("Exception ignored in"),
    # and this logger, unreachable, is out of the exit hook's reach: finish the close, then
    # hand the interrupt back to the main thread once this finalizer has returned (a handler
    # tripped now would run in it again: a few ms later, from a thread).
    interrupted = False
    for _ in range(3):
        try:
            log._close()
            break
        except KeyboardInterrupt:
            interrupted = True
        except Exception as exc:
            _log.error("syncless: closing a Logger dropped without close() failed: %s", exc)
            break
    if interrupted:
        threading.Thread(target=_interrupt_main_soon, name="syncless-interrupt",
                         daemon=True).start()


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _interrupt_main_soon() -> None:
    time.sleep(0.01)
    _thread.interrupt_main()


def _forked_child() -> None:
    """The child of os.fork() inherits each Logger but not its delivery thread, and their rows
    belong to the parent: it must neither deliver them again nor wait for a thread that does
    not run. Each becomes a closed logger that says why."""
    for log in list(_live):
        log._lock = threading.RLock()
        log._owner = _UNOWNED
        log._handover.forget(log._lock)
        log._host_rows = []
        log._gen = log._ring = None
        log._since_flush = 0
        log._closed = log._finished = log._forked = True
        _live.discard(log)


os.register_at_fork(after_in_child=_forked_child)


def _check_timeout(v: Any, name: str = "timeout") -> float | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
        raise ValueError(f"{name} must be a number of seconds >= 0 or None, got {v!r}")
    return float(v)


@atexit.register
def _close_all() -> None:
    """Close what is still open, including a close() an interrupt cut short (double or triple
    Ctrl-C): an interrupt here is taken as "finish anyway" three times, the fourth gives up."""
    for log in list(_live):
        for attempt in range(1, 5):
            try:
                log._close()
                break
            except Exception as exc:
                _log.error("syncless: closing %r at exit failed: %s", log, exc)
                break
            except BaseException:                # Ctrl-C, or a handler's exit, at exit
                if attempt == 4:
                    _log.error("syncless: closing %r at exit interrupted %d times: rows not "
                               "delivered yet are lost", log, attempt)
                else:
                    _log.warning("syncless: closing %r at exit was interrupted; finishing it "
                                 "(interrupt %d more times to give up)", log, 4 - attempt)
