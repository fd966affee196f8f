"""syncless.lightning on the Lightning code users write, with Lightning's defaults and idioms.

Each scenario fits twice with the same seed, plainly and with `SynclessLogging`, and compares
everything the user sees: every configured logger's output (CSVLogger's metrics.csv row by row,
TensorBoard scalars through TensorBoard's own reader), `trainer.callback_metrics`,
`logged_metrics` and `progress_bar_metrics` (values, types, dtypes), ModelCheckpoint's best
score and file names, EarlyStopping's stopped epoch, and the warnings each run raised."""
import csv
import os
import sys
import warnings

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")
from lightning.pytorch.callbacks import (  # noqa: E402
    Callback, EarlyStopping, LearningRateMonitor, ModelCheckpoint, TQDMProgressBar)
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from syncless.lightning import SynclessLogging  # noqa: E402

F = torch.nn.functional


def _data(n=32, batch_size=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = (x.sum(1, keepdim=True) + 0.3 * torch.randn(n, 1, generator=g) > 0).float()
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


class Base(pl.LightningModule):
    """The tutorial model: a loss on the bar, a validation loss."""

    def __init__(self, lr=0.1):
        super().__init__()
        self.net = torch.nn.Linear(4, 1)
        self.lr = lr

    def loss(self, batch):
        x, y = batch
        return F.binary_cross_entropy_with_logits(self.net(x), y)

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(batch), prog_bar=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def _nan(x):
    return "nan" if x != x else x          # NaN == NaN for the comparisons


def _value(v):
    if isinstance(v, torch.Tensor):
        return ("tensor", str(v.dtype), v.device.type, _nan(v.item()))
    return (type(v).__name__, _nan(v))


def _csv_rows(lg):
    path = os.path.join(lg.log_dir, "metrics.csv")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return list(csv.reader(f))


def _tb_scalars(lg):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(lg.log_dir)
    acc.Reload()
    return {tag: [(e.step, _nan(e.value)) for e in acc.Scalars(tag)]
            for tag in acc.Tags()["scalars"]}


def _wandb_settings():
    import wandb
    return wandb.Settings(console="off", x_disable_stats=True, x_disable_machine_info=True,
                          save_code=False, disable_git=True, x_save_requirements=False,
                          silent=True)


def _wandb_history(lg):
    """The history records of the offline run's .wandb file, by `wandb leet inspect`."""
    import json
    import subprocess
    run = lg.experiment
    run.finish()
    run_dir = os.path.dirname(run.dir)
    path = next(os.path.join(run_dir, f) for f in os.listdir(run_dir) if f.endswith(".wandb"))
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", path],
                         capture_output=True, text=True, check=True, timeout=120).stdout
    rows = [json.loads(line) for line in out.splitlines()]
    return [({k: v for k, v in r["history"]["item"].items()
              if k not in ("_runtime", "_timestamp")}, r["history"]["step"]["num"])
            for r in rows if r.get("type") == "history"]


def _seen(trainer, extra, root):
    """Everything a user reads after fit, with the run's own directory taken out of paths."""
    out = {"steps": (trainer.global_step, trainer.current_epoch,
                     trainer.fit_loop.epoch_loop._batches_that_stepped)}
    for i, lg in enumerate(trainer.loggers):
        if isinstance(lg, CSVLogger):
            out[f"csv{i}"] = _csv_rows(lg)
        elif isinstance(lg, TensorBoardLogger):
            out[f"tb{i}"] = _tb_scalars(lg)
        elif type(lg).__name__ == "WandbLogger":
            out[f"wandb{i}"] = _wandb_history(lg)
    out["callback_metrics"] = {k: _value(v) for k, v in trainer.callback_metrics.items()}
    out["logged_metrics"] = {k: _value(v) for k, v in trainer.logged_metrics.items()}
    out["progress_bar_metrics"] = [(k, _value(v)) for k, v in
                                   trainer.progress_bar_metrics.items()]
    for i, cb in enumerate(extra):
        if isinstance(cb, ModelCheckpoint):
            out[f"ckpt{i}"] = (os.path.basename(cb.best_model_path),
                               None if cb.best_model_score is None else float(cb.best_model_score),
                               sorted(os.path.basename(p) for p in cb.best_k_models),
                               os.path.basename(cb.last_model_path))
        elif isinstance(cb, EarlyStopping):
            out[f"early{i}"] = (cb.stopped_epoch, cb.wait_count, float(cb.best_score))
        elif isinstance(cb, TQDMProgressBar):
            out[f"bar{i}"] = (cb.train_progress_bar.postfix, cb.train_progress_bar.n)
        elif hasattr(cb, "seen"):
            out[f"seen{i}"] = cb.seen
    return out


def _warnings(caught, root):
    return sorted({(w.category.__name__, str(w.message).replace(str(root), "<root>"))
                   for w in caught})


def _forget_warnings():
    """Lightning warns some things once per process (its WarningCache): forget them, so that
    both runs of a scenario can warn."""
    from lightning_utilities.core.rank_zero import WarningCache
    for name, mod in list(sys.modules.items()):
        if name.startswith(("lightning", "pytorch_lightning")):
            for value in list(vars(mod).values()):
                caches = vars(value).values() if isinstance(value, type) else (value,)
                for cache in caches:
                    if isinstance(cache, WarningCache):
                        cache.clear()


def fit_both(tmp_path, device, model, *, callbacks=lambda root: [], before=lambda root: [],
             loggers=("csv", "tb"), fit=None, train=None, val=None, every=4, **trainer_kw):
    """Runs the scenario plainly and with SynclessLogging; returns both runs' observations."""
    runs = {}
    for kind in ("native", "syncless"):
        root = tmp_path / kind
        _forget_warnings()
        pl.seed_everything(0, verbose=False)
        lgs = []
        if "wandb" in loggers:
            from lightning.pytorch.loggers import WandbLogger
            lgs.append(WandbLogger(save_dir=str(root), offline=True, project="syncless-test",
                                   settings=_wandb_settings()))
        if "csv" in loggers:
            lgs.append(CSVLogger(root, name="csv"))
        if "tb" in loggers:
            lgs.append(TensorBoardLogger(root, name="tb"))
        extra = callbacks(root)
        first = before(root)                 # the user's callbacks listed before ours
        cbs = first + ([SynclessLogging(every=every)] if kind == "syncless" else []) + extra
        kw = dict(max_epochs=2, logger=lgs or False, callbacks=cbs, log_every_n_steps=3,
                  accelerator="cpu" if device == "cpu" else "gpu", devices=1,
                  enable_checkpointing=False, enable_model_summary=False,
                  enable_progress_bar=False, default_root_dir=root)
        kw.update(trainer_kw)
        warn_always = torch._C._get_warnAlways()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch._C._set_warnAlways(True)   # torch's warn-once warnings: in both runs too
            try:
                trainer = pl.Trainer(**kw)
                module = model()             # after the seed: the same initial weights
                tr = train() if train else _data()
                va = val() if val else (_data(16, 8, seed=1) if val is None else None)
                if fit is None:
                    trainer.fit(module, tr, va)
                else:                        # the scenario's own calls; it may hand back
                    trainer = fit(trainer, module, tr, va, root) or trainer    # a later one
            finally:
                torch._C._set_warnAlways(warn_always)
        seen = _seen(trainer, first + extra, root)
        seen["warnings"] = _warnings(caught, root)
        runs[kind] = seen
    return runs["native"], runs["syncless"]


def assert_same(native, fast):
    assert native.keys() == fast.keys()
    for key in native:
        assert fast[key] == native[key], key


# ---- the scenarios ---------------------------------------------------------------------------


class LogDict(Base):
    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        loss = F.binary_cross_entropy_with_logits(logits, y)
        acc = ((logits > 0).float() == y).float().mean()
        self.log_dict({"loss": loss, "acc": acc, "lr": self.lr, "epoch_i": self.current_epoch,
                       "idx": batch_idx, "half": loss.half(), "int_t": torch.tensor(3)},
                      prog_bar=True)
        self.log("f64", loss.double(), on_step=True, on_epoch=True)
        return loss


def test_log_dict_python_numbers_and_dtypes(tmp_path, device):
    native, fast = fit_both(tmp_path, device, LogDict)
    assert len(native["csv0"]) > 4 and "int_t" in native["csv0"][0]
    assert_same(native, fast)


class WithMetrics(Base):
    """torchmetrics objects passed to self.log, as the torchmetrics docs show."""

    def __init__(self):
        super().__init__()
        import torchmetrics
        self.train_acc = torchmetrics.classification.BinaryAccuracy()
        self.val_acc = torchmetrics.classification.BinaryAccuracy()
        self.train_metrics = torchmetrics.MetricCollection(
            {"f1": torchmetrics.classification.BinaryF1Score(),
             "prec": torchmetrics.classification.BinaryPrecision()}, prefix="train_")
        self.train_auroc = torchmetrics.MetricCollection(
            [torchmetrics.classification.BinaryAUROC(),
             torchmetrics.classification.BinaryRecall()], prefix="tr_")

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        loss = F.binary_cross_entropy_with_logits(logits, y)
        self.train_acc(logits, y.int())
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=True, prog_bar=True)
        self.log_dict(self.train_metrics(logits, y.int()))          # a dict of tensors
        self.train_auroc(logits, y.int())
        self.log_dict(self.train_auroc, on_step=True, on_epoch=True)  # the collection itself
        self.log("loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.val_acc.update(self.net(x), y.int())
        self.log("val_acc", self.val_acc, prog_bar=True)


def test_torchmetrics_objects(tmp_path, device):
    pytest.importorskip("torchmetrics")
    native, fast = fit_both(
        tmp_path, device, WithMetrics,
        callbacks=lambda root: [ModelCheckpoint(root / "ck", monitor="train_acc_epoch",
                                                mode="max", filename="{epoch}-{train_acc_epoch}")],
        enable_checkpointing=True)
    assert {"train_acc_step", "train_f1", "tr_BinaryAUROC_step", "tr_BinaryRecall_epoch",
            "val_acc"} <= set(native["csv0"][0])
    assert_same(native, fast)


class Reductions(Base):
    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.binary_cross_entropy_with_logits(self.net(x), y)
        self.log("mx", loss, on_step=True, on_epoch=True, reduce_fx="max", prog_bar=True)
        self.log("mn", loss, on_step=True, on_epoch=True, reduce_fx=torch.min)
        self.log("sm", loss, on_step=True, on_epoch=True, reduce_fx="sum")
        self.log("weighted", loss, on_step=True, on_epoch=True, batch_size=len(x))
        self.log("per_item", loss, on_epoch=True, batch_size=len(x), prog_bar=True)
        return loss


def test_reduce_fx_and_batch_size(tmp_path, device):
    """30 rows in batches of 4: the last batch has 2, so the batch-size weights matter."""
    native, fast = fit_both(tmp_path, device, Reductions, train=lambda: _data(30, 4),
                            callbacks=lambda root: [EarlyStopping("weighted_epoch", patience=0,
                                                                  mode="max")],
                            max_epochs=4)
    assert native["early0"][0] > 0
    assert_same(native, fast)


class Hooks(Base):
    """Logging from the batch hooks, the grad norms Lightning's docs recommend."""

    def on_train_batch_start(self, batch, batch_idx):
        self.log("batch_mean", batch[0].mean())

    def on_after_backward(self):
        self.log("grad_w", self.net.weight.grad.abs().sum())

    def on_before_optimizer_step(self, optimizer):
        from lightning.pytorch.utilities import grad_norm
        self.log_dict(grad_norm(self, norm_type=2))

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.log("out_loss", outputs["loss"], prog_bar=True)


class UserCallbackLogs(Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        pl_module.log("from_callback", outputs["loss"] * 10, on_step=True, on_epoch=True)


def test_logging_from_hooks_and_callbacks(tmp_path, device):
    native, fast = fit_both(tmp_path, device, Hooks, gradient_clip_val=0.5,
                            callbacks=lambda root: [UserCallbackLogs()])
    head = native["csv0"][0]
    assert {"grad_2.0_norm/net.weight", "grad_2.0_norm_total", "out_loss", "batch_mean",
            "grad_w", "from_callback_step", "from_callback_epoch"} <= set(head)
    assert_same(native, fast)


class Gan(pl.LightningModule):
    """Manual optimization with two optimizers and manual_backward (the GAN tutorial's shape)."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.g = torch.nn.Linear(4, 4)
        self.d = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, _ = batch
        opt_g, opt_d = self.optimizers()
        fake = self.g(torch.randn_like(x))
        d_loss = (F.softplus(-self.d(x)) + F.softplus(self.d(fake.detach()))).mean()
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        g_loss = F.softplus(-self.d(fake)).mean()
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        self.log_dict({"d_loss": d_loss, "g_loss": g_loss}, prog_bar=True)
        self.log("d_epoch", d_loss, on_step=False, on_epoch=True)

    def configure_optimizers(self):
        return (torch.optim.Adam(self.g.parameters(), lr=1e-2),
                torch.optim.Adam(self.d.parameters(), lr=1e-2))


def test_manual_optimization_two_optimizers(tmp_path, device):
    native, fast = fit_both(tmp_path, device, Gan, val=False, log_every_n_steps=2)
    assert native["steps"][0] == 2 * 16 and native["csv0"][0][:1]
    assert_same(native, fast)


class OnStepEpoch(Base):
    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("train_loss", loss, on_step=True, on_epoch=True, prog_bar=True)
        return loss


LOOP_OPTIONS = {
    "accumulate4": dict(accumulate_grad_batches=4, log_every_n_steps=1, max_epochs=3),
    "accumulate3-uneven": dict(accumulate_grad_batches=3, log_every_n_steps=1),
    "val-quarter": dict(val_check_interval=0.25, max_epochs=3, log_every_n_steps=1),
    "val-every-2": dict(num_sanity_val_steps=0, check_val_every_n_epoch=2, max_epochs=4),
    "max-steps": dict(max_steps=13, max_epochs=-1, log_every_n_steps=2),
    "limit-int": dict(limit_train_batches=5, log_every_n_steps=2, max_epochs=3),
    "limit-float": dict(limit_train_batches=0.5, limit_val_batches=1, log_every_n_steps=1),
    "fast-dev-run": dict(fast_dev_run=True),
    "fast-dev-run-3": dict(fast_dev_run=3),
    "overfit-batches": dict(overfit_batches=2, log_every_n_steps=1, max_epochs=3),
    "profiler": dict(profiler="simple", log_every_n_steps=2),
}


def test_trainer_loop_options(tmp_path, device):
    """Trainer options that change which batches run, step and log (one test: a fit pair
    each), with a checkpoint and early stopping on the validation loss."""
    def callbacks(root):
        return [ModelCheckpoint(root / "ck", monitor="val_loss", save_top_k=2, save_last=True,
                                filename="{epoch}-{step}-{val_loss:.4f}"),
                EarlyStopping("val_loss", patience=3)]
    for name, kw in LOOP_OPTIONS.items():
        native, fast = fit_both(tmp_path / name, device, OnStepEpoch, callbacks=callbacks,
                                enable_checkpointing=True, **kw)
        for key in native:
            assert fast[key] == native[key], (name, key)


def test_default_log_every_n_steps(tmp_path, device):
    """Lightning's default, 50, on a 100-batch epoch: two logged batches per epoch."""
    native, fast = fit_both(tmp_path, device, OnStepEpoch, train=lambda: _data(100, 1),
                            log_every_n_steps=50, max_epochs=1)
    steps = [r[native["csv0"][0].index("step")] for r in native["csv0"][1:]
             if r[native["csv0"][0].index("train_loss_step")]]
    assert steps == ["49", "99"]
    assert_same(native, fast)


class Scheduled(OnStepEpoch):
    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def test_learning_rate_monitor(tmp_path, device):
    native, fast = fit_both(
        tmp_path, device, Scheduled, log_every_n_steps=1,
        callbacks=lambda root: [LearningRateMonitor("step", log_momentum=True)])
    assert "lr-SGD" in native["csv0"][0]
    assert_same(native, fast)


class BarSeen(Callback):
    """The TQDM bar's postfix after each batch, as the user sees it in the terminal."""

    def __init__(self):
        self.seen = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen.append(trainer.progress_bar_callback.train_progress_bar.postfix)


def test_tqdm_bar(tmp_path, device):
    """The default bar (enable_progress_bar=True): the same text at the end of each epoch."""
    native, fast = fit_both(tmp_path, device, OnStepEpoch, enable_progress_bar=True,
                            callbacks=lambda root: [TQDMProgressBar(refresh_rate=1), BarSeen()])
    assert "train_loss_epoch" in native["bar0"][0]
    seen_native, seen_fast = native.pop("seen1"), fast.pop("seen1")
    assert len(seen_fast) == len(seen_native) == 16

    def shown(postfix):
        return dict(item.split("=") for item in postfix.split(", "))["train_loss_step"]
    history = [shown(p) for p in seen_native]
    # Values the plain bar showed at the same or an earlier batch (how much earlier depends on
    # the delivery thread); after the wait at the epoch's end, the epoch's last one.
    late = [i - history.index(shown(p)) for i, p in enumerate(seen_fast) if "train_loss" in p]
    assert late and min(late) >= 0
    assert shown(seen_fast[8]) == history[7]
    assert_same(native, fast)


class Direct(OnStepEpoch):
    """`self.logger.log_metrics` (what Lightning's own warning recommends for a step count)."""

    def training_step(self, batch, batch_idx):
        for lg in self.loggers:
            lg.log_metrics({"samples": float((self.global_step + 1) * len(batch[0]))},
                           step=self.global_step)
        return super().training_step(batch, batch_idx)


class EarlyHook(Callback):
    """A user callback listed before SynclessLogging, logging at the start of each batch."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        pl_module.log("batch_idx", float(batch_idx), prog_bar=True)
        pl_module.log("first_x", batch[0][0, 0], on_step=True, on_epoch=True)


def test_direct_logger_calls_and_callback_order(tmp_path, device):
    native, fast = fit_both(tmp_path, device, Direct, log_every_n_steps=1,
                            before=lambda root: [EarlyHook()])
    head, rows = native["csv0"][0], native["csv0"][1:]
    assert rows[0][head.index("samples")] == "4.0"        # the direct call comes first
    at = head.index("batch_idx")
    assert [r[at] for r in rows if r[at]][:3] == ["0.0", "1.0", "2.0"]
    assert_same(native, fast)


def test_fit_twice_on_one_trainer(tmp_path, device):
    """`trainer.fit` again with max_epochs raised, then validate and test on the same trainer."""
    class WithTest(OnStepEpoch):
        def test_step(self, batch, batch_idx):
            self.log("test_loss", self.loss(batch))

    def fit(trainer, module, train, val, root):
        trainer.fit(module, train, val)
        trainer.fit_loop.max_epochs = 4
        trainer.fit(module, train, val)
        trainer.validate(module, val, verbose=False)
        trainer.test(module, val, verbose=False)
    native, fast = fit_both(tmp_path, device, WithTest, fit=fit)
    assert native["steps"][:2] == (32, 4) and "test_loss" in native["csv0"][0]
    assert_same(native, fast)


@pytest.mark.parametrize("resume", ["last", "mid-epoch"])
def test_resume_from_checkpoint(tmp_path, device, resume):
    """A second Trainer resumes with ckpt_path=: from the end of an epoch, or from a checkpoint
    taken every 5 steps (mid-epoch)."""
    def fit(trainer, module, train, val, root):
        trainer.fit(module, train, val)
        saved = trainer.checkpoint_callback
        path = saved.last_model_path if resume == "last" else os.path.join(saved.dirpath,
                                                                            "step=5.ckpt")
        pl.seed_everything(1, verbose=False)
        fast = [SynclessLogging(every=4)] if root.name == "syncless" else []
        again = pl.Trainer(logger=CSVLogger(root, name="csv"), callbacks=fast + ckpt(root),
                           max_epochs=4, log_every_n_steps=3, devices=1,
                           accelerator="cpu" if device == "cpu" else "gpu",
                           enable_model_summary=False, enable_progress_bar=False,
                           default_root_dir=root)
        again.fit(module, train, val, ckpt_path=path)
        return again

    def ckpt(root):
        if resume == "last":
            return [ModelCheckpoint(root / "ck", save_last=True)]
        return [ModelCheckpoint(root / "ck", every_n_train_steps=5, save_top_k=-1,
                                filename="{step}")]
    native, fast = fit_both(tmp_path, device, OnStepEpoch, callbacks=ckpt,
                            enable_checkpointing=True, fit=fit)
    first = dict(zip(native["csv0"][0], native["csv0"][1]))
    assert native["steps"][:2] == (32, 4)
    assert (first["epoch"], first["step"]) == (("2", "17") if resume == "last" else ("0", "5"))
    assert_same(native, fast)


class Synced(OnStepEpoch):
    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("loss", loss, prog_bar=True, sync_dist=True)
        self.log("sum", loss, on_step=True, on_epoch=True, sync_dist=True, reduce_fx="sum")
        self.log("zero_only", loss, rank_zero_only=True)
        return loss


def test_sync_dist_on_one_process(tmp_path, device):
    native, fast = fit_both(tmp_path, device, Synced, log_every_n_steps=2)
    assert "sum_epoch" in native["csv0"][0]
    assert_same(native, fast)


class Bf16(Base):
    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)                          # bf16 under autocast
        loss = F.binary_cross_entropy_with_logits(logits.float(), y)
        self.log("loss", loss, prog_bar=True)
        self.log("logit_mean", logits.mean(), on_step=True, on_epoch=True)   # a bf16 tensor
        self.log("logit_dtype_bits", float(torch.finfo(logits.dtype).bits))
        return loss


def test_bf16_mixed(tmp_path, device):
    native, fast = fit_both(tmp_path, device, Bf16, precision="bf16-mixed", log_every_n_steps=1)
    bits = native["csv0"][0].index("logit_dtype_bits")
    assert native["csv0"][1][bits] == "16.0"
    assert_same(native, fast)


class NoLogger(Base):
    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("loss", loss, prog_bar=True, logger=True)     # logger=True with no logger
        self.log("plain", loss * 2)
        return loss


def test_no_logger_configured(tmp_path, device):
    """logger=False: nothing is written, Lightning's warning about logger=True is kept."""
    native, fast = fit_both(tmp_path, device, NoLogger, loggers=())
    assert any("no logger configured" in m for _, m in native["warnings"])
    assert native["logged_metrics"]["plain"][3] > 0
    assert_same(native, fast)


class Mismatch(Base):
    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("loss", loss, prog_bar=batch_idx == 0)
        return loss


def test_mismatched_arguments_raise_as_in_lightning(tmp_path, device):
    """Lightning refuses a key logged with different arguments; so does the callback, and what was
    logged before is in the loggers."""
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    def fit(trainer, module, train, val, root):
        with pytest.raises(MisconfigurationException, match=r"self.log\(loss, ...\)` twice"):
            trainer.fit(module, train, val)
    native, fast = fit_both(tmp_path, device, Mismatch, fit=fit, log_every_n_steps=1)
    assert native["csv0"][1][native["csv0"][0].index("loss")]
    assert_same(native, fast)


def test_rich_progress_bar(tmp_path, device):
    pytest.importorskip("rich")
    from lightning.pytorch.callbacks import RichProgressBar

    def bar(root):
        return [RichProgressBar(refresh_rate=1)]
    native, fast = fit_both(tmp_path, device, OnStepEpoch, enable_progress_bar=True,
                            callbacks=bar, max_epochs=1, train=lambda: _data(16, 4))
    assert_same(native, fast)


def test_wandb_logger_offline(tmp_path, device, monkeypatch):
    """WandbLogger (offline) next to CSVLogger: the history in its .wandb file, read back by
    wandb's own reader, is the same record for record."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    native, fast = fit_both(tmp_path, device, OnStepEpoch, loggers=("wandb", "csv"),
                            callbacks=lambda root: [LearningRateMonitor()], log_every_n_steps=2)
    assert len(native["wandb0"]) == len(native["csv1"]) - 1 > 10
    assert_same(native, fast)


class Wide(Base):
    """Many metrics per batch (per-class scores, grad norms of a deep model): more than one
    gather kernel holds."""

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("loss", loss, prog_bar=True)
        scores = torch.sigmoid(self.net.weight.sum() * torch.arange(260.0, device=self.device))
        self.log_dict({f"class_{i}": scores[i] for i in range(250)})
        self.log_dict({f"epoch_{i}": scores[250 + i] for i in range(10)}, on_step=True,
                      on_epoch=True)
        return loss


def test_hundreds_of_metrics_per_batch(tmp_path, device):
    native, fast = fit_both(tmp_path, device, Wide, log_every_n_steps=1, val=False,
                            loggers=("csv",), max_epochs=1, train=lambda: _data(8, 4))
    assert len(native["csv0"][0]) == 1 + 250 + 20 + 2 and len(native["csv0"]) == 4
    assert_same(native, fast)


class StepKey(Base):
    """Lightning's documented override of the logger step: a metric named `step`; and a metric
    named `time`."""

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("step", float(self.current_epoch * 100 + batch_idx))
        self.log("time", float(batch_idx) / 10)
        self.log("loss", loss, prog_bar=True)
        return loss


def test_metrics_named_step_and_time(tmp_path, device):
    native, fast = fit_both(tmp_path, device, StepKey, log_every_n_steps=1)
    head = native["csv0"][0]
    steps = [r[head.index("step")] for r in native["csv0"][1:] if r[head.index("loss")]]
    assert steps[:3] == ["0", "1", "2"] and steps[8] == "100"
    assert_same(native, fast)


class Irregular(Base):
    """What real loops do now and then: skip a batch (training_step returns None), log a NaN,
    stop the epoch early from on_train_batch_start (-1), stop training from a hook."""

    def on_train_batch_start(self, batch, batch_idx):
        if self.current_epoch == 1 and batch_idx == 5:
            return -1                                     # the rest of this epoch is skipped

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("loss", loss, prog_bar=True, on_step=True, on_epoch=True)
        self.log("maybe_nan", loss if batch_idx != 2 else loss * float("nan"))
        if batch_idx == 3:
            return None                                   # skipped: no optimizer step
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.current_epoch == 2 and batch_idx == 4:
            self.trainer.should_stop = True


def test_skipped_batches_nan_and_should_stop(tmp_path, device):
    native, fast = fit_both(tmp_path, device, Irregular, max_epochs=4, log_every_n_steps=2,
                            callbacks=lambda root: [EarlyStopping("maybe_nan", patience=5,
                                                                  check_on_train_epoch_end=True)])
    head = native["csv0"][0]
    assert "nan" in [r[head.index("maybe_nan")] for r in native["csv0"][1:]]
    assert native["steps"][1] < 4
    assert_same(native, fast)


class Timed(OnStepEpoch):
    pass


@pytest.mark.parametrize("hook", ["on_train_batch_end", "on_train_batch_start"])
def test_should_stop_from_a_callback(tmp_path, device, hook):
    """Lightning's Timer stops from on_train_batch_end; here after a fixed number of batches,
    through the same should_stop flag a time limit sets; also from on_train_batch_start of a
    callback that runs before ours."""
    class StopAfter(Callback):
        pass

    def stop(self, trainer, pl_module, *args):
        if trainer.global_step == 11:
            trainer.should_stop = True
    setattr(StopAfter, hook, stop)
    native, fast = fit_both(tmp_path, device, Timed, max_epochs=3, log_every_n_steps=5,
                            before=lambda root: [StopAfter()])
    assert native["steps"][0] == (11 if hook == "on_train_batch_end" else 12)
    assert_same(native, fast)


class Tunable(OnStepEpoch):
    def __init__(self, lr=0.1, batch_size=4):
        super().__init__(lr)
        self.batch_size = batch_size

    def train_dataloader(self):
        return _data(32, self.batch_size)

    def val_dataloader(self):
        return _data(16, 8, seed=1)


@pytest.mark.parametrize("tune", ["lr_find", "scale_batch_size", "LearningRateFinder"])
def test_tuner_then_fit(tmp_path, device, tune):
    """The tutorials' Tuner runs short fits of their own with the loggers swapped for a
    DummyLogger: none of their steps may reach the real loggers."""
    from lightning.pytorch.callbacks import LearningRateFinder
    from lightning.pytorch.tuner import Tuner
    suggested = {}

    def fit(trainer, module, train, val, root):
        if tune == "lr_find":
            finder = Tuner(trainer).lr_find(module, num_training=12, update_attr=True)
            suggested[root.name] = finder.results["loss"]
        elif tune == "scale_batch_size":
            suggested[root.name] = Tuner(trainer).scale_batch_size(module, max_trials=2,
                                                                   steps_per_trial=3)
        trainer.fit(module)

    def callbacks(root):
        if tune != "LearningRateFinder":
            return []
        return [LearningRateFinder(num_training_steps=12)]
    native, fast = fit_both(tmp_path, device, Tunable, fit=fit, callbacks=callbacks)
    assert suggested.get("syncless") == suggested.get("native")
    assert native["steps"][0] == 16
    assert_same(native, fast)


def test_callback_pickles_and_copies_after_fit(tmp_path, device):
    """ddp_spawn pickles the trainer with its callbacks, some code deep-copies callbacks: after a
    fit, a copy carries the settings and fits as the original did."""
    import copy
    import pickle
    rows, used = {}, None
    for kind in ("original", "pickled", "deepcopied"):
        pl.seed_everything(0, verbose=False)
        if kind == "original":
            cb = SynclessLogging(every=3)
        elif kind == "pickled":
            cb = pickle.loads(pickle.dumps(used))
        else:
            cb = copy.deepcopy(used)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = pl.Trainer(max_epochs=1, callbacks=[cb], log_every_n_steps=1,
                                 logger=CSVLogger(tmp_path / kind), enable_progress_bar=False,
                                 enable_checkpointing=False, enable_model_summary=False,
                                 accelerator="cpu" if device == "cpu" else "gpu", devices=1)
            trainer.fit(OnStepEpoch(), _data())
        used = cb
        assert cb.every == 3 and cb.syncless.closed
        rows[kind] = _csv_rows(trainer.logger)
    assert len(rows["original"]) == 1 + 8 + 1
    assert rows["pickled"] == rows["deepcopied"] == rows["original"]


class Stream(torch.utils.data.IterableDataset):
    def __init__(self, n):
        self.x, self.y = _data(n, 1).dataset.tensors

    def __iter__(self):
        return iter(zip(self.x, self.y))


class IterModel(Base):
    """`training_step(self, dataloader_iter)` (Lightning's hook for custom fetching): it pulls
    its own batches and gives batch_size to self.log."""

    def training_step(self, dataloader_iter):
        (x, y), _batch_idx, _dataloader_idx = next(dataloader_iter)
        x, y = x.to(self.device), y.to(self.device)    # this hook's batches are not moved
        loss = F.binary_cross_entropy_with_logits(self.net(x), y)
        self.log("loss", loss, prog_bar=True, batch_size=len(x), on_step=True, on_epoch=True)
        return loss


@pytest.mark.parametrize("model", [OnStepEpoch, IterModel], ids=["batches", "dataloader_iter"])
def test_iterable_dataset_and_step_based_validation(tmp_path, device, model):
    """An IterableDataset (no length), validation every 5 steps, max_steps over two passes."""
    native, fast = fit_both(
        tmp_path, device, model, train=lambda: DataLoader(Stream(32), batch_size=4),
        val_check_interval=5, check_val_every_n_epoch=None, max_steps=14, max_epochs=-1,
        log_every_n_steps=2)
    assert native["steps"][0] == 14 and any(r[-1] for r in native["csv0"][1:])
    assert_same(native, fast)


class Prefixed(Base):
    """A module that overrides `log` to put every key under a prefix (a common base class in
    research code), and logs through it."""

    def log(self, name, value, *args, **kwargs):
        stage = "train" if self.trainer.training else "val"
        super().log(f"{stage}/{name}", value, *args, **kwargs)

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("loss", loss, prog_bar=True)
        self.log_dict({"acc": 1 - loss, "lr": 0.1}, on_step=True, on_epoch=True)
        return loss


def test_module_overriding_log(tmp_path, device):
    native, fast = fit_both(tmp_path, device, Prefixed, log_every_n_steps=2)
    assert {"train/loss", "train/acc_step", "train/lr_epoch", "val/val_loss"} <= \
        set(native["csv0"][0])
    assert_same(native, fast)


def test_throughput_monitor_rows_keep_their_place(tmp_path, device):
    """ThroughputMonitor logs through Lightning's connector from on_train_batch_end: its rows
    stay where they were among the step rows (its timings differ run to run: masked)."""
    from lightning.pytorch.callbacks import ThroughputMonitor

    def monitor(root):
        return [ThroughputMonitor(batch_size_fn=lambda batch: batch[0].size(0), window_size=2)]
    native, fast = fit_both(tmp_path, device, OnStepEpoch, callbacks=monitor, log_every_n_steps=2,
                            loggers=("csv",))

    def masked(rows):
        timed = [i for i, name in enumerate(rows[0]) if "time" in name or "per_sec" in name]
        return [[v if i not in timed or not v else "<t>" for i, v in enumerate(r)]
                for r in rows]
    assert "train/samples" in native["csv0"][0]
    assert masked(fast.pop("csv0")) == masked(native.pop("csv0"))
    for seen in (native, fast):
        seen["logged_metrics"] = {k: v for k, v in seen["logged_metrics"].items()
                                  if "time" not in k and "per_sec" not in k}
    assert_same(native, fast)


class SameKey(Base):
    """One key in training and validation, logging from on_before_backward, enable_graph."""

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("loss", loss, prog_bar=True, on_step=True, on_epoch=True)
        self.log("graph", loss * 3, enable_graph=True)
        return loss

    def on_before_backward(self, loss):
        self.log("before_backward", loss + 1)

    def validation_step(self, batch, batch_idx):
        self.log("loss", self.loss(batch), prog_bar=True)


def test_one_key_in_training_and_validation(tmp_path, device):
    native, fast = fit_both(tmp_path, device, SameKey, log_every_n_steps=2,
                            val_check_interval=0.5,
                            callbacks=lambda root: [ModelCheckpoint(root / "ck", monitor="loss",
                                                                    filename="{step}-{loss:.4f}",
                                                                    save_top_k=2)],
                            enable_checkpointing=True)
    assert {"loss_step", "loss_epoch", "loss", "graph", "before_backward"} <= \
        set(native["csv0"][0])
    assert_same(native, fast)


def test_callback_from_configure_callbacks(tmp_path, device):
    """The module brings its callbacks (LightningModule.configure_callbacks): SynclessLogging
    among them works as when given to the Trainer."""
    class Bringing(OnStepEpoch):
        def configure_callbacks(self):
            cbs = [EarlyStopping("val_loss", patience=1)]
            return ([SynclessLogging(every=3)] if self.fast else []) + cbs

    def fit(trainer, module, train, val, root):
        module.fast = root.name == "syncless"
        trainer.callbacks = [cb for cb in trainer.callbacks
                             if not isinstance(cb, SynclessLogging)]
        trainer.fit(module, train, val)
        assert any(isinstance(cb, SynclessLogging) for cb in trainer.callbacks) == module.fast
    native, fast = fit_both(tmp_path, device, Bringing, fit=fit, max_epochs=6, log_every_n_steps=2)
    assert len(native["csv0"]) > 20
    assert_same(native, fast)


def test_sinks_serve_every_fit(tmp_path, device):
    """A JSONL sink given to the callback gets every batch of both fits on one trainer (the
    first fit's end flushes it, it does not close it), with the values the CSVLogger got; a
    path instead of a sink is refused at once."""
    import json

    import syncless
    with pytest.raises(TypeError, match="sinks takes sink objects, got the path"):
        SynclessLogging(sinks=str(tmp_path / "steps.jsonl"))
    sink = syncless.sinks.JSONL(tmp_path / "steps.jsonl")

    def fit(trainer, module, train, val):
        trainer.fit(module, train, val)
        trainer.fit_loop.max_epochs = 3
        trainer.fit(module, train, val)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = pl.Trainer(max_epochs=1, log_every_n_steps=1, logger=CSVLogger(tmp_path),
                                 callbacks=[SynclessLogging(every=3, sinks=sink)],
                                 enable_progress_bar=False, enable_checkpointing=False,
                                 enable_model_summary=False, devices=1,
                                 accelerator="cpu" if device == "cpu" else "gpu")
            pl.seed_everything(0, verbose=False)
            fit(trainer, OnStepEpoch(), _data(), _data(16, 8, seed=1))
    finally:
        sink.close()
    with open(tmp_path / "steps.jsonl") as f:
        rows = [json.loads(line) for line in f]
    head, *csv_rows = _csv_rows(trainer.logger)
    logged = {int(r[head.index("step")]): float(r[head.index("train_loss_step")])
              for r in csv_rows if r[head.index("train_loss_step")]}
    assert [r["step"] for r in rows] == list(range(24))
    assert {r["step"]: r["train_loss_step"] for r in rows} == logged


def test_two_callbacks_refused(tmp_path, device):
    """Two SynclessLogging in one Trainer (the Trainer's and the module's configure_callbacks,
    say): a clear error before the first batch, and nothing is left installed."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = pl.Trainer(max_epochs=1, callbacks=[SynclessLogging(), SynclessLogging()],
                             logger=False, enable_progress_bar=False, enable_checkpointing=False,
                             enable_model_summary=False, devices=1,
                             accelerator="cpu" if device == "cpu" else "gpu")
        module = OnStepEpoch()
        with pytest.raises(ValueError, match="the Trainer has 2 of them"):
            trainer.fit(module, _data())
    assert "log" not in vars(module) and trainer.global_step == 0


class PbarAt(Callback):
    """trainer.progress_bar_metrics and the TQDM bar's postfix after each batch of epoch 0."""

    def __init__(self):
        self.seen = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.current_epoch == 0:
            bar = trainer.progress_bar_callback.train_progress_bar
            self.seen.append(({k: float(v) for k, v in trainer.progress_bar_metrics.items()},
                              bar.postfix))


def test_progress_bar_shows_a_value_by_the_second_batch(tmp_path, device):
    """SynclessLogging's defaults (every=16): the first window would be copied back after 16
    batches; the fit's first batch is copied back at once instead, so the bar shows it at the
    second batch and the values that follow are those Lightning showed, a few batches late."""
    native, fast = fit_both(
        tmp_path, device, OnStepEpoch, every=16, train=lambda: _data(64, 2),
        enable_progress_bar=True, max_epochs=1,
        callbacks=lambda root: [TQDMProgressBar(refresh_rate=1), PbarAt()])
    plain, ours = native["seen1"], fast["seen1"]
    assert len(plain) == len(ours) == 32
    assert ours[0] == ({}, "v_num=0")               # batch 0's row is logged after its hooks
    history = [m["train_loss_step"] for m, _ in plain]
    if device == "cpu":                             # host rows: handed over at once
        metrics, postfix = ours[1]
        assert metrics == {"train_loss_step": history[0]}
        assert postfix == plain[0][1]               # the text the terminal showed, same digits
        shown = ours[1:]
    else:
        # Once the GPU finished batch 0 and the delivery thread decoded it: usually by batch 1,
        # here within 8 batches (a window of 16 before the first batch was sent at once).
        first = next(i for i, (m, _) in enumerate(ours) if m)
        assert first <= 8, first
        assert ours[first][0] == {"train_loss_step": history[0]}
        shown = ours[first:]
    late = [i - history.index(m["train_loss_step"])
            for i, (m, _) in enumerate(shown, len(ours) - len(shown))]
    # A window's last row is handed over by its 16th batch (sooner after max_delay), so shown
    # at most 16 batches later without a GPU; the delivery thread's lag on top with one.
    assert all(1 <= d <= (16 if device == "cpu" else 24) for d in late), late
    for key in ("csv0", "tb1", "callback_metrics", "logged_metrics", "progress_bar_metrics",
                "bar0"):
        assert fast[key] == native[key], key


class Recording(pl.loggers.Logger):
    """A logger that keeps each log_metrics call exactly as it was made (a mock would see the
    same): positional or keyword arguments, and which argument carried what."""

    def __init__(self):
        super().__init__()
        self.calls = []

    @property
    def name(self):
        return "recording"

    @property
    def version(self):
        return 0

    def log_metrics(self, *args, **kwargs):
        self.calls.append((tuple({k: round(float(v), 6) for k, v in a.items()}
                                 if isinstance(a, dict) else a for a in args),
                           {k: ({m: round(float(v), 6) for m, v in a.items()}
                                if isinstance(a, dict) else a) for k, a in kwargs.items()}))

    def log_hyperparams(self, params, *args, **kwargs):
        pass


class RecordingTB(TensorBoardLogger):
    """TensorBoardLogger, keeping the shape of each log_metrics call it gets (its own
    log_hyperparams calls it positionally: `log_metrics({"hp_metric": -1}, None)`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = []

    def log_metrics(self, *args, **kwargs):
        self.calls.append((len(args), sorted(kwargs)))
        super().log_metrics(*args, **kwargs)


class PositionalCalls(OnStepEpoch):
    """The user's own calls, positional and keyword, between batches whose rows are on their
    way; hyperparameters saved, so TensorBoardLogger logs its hp_metric."""

    def __init__(self, lr=0.1):
        super().__init__(lr)
        self.save_hyperparameters()

    def training_step(self, batch, batch_idx):
        lg = self.loggers[0]
        lg.log_metrics({"pos": float(batch_idx)}, self.global_step)
        lg.log_metrics({"pos_only": 1.0})
        lg.log_metrics(metrics={"kw": 2.0}, step=self.global_step)
        lg.log_metrics({"mixed": 3.0}, step=self.global_step)
        return super().training_step(batch, batch_idx)


def test_log_metrics_calls_keep_the_callers_shape(tmp_path, device):
    """Issue 28 item 5: a log_metrics call that waits behind step rows reaches the logger as the
    user's code made it; Lightning's own calls (keywords) stay keywords."""
    runs = {}
    for kind in ("native", "syncless"):
        pl.seed_everything(0, verbose=False)
        rec, tb = Recording(), RecordingTB(tmp_path / kind, name="tb")
        cbs = [SynclessLogging(every=4)] if kind == "syncless" else []
        trainer = pl.Trainer(max_epochs=1, logger=[rec, tb], callbacks=cbs, log_every_n_steps=2,
                             accelerator="cpu" if device == "cpu" else "gpu", devices=1,
                             enable_checkpointing=False, enable_model_summary=False,
                             enable_progress_bar=False, default_root_dir=tmp_path / kind)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(PositionalCalls(), _data())
        runs[kind] = rec.calls
        runs[kind + "-tb"] = tb.calls
    assert runs["native-tb"][0] == (2, [])               # log_metrics({"hp_metric": -1}, None)
    assert runs["syncless-tb"] == runs["native-tb"]
    calls = runs["native"]
    assert (({"pos": 0.0}, 0), {}) in calls and (({"pos_only": 1.0},), {}) in calls
    assert ((), {"metrics": {"kw": 2.0}, "step": 0}) in calls
    assert (({"mixed": 3.0},), {"step": 0}) in calls
    assert runs["syncless"] == calls


@pytest.mark.parametrize("kw, text", [
    (dict(every=True), "every must be a positive int, got True"),
    (dict(every=0), "every must be a positive int, got 0"),
    (dict(every=2.0), "every must be a positive int, got 2.0"),
    (dict(max_delay=-1), "max_delay must be None or a number of seconds >= 0, got -1"),
    (dict(max_delay="1"), "max_delay must be None or a number of seconds >= 0, got '1'"),
])
def test_bad_settings_are_refused(kw, text):
    with pytest.raises(ValueError, match="SynclessLogging: " + text):
        SynclessLogging(**kw)
