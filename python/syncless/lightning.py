"""Lightning without a host-device sync per step: one callback.

    import lightning.pytorch as pl
    from syncless.lightning import SynclessLogging

    trainer = pl.Trainer(callbacks=[SynclessLogging()])      # the only change
    # in the LightningModule, as before:  self.log("loss", loss, prog_bar=True)

Where Lightning syncs (lightning 2.6 source): `_ResultCollection.metrics()` turns every
`prog_bar=True` step value into a float with `.item()` on every batch, and again each time the
progress bar asks for `trainer.progress_bar_metrics`; `_LoggerConnector.log_metrics` converts every
step value before any Lightning `Logger` sees it (every `log_every_n_steps`); a Python float given
to `self.log` becomes `torch.tensor(v, device=...)`, a pageable host-to-device copy.

What the callback changes, for the fit it runs in. Every `self.log` ends in the training
results' `log` (Lightning's `_ResultCollection.log`) with its final key, `on_step` and flags,
whatever the module did on the way (a `log` override that prefixes keys, `log_dict`, a
torchmetrics object, a Callback calling `pl_module.log`). There, for an on-step value logged in
a training batch (`training_step`, `on_train_batch_start/end`, the backward and optimizer hooks),
the callback

- still calls Lightning's own `log`, with `prog_bar=False, logger=False`: Lightning keeps the
  tensor, its `on_epoch` reduction, `sync_dist`, `trainer.callback_metrics` and so every
  ModelCheckpoint/EarlyStopping `monitor` key exactly as before, and never reads the step value
  (a key logged again with other prog_bar/logger flags raises Lightning's
  MisconfigurationException, as without the callback);
- hands the value Lightning stored for the step (after its float32 cast and `sync_dist`) to a
  syncless Logger: one gather kernel per batch (per 248 metrics), no sync; and puts the same
  device tensor in `trainer.logged_metrics`, as Lightning does, unread.

The module's `log` only turns a Python number into a device tensor with `torch.full` (the value
travels as a kernel argument: no host-to-device copy) before Lightning's `log` sees it.

Delivered rows are drained on the training thread in the callback's hooks (never from the
delivery thread), so every configured Lightning logger (TensorBoardLogger, CSVLogger,
WandbLogger, ...) receives exactly the calls it would have: `log_metrics({name_step: value, ...,
"epoch": epoch}, step)` then `save()`, with Lightning's key names (`name`, or `name_step` when
`on_epoch=True` too; a metric named `step` sets the step, as in Lightning), at Lightning's step
(`trainer.global_step` of that batch, i.e. the number of optimizer steps before it), on the
batches Lightning logs: the decision is taken where Lightning takes it
(`update_train_step_metrics`, wrapped for the fit: `log_every_n_steps`, the last batch of an
accumulation, `should_stop`, `fast_dev_run`); keys logged earlier in the epoch are repeated, as
Lightning does. `log_metrics` calls that reach the loggers from elsewhere while step rows logged
before them are on their way (LearningRateMonitor, ThroughputMonitor, the user's
`self.logger.log_metrics`) wait behind those rows, so every logger sees the calls in Lightning's
order (the rows of metrics.csv come out the same). Set `Trainer(log_every_n_steps=1)` to give the
loggers every step: it costs no sync any more. The progress bar (`trainer.progress_bar_metrics`)
shows delivered step values.

Not ours to order: writes straight to a logger's experiment (`self.logger.experiment.add_scalar`,
`wandb.log`) bypass Lightning's loggers and happen at once, ahead of step rows that are still on
their way (each keeps its own step; wandb's own `_step` counter numbers them in the new order).
The Tuner's trial runs (`lr_find`, `scale_batch_size`, the LearningRateFinder and
BatchSizeFinder callbacks) swap the callbacks and loggers out: they log as they would without
the callback.

Delivered late: step values reach the loggers and the progress bar when their window is copied
back: every `every` batches (default 16), or at the first batch `max_delay` seconds (default
0.5) after the window's first batch when batches are slow, and the first batch of a fit at once,
so the bar shows a value from the second batch (on a GPU, as soon as the GPU has finished the
first one). A `log_metrics` call of the user's that waits behind step rows reaches the logger as
it was made (positional or keyword arguments).

Still synced, on purpose:
- before each validation run and at each training epoch end, the callback waits for the logged
  steps (one wait), so that the loggers see every step before Lightning logs epoch or validation
  values (WandbLogger and CSVLogger keep their step order); also at the end of fit and on an
  exception, so that nothing logged is lost;
- epoch values (`on_epoch=True`): Lightning reduces them on the device and reads each once per
  epoch to log it, as before; monitor comparisons (ModelCheckpoint, EarlyStopping) read their key
  when they run, as before;
- what the callback does not touch: validation/test/predict logging, `self.log` from epoch-level
  hooks, Lightning's per-step sigterm broadcast `.item()` in multi-process runs, and any sync in
  the user's own code.
"""
from __future__ import annotations

import collections
import copy
import importlib
import numbers
import weakref
from typing import Any, Iterable

import torch

from ._delivery import RESERVED
from ._torch import MAX_CELLS
from ._checks import LIGHTNING_EVERY, check_every, check_max_delay, check_sinks
from .logger import Logger

__all__ = ["SynclessLogging", "SynclessLoggingPL"]

# Hooks of the fit loop's training batches: the only ones whose `self.log` can be on_step.
_STEP_HOOKS = frozenset({
    "training_step", "on_train_batch_start", "on_train_batch_end", "on_before_backward",
    "backward", "on_after_backward", "on_before_optimizer_step", "optimizer_step",
    "configure_gradient_clipping", "clip_gradients", "on_before_zero_grad", "optimizer_zero_grad",
})

_classes: dict[str, type] = {}

# Lightning metric names that syncless keeps for its rows' own fields ("step", "time"): the
# Logger's column for each, and back.
_COLUMN = {name: f"lightning/{name}" for name in RESERVED}
_NAME = {column: name for name, column in _COLUMN.items()}


class _Batch:
    """Host facts about one training batch, kept until its row is delivered."""
    __slots__ = ("step", "epoch", "log_now", "keys", "rows")

    def __init__(self, step: int, epoch: int):
        self.step = step                 # the step Lightning's log_metrics would use
        self.epoch = epoch
        self.log_now = False             # Lightning logs this batch's step metrics
        self.keys: tuple = ()
        self.rows = 0                    # Logger rows of this batch (one per MAX_CELLS metrics)


class _Direct:
    """A `log_metrics` call that reached a logger from elsewhere (LearningRateMonitor, the user's
    `self.logger.log_metrics`, ...) while step rows logged before it were still on their way: it
    waits for them, so that the logger sees the calls in Lightning's order."""
    __slots__ = ("send", "args", "kwargs")
    rows = 0
    log_now = False

    def __init__(self, send: Any, args: tuple, kwargs: dict):
        self.send = send                 # the logger's own log_metrics
        self.args = args                 # the call as the caller made it (positional or not)
        self.kwargs = kwargs


class _KeptOpen:
    """A user's sink as each fit's Logger sees it. The Logger closes its sinks when the fit ends,
    but one callback can serve several fits (trainer.fit again, the same callback in another
    Trainer): here closing only flushes, so that the next fit writes to the sink too."""

    def __init__(self, sink: Any):
        self.sink = sink

    def write(self, rows: list) -> None:
        self.sink.write(rows)

    def flush(self) -> None:
        flush = getattr(self.sink, "flush", None)
        if flush is not None:
            flush()

    close = flush

    def __repr__(self) -> str:
        return repr(self.sink)


class _Rows:
    """The Logger's sink: runs on the delivery thread, only appends (deque.append is atomic)."""

    def __init__(self) -> None:
        self.rows: collections.deque = collections.deque()

    def write(self, rows: list) -> None:
        self.rows.extend(rows)


def _build(pkg_name: str) -> type:
    pl = importlib.import_module(pkg_name)
    result = importlib.import_module(f"{pkg_name}.trainer.connectors.logger_connector.result")
    default_dtype = result._get_default_dtype
    Misconfiguration = importlib.import_module(
        f"{pkg_name}.utilities.exceptions").MisconfigurationException

    class SynclessLogging(pl.Callback):
        """Route on-step `self.log` values through a syncless Logger (see the module docstring).

        every: batches per device-to-host copy (how late the progress bar and loggers are;
            default 16, a positive int).
        max_delay: seconds after which a batch's values are copied back anyway, when `every`
            batches take longer (the Logger's max_delay; None: only every `every` batches).
            The first batch of each fit is copied back at once, so the progress bar shows a
            value from the second batch (on a GPU: once the GPU finished the first batch).
        sinks: extra syncless sinks: every batch's row ({name: float}, Lightning's key names) at
            Lightning's step, from the delivery thread (on a GPU; without one, from the
            training thread as each window is handed over: no thread is needed to wait for
            copies there). A metric named `step` or `time` (the
            rows' own fields) comes as `lightning/step`, `lightning/time`; a batch that logs more
            metrics than one gather kernel holds (248) comes as several rows at its step. The
            sinks are flushed at the end of every fit and stay open for the next one (one
            callback can serve several fits): close them when you are done.
        """

        def __init__(self, every: int = LIGHTNING_EVERY, sinks: Iterable[Any] | Any = (),
                     max_delay: float | None = 0.5):
            self.every = check_every(every, "SynclessLogging: every")
            try:
                self.max_delay = check_max_delay(max_delay)
            except ValueError as exc:
                raise ValueError(f"SynclessLogging: {exc}") from None
            self._user_sinks = check_sinks(sinks)    # the Logger's own checks, at once
            self.syncless: Logger | None = None
            self._rows = _Rows()
            self._module: Any = None
            self._results: Any = None
            self._keys: dict[str, tuple] = {}     # result key -> (forked name, prog_bar, logger)
            self._pending: dict[str, Any] = {}
            self._open: _Batch | None = None
            self._batches: collections.deque = collections.deque()
            self._current: dict[str, float] = {}
            self._pbar_keys: set[str] = set()
            self._loggers: list = []             # (logger, its own log_metrics, was patched)
            self._trainer: Any = None            # weakref to the trainer the keys belong to
            self._connector: Any = None          # (its logger connector, was patched, own method)

        def __getstate__(self) -> dict:
            # What a pickle or deepcopy carries (ddp_spawn pickles the trainer with its
            # callbacks): the settings; a fit's Logger, thread and hooks are its own.
            return {"every": self.every, "sinks": self._user_sinks, "max_delay": self.max_delay}

        def __setstate__(self, state: dict) -> None:
            self.__init__(state["every"], state["sinks"], state.get("max_delay", 0.5))

        # ---- the log replacement ------------------------------------------------------------

        def _ours(self, trainer: Any, fx: str | None) -> bool:
            """A training batch hook of a fit we run in. (The Tuner's trial runs, inside our fit
            or not, swap the callbacks and loggers out: they log as they would without us.)"""
            return (fx in _STEP_HOOKS and trainer.training and self.syncless is not None
                    and self in trainer.callbacks)

        def _install(self, trainer: Any, pl_module: Any) -> None:
            """Two wrappers for the fit. The module's `log` only turns a Python number into a
            device tensor with torch.full (a kernel argument instead of torch.tensor(v,
            device=...)'s pageable copy); everything else reaches Lightning's own `log` (or the
            user's override of it) as given. The training results' `log`, where every
            `self.log` ends with its final key, on_step and flags, sends on-step values to
            Lightning with prog_bar and logger off, and records them for the syncless Logger."""
            cb = self
            own_module_log = type(pl_module).log.__get__(pl_module)

            @torch.compiler.disable
            def module_log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
                if (isinstance(value, numbers.Number) and pl_module._trainer is not None
                        and cb._ours(pl_module._trainer, pl_module._current_fx_name)):
                    value = torch.full((), float(value), dtype=default_dtype(),
                                       device=pl_module.device)
                return own_module_log(name, value, *args, **kwargs)

            results = _train_results(trainer)
            own_results_log = results.log

            @torch.compiler.disable
            def results_log(fx: str, name: str, value: Any, prog_bar: bool = False,
                            logger: bool = True, on_step: bool = False, on_epoch: bool = True,
                            **kw: Any) -> None:
                if not on_step or not cb._ours(trainer, fx):
                    return own_results_log(fx, name, value, prog_bar=prog_bar, logger=logger,
                                           on_step=on_step, on_epoch=on_epoch, **kw)
                key = f"{fx}.{name}"
                if kw.get("add_dataloader_idx", True) and results.dataloader_idx is not None:
                    key += f".{results.dataloader_idx}"
                entry = cb._keys.get(key)
                if entry is None and key in results:
                    # Logged by Lightning alone before (a Tuner's run): the user's flags are
                    # on its meta; from now on they are ours to keep off.
                    meta = results[key].meta
                    entry = (None, meta.prog_bar, meta.logger)
                    if entry[1:] == (prog_bar, logger):
                        meta.prog_bar = meta.logger = False
                if entry is not None and entry[1:] != (prog_bar, logger):
                    # Lightning compares the flags we pass it, always off: compare the user's.
                    raise Misconfiguration(
                        f"You called `self.log({name}, ...)` twice in `{fx}` with different "
                        "arguments. This is not allowed")
                own_results_log(fx, name, value, prog_bar=False, logger=False, on_step=True,
                                on_epoch=on_epoch, **kw)
                cb._record(trainer, key, prog_bar, logger)

            pl_module.__dict__["log"] = module_log
            results.__dict__["log"] = results_log
            self._module = pl_module
            self._results = results

        def _uninstall(self) -> None:
            if self._module is not None:
                self._module.__dict__.pop("log", None)
                self._results.__dict__.pop("log", None)
                self._module = self._results = None

        def _record(self, trainer: Any, key: str, prog_bar: bool, logger: bool) -> None:
            metric = _train_results(trainer).get(key)
            if metric is None:                       # Lightning chose not to log it
                return
            if self._open is None:                   # the batch's first value
                self._open = _Batch(_logger_step(trainer), trainer.current_epoch)
            entry = self._keys.get(key)
            if entry is None:
                entry = self._keys[key] = (metric.meta.forked_name(True), prog_bar, logger)
                if prog_bar:
                    self._pbar_keys.add(entry[0])
            value = metric._forward_cache            # after the float cast and sync_dist
            if isinstance(value, torch.Tensor):
                self._pending[entry[0]] = value
                if entry[2]:
                    # What Lightning's logged_metrics holds: the device tensor, unread.
                    trainer._logger_connector._logged_metrics[entry[0]] = value

        # ---- batches ----------------------------------------------------------------------

        def _step_end(self, trainer: Any) -> None:
            """Where Lightning decides to log a training batch's step metrics (its
            update_train_step_metrics, after every on_train_batch_end hook): the batch closes
            here, logged to the loggers if and only if Lightning would log it."""
            batch = self._open
            if batch is None or self not in trainer.callbacks:
                return
            connector = trainer._logger_connector
            batch.log_now = (
                not (trainer.fit_loop._should_accumulate()
                     and trainer.lightning_module.automatic_optimization)
                and bool(trainer.loggers)
                and (connector.should_update_logs or bool(trainer.fast_dev_run)))
            if batch.log_now:
                # The keys Lightning's log_metrics would send now: every on-step logger key
                # still valid in this epoch (host bookkeeping only, no tensor is read).
                results = _train_results(trainer)
                batch.keys = tuple(entry[0] for key, entry in self._keys.items()
                                   if entry[2] and _valid(results.get(key)))
            self._close_batch(trainer)

        def _close_batch(self, trainer: Any) -> None:
            """Hands the batch's values to the Logger; a batch Lightning did not reach the end
            of (skipped by on_train_batch_start returning -1, cut by an exception) is not sent
            to the loggers, as in Lightning."""
            batch = self._open
            if batch is None:
                return
            self._open = None
            if self._pending:
                # Rows are matched to batches by order; the step is Lightning's (equal steps
                # under gradient accumulation are fine). Names syncless keeps for its own row
                # fields go in under another; a batch wider than one kernel takes several rows.
                items = [(_COLUMN.get(k, k), v) for k, v in self._pending.items()]
                # Lightning's step can go back within a fit (a loop state loaded again); the
                # loggers get batch.step, a Logger row never goes behind the one before it.
                step = max(batch.step, self.syncless.last_step)
                first = self.syncless.last_step < 0
                for at in range(0, len(items), MAX_CELLS):
                    self.syncless.log(dict(items[at:at + MAX_CELLS]), step=step)
                    batch.rows += 1
                self._pending = {}
                if first:
                    self.syncless.flush(wait=False)   # the bar's first value: one copy, no wait
            self._batches.append(batch)

        # ---- delivery, on the training thread -----------------------------------------------

        def _drain(self, trainer: Any, wait: bool = False) -> None:
            if self.syncless is None or self.syncless.closed:
                return
            if wait:
                self._close_batch(trainer)
                self.syncless.flush()
            rows = self._rows.rows
            pbar: dict[str, float] = {}
            batches = self._batches
            while batches:
                batch = batches[0]
                if batch.rows:
                    if len(rows) < batch.rows:
                        break
                    for _ in range(batch.rows):
                        values = rows.popleft().values
                        if _NAME.keys() & values.keys():
                            values = {_NAME.get(k, k): v for k, v in values.items()}
                        self._current.update(values)
                        for k, v in values.items():
                            if k in self._pbar_keys:
                                pbar[k] = v
                batches.popleft()
                if isinstance(batch, _Direct):
                    batch.send(*batch.args, **batch.kwargs)
                elif batch.log_now and batch.keys:
                    self._emit(trainer, batch)
            if pbar:
                # The connector's dict, not the trainer.progress_bar_metrics property: the property
                # computes epoch values, an all-reduce under sync_dist that every rank must join.
                trainer._logger_connector._progress_bar_metrics.update(pbar)

        def _emit(self, trainer: Any, batch: _Batch) -> None:
            metrics = {k: self._current[k] for k in batch.keys if k in self._current}
            if not metrics:
                return
            step = batch.step
            step_metric = metrics.pop("step", None)
            if step_metric is not None:
                step = int(step_metric)
            else:
                metrics.setdefault("epoch", batch.epoch)
            for lg in trainer.loggers:
                self._send(lg, metrics, step)
                lg.save()

        def _send(self, lg: Any, metrics: dict, step: int | None) -> None:
            for logger, own, _patched in self._loggers:
                if logger is lg:
                    return own(metrics=metrics, step=step)
            lg.log_metrics(metrics=metrics, step=step)

        def _watch_loggers(self, trainer: Any) -> None:
            """Every configured logger's log_metrics, while fit runs: calls made by others wait
            behind the step rows logged before them (see _Direct), and reach the logger as they
            were made (positional or keyword arguments, the same metrics object when not
            waiting; a copy of it, taken at the call, when waiting)."""
            cb = self
            for lg in trainer.loggers:
                own = lg.log_metrics
                self._loggers.append((lg, own, "log_metrics" in vars(lg)))
                lg.log_metrics = self._ordered(trainer, own)

            connector = trainer._logger_connector
            own_update = connector.update_train_step_metrics

            def update_train_step_metrics() -> None:
                cb._step_end(trainer)
                own_update()          # logs nothing of ours: our keys' logger flags are off

            self._connector = (connector, "update_train_step_metrics" in vars(connector),
                               own_update)
            connector.update_train_step_metrics = update_train_step_metrics

        def _ordered(self, trainer: Any, own: Any) -> Any:
            cb = self

            def log_metrics(*args: Any, **kwargs: Any) -> Any:
                if cb._batches and not cb.syncless.closed:
                    args, kwargs = _copy_metrics(args, kwargs)
                    cb._batches.append(_Direct(own, args, kwargs))
                    cb._drain(trainer)
                    return None
                return own(*args, **kwargs)

            return log_metrics

        def _unwatch_loggers(self) -> None:
            for lg, own, patched in self._loggers:
                if patched:
                    lg.log_metrics = own
                else:
                    vars(lg).pop("log_metrics", None)
            self._loggers = []
            if self._connector is not None:
                connector, patched, own = self._connector
                if patched:
                    connector.update_train_step_metrics = own
                else:
                    vars(connector).pop("update_train_step_metrics", None)
                self._connector = None

        def _set_flags(self, trainer: Any, on: bool) -> None:
            """Lightning reads step values only for metas with prog_bar/logger set: those are
            kept off during the epoch and set back to the user's choice for the epoch-end log,
            so that epoch values are shown and logged by Lightning itself, once."""
            results = _train_results(trainer)
            for key, (_name, prog_bar, logger) in self._keys.items():
                metric = results.get(key)
                if metric is not None:
                    metric.meta.prog_bar = prog_bar and on
                    metric.meta.logger = logger and on

        # ---- Lightning hooks ----------------------------------------------------------------

        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            if stage != "fit":
                return
            self._finish()                       # a fit that ended without teardown
            twins = [cb for cb in trainer.callbacks
                     if isinstance(cb, SynclessLogging) and cb is not self]
            if twins:
                raise ValueError(
                    f"SynclessLogging: the Trainer has {len(twins) + 1} of them in its callbacks; "
                    "keep one (each would take every value, and the loggers would get them twice)")
            # The rows go to the hooks of this thread through a deque: without a GPU the Logger
            # hands them over itself (delivery="caller": host rows are out at the hand-over, so
            # the first batch's values are on the bar by the second), with one a thread waits
            # for the copies.
            on_gpu = trainer.strategy.root_device.type == "cuda"
            self.syncless = Logger(every=self.every, sinks_on="all", max_delay=self.max_delay,
                                   delivery="thread" if on_gpu else "caller",
                                   sinks=[self._rows, *map(_KeptOpen, self._user_sinks)])
            if self._trainer is None or self._trainer() is not trainer:
                # Lightning keeps a trainer's results (and our flags on their metas) from one
                # fit to the next: the keys are forgotten only for another trainer.
                self._trainer = weakref.ref(trainer)
                self._keys.clear()
                self._pbar_keys.clear()
            self._pending = {}
            self._open = None
            self._batches.clear()
            self._rows.rows.clear()
            self._current.clear()
            self._install(trainer, pl_module)
            self._watch_loggers(trainer)

        def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
            self._set_flags(trainer, on=False)

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any,
                                 batch_idx: int) -> None:
            self._drain(trainer)

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                               batch_idx: int) -> None:
            self._drain(trainer)

        def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
            if trainer.training or trainer.state.fn == "fit":
                self._drain(trainer, wait=True)

        def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
            self._drain(trainer, wait=True)
            self._set_flags(trainer, on=True)

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            self._drain(trainer, wait=True)

        def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
            try:
                self._drain(trainer, wait=True)
            finally:
                self._finish()

        def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
            if stage == "fit":
                self._drain(trainer, wait=True)
                self._finish()

        def _finish(self) -> None:
            self._uninstall()
            self._unwatch_loggers()
            if self.syncless is not None:
                self.syncless.close()

    SynclessLogging.__module__ = __name__
    SynclessLogging.__qualname__ = "SynclessLogging"
    return SynclessLogging


def _copy_metrics(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A log_metrics call kept for later, with its metrics copied as they are now (the caller
    may reuse the dict), in the same argument it came in."""
    if args:
        return (_copy(args[0]), *args[1:]), kwargs
    if "metrics" in kwargs:
        return args, {**kwargs, "metrics": _copy(kwargs["metrics"])}
    return args, kwargs


def _copy(metrics: Any) -> Any:
    try:
        return copy.copy(metrics)
    except Exception:
        return metrics


def _valid(metric: Any) -> bool:
    return metric is not None and not metric.has_reset and metric.meta.dataloader_idx is None


def _train_results(trainer: Any) -> Any:
    # Not trainer._results: that is the active loop's, the validation loop's during validation.
    return trainer.fit_loop.epoch_loop._results


def _logger_step(trainer: Any) -> int:
    """The step Lightning passes to log_metrics for a training batch."""
    loop = getattr(trainer.fit_loop, "epoch_loop", None)
    step = getattr(loop, "_batches_that_stepped", None)
    return trainer.global_step if step is None else step


def _callback_class(pkg_name: str) -> type:
    cls = _classes.get(pkg_name)
    if cls is None:
        try:
            cls = _classes[pkg_name] = _build(pkg_name)
        except ImportError as exc:
            raise ImportError(
                f"syncless.lightning needs {pkg_name}: pip install lightning") from exc
    return cls


def __getattr__(name: str) -> Any:
    # Built on first use so that importing this module imports no Lightning package.
    if name == "SynclessLogging":
        try:
            importlib.import_module("lightning.pytorch")
            return _callback_class("lightning.pytorch")
        except ImportError:
            return _callback_class("pytorch_lightning")
    if name == "SynclessLoggingPL":
        return _callback_class("pytorch_lightning")
    raise AttributeError(f"module 'syncless.lightning' has no attribute {name!r}")
