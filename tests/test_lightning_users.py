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


def _value(v):
    if isinstance(v, torch.Tensor):
        return ("tensor", str(v.dtype), v.device.type, v.item())
    return (type(v).__name__, v)


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
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _seen(trainer, extra, root):
    """Everything a user reads after fit, with the run's own directory taken out of paths."""
    out = {"steps": (trainer.global_step, trainer.current_epoch,
                     trainer.fit_loop.epoch_loop._batches_that_stepped)}
    for i, lg in enumerate(trainer.loggers):
        if isinstance(lg, CSVLogger):
            out[f"csv{i}"] = _csv_rows(lg)
        elif isinstance(lg, TensorBoardLogger):
            out[f"tb{i}"] = _tb_scalars(lg)
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
                if isinstance(value, WarningCache):
                    value.clear()


def fit_both(tmp_path, device, model, *, callbacks=lambda root: [], loggers=("csv", "tb"),
             fit=None, train=None, val=None, every=4, **trainer_kw):
    """Runs the scenario plainly and with SynclessLogging; returns both runs' observations."""
    runs = {}
    for kind in ("native", "syncless"):
        root = tmp_path / kind
        _forget_warnings()
        pl.seed_everything(0, verbose=False)
        lgs = []
        if "csv" in loggers:
            lgs.append(CSVLogger(root, name="csv"))
        if "tb" in loggers:
            lgs.append(TensorBoardLogger(root, name="tb"))
        extra = callbacks(root)
        cbs = ([SynclessLogging(every=every)] if kind == "syncless" else []) + extra
        kw = dict(max_epochs=2, logger=lgs or False, callbacks=cbs, log_every_n_steps=3,
                  accelerator="cpu" if device == "cpu" else "gpu", devices=1,
                  enable_checkpointing=False, enable_model_summary=False,
                  enable_progress_bar=False, default_root_dir=root)
        kw.update(trainer_kw)
        trainer = pl.Trainer(**kw)
        module = model()                     # after the seed: the same initial weights
        tr = train() if train else _data()
        va = val() if val else (_data(16, 8, seed=1) if val is None else None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if fit is None:
                trainer.fit(module, tr, va)
            else:
                fit(trainer, module, tr, va, root)
        seen = _seen(trainer, extra, root)
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
