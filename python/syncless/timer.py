"""GPU time that is never read early, with the host time beside it.

    with syncless.timer() as t:          # a CUDA event pair on torch's current stream, or
        y = model(x)                     # perf_counter when CUDA is not initialised
    t.ms                                 # waits for the end event, then GPU milliseconds
    t.cpu_ms                             # host time inside the block (how long enqueuing took)

    @syncless.timer("forward")           # named timers aggregate every use
    def forward(x): ...
    syncless.timer("forward").stats      # Stats(count, mean, median, p90, min, max), in ms
    print(syncless.timers.report())      # all named timers; a table (HTML in notebooks)

    syncless.bench(fn)                   # warm-up, L2 flush, one event pair per rep -> Stats

The clock is chosen at each use: the current CUDA device when CUDA is initialised, else
`time.perf_counter`; `device=` fixes it. The two events come from the C layer's pool (no create
or destroy per use) and are recorded on torch's current stream, so a use costs two cuEventRecord
calls and a little Python. Reading `.ms` waits (sleeping, GIL released) for the end event only.

`timer("step_ms", log=log)` hands each duration to a Logger without waiting, through
`Logger.attach`: the delivery thread reads it (waiting there, if at all) and adds it to the row of
its step.
"""
from __future__ import annotations

import collections
import functools
import html
import logging
import math
import os
import threading
from array import array
from time import perf_counter
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, NamedTuple

import torch

from . import _compile
from ._torch import _C, cuda_initialized
from .logger import Logger

__all__ = ["timer", "timers", "bench", "Timer", "Timing", "Stats", "Report"]

_log = logging.getLogger("syncless")

# TimerBase's modes and hook bits, defined in csrc/timer.c.
_CPU = _C.TIMER_CPU
_CUDA_CURRENT = _C.TIMER_CUDA       # device="cuda": whichever device is current at each use
_AUTO = _C.TIMER_AUTO               # no device given: CUDA's current device once it is up
_AFTER = _C.TIMER_AFTER             # TimerBase._hooks: call Timer._after at exit
_BEFORE = _C.TIMER_BEFORE           # ... and Timer._before at entry
_STOPPED = _C.PAIR_STOPPED          # Timing._state once the end event is recorded
_COLLECT_EVERY = 256                # read finished event pairs of a named timer in batches
_L2_FLUSH_BYTES = 256 * 2**20       # larger than any current GPU's L2 (H200: 50 MB)


def _auto_device() -> int:
    # is_initialized() is a flag check and _cuda_getDevice() is current_device() without its
    # lazy-init path: together well under a microsecond, so the choice can be made per use.
    if cuda_initialized():
        return torch._C._cuda_getDevice()
    return _CPU


_DEVICE_STRINGS = {"cpu": _CPU, "cuda": _CUDA_CURRENT}


def _parse_device(device: Any) -> int | None:
    if device is None:
        return None
    if device.__class__ is str and device in _DEVICE_STRINGS:
        return _DEVICE_STRINGS[device]
    if isinstance(device, int) and not isinstance(device, bool):
        if device < 0:
            raise ValueError(f"timer: CUDA device index must be >= 0, got {device}")
        return device
    dev = torch.device(device)
    if dev.type == "cpu":
        return _CPU
    if dev.type == "cuda":
        return _CUDA_CURRENT if dev.index is None else dev.index
    raise ValueError(f"timer: device must be cpu or cuda, got {dev}")


def _resolve(device: int | None) -> int:
    """A parsed device (None: automatic) -> a CUDA index, or _CPU."""
    if device is None:
        return _auto_device()
    if device == _CUDA_CURRENT:
        return torch.cuda.current_device()
    return device


def _device_name(device: int) -> str:
    return "cpu" if device < 0 else f"cuda:{device}"


def _fmt(ms: float) -> str:
    if math.isnan(ms):
        return "-"
    return f"{ms:.0f}" if ms >= 1000 else f"{ms:.4g}"


# ---- statistics --------------------------------------------------------------------------------

def _quantile(ordered: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default, statistics' 'inclusive')."""
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


class Stats(NamedTuple):
    """Summary of a timer's readings, in milliseconds. float(stats) is the median."""
    count: int  # type: ignore[assignment]  # shadows tuple.count: a public field since 0.1
    mean: float
    median: float
    p90: float
    min: float
    max: float

    @classmethod
    def of(cls, times: Iterable[float]) -> "Stats":
        ordered = sorted(times)
        n = len(ordered)
        if n == 0:
            nan = float("nan")
            return cls(0, nan, nan, nan, nan, nan)
        return cls(n, math.fsum(ordered) / n, _quantile(ordered, 0.5), _quantile(ordered, 0.9),
                   ordered[0], ordered[-1])

    def __float__(self) -> float:
        return self.median

    def __repr__(self) -> str:
        return (f"Stats(count={self.count}, median={_fmt(self.median)} ms, "
                f"mean={_fmt(self.mean)}, p90={_fmt(self.p90)}, min={_fmt(self.min)}, "
                f"max={_fmt(self.max)})")


# ---- one use -----------------------------------------------------------------------------------

class Timing(_C.EventPair):
    """The reading of one timed block: what `with timer() as t` binds to `t`.

    `ms` waits for the end event, so it is never early; `ready` says whether it would wait.
    On the CPU clock `ms` and `cpu_ms` are the same wall time. Made by the timer (in C), never
    by hand; the two events go back to the pool once the reading is taken.
    """
    __slots__ = ("_step0",)
    _step0: int                     # the Logger's last step at the block's start (log= only)

    def _early(self, what: str) -> str:
        label = f"timer {self.name!r}" if self.name else "timer"
        return f"{label}: .{what} read inside the timed block; read it after the block ends"

    @property
    def ms(self) -> float:
        """Milliseconds of the block: GPU time between the two events (waiting for the end
        event first), or wall time on the CPU clock."""
        ms = self._ms
        if ms == ms:                    # not NaN: known
            return ms
        if self._state != _STOPPED:
            raise RuntimeError(self._early("ms"))
        return self.elapsed()

    def _poll(self) -> float | None:
        """ms if known without waiting, else None."""
        ms = self._ms
        if ms == ms:
            return ms
        return self.poll() if self._state == _STOPPED else None

    @property
    def cpu_ms(self) -> float:
        """Host wall time spent inside the block, in milliseconds."""
        if self._state != _STOPPED:
            raise RuntimeError(self._early("cpu_ms"))
        return self._cpu_ms

    @property
    def ready(self) -> bool:
        """True once the end event completed (so .ms will not wait); never waits."""
        return self._poll() is not None

    @property
    def device(self) -> torch.device:
        return torch.device("cpu") if self._device < 0 else torch.device("cuda", self._device)

    def __repr__(self) -> str:
        """Never waits: an unfinished GPU reading shows as pending."""
        label = f"<timer {self.name!r}" if self.name else "<timer"
        if self._state != _STOPPED:
            return f"{label} running>"
        if self._device < 0:
            return f"{label} cpu {self._cpu_ms:.3f} ms>"
        ms = self._poll()
        gpu = "pending" if ms is None else f"{ms:.3f} ms"
        return f"{label} gpu {gpu}, cpu {self._cpu_ms:.3f} ms>"

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        # Displaying a reading in IPython is reading it: wait for the end event.
        if self._state == _STOPPED:
            self.ms
        p.text(repr(self))


# ---- every use of one timer --------------------------------------------------------------------

class _Series:
    """The readings of one named timer (shared by every Timer of that name) or of one unnamed
    Timer. GPU readings wait in `_pending` until their end event completed; they are read in
    batches (one cuEventElapsedTime each) so a long run holds few events."""
    __slots__ = ("name", "_done", "_cpu", "_pending", "_devices", "_lock", "_collect_at")

    def __init__(self, name: str | None):
        self.name = name
        self._done = array("d")                       # ms, in the order they were read
        self._cpu = array("d")
        self._pending: collections.deque[Timing] = collections.deque()
        self._devices: set[int] = set()
        self._lock = threading.Lock()
        self._collect_at = _COLLECT_EVERY

    def add(self, rec: Timing) -> None:
        self._cpu.append(rec._cpu_ms)
        if rec._device not in self._devices:
            self._devices.add(rec._device)
        ms = rec._ms
        if ms == ms:                                  # known already (CPU clock)
            self._done.append(ms)
            return
        self._pending.append(rec)
        if len(self._pending) >= self._collect_at:
            self.collect(wait=False)
            # When the GPU is far behind, the oldest is still running: try again a batch later,
            # not at every use.
            self._collect_at = len(self._pending) + _COLLECT_EVERY

    def collect(self, wait: bool) -> None:
        """Move finished readings from _pending to _done, oldest first; with wait=True all."""
        with self._lock:
            pending = self._pending
            while pending:
                rec = pending[0]
                ms = rec.ms if wait else rec._poll()
                if ms is None:
                    return
                pending.popleft()
                self._done.append(ms)

    def stats(self, wait: bool = True) -> Stats:
        self.collect(wait)
        return Stats.of(self._done)

    def cpu_stats(self) -> Stats:
        return Stats.of(self._cpu)

    def times(self) -> list[float]:
        self.collect(wait=True)
        return list(self._done)

    @property
    def clock(self) -> str:
        devices = self._devices
        if len(devices) == 1:
            return _device_name(next(iter(devices)))
        return "mixed" if devices else "-"

    def clear(self) -> None:
        with self._lock:
            self._done = array("d")
            self._cpu = array("d")
            self._pending.clear()
            self._devices = set()
            self._collect_at = _COLLECT_EVERY


# ---- the timer ---------------------------------------------------------------------------------

class Timer(_C.TimerBase):
    """A context manager and a decorator; each use is a fresh measurement (a `Timing`).

    Use `timer(...)` to make one. `__enter__`/`__exit__` are C (TimerBase): a use costs two
    cuEventRecord calls and a record; names, series and logging run here, in `_before`/`_after`,
    only for timers that have them. Nested and recursive uses of one Timer are fine: every use
    has its own record. One Timer object used as a context manager from several threads at once
    is not (the decorator form is): give each thread its own `timer(name)`; they share the
    name's statistics.
    """
    __slots__ = ()
    if TYPE_CHECKING:               # what TimerBase's members hold here (bind_timer: Timing)
        _series: _Series | None
        _log: Logger | None
        _step: int | None

        @property
        def last(self) -> Timing | None: ...
        def __enter__(self) -> Timing: ...

    def __init__(self, name: str | None = None, device: Any = None, log: Logger | None = None,
                 step: int | None = None):
        if name is not None or device is not None or log is not None or step is not None:
            self._setup(name, device, log, step)

    def _setup(self, name: str | None, device: Any, log: Logger | None, step: int | None) -> None:
        _check_settings(name, log, step)
        parsed = _parse_device(device)
        self._mode = _AUTO if parsed is None else parsed
        self.name = name
        # An unnamed timer starts its series at its second use: `with timer() as t` pays for
        # one record only.
        self._series = timers._series_for(name) if name is not None else None
        self._log = log
        self._step = step
        self._hooks = (_AFTER if name is not None else 0) | (_BEFORE if log is not None else 0)

    # -- called by TimerBase (C) around a use, for timers with a name, a log, or a second use

    def _before(self, rec: Timing) -> None:
        log = self._log
        assert log is not None                   # TIMER_BEFORE is set only with a log
        if self._step is None:
            log._refuse_device_steps(f"timer({self.name!r}, log=...) without step=")
        rec._step0 = log.last_step

    def _after(self, rec: Timing) -> None:
        self._readings().add(rec)            # an unnamed timer's second use makes its series
        log = self._log
        if log is not None and not log.closed:
            assert self.name is not None             # _setup: a log needs a name
            step = self._step
            if step is None:
                # The step this block belongs to: the last logged step if log() was called
                # inside the block, else the step the next log() call will take.
                last = log.last_step
                step = last if last != rec._step0 else last + 1
            # Read on the delivery thread, which may wait for the end event there.
            log.attach(self.name, _Reader(rec), step)

    def __call__(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Decorate fn: every call is timed. An unnamed timer takes the function's name."""
        if not callable(fn):
            raise TypeError(f"timer(...) decorates a callable, got {type(fn).__name__}")
        if self.name is None:
            self.name = getattr(fn, "__qualname__", None) or repr(fn)
            self._series = timers._series_for(self.name)
            self._hooks |= _AFTER
        enter, leave = self.__enter__, self.__exit__

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            enter()
            try:
                return fn(*args, **kwargs)
            finally:
                leave(None, None, None)

        setattr(timed, "timer", self)            # the decorated function's .timer
        return timed

    # -- reading

    def _readings(self) -> _Series:
        series = self._series
        if series is None:
            series = self._series = _Series(None)
            if self.last is not None:
                series.add(self.last)
            # From now on every use goes into the series, the next one too (a timer shown before
            # its first use would otherwise start counting at its second).
            self._hooks |= _AFTER
        return series

    @property
    def stats(self) -> Stats:
        """Statistics of every use so far (of every Timer with this name); waits for the GPU."""
        return self._readings().stats()

    @property
    def cpu_stats(self) -> Stats:
        """The same for the host time inside the block."""
        return self._readings().cpu_stats()

    @property
    def times(self) -> list[float]:
        """Every reading in milliseconds, oldest first; waits for the GPU."""
        return self._readings().times()

    def _last(self) -> Timing:
        if self.last is None:
            raise RuntimeError("this timer has not finished a timed block yet")
        return self.last

    @property
    def ms(self) -> float:
        """The last finished use's `ms` (waits for its end event)."""
        return self._last().ms

    @property
    def cpu_ms(self) -> float:
        return self._last().cpu_ms

    @property
    def ready(self) -> bool:
        return self.last is not None and self.last.ready

    def __repr__(self) -> str:
        """Never waits: readings still on the GPU show as pending."""
        label = f"<timer {self.name!r}" if self.name else "<timer"
        series = self._readings()
        s = series.stats(wait=False)
        pending = len(series._pending)
        if s.count == 0:
            return f"{label}: {'no runs' if not pending else f'{pending} pending'}>"
        more = f", {pending} pending" if pending else ""
        return (f"{label} {series.clock}: {s.count} runs, median {_fmt(s.median)} ms, "
                f"p90 {_fmt(s.p90)} ms{more}>")

    def _repr_html_(self) -> str:
        return Report([_report_row(self.name or "(unnamed)", self._readings())])._repr_html_()


def _check_settings(name: str | None, log: Logger | None, step: int | None) -> None:
    if name is not None and not isinstance(name, str):
        raise TypeError(f"timer name must be a str, got {type(name).__name__}")
    if log is not None and name is None:
        raise ValueError("timer(log=...) needs a name: the metric its durations are logged as")
    if step is not None and log is None:
        raise ValueError("timer(step=...) only applies with log=")
    if log is not None:
        if not isinstance(log, Logger):
            raise TypeError(f"timer(log=...) takes a syncless.Logger, got {type(log).__name__}")
        if log.closed:
            raise ValueError("timer(log=...): this Logger is closed")


def timer(name: str | Callable[..., Any] | None = None, *, device: Any = None,
          log: Logger | None = None, step: int | None = None) -> Any:
    """Time a block or a function: `with timer() as t:`, `@timer("forward")`, `@timer`.

    name    aggregates every use under syncless.timers[name] (and names the logged metric)
    device  "cpu", "cuda", "cuda:1" or an index; default: the current CUDA device when CUDA is
            initialised, else the CPU clock (chosen at each use)
    log     a syncless.Logger: each duration is logged as metric `name` at the step the block
            belongs to (the last step logged inside the block, else the next one), without
            waiting; several uses at one step add up
    step    log at this step instead
    """
    if _compile.tracing():                   # inside torch.compile: a graph break, said why
        return _compile.timer_new(Timer, name, device, log, step)
    if callable(name):
        return Timer()(name)
    if name is None and device is None and log is None and step is None:
        return _new_timer(Timer)                   # the common `with timer() as t`: no __init__
    return Timer(name, device, log, step)


_new_timer = Timer.__new__


def _choose_device(mode: int) -> int:
    """TimerBase asks this when no current CUDA context names the device (mode: auto/cuda)."""
    if mode == _CUDA_CURRENT:
        return torch.cuda.current_device()
    return _auto_device()


_C.bind_timer(Timing, _choose_device)
os.register_at_fork(after_in_child=_C.forget_cuda)


# ---- the named-timer registry ------------------------------------------------------------------

def _report_row(name: str, series: _Series) -> tuple[str, str, Stats, Stats]:
    return (name, series.clock, series.stats(), series.cpu_stats())


_COLUMNS = ("timer", "clock", "count", "mean", "median", "p90", "min", "max", "cpu mean")


class Report:
    """A table of timers (ms): text via str()/repr(), HTML in notebooks."""

    def __init__(self, rows: list[tuple[str, str, Stats, Stats]]):
        self.rows = rows            # (name, clock, Stats, cpu Stats)

    def _cells(self) -> list[list[str]]:
        return [[name, clock, str(s.count), _fmt(s.mean), _fmt(s.median), _fmt(s.p90),
                 _fmt(s.min), _fmt(s.max), _fmt(c.mean)] for name, clock, s, c in self.rows]

    def __str__(self) -> str:
        if not self.rows:
            return "no timer has run yet"
        cells = [list(_COLUMNS)] + self._cells()
        widths = [max(len(r[i]) for r in cells) for i in range(len(_COLUMNS))]
        lines = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w)
                           for i, (c, w) in enumerate(zip(r, widths))) for r in cells]
        lines.insert(1, "-" * len(lines[0]))
        return "\n".join(lines) + "\n(ms)"

    __repr__ = __str__

    def _repr_html_(self) -> str:
        if not self.rows:
            return "<p>no timer has run yet</p>"
        head = "".join(f"<th>{html.escape(c)}</th>" for c in _COLUMNS)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>"
                       for row in self._cells())
        return (f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
                "<small>milliseconds; GPU time from CUDA events, cpu mean = host time inside "
                "the block</small>")


class _Registry:
    """syncless.timers: every named timer. report() and reset(); timers["forward"] is a Timer."""

    def __init__(self) -> None:
        self._series: dict[str, _Series] = {}

    def _series_for(self, name: str) -> _Series:
        s = self._series.get(name)
        if s is None:
            s = self._series.setdefault(name, _Series(name))
        return s

    def __getitem__(self, name: str) -> Timer:
        if name not in self._series:
            raise KeyError(f"no timer named {name!r}")
        return Timer(name)

    def __contains__(self, name: object) -> bool:
        return name in self._series

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._series))

    def __len__(self) -> int:
        return len(self._series)

    def report(self) -> Report:
        """Every named timer that has run, in order of first use (waits for the GPU)."""
        return Report([_report_row(name, s) for name, s in list(self._series.items())
                       if len(s._cpu)])

    def reset(self, name: str | None = None) -> None:
        """Forget the readings of one named timer, or of all. Decorated functions keep timing."""
        for key, s in list(self._series.items()):
            if name is None or key == name:
                s.clear()

    def __repr__(self) -> str:
        return repr(self.report())

    def _repr_html_(self) -> str:
        return self.report()._repr_html_()


timers = _Registry()


class _Reader:
    """A timing's value for Logger.attach: calling it waits for the end event; poll() does not
    (None until known), so delivery on the training thread never waits for a timer."""
    __slots__ = ("rec",)

    def __init__(self, rec: Timing):
        self.rec = rec

    def __call__(self) -> float:
        return self.rec.ms

    def poll(self) -> float | None:
        return self.rec._poll()


# ---- microbenchmark ----------------------------------------------------------------------------

def bench(fn: Callable[[], Any], warmup: int = 25, rep: int = 100, *, flush_l2: bool = True,
          device: Any = None) -> Stats:
    """Time fn() `rep` times after `warmup` calls; returns Stats in ms (float() is the median).

    On CUDA each rep is bracketed by its own event pair on the current stream, after an L2
    flush (a 256 MB memset, outside the pair) when flush_l2; the pairs are read at the end.
    warmup and rep are counts (triton's do_bench takes millisecond budgets instead). The
    device is chosen after the first warm-up call, so fn may be what initialises CUDA.
    """
    for name, v, least in (("rep", rep, 1), ("warmup", warmup, 0)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"bench({name}=...) must be an int (a count of calls), got "
                            f"{type(v).__name__} {v!r}")
        if v < least:
            raise ValueError(f"bench needs {name} >= {least}, got {name}={v}")
    if not callable(fn):
        raise TypeError(f"bench(fn) needs a callable, got {type(fn).__name__}")
    dev = _parse_device(device)
    for _ in range(warmup):
        fn()
    dev = _resolve(dev)
    if dev < 0:
        times = []
        for _ in range(rep):
            t0 = perf_counter()
            fn()
            times.append((perf_counter() - t0) * 1e3)
        return Stats.of(times)
    cache = None
    if flush_l2:
        cache = torch.empty(_L2_FLUSH_BYTES // 4, dtype=torch.int32, device=f"cuda:{dev}")
    pairs = []
    for _ in range(rep):
        if cache is not None:
            cache.zero_()
        pair = _C.EventPair(dev)
        pair.start()
        fn()
        pair.stop()
        pairs.append(pair)
    return Stats.of([p.elapsed() for p in pairs])

