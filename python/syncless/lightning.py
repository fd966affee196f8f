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
from typing import Any, Callable, ClassVar, Iterable, TypeVar

import torch

from ._checks import LIGHTNING_EVERY, check_every, check_max_delay
from ._torch import MAX_CELLS
from .logger import Logger
from .rows import RESERVED, Row, check_sinks

__all__ = ["SynclessLogging", "SynclessLoggingPL"]

# Hooks of the fit loop's training batches: the only ones whose `self.log` can be on_step.
_STEP_HOOKS = frozenset({
    "training_step", "on_train_batch_start", "on_train_batch_end", "on_before_backward",
    "backward", "on_after_backward", "on_before_optimizer_step", "optimizer_step",
    "configure_gradient_clipping", "clip_gradients", "on_before_zero_grad", "optimizer_zero_grad",
})

# Lightning metric names that syncless keeps for its rows' own fields ("step", "time"): the
# Logger's column for each, and back.
_COLUMN = {name: f"lightning/{name}" for name in RESERVED}
_NAME = {column: name for name, column in _COLUMN.items()}

_Send = Callable[..., Any]              # a Lightning logger's own log_metrics
_F = TypeVar("_F", bound=Callable[..., Any])


def _eager(fn: _F) -> _F:
    """torch.compiler.disable(fn): a compiled training_step calls the log wrappers eagerly."""
    disable: Callable[[_F], _F] = torch.compiler.disable     # (torch leaves it unannotated)
    return disable(fn)


class _Package:
    """What the callback takes from one Lightning package (lightning.pytorch or
    pytorch_lightning): its Callback base, its default dtype and its misconfiguration error."""

    def __init__(self, name: str):
        self.callback: type = importlib.import_module(name).Callback
        result = importlib.import_module(f"{name}.trainer.connectors.logger_connector.result")
        self.default_dtype: Callable[[], torch.dtype] = result._get_default_dtype
        self.misconfiguration: type[Exception] = importlib.import_module(
            f"{name}.utilities.exceptions").MisconfigurationException


class _Batch:
    """Host facts about one training batch, kept until its row is delivered."""
    __slots__ = ("step", "epoch", "log_now", "keys", "rows")

    def __init__(self, step: int, epoch: int):
        self.step = step                 # the step Lightning's log_metrics would use
        self.epoch = epoch
        self.log_now = False             # Lightning logs this batch's step metrics
        self.keys: tuple[str, ...] = ()
        self.rows = 0                    # Logger rows of this batch (one per MAX_CELLS metrics)


class _Direct:
    """A `log_metrics` call that reached a logger from elsewhere (LearningRateMonitor, the user's
    `self.logger.log_metrics`, ...) while step rows logged before it were still on their way: it
    waits for them, so that the logger sees the calls in Lightning's order."""
    __slots__ = ("send", "args", "kwargs")
    rows = 0
    log_now = False

    def __init__(self, send: _Send, args: tuple[Any, ...], kwargs: dict[str, Any]):
        self.send = send                 # the logger's own log_metrics
        self.args = args                 # the call as the caller made it (positional or not)
        self.kwargs = kwargs


class _KeptOpen:
    """A user's sink as each fit's Logger sees it. The Logger closes its sinks when the fit ends,
    but one callback can serve several fits (trainer.fit again, the same callback in another
    Trainer): here closing only flushes, so that the next fit writes to the sink too."""

    def __init__(self, sink: Any):
        self.sink = sink

    def write(self, rows: list[Row]) -> None:
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
        self.rows: collections.deque[Row] = collections.deque()

    def write(self, rows: list[Row]) -> None:
        self.rows.extend(rows)


class _Capture:
    """The fit's `self.log` replacement and what it keeps: the keys seen (with the user's flags)
    and the open batch's device values, never read on the host."""

    def __init__(self, package: _Package, ours: Callable[[Any, str | None], bool]):
        self.package = package
        self.ours = ours                      # is this a training batch hook of our fit?
        self.keys: dict[str, tuple[str, bool, bool]] = {}   # key -> (name, prog_bar, logger)
        self.pbar_keys: set[str] = set()
        self.pending: dict[str, torch.Tensor] = {}
        self.open: _Batch | None = None
        self._module: Any = None
        self._results: Any = None

    def install(self, trainer: Any, pl_module: Any) -> None:
        """Two wrappers for the fit. The module's `log` only turns a Python number into a
        device tensor with torch.full (a kernel argument instead of torch.tensor(v,
        device=...)'s pageable copy); everything else reaches Lightning's own `log` (or the
        user's override of it) as given. The training results' `log`, where every `self.log`
        ends with its final key, on_step and flags, sends on-step values to Lightning with
        prog_bar and logger off, and records them for the syncless Logger."""
        results = _train_results(trainer)
        pl_module.__dict__["log"] = self._module_log(pl_module)
        results.__dict__["log"] = self._results_log(trainer, results)
        self._module = pl_module
        self._results = results

    def _module_log(self, pl_module: Any) -> Callable[..., None]:
        own_module_log = type(pl_module).log.__get__(pl_module)
        ours, default_dtype = self.ours, self.package.default_dtype

        @_eager
        def module_log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
            if (isinstance(value, numbers.Number) and pl_module._trainer is not None
                    and ours(pl_module._trainer, pl_module._current_fx_name)):
                # (a complex Number fails in float(), as without the callback)
                value = torch.full((), float(value),  # type: ignore[arg-type]
                                   dtype=default_dtype(), device=pl_module.device)
            own_module_log(name, value, *args, **kwargs)

        return module_log

    def _results_log(self, trainer: Any, results: Any) -> Callable[..., None]:
        own_results_log = results.log
        capture = self

        @_eager
        def results_log(fx: str, name: str, value: Any, prog_bar: bool = False,
                        logger: bool = True, on_step: bool = False, on_epoch: bool = True,
                        **kw: Any) -> None:
            if not on_step or not capture.ours(trainer, fx):
                own_results_log(fx, name, value, prog_bar=prog_bar, logger=logger,
                                on_step=on_step, on_epoch=on_epoch, **kw)
                return
            key = f"{fx}.{name}"
            if kw.get("add_dataloader_idx", True) and results.dataloader_idx is not None:
                key += f".{results.dataloader_idx}"
            capture.check_flags(key, results, fx, name, prog_bar, logger)
            own_results_log(fx, name, value, prog_bar=False, logger=False, on_step=True,
                            on_epoch=on_epoch, **kw)
            capture.record(trainer, key, prog_bar, logger)

        return results_log

    def check_flags(self, key: str, results: Any, fx: str, name: str, prog_bar: bool,
                    logger: bool) -> None:
        """Lightning compares the flags we pass it, always off: compare the user's."""
        entry = self.keys.get(key)
        flags = None if entry is None else entry[1:]
        if flags is None and key in results:
            # Logged by Lightning alone before (a Tuner's run): the user's flags are on its
            # meta; from now on they are ours to keep off.
            meta = results[key].meta
            flags = (meta.prog_bar, meta.logger)
            if flags == (prog_bar, logger):
                meta.prog_bar = meta.logger = False
        if flags is not None and flags != (prog_bar, logger):
            raise self.package.misconfiguration(
                f"You called `self.log({name}, ...)` twice in `{fx}` with different "
                "arguments. This is not allowed")

    def uninstall(self) -> None:
        if self._module is not None:
            self._module.__dict__.pop("log", None)
            self._results.__dict__.pop("log", None)
            self._module = self._results = None

    def record(self, trainer: Any, key: str, prog_bar: bool, logger: bool) -> None:
        metric = _train_results(trainer).get(key)
        if metric is None:                       # Lightning chose not to log it
            return
        if self.open is None:                    # the batch's first value
            self.open = _Batch(_logger_step(trainer), trainer.current_epoch)
        entry = self.keys.get(key)
        if entry is None:
            entry = self.keys[key] = (metric.meta.forked_name(True), prog_bar, logger)
            if prog_bar:
                self.pbar_keys.add(entry[0])
        value = metric._forward_cache            # after the float cast and sync_dist
        if isinstance(value, torch.Tensor):
            self.pending[entry[0]] = value
            if entry[2]:
                # What Lightning's logged_metrics holds: the device tensor, unread.
                trainer._logger_connector._logged_metrics[entry[0]] = value

    def logger_keys(self, trainer: Any) -> tuple[str, ...]:
        """The keys Lightning's log_metrics would send now: every on-step logger key still
        valid in this epoch (host bookkeeping only, no tensor is read)."""
        results = _train_results(trainer)
        return tuple(name for key, (name, _pbar, logger) in self.keys.items()
                     if logger and _valid(results.get(key)))

    def take(self) -> tuple[_Batch | None, dict[str, torch.Tensor]]:
        """The open batch and its values, now closed."""
        batch, pending = self.open, self.pending
        self.open, self.pending = None, {}
        return batch, pending

    def set_flags(self, trainer: Any, on: bool) -> None:
        """Lightning reads step values only for metas with prog_bar/logger set: those are
        kept off during the epoch and set back to the user's choice for the epoch-end log,
        so that epoch values are shown and logged by Lightning itself, once."""
        results = _train_results(trainer)
        for key, (_name, prog_bar, logger) in self.keys.items():
            metric = results.get(key)
            if metric is not None:
                metric.meta.prog_bar = prog_bar and on
                metric.meta.logger = logger and on


class _Feed:
    """Batches on their way: sent to the syncless Logger in order, and when their rows come
    back (drained on the training thread), given to the progress bar and Lightning's loggers."""

    def __init__(self) -> None:
        self.sink = _Rows()
        self.batches: collections.deque[_Batch | _Direct] = collections.deque()
        self.current: dict[str, float] = {}

    def clear(self) -> None:
        self.batches.clear()
        self.sink.rows.clear()
        self.current.clear()

    def send(self, log: Logger, batch: _Batch, pending: dict[str, torch.Tensor]) -> None:
        """Hands the batch's values to the Logger."""
        if pending:
            # Rows are matched to batches by order; the step is Lightning's (equal steps
            # under gradient accumulation are fine). Names syncless keeps for its own row
            # fields go in under another; a batch wider than one kernel takes several rows.
            items = [(_COLUMN.get(k, k), v) for k, v in pending.items()]
            # Lightning's step can go back within a fit (a loop state loaded again); the
            # loggers get batch.step, a Logger row never goes behind the one before it.
            step = max(batch.step, log.last_step)
            first = log.last_step < 0
            for at in range(0, len(items), MAX_CELLS):
                log.log(dict(items[at:at + MAX_CELLS]), step=step)
                batch.rows += 1
            if first:
                log.flush(wait=False)          # the bar's first value: one copy, no wait
        self.batches.append(batch)

    def deliver(self, trainer: Any, pbar_keys: set[str], loggers: _Loggers) -> dict[str, float]:
        """Every batch whose rows are back, in order: its values become current, and Lightning's
        loggers get the batches Lightning logs. Returns the progress bar's new values."""
        rows = self.sink.rows
        pbar: dict[str, float] = {}
        batches = self.batches
        while batches:
            batch = batches[0]
            if batch.rows:
                if len(rows) < batch.rows:
                    break
                for _ in range(batch.rows):
                    values = rows.popleft().values
                    if _NAME.keys() & values.keys():
                        values = {_NAME.get(k, k): v for k, v in values.items()}
                    self.current.update(values)
                    for k, v in values.items():
                        if k in pbar_keys:
                            pbar[k] = v
            batches.popleft()
            if isinstance(batch, _Direct):
                batch.send(*batch.args, **batch.kwargs)
            elif batch.log_now and batch.keys:
                self._emit(trainer, batch, loggers)
        return pbar

    def _emit(self, trainer: Any, batch: _Batch, loggers: _Loggers) -> None:
        metrics = {k: self.current[k] for k in batch.keys if k in self.current}
        if not metrics:
            return
        step = batch.step
        step_metric = metrics.pop("step", None)
        if step_metric is not None:
            step = int(step_metric)
        else:
            metrics.setdefault("epoch", batch.epoch)
        for lg in trainer.loggers:
            loggers.send(lg, metrics, step)
            lg.save()


class _Loggers:
    """Lightning's hooks the fit wraps: every configured logger's log_metrics (calls made by
    others wait behind the step rows logged before them, see _Direct) and the connector's
    update_train_step_metrics (where a batch closes). Each is put back as it was found."""

    def __init__(self) -> None:
        self._loggers: list[tuple[Any, _Send, bool]] = []   # (logger, its own, was patched)
        self._connector: tuple[Any, bool, Callable[[], None]] | None = None

    def watch(self, trainer: Any, step_end: Callable[[], None],
              defer: Callable[[_Send, tuple[Any, ...], dict[str, Any]], bool]) -> None:
        """defer(own, args, kwargs) queues a call and says so, or says it must go now. A call
        reaches the logger as it was made (positional or keyword arguments, the same metrics
        object when not waiting; a copy of it, taken at the call, when waiting)."""
        for lg in trainer.loggers:
            own = lg.log_metrics
            self._loggers.append((lg, own, "log_metrics" in vars(lg)))
            lg.log_metrics = _ordered(own, defer)
        connector = trainer._logger_connector
        own_update = connector.update_train_step_metrics

        def update_train_step_metrics() -> None:
            step_end()
            own_update()          # logs nothing of ours: our keys' logger flags are off

        self._connector = (connector, "update_train_step_metrics" in vars(connector),
                           own_update)
        connector.update_train_step_metrics = update_train_step_metrics

    def send(self, lg: Any, metrics: dict[str, float], step: int | None) -> None:
        """A step's metrics to a logger, by its own log_metrics while it is watched."""
        for logger, own, _patched in self._loggers:
            if logger is lg:
                own(metrics=metrics, step=step)
                return
        lg.log_metrics(metrics=metrics, step=step)

    def unwatch(self) -> None:
        for lg, own, patched in self._loggers:
            if patched:
                lg.log_metrics = own
            else:
                vars(lg).pop("log_metrics", None)
        self._loggers = []
        if self._connector is not None:
            connector, patched, own_update = self._connector
            if patched:
                connector.update_train_step_metrics = own_update
            else:
                vars(connector).pop("update_train_step_metrics", None)
            self._connector = None


def _ordered(own: _Send, defer: Callable[[_Send, tuple[Any, ...], dict[str, Any]], bool]) -> _Send:
    def log_metrics(*args: Any, **kwargs: Any) -> Any:
        if defer(own, args, kwargs):
            return None
        return own(*args, **kwargs)

    return log_metrics


class _SynclessLogging:
    """Route on-step `self.log` values through a syncless Logger (see the module docstring).

    every: batches per device-to-host copy (how late the progress bar and loggers are;
        default 16, a positive int).
    max_delay: seconds after which a batch's values are copied back anyway, when `every`
        batches take longer (the Logger's max_delay; None: only every `every` batches).
        The first batch of each fit is copied back at once, so the progress bar shows a
        value from the second batch (on a GPU: once the GPU finished the first batch).
    sinks: extra syncless sinks: every batch's row ({name: float}, Lightning's key names) at
        Lightning's step, from the delivery thread (on a GPU; without one, from the training
        thread as each window is handed over: no thread is needed to wait for copies there).
        A metric named `step` or `time` (the rows' own fields) comes as `lightning/step`,
        `lightning/time`; a batch that logs more metrics than one gather kernel holds (248)
        comes as several rows at its step. The sinks are flushed at the end of every fit and
        stay open for the next one (one callback can serve several fits): close them when you
        are done.
    """
    _package: ClassVar[_Package]         # set on each package's class (see _callback_class)

    def __init__(self, every: int = LIGHTNING_EVERY, sinks: Iterable[Any] | Any = (),
                 max_delay: float | None = 0.5):
        self._configure(every, sinks, max_delay)

    def _configure(self, every: int, sinks: Iterable[Any] | Any,
                   max_delay: float | None) -> None:
        self.every = check_every(every, "SynclessLogging: every")
        self.max_delay = check_max_delay(max_delay, "SynclessLogging: max_delay")
        self._user_sinks = check_sinks(sinks)    # the Logger's own checks, at once
        self.syncless: Logger | None = None
        self._capture = _Capture(self._package, lambda trainer, fx: _ours(self, trainer, fx))
        self._feed = _Feed()
        self._hooks = _Loggers()
        self._trainer: weakref.ref[Any] | None = None   # the trainer the keys belong to

    def __getstate__(self) -> dict[str, Any]:
        # What a pickle or deepcopy carries (ddp_spawn pickles the trainer with its
        # callbacks): the settings; a fit's Logger, thread and hooks are its own.
        return {"every": self.every, "sinks": self._user_sinks, "max_delay": self.max_delay}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._configure(state["every"], state["sinks"], state.get("max_delay", 0.5))

    def _step_end(self, trainer: Any) -> None:
        """Where Lightning decides to log a training batch's step metrics (its
        update_train_step_metrics, after every on_train_batch_end hook): the batch closes
        here, logged to the loggers if and only if Lightning would log it."""
        batch = self._capture.open
        if batch is None or self not in trainer.callbacks:
            return
        batch.log_now = _logs_now(trainer)
        if batch.log_now:
            batch.keys = self._capture.logger_keys(trainer)
        self._close_batch()

    def _close_batch(self) -> None:
        """To the Logger. (A batch cut short, by on_train_batch_start returning -1 or by an
        exception, never reached _step_end: the loggers do not get it, as in Lightning.)"""
        batch, pending = self._capture.take()
        if batch is not None and self.syncless is not None:
            self._feed.send(self.syncless, batch, pending)

    def _defer(self, trainer: Any, own: _Send, args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> bool:
        """A logger's log_metrics call waits behind the step rows on their way, if any."""
        if not self._feed.batches or self.syncless is None or self.syncless.closed:
            return False
        args, kwargs = _copy_metrics(args, kwargs)
        self._feed.batches.append(_Direct(own, args, kwargs))
        self._drain(trainer)
        return True

    def _drain(self, trainer: Any, wait: bool = False) -> None:
        """Delivered rows to the progress bar and the loggers, on the training thread."""
        if self.syncless is None or self.syncless.closed:
            return
        if wait:
            self._close_batch()
            self.syncless.flush()
        pbar = self._feed.deliver(trainer, self._capture.pbar_keys, self._hooks)
        if pbar:
            # The connector's dict, not the trainer.progress_bar_metrics property: the property
            # computes epoch values, an all-reduce under sync_dist that every rank must join.
            trainer._logger_connector._progress_bar_metrics.update(pbar)

    # ---- Lightning hooks ----------------------------------------------------------------

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        self._finish()                       # a fit that ended without teardown
        _check_alone(self, trainer)
        # The rows go to the hooks of this thread through a deque: without a GPU the Logger
        # hands them over itself (delivery="caller": host rows are out at the hand-over, so
        # the first batch's values are on the bar by the second), with one a thread waits
        # for the copies.
        on_gpu = trainer.strategy.root_device.type == "cuda"
        self.syncless = Logger(every=self.every, sinks_on="all", max_delay=self.max_delay,
                               delivery="thread" if on_gpu else "caller",
                               sinks=[self._feed.sink, *map(_KeptOpen, self._user_sinks)])
        if self._trainer is None or self._trainer() is not trainer:
            # Lightning keeps a trainer's results (and our flags on their metas) from one
            # fit to the next: the keys are forgotten only for another trainer.
            self._trainer = weakref.ref(trainer)
            self._capture.keys.clear()
            self._capture.pbar_keys.clear()
        self._capture.take()
        self._feed.clear()
        self._capture.install(trainer, pl_module)
        self._hooks.watch(trainer, lambda: self._step_end(trainer),
                          lambda own, args, kwargs: self._defer(trainer, own, args, kwargs))

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self._capture.set_flags(trainer, on=False)

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
        self._capture.set_flags(trainer, on=True)

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
        self._capture.uninstall()
        self._hooks.unwatch()
        if self.syncless is not None:
            self.syncless.close()


def _ours(cb: _SynclessLogging, trainer: Any, fx: str | None) -> bool:
    """A training batch hook of a fit cb runs in. (The Tuner's trial runs, inside our fit or
    not, swap the callbacks and loggers out: they log as they would without us.)"""
    return (fx in _STEP_HOOKS and trainer.training and cb.syncless is not None
            and cb in trainer.callbacks)


def _logs_now(trainer: Any) -> bool:
    """Lightning logs this training batch's step metrics (its update_train_step_metrics)."""
    return (not (trainer.fit_loop._should_accumulate()
                 and trainer.lightning_module.automatic_optimization)
            and bool(trainer.loggers)
            and bool(trainer._logger_connector.should_update_logs or trainer.fast_dev_run))


def _check_alone(cb: _SynclessLogging, trainer: Any) -> None:
    twins = [c for c in trainer.callbacks if isinstance(c, _SynclessLogging) and c is not cb]
    if twins:
        raise ValueError(
            f"SynclessLogging: the Trainer has {len(twins) + 1} of them in its callbacks; "
            "keep one (each would take every value, and the loggers would get them twice)")


def _copy_metrics(args: tuple[Any, ...], kwargs: dict[str, Any]
                  ) -> tuple[tuple[Any, ...], dict[str, Any]]:
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
    return int(trainer.global_step if step is None else step)


_classes: dict[str, type[_SynclessLogging]] = {}


def _callback_class(pkg_name: str) -> type[_SynclessLogging]:
    """The callback on one Lightning package's Callback base: the class above, with the base
    (Lightning's Trainer takes only its own Callback subclasses) and the package's facts."""
    cls = _classes.get(pkg_name)
    if cls is None:
        try:
            package = _Package(pkg_name)
        except ImportError as exc:
            raise ImportError(
                f"syncless.lightning needs {pkg_name}: pip install lightning") from exc
        cls = _classes[pkg_name] = type(
            "SynclessLogging", (_SynclessLogging, package.callback),
            {"__module__": __name__, "__doc__": _SynclessLogging.__doc__, "_package": package})
    return cls


def __getattr__(name: str) -> Any:
    # Made on first use so that importing this module imports no Lightning package.
    if name == "SynclessLogging":
        try:
            importlib.import_module("lightning.pytorch")
            return _callback_class("lightning.pytorch")
        except ImportError:
            return _callback_class("pytorch_lightning")
    if name == "SynclessLoggingPL":
        return _callback_class("pytorch_lightning")
    raise AttributeError(f"module 'syncless.lightning' has no attribute {name!r}")
