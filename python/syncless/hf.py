"""The Hugging Face Trainer without a host-device sync per step: one line.

    from syncless.hf import SynclessTrainer
    trainer = SynclessTrainer(model=model, args=args, train_dataset=ds)     # was: Trainer(...)

    class MyTrainer(SynclessTrainerMixin, SFTTrainer): ...                  # any Trainer subclass

Where the Trainer syncs (transformers 5.17 to 5.24, `Trainer._run_epoch`): the NaN/Inf filter
(`logging_nan_inf_filter`, on by default) runs `torch.isnan(loss) or torch.isinf(loss)` on the host
after every micro-batch, two syncs; `include_num_input_tokens_seen` gathers the batch's token count
and `.item()`s it after every micro-batch; at each logging step `_maybe_log_save_evaluate`
`.item()`s the loss and the grad norm. `on_log` callbacks and `report_to` integrations only ever
receive floats.

What SynclessTrainer changes, keeping the Trainer's loop as it is:
- the filter runs on the device with the Trainer's own formula: a non-finite micro-batch adds
  `tr_loss / (1 + global_step - globalstep_last_logged)` (the running mean of the window) instead
  of its loss; the Trainer's host check is skipped for exactly that micro-batch
  (`args.logging_nan_inf_filter` reads False only between `training_step` returning and
  `floating_point_ops`, and is the user's value everywhere else: callbacks, saved arguments).
  So `training_step` returns the filtered loss: a subclass of SynclessTrainer that reads it sees
  the window's mean where the loss was NaN/Inf (put the mixin first on your own subclass,
  `class T(SynclessTrainerMixin, MyTrainer)`, and MyTrainer.training_step sees the raw loss);
- tokens: a count the host has (`"all"` in one process: the input's numel) goes straight into
  `state.num_input_tokens_seen`, exact at every micro-batch and without a kernel; a count the
  device makes (`"non_padding"`: the attention mask's sum or the non-pad tokens; any count in a
  multi-process run, gathered by the Trainer's all-gather) goes into a device counter;
- at a logging step the window's loss mean and the grad norm stay on the device and go into a
  syncless Logger; when the row arrives (normally at the next step) the Trainer's own `log()` is
  called with the values the Trainer would have computed (loss = window sum / steps, grad_norm,
  learning_rate, then `log()` adds epoch, num_input_tokens_seen and the speed metrics), with
  `state.global_step`, `state.epoch`, `state.num_input_tokens_seen` and `state.total_flos` set
  back to the logging step's for that call: `state.log_history`, every `on_log` callback and
  every `report_to` integration get the same keys, values and steps as with `Trainer`;
- `syncless_log_at_step=True` waits for each logging step's row at that step (one wait per
  logging step, none in between) and calls `log()` there, exactly when the Trainer does. It is on
  by default when a class of the trainer overrides `log()`: TRL's trainers (SFTTrainer,
  DPOTrainer, GRPOTrainer...) add the metrics they gathered since the last log (and look at
  `self.model.training` or `self.control`), which must be read at the logging step;
- a `log()` call of your own (from `compute_loss`, a callback) or the Trainer's (evaluation, the
  end) first delivers the logging steps before it (a wait, only if one is pending) and reads the
  device token count (a wait, only if there is one), so `log_history` keeps the Trainer's order
  and every entry its exact `num_input_tokens_seen`;
- a class of yours that overrides `_maybe_log_save_evaluate` (to log in its own way) keeps the
  Trainer's logging and token count as they are, with their syncs; the filter stays on the
  device;
- every optimizer step is also logged to `trainer.syncless`, a public syncless Logger (loss of
  the step, grad_norm, learning_rate, epoch, num_input_tokens_seen): give it sinks with
  `syncless_sinks=[...]` (delivered every `syncless_every` steps); `syncless_every_step=False`
  leaves it out (its gather kernel per step, and an add per extra micro-batch).

Per step on the device (measured on the H200, GPT-2 2x128, torch.profiler): two kernels more
than the Trainer (the filter's four against its three, and the row's gather), two device-to-host
copies and two syncs fewer: the same number of device operations, none of them waited for.

Still synced, on purpose: before an evaluation or a checkpoint save and at the end of training
the trainer waits for the logged steps (one wait), so that `log_history` and `trainer_state.json`
hold every logging step in order; `_finalize_training` reads the remaining loss once
(`.item()`, as the Trainer does); in multi-process runs `store_flos` still broadcasts and
`.item()`s the FLOP count at each logging step; the waits above (`syncless_log_at_step`, a log()
of your own). The batch's host-to-device copies are made non-blocking when the loader pins
memory (the default; see `syncless_non_blocking`), so they no longer wait for the GPU.
Untouched: a learning rate kept as a tensor (`_get_learning_rate` reads it every step),
DeepSpeed's grad norm (a float already), evaluation, and XLA (the class does nothing there).

Delivered late (unless `syncless_log_at_step`): `log()`, so `on_log`/`report_to`/`log_history`,
runs when the logging step's row arrives, and before the next optimizer step's `on_step_end` (or
the epoch's `on_epoch_end`) at the latest, as with the Trainer (`logging_first_step` included):
if the row is not there yet, the trainer waits for it there (counted in
`trainer.syncless_waits`). One step after the logging step, the GPU still has that next step's
work queued, so it does not idle meanwhile, and a host slower than the GPU finds the row there
already; at `on_epoch_end` right after a logging step the wait is a full one (once per epoch).
A callback reading `state.log_history` in that next step's `on_step_begin` or
`on_optimizer_step` may not see it yet; one that stops training (or asks for a save or an
evaluation) from `on_log` acts at the step where the row arrived (the next one), not at the
logging step: pass `syncless_log_at_step=True` if that step must be the Trainer's. What an
`on_log` callback reads beyond `logs` and the state fields set back (the model's weights, the
optimizer, the scheduler, counters of its own) is as of that later step too.
`state.num_input_tokens_seen` of a device count lags between logging steps (it holds the last
delivered row's count: the last logging step, or the last window of `trainer.syncless`); it is
exact at every log, save, evaluation and the end, and a host count (`"all"`) is never late.
"""
from __future__ import annotations

import collections
import logging
import time
from typing import TYPE_CHECKING, Any, Iterable

import torch

from ._checks import ADAPTER_EVERY, check_every
from .logger import Logger, Row

if TYPE_CHECKING:                        # what the mixin is mixed into
    from transformers import Trainer as _Trainer
else:
    _Trainer = object

__all__ = ["SynclessTrainerMixin", "SynclessTrainer"]

_log = logging.getLogger("syncless")
_INF = float("inf")
_UNSET = object()
_classes: dict[str, type] = {}


class _Rows:
    """The records Logger's sink: runs on the delivery thread and only appends (atomic)."""

    def __init__(self) -> None:
        self.rows: collections.deque[Row] = collections.deque()

    def write(self, rows: list[Row]) -> None:
        self.rows.extend(rows)


class _Record:
    """Host facts of one logging step, kept until its device values arrive."""
    __slots__ = ("step", "steps", "grad_norm", "lr", "epoch", "flos", "tokens", "time",
                 "start_time")

    def __init__(self, step: int, steps: int, grad_norm: Any, lr: float, epoch: Any,
                 flos: float, tokens: int, start_time: Any):
        self.step = step
        self.steps = steps                  # optimizer steps in the window
        self.grad_norm = grad_norm          # a host value (DeepSpeed) or None
        self.lr = lr
        self.epoch = epoch
        self.flos = flos                    # state.total_flos as of the logging step
        self.tokens = tokens                # state.num_input_tokens_seen (host counts)
        self.time = time.time()
        self.start_time = start_time


def _is_trainer(cls: type) -> bool:
    """transformers.Trainer itself (found without importing transformers)."""
    return cls.__name__ == "Trainer" and cls.__module__.startswith("transformers.")


class _State(_Trainer):
    """The attributes the mixin keeps on the trainer (set in SynclessTrainerMixin.__init__ and
    at the start of each training loop), shared by the two concerns below."""
    syncless: Logger | None
    syncless_waits: int
    syncless_log_at_step: bool
    _sl_active: bool                     # this training loop runs with syncless
    _sl_own_logging: bool                # a class of the user's overrides the logging step
    _sl_filter_off: bool                 # args.logging_nan_inf_filter is off until restored
    _sl_delivering: bool                 # inside the log() of a delivered logging step
    _sl_step_loss: torch.Tensor | None   # the optimizer step's loss so far
    _sl_tokens: torch.Tensor | None      # the device token count, once there is one
    _sl_last_step: int                   # the last step logged to trainer.syncless
    _sl_rows: _Rows
    _sl_records: Logger                  # one row per logging step
    _sl_pending: collections.deque[_Record]


class _DeviceValues(_State):
    """What a micro-batch adds, kept on the device: the NaN/Inf filter, the step's loss and the
    token count (no sync per micro-batch), and the step's row of `trainer.syncless`."""

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
        loss = super().training_step(model, inputs, num_items_in_batch)
        tr_loss = getattr(self, "_tr_loss", None)
        if not self._sl_active or not isinstance(loss, torch.Tensor) or tr_loss is None:
            return loss
        if self.args.logging_nan_inf_filter and loss.device == tr_loss.device:
            # The Trainer's filter, on the device: a non-finite loss adds the window's mean.
            # Four kernels (abs, lt, div, where; torch.isfinite alone is four), where the
            # Trainer's check is three and two syncs. |NaN| < inf and |±inf| < inf are False.
            window = 1 + self.state.global_step - self._globalstep_last_logged
            loss = torch.where(loss.abs() < _INF, loss, tr_loss / window)
            self.args.logging_nan_inf_filter = False     # the host check would sync; see below
            self._sl_filter_off = True
        if self.syncless is not None:
            # The step's loss: the micro-batch's own tensor when it is the step's only one (no
            # kernel: nothing writes to it later), a sum in a new tensor for the next ones,
            # in the dtype the Trainer sums in (its tr_loss's).
            step_loss = self._sl_step_loss
            if step_loss is None:
                self._sl_step_loss = loss
            else:
                if step_loss.dtype != tr_loss.dtype:
                    step_loss = step_loss.to(tr_loss.dtype)
                self._sl_step_loss = step_loss + loss
        return loss

    def _sl_restore_filter(self) -> None:
        # Called first thing in every Trainer method that runs after the filter's check.
        if self._sl_filter_off:
            self._sl_filter_off = False
            self.args.logging_nan_inf_filter = True

    def floating_point_ops(self, inputs: Any) -> int:
        self._sl_restore_filter()
        return super().floating_point_ops(inputs)

    def _track_num_input_tokens(self, inputs: Any) -> None:
        self._sl_restore_filter()
        mode = self.args.include_num_input_tokens_seen
        main = getattr(self.model, "main_input_name", "input_ids")
        if not self._sl_active or self._sl_own_logging or mode == "no" or main not in inputs:
            super()._track_num_input_tokens(inputs)  # type: ignore[no-untyped-call]  # (HF's)
            return
        if mode == "non_padding":
            pad = getattr(self.processing_class, "pad_token_id", None)
            if "attention_mask" in inputs:
                count = inputs["attention_mask"].sum()
            elif pad is not None:
                count = (inputs[main] != pad).sum()
            else:                            # the Trainer's warning, then all tokens (a sync)
                super()._track_num_input_tokens(inputs)  # type: ignore[no-untyped-call]
                return
        else:
            count = inputs[main].numel()
        device = self.args.device
        single = self.accelerator.num_processes == 1
        if not isinstance(count, torch.Tensor) and single and self._sl_tokens is None:
            # A host number (numel: "all"): state is exact at every micro-batch, no kernel.
            self.state.num_input_tokens_seen += int(count)
            return
        if self._sl_tokens is None:
            self._sl_tokens = torch.full((), self.state.num_input_tokens_seen, dtype=torch.int64,
                                         device=device)
        if isinstance(count, torch.Tensor) and count.device == self._sl_tokens.device:
            count = count.to(torch.int64)
        else:
            count = int(count)               # a host number (numel, or a CPU tensor's sum)
        if not single:
            if not isinstance(count, torch.Tensor):
                count = torch.full((), count, dtype=torch.int64, device=device)   # no H2D copy
            count = self.accelerator.gather(count).sum()
        self._sl_tokens += count

    def _sl_log_step(self, step: int, norm: Any, learning_rate: float | None) -> float | None:
        """A new optimizer step's row of `trainer.syncless` (no sync); the learning rate read
        for it, or None when there is no new step or no Logger."""
        if step == self._sl_last_step or self.syncless is None:
            return None
        self._sl_last_step = step
        lr = learning_rate if learning_rate is not None else self._get_learning_rate()
        row: dict[str, Any] = {}
        if self._sl_step_loss is not None:
            row["loss"] = self._sl_step_loss
        if norm is not None:
            row["grad_norm"] = norm
        row["learning_rate"] = lr
        if self.state.epoch is not None:
            row["epoch"] = self.state.epoch
        if self._sl_tokens is not None:
            row["num_input_tokens_seen"] = self._sl_tokens
        elif self.args.include_num_input_tokens_seen != "no":
            row["num_input_tokens_seen"] = self.state.num_input_tokens_seen
        self.syncless.log(row, step=step)
        self._sl_step_loss = None            # the next micro-batch starts the next step's sum
        return lr


class _LoggedSteps(_State):
    """The logging steps on their way: each one's device values are one row of a private
    Logger, its host facts a _Record; when the row arrives, on the training thread, the
    Trainer's own log() is called with the values and the state of that step."""

    def _sl_start(self) -> None:
        self._sl_rows = _Rows()
        # One copy per logging step; 16 windows let the host run 16 logging steps ahead of the
        # GPU (logging_steps=1 on a GPU-bound model) before it would wait.
        self._sl_records = Logger(every=1, windows=16, sinks=[self._sl_rows], sinks_on="all")
        self._sl_pending = collections.deque()

    def _sl_record(self, tr_loss: Any, norm: Any, lr: float | None,
                   learning_rate: float | None, start_time: Any) -> None:
        """The logging step: its values to the Logger (no sync), the rest kept for log()."""
        from transformers.trainer_pt_utils import nested_gather
        state = self.state
        step = state.global_step
        values = {"loss": nested_gather(  # type: ignore[no-untyped-call]  # (unannotated)
            tr_loss, self.args.parallel_mode).mean()}
        host_norm = None
        if isinstance(norm, torch.Tensor):
            values["grad_norm"] = norm
        elif norm is not None:
            host_norm = norm
        if self._sl_tokens is not None:
            values["tokens"] = self._sl_tokens
        if lr is None:
            lr = learning_rate if learning_rate is not None else self._get_learning_rate()
        self._sl_records.log(values, step=step)
        tr_loss -= tr_loss
        steps = step - self._globalstep_last_logged
        self._globalstep_last_logged = step
        self.store_flos()
        self._sl_pending.append(_Record(step, steps, host_norm, lr, state.epoch,
                                        state.total_flos, state.num_input_tokens_seen,
                                        start_time))
        self.control.should_log = False      # what the Trainer's on_log would have done
        if self.syncless_log_at_step:
            self._sl_records.flush()         # log() runs now, as the Trainer's does

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self._sl_active and not self._sl_delivering:
            # A log() of the user's own (from compute_loss, a callback) or the Trainer's
            # (evaluation, the end): the logging steps before it go first, and the token
            # count it reports is read (a wait), as exact as the Trainer's.
            if self._sl_pending:
                self._sl_drain(wait=True)
            if self._sl_tokens is not None:
                self.state.num_input_tokens_seen = max(self.state.num_input_tokens_seen,
                                                       int(self._sl_tokens.item()))
        super().log(logs, start_time)

    def _sl_logs_first(self, own: Any) -> Any:
        """The callback handler's on_step_end (on_epoch_end): the logs of the steps before go
        first, as with the Trainer, whose log() runs at the logging step. Waiting for them here,
        a step later, leaves the GPU the work of that step to do meanwhile; a host that is
        slower than the GPU finds them there already and does not wait."""

        def event(args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            if self._sl_pending and self._sl_active:
                self._sl_logs_now()
            return own(args, state, control, **kwargs)

        return event

    def _sl_logs_now(self) -> None:
        """log() every pending logging step now, waiting (counted) for rows not yet here."""
        rows = self._sl_rows.rows
        if len(rows) < len(self._sl_pending):
            self.syncless_waits += 1
            self._sl_records.flush()
        self._sl_drain()

    def _sl_drain(self, wait: bool = False) -> None:
        if wait:
            self._sl_records.flush()
            if self.syncless is not None:
                self.syncless.flush()
        rows = self._sl_rows.rows
        while rows and self._sl_pending:
            self._sl_deliver(rows.popleft(), self._sl_pending.popleft())
        if self.syncless is None:
            if wait and self._sl_tokens is not None:      # the GPU is drained: a cheap read
                self.state.num_input_tokens_seen = max(self.state.num_input_tokens_seen,
                                                       int(self._sl_tokens.item()))
            return
        tokens = self.syncless.latest.get("num_input_tokens_seen")
        if tokens is not None and int(tokens) > self.state.num_input_tokens_seen:
            self.state.num_input_tokens_seen = int(tokens)

    def _sl_deliver(self, row: Row, rec: _Record) -> None:
        values = row.values
        loss = values["loss"]
        logs: dict[str, float] = {"loss": loss / rec.steps}
        if "grad_norm" in values:
            logs["grad_norm"] = values["grad_norm"]
        elif rec.grad_norm is not None:
            logs["grad_norm"] = rec.grad_norm
        logs["learning_rate"] = rec.lr
        self._total_loss_scalar += loss
        state = self.state
        now = (state.global_step, state.epoch, state.num_input_tokens_seen, state.total_flos)
        tokens = int(values["tokens"]) if "tokens" in values else rec.tokens
        state.global_step, state.epoch, state.total_flos = rec.step, rec.epoch, rec.flos
        state.num_input_tokens_seen = tokens
        start = rec.start_time
        if start is not None:                # speed metrics as of the logging step
            start += time.time() - rec.time
        self._sl_delivering = True
        try:
            self.log(logs, start)
        finally:
            self._sl_delivering = False
            state.global_step, state.epoch, state.total_flos = now[0], now[1], now[3]
            state.num_input_tokens_seen = max(now[2], tokens)

    def _sl_stop(self, ok: bool) -> None:
        """The end of a training loop: every logged step handed over (after an error too), the
        Loggers closed."""
        try:
            if not ok:                       # still hand over every logged step
                self._sl_drain(wait=True)
        except Exception as exc:
            _log.error("syncless: delivering the last logs after an error failed: %s", exc)
        finally:
            self._sl_active = False
            self._sl_records.close()
            if self.syncless is not None:
                self.syncless.close()



class SynclessTrainerMixin(_LoggedSteps, _DeviceValues):
    """Mix into any `transformers.Trainer` subclass, first: `class T(SynclessTrainerMixin, X)`.

    syncless_every: optimizer steps per copy of `trainer.syncless` (the per-step Logger;
        default 50, a positive int).
    syncless_sinks: sinks for `trainer.syncless` (syncless.sinks.JSONL(...), CSV, TensorBoard...).
    syncless_every_step: False skips the per-step Logger (a gather kernel per step);
        `trainer.syncless` is then None and the logging steps are all that is recorded.
    syncless_log_at_step: True calls `log()` (so `on_log`, `report_to`, `log_history`) at its
        logging step, as the Trainer does, after one wait for that step's values; False when
        they arrive, before the next step's `on_step_end` at the latest; None (default): True
        when a class of the trainer overrides `log()` (TRL's trainers do), False otherwise.
    syncless_non_blocking: True (None, the default, when `dataloader_pin_memory` is on) copies
        each batch to the device without blocking the host, as
        `accelerator_config={"non_blocking": True}` does; False leaves the copies as
        `accelerator_config` says (the Trainer cannot tell its default `non_blocking: False`
        from one the user wrote, so an explicit False must be said here).
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Trainer's methods do not call super(): a mixin after it in the MRO would never run.
        mro = cls.__mro__
        trainer = next((i for i, c in enumerate(mro) if _is_trainer(c)), None)
        if trainer is not None and trainer < mro.index(SynclessTrainerMixin):
            raise TypeError(f"{cls.__name__}: SynclessTrainerMixin must come before "
                            f"{mro[1].__name__} in the bases (class {cls.__name__}("
                            f"SynclessTrainerMixin, {mro[1].__name__})); after it, it is "
                            "never called")

    def __init__(self, *args: Any, syncless_every: int = ADAPTER_EVERY,
                 syncless_sinks: Iterable[Any] | Any = (), syncless_every_step: bool = True,
                 syncless_log_at_step: bool | None = None,
                 syncless_non_blocking: bool | None = None, **kwargs: Any):
        check_every(syncless_every, "syncless_every")
        if not (syncless_log_at_step is None or isinstance(syncless_log_at_step, bool)):
            raise ValueError(f"syncless_log_at_step must be True, False or None, got "
                             f"{syncless_log_at_step!r}")
        if not (syncless_non_blocking is None or isinstance(syncless_non_blocking, bool)):
            raise ValueError(f"syncless_non_blocking must be True, False or None, got "
                             f"{syncless_non_blocking!r}")
        self.syncless_non_blocking = syncless_non_blocking
        if syncless_log_at_step is None:
            syncless_log_at_step = any("log" in vars(c) for c in _theirs(type(self)))
        self.syncless_log_at_step = syncless_log_at_step
        # A class of the user's that overrides _maybe_log_save_evaluate logs in its own way:
        # it keeps the Trainer's logging and token count (and their syncs).
        self._sl_own_logging = any("_maybe_log_save_evaluate" in vars(c)
                                   for c in _theirs(type(self)))
        if hasattr(syncless_sinks, "write"):
            syncless_sinks = [syncless_sinks]
        self.syncless_every = syncless_every
        self.syncless_sinks = list(syncless_sinks)
        if self.syncless_sinks and not syncless_every_step:
            raise ValueError("syncless_sinks need syncless_every_step=True (they get its rows)")
        self.syncless_every_step = syncless_every_step
        self.syncless: Logger | None = None
        self._sl_active = False
        self._sl_filter_off = False
        self._sl_delivering = False
        self.syncless_waits = 0              # waits for a logging step's row (see the docstring)
        super().__init__(*args, **kwargs)

    def create_accelerator_and_postprocess(self) -> None:
        # The batch's host-to-device copy without a wait (accelerate's DataLoader config, read
        # here from args.accelerator_config): set for the Accelerator's creation only, so the
        # user's arguments (saved with checkpoints) stay as they were written.
        config = getattr(self.args, "accelerator_config", None)
        on = self.syncless_non_blocking
        if on is None:
            on = bool(getattr(self.args, "dataloader_pin_memory", False))
        if not on or config is None or getattr(config, "non_blocking", True):
            super().create_accelerator_and_postprocess()
            return
        config.non_blocking = True
        try:
            super().create_accelerator_and_postprocess()
        finally:
            config.non_blocking = False

    # ---- the training run ----------------------------------------------------------------

    def _inner_training_loop(self, *args: Any, **kwargs: Any) -> Any:
        from transformers.utils.import_utils import is_torch_xla_available
        # The loop this mixin works with (transformers >= 5.17): the loss accumulates in
        # self._tr_loss, tokens are counted in _track_num_input_tokens. Otherwise: plain Trainer.
        self._sl_active = (not is_torch_xla_available() and hasattr(self, "_run_epoch")
                           and hasattr(self, "_track_num_input_tokens"))
        if not self._sl_active:
            return super()._inner_training_loop(*args, **kwargs)
        self.syncless = (Logger(every=self.syncless_every, sinks=self.syncless_sinks)
                         if self.syncless_every_step else None)
        self._sl_start()
        self._sl_step_loss = None
        self._sl_tokens = None
        self._sl_filter_off = False
        self._sl_last_step = -1
        self.syncless_waits = 0
        # The logs of the steps before go first at these events (see _sl_logs_first); the
        # handler's own attributes, if someone set them, are put back afterwards.
        handler = self.callback_handler
        kept = {name: vars(handler).get(name, _UNSET) for name in ("on_step_end", "on_epoch_end")}
        for name in kept:
            setattr(handler, name, self._sl_logs_first(getattr(handler, name)))
        ok = False
        try:
            out = super()._inner_training_loop(*args, **kwargs)
            ok = True
            return out
        finally:
            for name, own in kept.items():
                if own is _UNSET:
                    vars(handler).pop(name, None)
                else:
                    setattr(handler, name, own)
            self._sl_restore_filter()
            self._sl_stop(ok)

    def _maybe_log_save_evaluate(self, tr_loss: Any, grad_norm: Any, model: Any, trial: Any,
                                 epoch: Any, ignore_keys_for_eval: Any, start_time: Any,
                                 learning_rate: float | None = None, **kwargs: Any) -> None:
        self._sl_restore_filter()
        if self._sl_active:
            norm = grad_norm
            if isinstance(norm, torch.Tensor) and hasattr(norm, "full_tensor"):
                norm = norm.full_tensor()    # a DTensor (FSDP2): its data pointer is no value
            lr = self._sl_log_step(self.state.global_step, norm, learning_rate)
            if not self._sl_own_logging:
                if (self.control.should_log
                        and self.state.global_step > self._globalstep_last_logged):
                    self._sl_record(tr_loss, norm, lr, learning_rate, start_time)
                self._sl_drain()
                if (self.control.should_evaluate or self.control.should_save) \
                        and self._sl_pending:
                    self._sl_drain(wait=True)    # evaluation and checkpoints see every log first
        super()._maybe_log_save_evaluate(tr_loss, grad_norm, model, trial, epoch,
                                         ignore_keys_for_eval, start_time,
                                         learning_rate=learning_rate, **kwargs)

    def _finalize_training(self, *args: Any, **kwargs: Any) -> Any:
        self._sl_restore_filter()
        if self._sl_active:
            self._sl_drain(wait=True)
        return super()._finalize_training(  # type: ignore[no-untyped-call]  # (unannotated)
            *args, **kwargs)


def _theirs(cls: type) -> list[type]:
    """The classes of a trainer's MRO that are neither syncless's nor transformers.Trainer."""
    return [c for c in cls.__mro__ if c not in _OURS and not _is_trainer(c)]


_OURS = frozenset({SynclessTrainerMixin, _LoggedSteps, _DeviceValues, _State})


def _trainer_class() -> type:
    cls = _classes.get("SynclessTrainer")
    if cls is None:
        try:
            from transformers import Trainer
        except ImportError as exc:
            raise ImportError("syncless.hf needs transformers: pip install transformers") from exc
        cls = type("SynclessTrainer", (SynclessTrainerMixin, Trainer), {
            "__module__": __name__,
            "__doc__": "transformers.Trainer with the sync-free logging of SynclessTrainerMixin."})
        _classes["SynclessTrainer"] = cls
    return cls


def __getattr__(name: str) -> Any:
    # Built on first use so that importing this module imports no transformers.
    if name == "SynclessTrainer":
        return _trainer_class()
    raise AttributeError(f"module 'syncless.hf' has no attribute {name!r}")
