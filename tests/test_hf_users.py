"""syncless.hf on Trainer code as users write it: the Trainer's own defaults and idioms (a tokenizer
and DataCollatorForLanguageModeling, GPT-2, gradient accumulation, evaluation with early stopping,
resuming, compute_loss overrides, Seq2SeqTrainer, a TRL-style log() override, callbacks that stop
training). Every scenario trains twice with the same seed, with the plain class and with syncless,
and compares what the user sees: log_history, what on_log received, the TrainOutput, checkpoints,
TensorBoard scalars, the best model."""
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
from transformers import (DataCollatorForLanguageModeling, EarlyStoppingCallback,  # noqa: E402
                          GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast, Trainer,
                          TrainerCallback, TrainerControl, TrainingArguments)

import syncless  # noqa: E402
from syncless.hf import SynclessTrainer, SynclessTrainerMixin  # noqa: E402

SPEED = ("_runtime", "_per_second")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Models this small run faster on one thread (two spin against each other on 2 cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _tokenizer():
    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i + 2 for i in range(62)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


TOK = _tokenizer()


def _texts(n, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(3, 12, (1,), generator=g))
        out.append(" ".join(f"w{int(t)}" for t in torch.randint(0, 62, (length,), generator=g)))
    return out


class Texts(torch.utils.data.Dataset):
    """Tokenized sentences of 3 to 11 words: the collator pads them (an attention mask)."""

    def __init__(self, n=24, seed=0):
        self.rows = [TOK(t) for t in _texts(n, seed)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return dict(self.rows[i])


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(Texts().rows)


class MaskedBatches(DataCollatorForLanguageModeling):
    """Batches `masked` (counted from 1) have every label -100: the loss is NaN there."""

    def __init__(self, masked):
        super().__init__(TOK, mlm=False)
        self.masked, self.calls = masked, 0

    def __call__(self, features):
        batch = super().__call__(features)
        self.calls += 1
        if self.calls in self.masked:
            batch["labels"][:] = -100
        return batch


def gpt2():
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                                      bos_token_id=1, eos_token_id=1, pad_token_id=0))


def _strip(d):
    """Wall-clock values differ between any two runs: their keys must be there, not their values."""
    return {k: ("<time>" if k.endswith(SPEED) else v) for k, v in d.items()}


def _text(x):
    return json.dumps(x, sort_keys=True)        # NaN == NaN, as text


class Seen(TrainerCallback):
    """What an on_log callback receives: the state it sees and the logs."""

    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kw):
        self.logs.append((state.global_step, state.epoch, state.num_input_tokens_seen,
                          state.total_flos, _strip(logs)))


class Run:
    def __init__(self, trainer, seen, out):
        self.trainer, self.seen, self.out = trainer, seen, out
        self.state = trainer.state

    def history(self):
        return [_strip(d) for d in self.state.log_history]

    def view(self):
        """Everything the user sees after train(), as text."""
        out = self.out
        return _text({"history": self.history(), "on_log": self.seen.logs,
                      "output": [out.global_step, out.training_loss, _strip(out.metrics)],
                      "tokens": self.state.num_input_tokens_seen,
                      "flos": self.state.total_flos, "step": self.state.global_step,
                      "warnings": getattr(self, "warnings", [])})


def _train(cls, out_dir, *, model=gpt2, data=None, eval_data=None, collator=None, callbacks=(),
           trainer_kw=None, train_kw=None, **kw):
    args = dict(output_dir=str(out_dir), per_device_train_batch_size=4, num_train_epochs=1,
                report_to=[], use_cpu=True, save_strategy="no", seed=0, disable_tqdm=True,
                logging_steps=2)
    args.update(kw)
    torch.manual_seed(0)
    seen = Seen()
    trainer = cls(model=model(), args=TrainingArguments(**args),
                  train_dataset=Texts() if data is None else data, eval_dataset=eval_data,
                  data_collator=collator() if collator else DataCollatorForLanguageModeling(
                      TOK, mlm=False),
                  processing_class=TOK, callbacks=[*callbacks, seen], **(trainer_kw or {}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")          # transformers' advice on a CPU toy run...
        out = trainer.train(**(train_kw or {}))
    run = Run(trainer, seen, out)
    run.warnings = sorted({f"{w.category.__name__}: {w.message}" for w in caught})
    return run


def _pair(tmp_path, native=Trainer, fast=SynclessTrainer, *, callbacks=None, trainer_kw=None,
          fast_kw=None, **kw):
    """The same run with `native` and with `fast` (given fast_kw too); callbacks: a factory of
    fresh callbacks."""
    fresh = callbacks or tuple
    return [_train(native, tmp_path / "native", callbacks=fresh(), trainer_kw=trainer_kw, **kw),
            _train(fast, tmp_path / "fast", callbacks=fresh(),
                   trainer_kw={**(trainer_kw or {}), **(fast_kw or {})}, **kw)]


# ---- the Trainer's arguments, as users set them ------------------------------------------------

@pytest.mark.parametrize("kw", [
    dict(disable_tqdm=False, logging_steps=500),     # the defaults: tqdm, one log at the end
    dict(logging_steps=1, logging_first_step=True, gradient_accumulation_steps=4,
         num_train_epochs=2, model=lambda: gpt2().to(torch.bfloat16)),
    dict(logging_strategy="epoch", num_train_epochs=2, include_num_input_tokens_seen=True,
         max_grad_norm=0),
    dict(include_num_input_tokens_seen="non_padding", gradient_accumulation_steps=2,
         logging_steps=1, label_smoothing_factor=0.1, weight_decay=0.01),
    dict(lr_scheduler_type="cosine", warmup_steps=2, max_steps=10, logging_steps=1,
         learning_rate=1e-3),
    dict(data=Stream(), max_steps=9, include_num_input_tokens_seen="non_padding"),
    dict(logging_steps=0.25, num_train_epochs=2, auto_find_batch_size=True),
], ids=["defaults", "every-step-first-ga4-bf16", "epoch-tokens-no-clip",
        "non-padding-ga2-label-smoothing", "cosine-warmup-max-steps", "iterable-max-steps",
        "fractional-logging-steps-auto-batch-size"])
def test_training_arguments_agree(tmp_path, kw):
    native, fast = _pair(tmp_path, **kw)
    assert "train_loss" in native.history()[-1]
    assert fast.view() == native.view()
    assert fast.trainer.args.logging_nan_inf_filter is True


def test_dataloader_workers(tmp_path):
    with warnings.catch_warnings():              # Python >= 3.12 on fork() with threads alive
        warnings.filterwarnings("ignore", "This process .* is multi-threaded", DeprecationWarning)
        native, fast = _pair(tmp_path, dataloader_num_workers=2,
                             include_num_input_tokens_seen="non_padding")
    assert [d["step"] for d in native.history()] == [2, 4, 6, 6]
    assert fast.view() == native.view()


def test_max_grad_norm_none_refused_alike(tmp_path):
    errors = []
    for cls in (Trainer, SynclessTrainer):
        with pytest.raises(TypeError) as exc:
            _train(cls, tmp_path / cls.__name__, max_grad_norm=None)
        errors.append(str(exc.value))
    assert errors[0] == errors[1] and "NoneType" in errors[0]


@pytest.mark.parametrize("nan_filter", [True, False])
def test_batches_with_every_label_masked(tmp_path, nan_filter):
    # Batches 3 and 5 have no label: the loss is NaN there. The filter (on by default) puts the
    # window's running mean in its place; off, the NaN reaches the log and the train loss.
    native, fast = _pair(tmp_path, collator=lambda: MaskedBatches({3, 5}), num_train_epochs=2,
                         logging_nan_inf_filter=nan_filter)
    losses = [d["loss"] for d in native.history() if "loss" in d]
    assert len(losses) == 6
    assert all(v == v for v in losses) is nan_filter
    assert fast.view() == native.view()
    assert fast.trainer.args.logging_nan_inf_filter is nan_filter


# ---- the user's own Trainer code ---------------------------------------------------------------

class ShiftedLoss(Trainer):
    """compute_loss written out, returning (loss, outputs) when asked."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        logits = outputs.logits[:, :-1]
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)),
                                           labels[:, 1:].reshape(-1))
        return (loss, outputs) if return_outputs else loss


class SynclessShiftedLoss(SynclessTrainerMixin, ShiftedLoss):
    pass


def _summed_loss(outputs, labels, num_items_in_batch=None):
    logits = outputs.logits[:, :-1]
    summed = nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)),
                                         labels[:, 1:].reshape(-1), reduction="sum")
    return summed / num_items_in_batch


def test_compute_loss_override_and_compute_loss_func(tmp_path):
    native, fast = _pair(tmp_path / "override", ShiftedLoss, SynclessShiftedLoss,
                         include_num_input_tokens_seen="non_padding")
    assert fast.view() == native.view()
    native, fast = _pair(tmp_path / "func", gradient_accumulation_steps=2, logging_steps=1,
                         trainer_kw=dict(compute_loss_func=_summed_loss))
    assert len(native.history()) == 4
    assert fast.view() == native.view()


class MetricsInLog(Trainer):
    """TRL's pattern (SFTTrainer, DPOTrainer...): values gathered per micro-batch in compute_loss,
    averaged and cleared in a log() override."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self._metrics = []

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = super().compute_loss(model, inputs, True, num_items_in_batch)
        self._metrics.append(inputs["attention_mask"].sum().item())
        return (loss, outputs) if return_outputs else loss

    def log(self, logs, start_time=None):
        if self._metrics:
            logs = {**logs, "tokens_per_batch": sum(self._metrics) / len(self._metrics)}
        super().log(logs, start_time)
        self._metrics = []


class SynclessMetricsInLog(SynclessTrainerMixin, MetricsInLog):
    pass


def test_log_override_runs_at_its_step(tmp_path):
    native, fast = _pair(tmp_path, MetricsInLog, SynclessMetricsInLog, num_train_epochs=2)
    assert fast.trainer.syncless_log_at_step is True            # found the override
    assert native.history()[0]["tokens_per_batch"] == 31.0
    assert fast.view() == native.view()


class OwnLogs(Trainer):
    """A user's own self.log() inside compute_loss, on every other step."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = super().compute_loss(model, inputs, True, num_items_in_batch)
        if self.state.global_step % 2 == 0:
            self.log({"logits_std": float(outputs.logits.detach().float().std())})
        return (loss, outputs) if return_outputs else loss


class SynclessOwnLogs(SynclessTrainerMixin, OwnLogs):
    pass


def test_own_log_calls_keep_their_order_and_tokens(tmp_path):
    # Own logs at global steps 0, 2, 4 come after the loss row of steps 2 and 4 (still on its way
    # in the syncless run) and report the exact token count, counted on the device here.
    native, fast = _pair(tmp_path, OwnLogs, SynclessOwnLogs, gradient_accumulation_steps=2,
                         per_device_train_batch_size=2, include_num_input_tokens_seen="non_padding")
    assert fast.trainer.syncless_log_at_step is False
    steps = [(d["step"], "loss" in d) for d in native.history()]
    assert steps[:6] == [(0, False), (0, False), (2, True), (2, False), (2, False), (4, True)]
    assert fast.view() == native.view()


def _weight_norm_log(trainer, model):
    """A log of the user's own at each logging step (its on_log resets should_log, so the
    Trainer's loss log of that step is skipped: what the user sees either way)."""
    if trainer.control.should_log and trainer.state.global_step > trainer._globalstep_last_logged:
        norm = sum(p.detach().float().norm() ** 2 for p in model.parameters()) ** 0.5
        trainer.log({"weight_norm": float(norm)})


class LogsInMaybeLog(Trainer):
    def _maybe_log_save_evaluate(self, tr_loss, grad_norm, model, *args, **kw):
        _weight_norm_log(self, model)
        super()._maybe_log_save_evaluate(tr_loss, grad_norm, model, *args, **kw)


class SynclessLogsInMaybeLog(SynclessTrainerMixin, LogsInMaybeLog):
    pass


class SubclassLogsInMaybeLog(SynclessTrainer):
    def _maybe_log_save_evaluate(self, tr_loss, grad_norm, model, *args, **kw):
        _weight_norm_log(self, model)
        super()._maybe_log_save_evaluate(tr_loss, grad_norm, model, *args, **kw)


@pytest.mark.parametrize("fast", [SynclessLogsInMaybeLog, SubclassLogsInMaybeLog],
                         ids=["mixin-first", "subclass"])
def test_maybe_log_save_evaluate_override_keeps_its_logging(tmp_path, fast):
    native, run = _pair(tmp_path, LogsInMaybeLog, fast,
                        include_num_input_tokens_seen="non_padding")
    assert [sorted(d) for d in native.history()[:1]] == [
        ["epoch", "num_input_tokens_seen", "step", "weight_norm"]]
    assert run.view() == native.view()


def test_seq2seq_trainer_with_the_mixin(tmp_path):
    from transformers import (DataCollatorForSeq2Seq, Seq2SeqTrainer, Seq2SeqTrainingArguments,
                              T5Config, T5ForConditionalGeneration)

    class SynclessSeq2Seq(SynclessTrainerMixin, Seq2SeqTrainer):
        pass

    def pairs(n, seed):
        return [{**TOK(x), "labels": TOK(y)["input_ids"]}
                for x, y in zip(_texts(n, seed), _texts(n, seed + 7))]

    runs = []
    for cls in (Seq2SeqTrainer, SynclessSeq2Seq):
        args = Seq2SeqTrainingArguments(
            output_dir=str(tmp_path / cls.__name__), per_device_train_batch_size=4,
            num_train_epochs=2, report_to=[], use_cpu=True, save_strategy="no", seed=0,
            disable_tqdm=True, logging_steps=2, eval_strategy="steps", eval_steps=4,
            predict_with_generate=True, generation_max_length=8,
            include_num_input_tokens_seen=True)
        torch.manual_seed(0)
        model = T5ForConditionalGeneration(T5Config(
            vocab_size=64, d_model=32, d_ff=64, d_kv=16, num_layers=1, num_heads=2,
            decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))
        seen = Seen()
        trainer = cls(model=model, args=args, train_dataset=pairs(16, 0),
                      eval_dataset=pairs(8, 3), data_collator=DataCollatorForSeq2Seq(TOK),
                      processing_class=TOK, callbacks=[seen])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            runs.append(Run(trainer, seen, trainer.train()))
    native, fast = runs
    assert [d["step"] for d in native.history() if "eval_loss" in d] == [4, 8]
    assert fast.view() == native.view()


# ---- evaluation, checkpoints, resuming ---------------------------------------------------------

def _tensorboard(logdir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]
            if not tag.endswith(("runtime", "_per_second"))}


def _checkpoints(out_dir):
    """Every checkpoint's trainer_state.json, wall-clock values masked."""
    saved = {}
    for name in sorted(os.listdir(out_dir)):
        if name.startswith("checkpoint-"):
            with open(out_dir / name / "trainer_state.json") as f:
                state = json.load(f)
            state["log_history"] = [_strip(d) for d in state["log_history"]]
            state["best_model_checkpoint"] = os.path.basename(state["best_model_checkpoint"] or "")
            saved[name] = state
    return saved


def test_eval_early_stopping_best_model_and_tensorboard(tmp_path, monkeypatch):
    kw = dict(eval_strategy="steps", eval_steps=3, save_strategy="steps", save_steps=3,
              num_train_epochs=8, load_best_model_at_end=True, metric_for_best_model="eval_loss",
              save_total_limit=2, learning_rate=1e-3, report_to=["tensorboard"],
              include_num_input_tokens_seen="non_padding", eval_data=Texts(8, 1))
    runs = {}
    for cls, name in ((Trainer, "native"), (SynclessTrainer, "fast")):
        monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / name / "tb"))
        run = _train(cls, tmp_path / name, callbacks=[EarlyStoppingCallback(2)], **kw)
        runs[name] = (run, _checkpoints(tmp_path / name), _tensorboard(tmp_path / name / "tb"),
                      {k: v.clone() for k, v in run.trainer.model.state_dict().items()})
    native, fast = runs["native"], runs["fast"]
    state = native[0].state
    assert state.global_step < 48                                # early stopping stopped it
    assert os.path.basename(state.best_model_checkpoint) in native[1]
    assert len(native[2]["train/loss"]) >= 5 and "eval/loss" in native[2]
    assert fast[0].view() == native[0].view()
    assert os.path.basename(fast[0].state.best_model_checkpoint) == \
        os.path.basename(state.best_model_checkpoint)
    assert fast[0].state.best_metric == state.best_metric
    assert _text(fast[1]) == _text(native[1])                    # trainer_state.json, each one
    assert fast[2] == native[2]                                  # TensorBoard scalars
    assert native[3].keys() == fast[3].keys()                    # the best model, loaded back
    assert all(torch.equal(native[3][k], fast[3][k]) for k in native[3])


def _wandb_history(run_dir):
    """The history rows of an offline run's .wandb log, read by wandb's own reader."""
    path = next(os.path.join(run_dir, f) for f in os.listdir(run_dir) if f.endswith(".wandb"))
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", path],
                         capture_output=True, text=True, check=True, timeout=120).stdout
    rows = [json.loads(line)["history"] for line in out.splitlines()
            if json.loads(line).get("type") == "history"]
    return [{k: v for k, v in row["item"].items()
             if not k.startswith("_") and not k.endswith(("runtime", "_per_second"))}
            for row in rows]


@pytest.mark.filterwarnings("ignore::DeprecationWarning:google.protobuf.*",
                            "ignore::DeprecationWarning:wandb.*",
                            "ignore::DeprecationWarning:pydantic.*")
def test_wandb_report_to(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    for k, v in dict(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DIR=str(tmp_path),
                     WANDB_CONSOLE="off", WANDB_DISABLE_GIT="true", WANDB_DISABLE_CODE="true",
                     WANDB_X_DISABLE_STATS="true", WANDB_X_DISABLE_MACHINE_INFO="true").items():
        monkeypatch.setenv(k, v)
    histories = []
    for cls in (Trainer, SynclessTrainer):
        try:
            _train(cls, tmp_path / cls.__name__, report_to=["wandb"], run_name=cls.__name__,
                   include_num_input_tokens_seen="non_padding", logging_steps=1)
            run_dir = os.path.dirname(wandb.run.dir)
        finally:
            wandb.finish()
        histories.append(_wandb_history(run_dir))
    native = histories[0]
    assert [row["train/global_step"] for row in native] == [1, 2, 3, 4, 5, 6, 6]
    assert native[0]["train/num_input_tokens_seen"] == 28
    assert histories[1] == native


def test_resume_from_checkpoint_and_train_twice(tmp_path):
    kw = dict(save_strategy="steps", save_steps=4, include_num_input_tokens_seen="non_padding")
    runs = []
    for cls, name in ((Trainer, "native"), (SynclessTrainer, "fast")):
        _train(cls, tmp_path / name, max_steps=8, **kw)
        resumed = _train(cls, tmp_path / name, max_steps=14, train_kw=dict(
            resume_from_checkpoint=True), **kw)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            again = Run(resumed.trainer, resumed.seen, resumed.trainer.train())
        runs.append((resumed.view(), again.view(), _checkpoints(tmp_path / name)))
    assert runs[1] == runs[0]
    assert "checkpoint-12" in runs[0][2]
    steps = [d["step"] for d in json.loads(runs[0][0])["history"]]
    assert steps == [2, 4, 6, 8, 10, 12, 14, 14]     # checkpoint-8's history, then the rest


# ---- callbacks ---------------------------------------------------------------------------------

class StopOnLog(TrainerCallback):
    """Stops training from on_log once the step reaches 4; notes the steps of log_history that
    on_step_end sees."""

    def __init__(self):
        self.seen = {}

    def on_step_end(self, args, state, control, **kw):
        self.seen[state.global_step] = [d["step"] for d in state.log_history]

    def on_log(self, args, state, control, logs=None, **kw):
        if "loss" in logs and state.global_step >= 4:
            control.should_training_stop = True


class TokenBudget(TrainerCallback):
    def on_step_end(self, args, state, control, **kw):
        if state.num_input_tokens_seen >= 150:
            control.should_training_stop = True


class NewControl(TrainerCallback):
    """Returns a new TrainerControl from on_log (the handler takes it as the control)."""

    def on_log(self, args, state, control, logs=None, **kw):
        new = TrainerControl()
        for k in ("should_training_stop", "should_epoch_stop", "should_save", "should_evaluate"):
            setattr(new, k, getattr(control, k))
        return new


def test_stop_from_on_log(tmp_path):
    stops = []
    kw = dict(callbacks=lambda: stops.append(StopOnLog()) or [stops[-1]], num_train_epochs=3)
    native, exact = _pair(tmp_path / "at-step", fast_kw=dict(syncless_log_at_step=True), **kw)
    assert native.state.global_step == 4
    assert stops[0].seen == {1: [], 2: [], 3: [2], 4: [2]}
    assert exact.view() == native.view()                         # stopped at the same step
    assert stops[1].seen == stops[0].seen
    _, late = _pair(tmp_path / "late", **kw)
    # By default log() runs when the row arrives: at the logging step or a later one. The stop
    # comes at the same step or later, never earlier; every log before it is the same, and
    # on_step_end sees log_history as the Trainer's or an earlier part of it, never more.
    assert late.state.global_step >= 4
    assert late.history()[:2] == native.history()[:2]
    for step, history in stops[3].seen.items():
        assert history == stops[0].seen.get(step, [2, 4])[:len(history)]


def test_token_budget_and_a_new_control_from_on_log(tmp_path):
    rows = []
    sink = syncless.sinks.Callback(lambda step, t, values: rows.append((step, values)))
    native, fast = _pair(tmp_path / "budget", callbacks=lambda: [TokenBudget()],
                         include_num_input_tokens_seen=True, num_train_epochs=3,
                         fast_kw=dict(syncless_sinks=[sink], syncless_every=3))
    assert native.state.global_step == 4 and native.state.num_input_tokens_seen == 164
    assert fast.view() == native.view()                          # a host count: exact at once
    assert [(step, v["num_input_tokens_seen"]) for step, v in rows] == [
        (1, 44), (2, 88), (3, 128), (4, 164)]                    # trainer.syncless, every step
    native, fast = _pair(tmp_path / "control", callbacks=lambda: [NewControl()],
                         eval_strategy="steps", eval_steps=3, save_strategy="steps", save_steps=3,
                         eval_data=Texts(8, 1), eval_on_start=True,
                         lr_scheduler_type="reduce_lr_on_plateau", learning_rate=5e-2,
                         lr_scheduler_kwargs={"patience": 0},
                         num_train_epochs=2)
    assert "eval_loss" in native.history()[0] and native.history()[0]["step"] == 0
    assert sorted(os.listdir(tmp_path / "control" / "native")) == [
        "checkpoint-12", "checkpoint-3", "checkpoint-6", "checkpoint-9"]
    rates = [d["learning_rate"] for d in native.history() if "learning_rate" in d]
    assert rates[0] == 5e-2 and rates[-1] < 5e-2                 # the plateau lowered it
    assert fast.view() == native.view()
    assert _text(_checkpoints(tmp_path / "control" / "fast")) == \
        _text(_checkpoints(tmp_path / "control" / "native"))


class FailOnLog(TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kw):
        if "loss" in logs and state.global_step == 4:
            raise ValueError("a callback's error at step 4")


def test_on_log_error_reaches_the_user(tmp_path):
    histories = []
    for cls in (Trainer, SynclessTrainer):
        trainer = None

        class Keep(TrainerCallback):
            def on_train_begin(self, args, state, control, **kw):
                nonlocal trainer
                trainer = state

        with pytest.raises(ValueError, match="a callback's error at step 4"):
            _train(cls, tmp_path / cls.__name__, callbacks=[Keep(), FailOnLog()])
        histories.append([_strip(d) for d in trainer.log_history])
    assert [d["step"] for d in histories[0]] == [2, 4]
    assert histories[1] == histories[0]


def test_mixin_order_and_arguments_checked():
    with pytest.raises(TypeError, match="SynclessTrainerMixin must come before ShiftedLoss"):
        class Late(ShiftedLoss, SynclessTrainerMixin):
            pass
    with pytest.raises(ValueError, match="syncless_log_at_step must be True, False or None"):
        SynclessTrainer(model=gpt2(), args=TrainingArguments(output_dir="unused", use_cpu=True,
                                                             report_to=[]),
                        syncless_log_at_step=1)


# ---- on any device: a model with deterministic kernels (no atomics) ---------------------------

class OneHotLM(nn.Module):
    """A next-token model of one-hot inputs and matmuls: the same numbers on every run, also on
    CUDA (nn.Embedding's backward adds with atomics there)."""
    main_input_name = "input_ids"

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(64, 32)
        self.out = nn.Linear(32, 64)

    def forward(self, input_ids, attention_mask=None, labels=None):
        x = nn.functional.one_hot(input_ids, 64).to(self.inp.weight.dtype)
        logits = self.out(torch.tanh(self.inp(x)))
        loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 64),
                                           labels[:, 1:].reshape(-1))
        return {"loss": loss, "logits": logits}


@pytest.mark.parametrize("kw", [
    dict(include_num_input_tokens_seen="non_padding", gradient_accumulation_steps=2,
         logging_steps=1, collator=lambda: MaskedBatches({3})),
    dict(native=MetricsInLog, fast=SynclessMetricsInLog, callbacks=lambda: [StopOnLog()],
         num_train_epochs=3, include_num_input_tokens_seen=True),
], ids=["tokens-ga2-nan", "log-override-stop"])
def test_on_the_device(tmp_path, device, kw):
    native, fast = _pair(tmp_path, model=OneHotLM, use_cpu=device == "cpu", **kw)
    assert str(fast.trainer.args.device).startswith(device)
    assert len(native.history()) >= 3
    assert fast.view() == native.view()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
