"""wandb.log that never syncs: change one import.

    import syncless.wandb as wandb          # was: import wandb
    wandb.init(project="p")                 # wandb.init itself; returns the real run
    wandb.log({"loss": loss, "lr": lr})     # CUDA tensors: one kernel launch, no sync

Each log() call is one row of a `syncless.Logger`: one-element tensors are gathered on the
device in stream order; everything else in the call (Python numbers, strings, wandb.Image,
Histogram, nested dicts), its `step` and `commit` stay on the host, keyed by the row. Every `every`
calls the rows are copied back and the calls are replayed to the run in the order they were made,
with each tensor replaced by its `.item()` value, on the logger's delivery thread. Replaying the
same calls in the same order lets wandb do its own step counting, so the run's history is the one
`wandb.log` with `.item()` values would have written; `_timestamp` is the time of the original
call. `wandb.finish()` / `run.finish()` (and interpreter exit, through wandb's own finish) deliver
everything first; `flush()` does it on demand.

Until delivery the run has not seen the deferred calls: `run.step` and `run.summary` lag by up to
`every` calls. Direct calls join the same queue: once syncless logs to a run, that run's own
`run.log` (and the real `wandb.log`, while the run is wandb's global run) go through it, so rows
logged any way reach the run in call order, each at the step wandb gives it, without a sync and
without a row lost; `run.finish()` restores wandb's own method. Multi-element tensors are
snapshotted on the device (no sync here) and converted by wandb on the delivery thread. A call
during CUDA graph capture raises RuntimeError.

Any other attribute (`wandb.Image`, `wandb.config`, `wandb.run`, ...) is the real wandb's.
"""
from __future__ import annotations

import functools
import logging
import operator
from typing import Any, Mapping

import torch

try:
    import wandb as _wandb                      # the real package: imports are absolute
except ImportError as exc:
    raise ImportError("syncless.wandb needs wandb: pip install wandb "
                      "(from a syncless checkout: pip install -e '.[wandb]')") from exc

from ._checks import ADAPTER_EVERY, check_every, check_max_delay
from ._deferred import Deferred, Failures, check_name

__all__ = ["init", "log", "flush", "finish"]

_log = logging.getLogger("syncless")

_states: dict[int, "_RunState"] = {}     # id(run) -> its deferred calls
_closed_errors = [0]                     # errors of the runs whose states are closed
_DEFAULT = object()                      # max_delay not given


class _Slot:
    """Where a tensor's value goes back in the replayed call, and the type .item() gives."""
    __slots__ = ("index", "cast")

    def __init__(self, index: int, cast: type):
        self.index = index
        self.cast = cast


def _item_type(dtype: torch.dtype) -> type:
    if dtype.is_floating_point:
        return float
    return bool if dtype == torch.bool else int


def _split(data: Mapping[str, Any], values: list[torch.Tensor], names: list[str],
           prefix: str = "") -> dict[str, Any]:
    """A copy of `data` with each one-element tensor moved into `values` (the logger's row;
    `names` gets its key) and replaced by a _Slot. Reads only host metadata: no sync."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(key, str):
            check_name(key, "key")
        if isinstance(value, torch.Tensor):
            if value.numel() == 1 and not value.dtype.is_complex:
                out[key] = _Slot(len(values), _item_type(value.dtype))
                values.append(value)
                names.append(f"{prefix}{key}")
            else:
                out[key] = value.detach().clone()   # a snapshot: later in-place updates miss it
        elif isinstance(value, dict):
            out[key] = _split(value, values, names, f"{prefix}{key}.")
        elif type(value).__name__ == "ndarray" and type(value).__module__ == "numpy":
            out[key] = value.copy()             # numpy arrays are mutable; tensors above
        else:
            out[key] = value
    return out


def _fill(template: dict[str, Any], values: list[float]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in template.items():
        if type(value) is _Slot:
            out[key] = value.cast(values[value.index])
        elif type(value) is dict:
            out[key] = _fill(value, values)
        else:
            out[key] = value
    return out


def _numbers(data: dict[str, Any], out: dict[str, float], prefix: str = "") -> None:
    for key, value in data.items():
        if type(value) is dict:
            _numbers(value, out, f"{prefix}{key}.")
        elif (isinstance(value, (int, float)) and not isinstance(value, bool)
              and not key.startswith("_")):                     # _timestamp, _step
            out[prefix + key] = value


def _step(step: Any) -> int:
    """wandb's rule for `step`, applied at the call: an integer (numpy ints too), not a bool."""
    if not isinstance(step, bool):
        try:
            return operator.index(step)
        except TypeError:
            pass
    raise TypeError(f"step must be an integer, got {type(step).__name__} {step!r}")


def _describe(record: tuple[Any, ...]) -> tuple[str, str]:
    keys = ", ".join(repr(k) for k in record[0])
    return keys, f"log({{{keys}}})"


class _RunState:
    """One run's deferred log() calls, replayed to the run in order on the delivery thread."""

    def __init__(self, run: Any, every: int = ADAPTER_EVERY, max_delay: float | None = 2.0):
        self.run = run
        self.latest: dict[str, float] = {}
        self.finished = False
        self._deferred = Deferred(self._replay, _describe,
                                  Failures("syncless.wandb", "syncless.wandb.errors"), every,
                                  max_delay, step_name="step", step_of=_step)
        # Direct run.log calls join the queue: passed through at once, a call would reach the
        # run ahead of deferred rows logged before it, and wandb would drop those rows (their
        # steps are behind the run's by then). Queued, it costs what a syncless log costs.
        self._own_log = run.log
        self._direct = self._direct_log()
        run.log = self._direct
        if getattr(_wandb, "log", None) == self._own_log:
            _wandb.log = self._direct              # the real wandb.log of this global run

    def _direct_log(self) -> Any:
        state = self

        @functools.wraps(self._own_log)
        def log(data: Mapping[str, Any], step: Any = None, commit: bool | None = None) -> None:
            state.log(data, step, commit)

        return log

    @property
    def errors(self) -> int:
        return self._deferred.errors

    def log(self, data: Mapping[str, Any], step: Any = None, commit: bool | None = None) -> None:
        if not isinstance(data, Mapping):
            raise TypeError("wandb.log must be passed a dictionary")
        if any(not isinstance(key, str) for key in data):
            raise TypeError("Key values passed to `wandb.log` must be strings.")
        if self.finished:
            raise _wandb.errors.UsageError(
                f"Run ({getattr(self.run, 'id', '?')}) is finished. The call to `log` will "
                "be ignored. Please make sure that you are using an active run.")
        values: list[torch.Tensor] = []
        names: list[str] = []
        template = _split(data, values, names)
        self._deferred.put((template, commit), values, names, step)

    def _replay(self, record: tuple[Any, ...], values: list[float], step: Any,
                wall: float) -> None:
        template, commit = record          # the logger's delivery thread
        data = _fill(template, values)
        data.setdefault("_timestamp", wall)
        self._own_log(data, step=step, commit=commit)
        _numbers(data, self.latest)

    def flush(self) -> None:
        self._deferred.flush()

    def close(self) -> None:
        self.finished = True
        self._deferred.close()
        if vars(self.run).get("log") is self._direct:
            del self.run.log                       # wandb's own method again
        if getattr(_wandb, "log", None) is self._direct:
            _wandb.log = self._own_log
        if _states.get(id(self.run)) is self:
            del _states[id(self.run)]
            _closed_errors[0] += self.errors


def _deferred(run: Any, every: int | None = None, max_delay: Any = _DEFAULT) -> _RunState:
    state = _states.get(id(run))
    if state is None or state.run is not run:
        state = _states[id(run)] = _RunState(run, ADAPTER_EVERY if every is None else every,
                                             2.0 if max_delay is _DEFAULT else max_delay)
        try:
            from wandb.sdk.wandb_run import TeardownHook, TeardownStage
            # EARLY hooks run inside finish() while the run still accepts log().
            run._teardown_hooks.append(TeardownHook(state.close, TeardownStage.EARLY))
        except (ImportError, AttributeError):
            pass                                         # finish() below still drains
    return state


def init(*args: Any, every: int = ADAPTER_EVERY, max_delay: float | None = 2.0,
         **kwargs: Any) -> Any:
    """`wandb.init(*args, **kwargs)`, unchanged; returns the real run.

    every: how many log() calls share one device-to-host copy (default 50; a positive int).
    max_delay: seconds after which the next log() hands the calls over anyway, so a slow loop
        still shows up in W&B (None: only every `every` calls, flush() and finish())."""
    check_every(every)                            # before wandb.init starts a run
    check_max_delay(max_delay)
    run = _wandb.init(*args, **kwargs)
    if run is not None:
        _deferred(run, every, max_delay)
    return run


def log(data: Mapping[str, Any], step: int | None = None, commit: bool | None = None, *,
        run: Any = None) -> None:
    """`wandb.log` with the same arguments and meaning; tensors are never read here.
    run: the run to log to (default: wandb.run); needed for runs made with
    reinit="create_new", which wandb does not make the global run."""
    run = run if run is not None else _wandb.run
    if run is None:
        raise _wandb.Error("You must call wandb.init() before syncless.wandb.log()")
    _deferred(run).log(data, step, commit)


def flush() -> None:
    """Replay every deferred call to its run now (waits for the GPU to reach them)."""
    for state in list(_states.values()):
        state.flush()


def finish(*args: Any, **kwargs: Any) -> None:
    """`wandb.finish`, after delivering the current run's deferred calls."""
    run = _wandb.run
    if run is not None and id(run) in _states:
        _states[id(run)].close()
    _wandb.finish(*args, **kwargs)


def __dir__() -> list[str]:
    """wandb's names and this module's: tab completion shows what attribute access gives."""
    return sorted(set(globals()) | set(dir(_wandb)) | {"errors", "latest"})


def __getattr__(name: str) -> Any:
    if name == "errors":     # calls the runs of this process refused at delivery, finished too
        return _closed_errors[0] + sum(state.errors for state in list(_states.values()))
    if name == "latest":                 # {key: value} of wandb.run's latest replayed numbers
        run = _wandb.run
        state = _states.get(id(run)) if run is not None else None
        return dict(state.latest) if state is not None else {}
    return getattr(_wandb, name)
