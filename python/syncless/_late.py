"""Late values: attach()ed values and timer readings that join the row of their step when
they become known, or come as a row of their own at that step if it already went out."""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from ._signals import by_signal, start
from ._torch import _C
from ._whole import Whole, on_main
from .rows import Row

__all__ = ["Late", "LateValues"]

_log = logging.getLogger("syncless")
# Starts the threads of bounded resolves; re-entrant, as a signal handler's close() may come
# back here on the thread it interrupted (see _handover.Pool).
_RUNNERS = threading.RLock()


class Late:
    __slots__ = ("step", "name", "resolve", "value", "missing", "runner")

    def __init__(self, step: int, name: str, resolve: Callable[[], Any]):
        self.step, self.name, self.resolve = step, name, resolve
        self.value: float | None = None      # known without waiting (see known), or resolved
        self.missing = False                 # close() gave up waiting for it
        self.runner: tuple[threading.Thread, list[Any]] | None = None   # a bounded resolve

    def known(self) -> bool:
        """Is the value known without waiting? A resolve with a poll() method (a timer's
        reading) says so, None meaning not yet; any other resolve is taken to be known (it runs
        when its row is delivered, wherever that is)."""
        if self.value is not None or self.missing:
            return True
        poll = getattr(self.resolve, "poll", None)
        if poll is None:
            return True
        try:
            v = poll()
        except Exception:
            return True                      # resolve() will raise it, and it is reported
        if v is None:
            return False
        self.value = v                       # checked like any attached value when merged
        return True


class Raised(Exception):
    """An attach() fn raised a BaseException that is no Exception (KeyboardInterrupt,
    SystemExit), on another thread: reported like any failure, then raised again by the training
    thread's next flush() or close() (see LateValues.raised)."""

    def __init__(self, exc: BaseException):
        super().__init__(f"{type(exc).__name__}: {exc}")
        self.exc = exc


def _late_value(name: str, v: Any) -> float:
    """An attached fn's result, under log()'s rules (a real number or a one-element tensor;
    the same errors, naming the metric). A CUDA tensor is read here, where resolve() may wait."""
    if type(v) is float:
        return v
    device, values = _C.read_host_values({name: v})
    return float(v.item()) if values is None else values[name]


class LateValues:
    """The late values not delivered yet (`values`, replaced only by Delivery's commit), and
    the failures among them (`errors`, each name reported once)."""

    def __init__(self, whole: Whole | None = None) -> None:
        self.whole = whole                   # runs an fn called on the main thread (_whole)
        self.raised: BaseException | None = None    # see Raised
        self.values: list[Late] = []
        self.hold = False                    # once late values are in use (see _delivery)
        self.errors = 0
        self._failed: set[str] = set()
        self.resolving: Late | None = None   # the one a delivery waits for now
        self.deadline: float | None = None   # close(): late values are waited for until then

    def keep(self, late: Late) -> None:
        self.hold = True
        self.values.append(late)

    def give_up_waiting(self) -> None:
        """take_over(): the value the stuck thread waits for is counted missing."""
        stuck = self.resolving
        if stuck is not None:
            stuck.missing = True

    def resolve(self, late: Late) -> float:
        """A late value, waiting for it; after close() set a deadline, until then at most (an
        fn without poll() then runs on a thread of its own, left behind if it does not
        return). Raises TimeoutError when it gave up (the value is then counted missing)."""
        if late.value is not None:
            return late.value
        deadline = self.deadline
        if deadline is None and self.whole is not None and on_main():
            self._resolve_whole(late, self.whole)
            return late.value                    # type: ignore[return-value]
        if deadline is None:
            self.resolving = late
            try:
                late.value = _late_value(late.name, late.resolve())
            finally:
                self.resolving = None
            return late.value
        if not late.missing and getattr(late.resolve, "poll", None) is not None:
            while not late.known() and time.monotonic() < deadline:
                time.sleep(0.001)
        elif not late.missing:
            with _RUNNERS:                   # one run, for the thread and take_over() both
                if late.runner is None:
                    box: list[Any] = []

                    def run() -> None:
                        try:
                            box.append(_late_value(late.name, late.resolve()))
                        except BaseException as exc:
                            box.append(exc)
                    t = threading.Thread(target=run, name="syncless-attach", daemon=True)
                    start(t)
                    late.runner = t, box
            t, box = late.runner
            t.join(max(deadline - time.monotonic(), 0.05))
            if box and isinstance(box[0], Exception):
                raise box[0]
            if box and isinstance(box[0], BaseException):
                raise Raised(box[0])             # the fn's own, on its thread: not a signal's
            if box:
                late.value = box[0]
        if late.value is None:
            late.missing = True
            raise TimeoutError("close() stopped waiting for it")
        return late.value

    def _resolve_whole(self, late: Late, whole: Whole) -> None:
        """resolve() on the main thread: the fn runs whole on the helper (see _whole), so a
        signal handler's exception never cuts it short, and one it raises is never taken for a
        handler's. A handler's delivery that resolves the same value meanwhile waits for the
        call in flight and finds the value."""
        box: list[Any] = []

        def call() -> None:
            try:
                late.value = _late_value(late.name, late.resolve())
            except BaseException as exc:
                box.append(exc)
            done[0] = 1

        done = [0]
        whole.ready()
        while late.value is None and not done[0]:
            stuck = whole.idle()
            if stuck is not None:                # (no deadline: it does not happen)
                continue
            job = whole.job(call, done, 0, 0, f"attach({late.name!r}) fn")
            if late.value is None and whole.busy is None:     # the claim: no call since
                whole.busy = job
                whole.gate.release()
            whole.wait(job)
        if late.value is None:
            exc = box[0] if box else RuntimeError("the fn did not run")
            raise exc if isinstance(exc, Exception) else Raised(exc)

    def merge(self, rows: list[Row], upto: float | None, blocking: bool,
              nonfinite: dict[str, int]) -> tuple[list[Row], list[Row], list[Late], list[str]]:
        """Late values join the first row of their step; those whose step already went out
        (or, at a drain, has no row) become rows of their own at that step. Not blocking, the
        rows from the first step whose late value is not known yet are held back, with it.
        Returns (rows, rows held back, late values kept, late values given up on); the rows'
        values are new dicts, so a delivery an interrupt cut short before its commit is
        planned again from the same state."""
        held: list[Row] = []
        if not self.values:
            return rows, held, self.values, []
        top: float = rows[-1].step if rows else -1
        if upto is not None:
            top = max(top, upto)
        due: list[Late] = []
        keep: list[Late] = []
        for late in self.values:
            (due if late.step <= top else keep).append(late)
        if due and not blocking:
            waiting = [late.step for late in due if not late.known()]
            if waiting:
                first = min(waiting)
                cut = next((i for i, row in enumerate(rows) if row.step >= first), len(rows))
                rows, held = rows[:cut], rows[cut:]
                keep += [late for late in due if late.step >= first]
                due = [late for late in due if late.step < first]
        if not due:
            return rows, held, keep, []
        rows = [row._with(dict(row.values)) for row in rows]
        missing = self._join(rows, due, nonfinite)
        return rows, held, keep, missing

    def _join(self, rows: list[Row], due: list[Late], nonfinite: dict[str, int]) -> list[str]:
        """Add the due late values to `rows` (in place, new rows sorted in by step); returns
        those given up on."""
        first: dict[int, Row] = {}
        for row in rows:
            first.setdefault(row.step, row)
        extra: dict[int, dict[str, float]] = {}
        merged: set[tuple[int, str]] = set()       # late values added to a row here
        added: list[dict[str, float]] = []         # each one, for the NaN/Inf count
        missing = []
        for late in due:
            try:
                v = _late_value(late.name, self.resolve(late))   # may wait
            except TimeoutError:
                missing.append(f"{late.name!r} at step {late.step}")
                continue
            except Raised as exc:                 # the fn's KeyboardInterrupt, SystemExit...
                if self.raised is None:
                    self.raised = exc.exc
                self._failed_once(late, f"failed: {exc} (the next flush() or close() raises "
                                  "it again)")
                continue
            except BaseException as exc:
                if by_signal(exc):
                    raise                         # the training thread's own interrupt
                if not isinstance(exc, Exception):   # raised on the delivery thread
                    if self.raised is None:
                        self.raised = exc
                self._failed_once(late, f"failed: {type(exc).__name__}: {exc}")
                continue
            target = first.get(late.step)
            if target is not None and late.name in target.values and \
                    (late.step, late.name) not in merged:
                self._failed_once(late, f"was not added: log() wrote {late.name!r} at that "
                                  "step, and its value is kept; attach under a name log() does "
                                  "not use")
                continue
            merged.add((late.step, late.name))
            values = target.values if target is not None else extra.setdefault(late.step, {})
            values[late.name] = values.get(late.name, 0.0) + v     # repeated durations add up
            added.append({late.name: v})
        _C.tally(added, None, nonfinite)
        if extra:
            now = time.time()
            for step, values in extra.items():
                row = Row(step, now, values)
                row.late = True
                rows.append(row)
            rows.sort(key=lambda r: r.step)        # stable: equal steps keep their order
        return missing

    def _failed_once(self, late: Late, what: str) -> None:
        self.errors += 1
        if late.name not in self._failed:
            self._failed.add(late.name)
            _log.error("syncless: late value %r for step %d %s (reported once per name; "
                       "stats.late_errors counts them)", late.name, late.step, what)
