"""syncless.hf against the plain transformers Trainer with the same seed: log_history, on_log
callbacks, TensorBoard files, checkpoints and early stopping must come out the same."""
import json
import math
import os
import warnings

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
from transformers import (EarlyStoppingCallback, Trainer, TrainerCallback,  # noqa: E402
                          TrainingArguments)

import syncless  # noqa: E402
from benchmarks._common import SyncCount  # noqa: E402
from syncless.hf import SynclessTrainer  # noqa: E402

VOCAB = 32


class Tiny(nn.Module):
    """A two-layer token model; `bad` (per example: 0, 1 = NaN, 2 = Inf) poisons the reported
    loss without touching the gradient, so that training goes on as the filter expects."""
    main_input_name = "input_ids"

    def __init__(self, fail_at=None):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.out = nn.Linear(16, VOCAB)
        self.fail_at = fail_at
        self.calls = 0

    def forward(self, input_ids, labels=None, attention_mask=None, bad=None):
        self.calls += 1
        if self.fail_at is not None and self.training and self.calls == self.fail_at:
            raise RuntimeError("boom")
        logits = self.out(self.emb(input_ids))
        loss = nn.functional.cross_entropy(logits.view(-1, VOCAB), labels.view(-1))
        if bad is not None:
            poison = torch.where(bad.max() == 1, float("nan"), 0.0)
            poison = torch.where(bad.max() == 2, float("inf"), poison)
            loss = loss + poison.detach()
        return {"loss": loss, "logits": logits}


class Data(torch.utils.data.Dataset):
    def __init__(self, n=64, bad=()):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randint(0, VOCAB, (n, 6), generator=g)
        self.bad = dict(bad)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        x = self.x[i]
        return {"input_ids": x, "labels": x, "attention_mask": (x > 3).long(),
                "bad": torch.tensor(self.bad.get(i, 0))}


class Seen(TrainerCallback):
    """Every on_log call as a callback sees it, and the filter flag at every event."""

    def __init__(self):
        self.logs = []
        self.flags = set()

    def on_log(self, args, state, control, logs=None, **kw):
        self.logs.append((state.global_step, state.epoch, state.num_input_tokens_seen,
                          _strip(logs)))
        self.flags.add(args.logging_nan_inf_filter)

    def on_step_end(self, args, state, control, **kw):
        self.flags.add(args.logging_nan_inf_filter)

    def on_substep_end(self, args, state, control, **kw):
        self.flags.add(args.logging_nan_inf_filter)


def _strip(d):
    """Wall-clock keys differ between any two runs; everything else must be identical."""
    return {k: v for k, v in d.items() if not k.endswith(("_runtime", "_per_second"))}


def _train(tmp_path, cls, *, callbacks=(), data=None, eval_data=None, model_kw=None, **kw):
    name = cls.__name__
    args = dict(output_dir=str(tmp_path / name), per_device_train_batch_size=4,
                num_train_epochs=1, logging_steps=3, report_to=[], use_cpu=True,
                save_strategy="no", disable_tqdm=True, seed=0, learning_rate=1e-2)
    args.update(kw)
    torch.manual_seed(0)
    seen = Seen()
    trainer = cls(model=Tiny(**(model_kw or {})), args=TrainingArguments(**args),
                  train_dataset=data or Data(), eval_dataset=eval_data,
                  callbacks=[*callbacks, seen])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")          # transformers' advice on a CPU toy run
        try:
            trainer.train()
        except RuntimeError as exc:
            if str(exc) != "boom":
                raise
    return trainer, seen


def _history(trainer):
    return [_strip(d) for d in trainer.state.log_history]


@pytest.mark.parametrize("kw", [
    dict(),
    dict(logging_steps=1, logging_first_step=True, gradient_accumulation_steps=2,
         include_num_input_tokens_seen="all"),
    dict(include_num_input_tokens_seen="non_padding", num_train_epochs=2, logging_steps=5,
         logging_strategy="epoch"),
    dict(max_grad_norm=0.0, logging_steps=4, max_steps=10),
], ids=["default", "every-step-ga2-tokens", "non-padding-epoch", "no-clip-max-steps"])
def test_log_history_and_on_log_identical(tmp_path, kw):
    native, n_seen = _train(tmp_path, Trainer, **kw)
    fast, f_seen = _train(tmp_path, SynclessTrainer, **kw)
    history = _history(native)
    assert len(history) >= 3 and "loss" in history[0]
    assert _history(fast) == history
    assert f_seen.logs == n_seen.logs                # same logs, at the same step/epoch/tokens
    assert f_seen.flags == {True}                    # callbacks never see the filter switched
    assert fast.state.num_input_tokens_seen == native.state.num_input_tokens_seen
    assert fast.state.total_flos == native.state.total_flos


@pytest.mark.parametrize("nan_filter", [True, False])
def test_nan_inf_filter_on_the_device(tmp_path, nan_filter):
    # Examples 9 (NaN) and 22 (Inf): batches 2 and 5; the filter adds the window's mean there.
    kw = dict(data=Data(bad={9: 1, 22: 2}), logging_nan_inf_filter=nan_filter, logging_steps=4)
    native, n_seen = _train(tmp_path, Trainer, **kw)
    fast, f_seen = _train(tmp_path, SynclessTrainer, **kw)
    history = _history(native)
    losses = [d["loss"] for d in history if "loss" in d]
    if nan_filter:
        assert all(math.isfinite(v) for v in losses)
    else:
        assert not math.isfinite(losses[0])          # NaN/Inf reach the log unfiltered
    assert json.dumps(_history(fast)) == json.dumps(history)   # NaN == NaN, as text
    assert json.dumps(f_seen.logs) == json.dumps(n_seen.logs)
    assert fast.args.logging_nan_inf_filter is nan_filter


def test_without_the_per_step_logger(tmp_path):
    kw = dict(include_num_input_tokens_seen="all", logging_steps=5)
    native, n_seen = _train(tmp_path, Trainer, **kw)
    torch.manual_seed(0)
    args = TrainingArguments(output_dir=str(tmp_path / "s"), per_device_train_batch_size=4,
                             num_train_epochs=1, report_to=[], use_cpu=True, save_strategy="no",
                             disable_tqdm=True, seed=0, learning_rate=1e-2, **kw)
    fast = SynclessTrainer(model=Tiny(), args=args, train_dataset=Data(),
                           syncless_every_step=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast.train()
    assert fast.syncless is None
    assert _history(fast) == _history(native)
    assert fast.state.num_input_tokens_seen == native.state.num_input_tokens_seen == 16 * 4 * 6


@pytest.mark.parametrize("ga", [1, 2])
def test_every_step_to_the_syncless_logger(tmp_path, ga):
    # ga=1: the micro-batch's loss tensor is logged as it is; ga=2: the sum of the two.
    native, _ = _train(tmp_path, Trainer, logging_steps=1, gradient_accumulation_steps=ga)
    rows = []
    sink = syncless.sinks.Callback(lambda step, t, values: rows.append((step, values)))
    torch.manual_seed(0)
    args = TrainingArguments(output_dir=str(tmp_path / "s"), per_device_train_batch_size=4,
                             num_train_epochs=1, logging_steps=5, report_to=[], use_cpu=True,
                             save_strategy="no", disable_tqdm=True, seed=0, learning_rate=1e-2,
                             gradient_accumulation_steps=ga)
    fast = SynclessTrainer(model=Tiny(), args=args, train_dataset=Data(), syncless_every=4,
                           syncless_sinks=[sink])
    fast.train()
    per_step = [d for d in native.state.log_history if "loss" in d]
    assert [r[0] for r in rows] == [d["step"] for d in per_step] == list(range(1, 16 // ga + 1))
    for r, d in zip(rows, per_step):
        assert r[1] == {"loss": d["loss"], "grad_norm": d["grad_norm"],
                            "learning_rate": d["learning_rate"], "epoch": d["epoch"]}
    assert fast.syncless.closed and fast.syncless.stats.steps == 16 // ga


def test_tensorboard_report_to_identical(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    scalars = {}
    for cls in (Trainer, SynclessTrainer):
        logdir = tmp_path / cls.__name__ / "tb"
        monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(logdir))   # TensorBoardCallback's
        _train(tmp_path, cls, report_to=["tensorboard"], include_num_input_tokens_seen="all")
        acc = EventAccumulator(str(logdir))
        acc.Reload()
        scalars[cls] = {tag: [(e.step, e.value) for e in acc.Scalars(tag)]
                        for tag in acc.Tags()["scalars"]
                        if not tag.endswith(("_runtime", "_per_second"))}
    assert "train/loss" in scalars[Trainer] and len(scalars[Trainer]["train/loss"]) == 5
    assert scalars[SynclessTrainer] == scalars[Trainer]


def test_eval_checkpoints_and_early_stopping_unchanged(tmp_path):
    kw = dict(eval_strategy="steps", eval_steps=4, save_strategy="steps", save_steps=4,
              logging_steps=3, num_train_epochs=3, load_best_model_at_end=True,
              metric_for_best_model="eval_loss", greater_is_better=True, save_total_limit=2,
              eval_data=Data(n=16), learning_rate=5e-2)
    out = {}
    for cls in (Trainer, SynclessTrainer):
        stop = EarlyStoppingCallback(early_stopping_patience=2)
        trainer, seen = _train(tmp_path, cls, callbacks=[stop], **kw)
        state = trainer.state
        ckpts = sorted(os.listdir(tmp_path / cls.__name__))
        with open(tmp_path / cls.__name__ / ckpts[-1] / "trainer_state.json") as f:
            saved = json.load(f)
        saved_args = torch.load(tmp_path / cls.__name__ / ckpts[-1] / "training_args.bin",
                                weights_only=False)
        out[cls] = (os.path.basename(state.best_model_checkpoint), state.best_metric,
                    state.global_step, ckpts, [_strip(d) for d in saved["log_history"]],
                    saved["num_input_tokens_seen"], saved_args.logging_nan_inf_filter,
                    _history(trainer), seen.logs)
    native = out[Trainer]
    assert native[2] < 48                            # early stopping stopped it
    assert any("eval_loss" in d for d in native[4]) and any("loss" in d for d in native[4])
    assert native[6] is True
    assert out[SynclessTrainer] == native


def test_exception_keeps_every_logged_step(tmp_path):
    native, n_seen = _train(tmp_path, Trainer, model_kw=dict(fail_at=11), logging_steps=2)
    fast, f_seen = _train(tmp_path, SynclessTrainer, model_kw=dict(fail_at=11), logging_steps=2)
    assert [d["step"] for d in _history(native)] == [2, 4, 6, 8, 10]
    assert _history(fast) == _history(native)
    assert f_seen.logs == n_seen.logs
    assert fast.args.logging_nan_inf_filter is True


# ---- CUDA: count the syncs of steady-state steps -------------------------------------------

class SyncCounter(TrainerCallback):
    """Sync-debug warnings from the start of step `start` to the end of step `stop`."""

    def __init__(self, start, stop):
        self.start, self.stop = start, stop
        self.syncs = SyncCount()

    def on_step_begin(self, args, state, control, **kw):
        if state.global_step == self.start:
            self.syncs.start()

    def on_step_end(self, args, state, control, **kw):
        # global_step already counts the step that just ended: step `stop` ends at stop + 1.
        if state.global_step == self.stop + 1:
            self.syncs.stop()


class CudaData(Data):
    """Examples already on the GPU (copied once here), so that no batch copy is counted."""

    def __init__(self, n):
        super().__init__(n)
        self.items = [{k: v.cuda() for k, v in super(CudaData, self).__getitem__(i).items()}
                      for i in range(n)]

    def __getitem__(self, i):
        return self.items[i]


@pytest.mark.cuda
@pytest.mark.parametrize("kw", [dict(), dict(logging_steps=1, include_num_input_tokens_seen="all")],
                         ids=["defaults", "every-step-tokens"])
def test_cuda_zero_syncs_per_step(tmp_path, kw):
    counts = {}
    for cls in (Trainer, SynclessTrainer):
        counter = SyncCounter(10, 49)
        args = TrainingArguments(output_dir=str(tmp_path / cls.__name__), report_to=[],
                                 per_device_train_batch_size=4, max_steps=60, save_strategy="no",
                                 disable_tqdm=True, seed=0, dataloader_pin_memory=False, **kw)
        torch.manual_seed(0)
        trainer = cls(model=Tiny(), args=args, train_dataset=CudaData(n=256),
                      callbacks=[counter])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.train()
        counts[cls.__name__] = (counter.syncs.count, counter.syncs.sites)
    # Native: the filter's two reads per step (measured on the H200: 78 in 39 steps).
    assert counts["Trainer"][0] >= 40 * 2, counts
    assert counts["SynclessTrainer"][0] == 0, counts


# ---- on_log's place among the callback events, and the batch copies ----------------------------

class Events(TrainerCallback):
    """The order in which on_step_end, on_log and on_epoch_end reach a callback, with the step
    each sees, and the log_history length on_step_end sees."""

    def __init__(self):
        self.events = []

    def on_step_end(self, args, state, control, **kw):
        self.events.append(("step_end", state.global_step, len(state.log_history)))

    def on_log(self, args, state, control, logs=None, **kw):
        self.events.append(("log", state.global_step, sorted(_strip(logs))))

    def on_epoch_end(self, args, state, control, **kw):
        self.events.append(("epoch_end", state.global_step, len(state.log_history)))


@pytest.mark.parametrize("kw", [
    dict(logging_first_step=True, logging_steps=2, gradient_accumulation_steps=2,
         num_train_epochs=2, data=Data(n=24)),
    pytest.param(dict(logging_steps=1, include_num_input_tokens_seen="non_padding"),
                 marks=pytest.mark.slow),
], ids=["first-step-ga2-two-epochs", "every-step-device-tokens"])
def test_on_log_comes_before_the_next_steps_on_step_end(tmp_path, kw):
    """Issue 28: each logging step's on_log (logging_first_step's included) reaches callbacks
    before the next step's on_step_end and before on_epoch_end, as with the Trainer, whether or
    not the delivery thread was quick."""
    native_events, fast_events = Events(), Events()
    native, n_seen = _train(tmp_path, Trainer, callbacks=[native_events], **kw)
    fast, f_seen = _train(tmp_path, SynclessTrainer, callbacks=[fast_events], **kw)
    # logging_first_step (or logging_steps=1): step 1's log between steps 1 and 2.
    assert [e[:2] for e in native_events.events[:3]] == [("step_end", 1), ("log", 1),
                                                          ("step_end", 2)]
    assert native_events.events[2][2] == 1            # step 2's on_step_end sees that log
    assert fast_events.events == native_events.events
    assert _history(fast) == _history(native)
    assert f_seen.logs == n_seen.logs


@pytest.mark.parametrize("kw, expected", [
    (dict(), True),                                          # pinned by default: on
    (dict(dataloader_pin_memory=False), False),              # pageable: nothing to gain
    (dict(fast_kw=dict(syncless_non_blocking=False)), False),
    (dict(dataloader_pin_memory=False, fast_kw=dict(syncless_non_blocking=True)), True),
    (dict(accelerator_config={"non_blocking": True}), True),
])
def test_batch_copies_are_non_blocking_when_the_loader_pins(tmp_path, kw, expected):
    """What accelerator_config={"non_blocking": True} does, for the Accelerator only: the
    user's TrainingArguments keep what they wrote (they are saved with checkpoints)."""
    fast_kw = kw.pop("fast_kw", {})
    # Not use_cpu=True: that turns pinning off (on a machine without a GPU, pinning is on but
    # does nothing; the setting is what is tested here).
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[],
                             per_device_train_batch_size=4, max_steps=4, logging_steps=2,
                             save_strategy="no", disable_tqdm=True, seed=0, **kw)
    written = args.accelerator_config.non_blocking
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = SynclessTrainer(model=Tiny(), args=args, train_dataset=Data(), **fast_kw)
        native = Trainer(model=Tiny(), args=args, train_dataset=Data())
    assert trainer.accelerator.non_blocking is expected
    assert native.accelerator.non_blocking is written
    assert args.accelerator_config.non_blocking is written


def test_bad_non_blocking_setting_is_refused(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    with pytest.raises(ValueError, match="syncless_non_blocking must be True, False or None, "
                                         "got 'yes'"):
        SynclessTrainer(model=Tiny(), args=args, train_dataset=Data(), syncless_non_blocking="yes")


@pytest.mark.cuda
def test_cuda_pinned_batches_cost_no_sync(tmp_path):
    """The batches come from host memory through the pinned loader (the Trainer's default): the
    Trainer's copies wait for the GPU, SynclessTrainer's do not. With gradient accumulation 2,
    logging every 10 steps, on_log before the next on_step_end, and log_history identical."""
    counts, histories = {}, {}
    for cls in (Trainer, SynclessTrainer):
        counter = SyncCounter(10, 49)
        args = TrainingArguments(output_dir=str(tmp_path / cls.__name__), report_to=[],
                                 per_device_train_batch_size=4, max_steps=60, save_strategy="no",
                                 disable_tqdm=True, seed=0, logging_steps=10,
                                 gradient_accumulation_steps=2)
        torch.manual_seed(0)
        trainer = cls(model=Tiny(), args=args, train_dataset=Data(n=512), callbacks=[counter])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.train()
        counts[cls.__name__] = (counter.syncs.count, counter.syncs.sites)
        histories[cls.__name__] = _history(trainer)
    assert counts["Trainer"][0] >= 40 * 2 * 4, counts        # 4 tensors per micro-batch
    assert counts["SynclessTrainer"][0] == 0, counts
    assert histories["SynclessTrainer"] == histories["Trainer"]
