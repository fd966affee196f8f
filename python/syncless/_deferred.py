"""The drop-in adapters' shared core: host-side records whose tensors a private Logger gathers.

`Deferred.put(record, values, names, step, walltime)` logs the record's values as one row of a
private Logger (one kernel launch, no sync; the row's step is the record's sequence number) and
keeps the record itself on the host. On the logger's delivery thread `replay(record, values,
step, walltime)` runs for every record, in call order, with the values read as floats. Both
adapters (syncless.tensorboard, syncless.wandb) are this plus the call that writes to their
backend, so they share one set of rules:

- `every` and `max_delay` are checked here, once.
- A tensor `step` or `walltime` rides in the row and is read with the values (a step tensor must
  hold one element, of an integer dtype unless the adapter's `step_tensor` rule allows more); a
  host step goes through the adapter's own conversion at the call, so a bad one fails there, as
  the backend itself would.
- A name that is not valid UTF-8 text, and every value the Logger refuses, fail at the call with
  the Logger's error naming the user's metric (never a private column name).
- A record the backend refuses at delivery is reported (once per metric, by name) and counted in
  `errors`; delivery goes on and every other record is written.
- Any number of values per call: more than one kernel's worth (MAX_CELLS) spans several rows of
  the private logger, replayed as one record.
- A call during CUDA graph capture raises: each replay would add a row with no record behind it.
"""
from __future__ import annotations

import logging
import math
import numbers
import threading
from typing import Any, Callable, Sequence

import torch

from ._torch import MAX_CELLS, cuda_initialized   # MAX_CELLS: cells per log() call
from ._checks import ADAPTER_EVERY, check_every, check_max_delay
from .logger import Logger, Row

_log = logging.getLogger("syncless")

_MAX_REPORTS = 20                  # distinct failing metrics reported by name, then only counted

_STEP, _WALL = "s", "w"            # the row's cells for a tensor step / walltime
_IN_ROW = object()                 # step / walltime given as a tensor: read from the row
_PART = object()                   # a row holding the first cells of a wider record
_columns: list[str] = [str(i) for i in range(MAX_CELLS)]
_columns_lock = threading.Lock()
_good_names: set[str] = set()      # names check_name() passed


def check_name(name: Any, what: str = "metric") -> None:
    """Names reach the backend as UTF-8: refuse, at the call, what the backend would refuse."""
    if type(name) is str and name in _good_names:
        return                                  # checked before: a set lookup per call
    if not isinstance(name, str):
        raise TypeError(f"{what} names must be str, got {type(name).__name__} {name!r}")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{what} {name!r} is not valid UTF-8 text ({exc.reason} at "
                         f"position {exc.start})") from None
    if len(_good_names) < 100_000:               # bounded, whatever names a run invents
        _good_names.add(name)


def _columns_for(n: int) -> list[str]:
    """The row's column names for n values ("0", "1", ...), shared by every adapter."""
    if len(_columns) < n:
        with _columns_lock:                     # adapters in several threads may grow it
            _columns.extend(str(i) for i in range(len(_columns), n))
    return _columns


class _Rows:
    """A Logger sink that hands whole windows to one function."""
    __slots__ = ("write",)

    def __init__(self, write: Callable[[list[Row]], None]):
        self.write = write


class Failures:
    """One reporting policy for records a backend refused: counted, reported once per metric."""

    def __init__(self, source: str, counter: str):
        self.source = source          # "syncless.tensorboard"
        self.counter = counter        # where the user reads the count: "writer.errors"
        self.count = 0
        self._reported: set[str] = set()

    def failed(self, metric: str, what: str, exc: BaseException) -> None:
        self.count += 1
        if metric in self._reported or len(self._reported) > _MAX_REPORTS:
            return
        self._reported.add(metric)
        if len(self._reported) > _MAX_REPORTS:
            _log.error("%s: more metrics failed; the rest are only counted in %s",
                       self.source, self.counter)
            return
        _log.error("%s: %s was not written: %s: %s (reported once per metric; %s counts "
                   "them; the other records go on)", self.source, what, type(exc).__name__,
                   exc, self.counter)


class Deferred:
    """The records of one adapter object (a writer, a run), replayed in call order.

    replay(record, values, step, walltime): values are floats in the order put() got them;
    step is the host step as converted at put(), or the int a step tensor held; walltime is
    the given one, the float a walltime tensor held, or the host time of the put() call.
    describe(record) -> (metric, text) names a failed record in the report."""

    def __init__(self, replay: Callable[[Any, list[float], Any, float], None],
                 describe: Callable[[Any], tuple[str, str]], failures: Failures,
                 every: int = ADAPTER_EVERY, max_delay: float | None = 2.0,
                 step_name: str = "step", step_of: Callable[[Any], Any] | None = None,
                 step_tensor: Callable[[torch.Tensor], None] | None = None):
        self.every = check_every(every)
        # The private Logger's max_delay: rows are handed over that late at most.
        self.max_delay = check_max_delay(max_delay)
        self.failures = failures
        self._replay = replay
        self._describe = describe
        self._step_name = step_name
        self._step_of = step_of
        self._step_tensor = step_tensor or self._integer_step
        self._lock = threading.Lock()       # callers may log from several threads
        self._pending: dict[int, Any] = {}  # sequence number -> (record, n, step, wall) or part
        self._carry: dict[str, float] = {}  # cells of a wide record's earlier rows
        self._seq = 0
        self._logger: Logger | None = None

    @property
    def errors(self) -> int:
        return self.failures.count

    def __deepcopy__(self, memo: dict[int, Any]) -> Deferred:
        raise _not_copyable(self.failures.source)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise _not_copyable(self.failures.source)

    # ---- the caller's thread ---------------------------------------------------------------

    def put(self, record: Any, values: Sequence[Any], names: Sequence[str], step: Any = None,
            walltime: Any = None) -> None:
        """Log `values` (one-element tensors or real numbers; `names` are the user's names for
        them, used only in errors) and keep `record` for replay."""
        n = len(values)
        cells = {"0": values[0]} if n == 1 else dict(zip(_columns_for(n), values))
        if step is None or type(step) is int:
            pass                                    # the common cases, at no cost
        elif isinstance(step, torch.Tensor):
            self._step_tensor(step)
            cells[_STEP], step = step, _IN_ROW
        elif self._step_of is not None:
            step = self._step_of(step)
        if walltime is not None:
            if isinstance(walltime, torch.Tensor):
                cells[_WALL], walltime = walltime, _IN_ROW
            elif isinstance(walltime, bool) or not isinstance(walltime, numbers.Real):
                raise TypeError(f"walltime must be a real number or a one-element tensor, "
                                f"got {type(walltime).__name__}")
            else:
                walltime = float(walltime)
        with self._lock:
            # Only once CUDA is in use (never initialised by this check): a replay of a
            # captured call would append rows that no call made, shifting every later record.
            if cuda_initialized() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"{self.failures.source}: called during CUDA graph capture; "
                                   "log inside graphs with syncless.Logger instead")
            log = self._logger
            if log is None or log.closed:     # (closed: by the exit hook, or a test's cleanup)
                # sinks_on="all": on every rank of a distributed job, each writer writes its own.
                # threads=True: callers may put() from any thread (serialised by our lock).
                log = self._logger = Logger(every=self.every, sinks=[_Rows(self._deliver)],
                                            sinks_on="all", threads=True,
                                            max_delay=self.max_delay)
            first = seq = self._seq
            try:
                if len(cells) <= MAX_CELLS:
                    self._pending[seq] = (record, n, step, walltime)
                    log.log(cells, seq)
                else:
                    items = list(cells.items())
                    last = first + (len(items) - 1) // MAX_CELLS
                    for seq in range(first, last + 1):
                        chunk = dict(items[(seq - first) * MAX_CELLS:(seq - first + 1) * MAX_CELLS])
                        self._pending[seq] = (record, n, step, walltime) if seq == last else _PART
                        log.log(chunk, seq)
            except BaseException as exc:
                for s in range(first, seq + 1):      # rows already logged replay nothing
                    self._pending.pop(s, None)
                self._seq = seq + 1                   # never reuse a step the logger saw
                if isinstance(exc, (TypeError, ValueError)):
                    raise _renamed(exc, cells, names, self._step_name) from None
                raise
            self._seq = seq + 1

    def _integer_step(self, step: torch.Tensor) -> None:
        """The default rule for a step tensor: an integer dtype (read as the row's float64)."""
        if step.dtype.is_floating_point or step.dtype.is_complex or step.dtype == torch.bool:
            raise TypeError(f"{self._step_name} must be an integer tensor, got {step.dtype}")

    # ---- the logger's delivery thread -------------------------------------------------------

    def _deliver(self, rows: list[Row]) -> None:
        pending = self._pending
        for row in rows:
            entry = pending.pop(row.step, None)
            if entry is None:                       # a CUDA graph replay, or an aborted put()
                self._carry.clear()
                continue
            if entry is _PART:
                self._carry.update(row.values)
                continue
            cells = row.values
            if self._carry:
                cells, self._carry = {**self._carry, **cells}, {}
            record, n, step, wall = entry
            try:
                values = [cells[c] for c in _columns[:n]]
                if step is _IN_ROW:
                    step = _int_step(cells[_STEP], self._step_name)
                if wall is None:
                    wall = row.time
                elif wall is _IN_ROW:
                    wall = cells[_WALL]
                self._replay(record, values, step, wall)
            except Exception as exc:                # one bad record never stops the others
                try:
                    metric, what = self._describe(record)
                except Exception:
                    metric = what = repr(record)
                if step is not None and step is not _IN_ROW:
                    what = f"{what} at {self._step_name} {step}"
                self.failures.failed(metric, what, exc)

    # ---- draining ---------------------------------------------------------------------------

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


def _not_copyable(source: str) -> TypeError:
    # As syncless.Logger's: a copy would split one run's records between two loggers.
    return TypeError(f"{source}: this object cannot be deep-copied or pickled "
                     "(neither can torch's or wandb's: it owns a syncless.Logger, a thread "
                     "and open files); share the one object: keep it out of what gets "
                     "copied or saved, or copy around it: copy.deepcopy(model, "
                     "{id(writer): writer})")


def _renamed(exc: Exception, cells: dict[str, Any], names: Sequence[str],
             step_name: str) -> Exception:
    """The Logger's error about a private column, told with the user's name for it."""
    text = str(exc)
    for i, column in enumerate(cells):
        key = f"metric {column!r}"
        if key in text:
            if column == _STEP:
                return type(exc)(text.replace(key, step_name, 1))
            if column == _WALL:
                return type(exc)(text.replace(key, "walltime", 1))
            return type(exc)(text.replace(key, f"metric {names[i]!r}", 1))
    return exc


def _int_step(value: float, name: str) -> int:
    """A step tensor's value, as the row holds it (a float64): exact below 2**53."""
    if not math.isfinite(value) or not -2**63 <= value < 2**63:
        raise ValueError(f"{name} {value!r} (from a tensor) is not an int64")
    return int(value)
