"""syncless.lightning against a plain Lightning run with the same seed: the loggers' files, the
progress bar, callback metrics, checkpoints and early stopping must come out the same."""
import csv
import os
import subprocess
import sys
import warnings

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")
from lightning.pytorch.callbacks import Callback, EarlyStopping, ModelCheckpoint  # noqa: E402
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import syncless  # noqa: E402
from benchmarks._common import SyncCount  # noqa: E402
from syncless.lightning import SynclessLogging  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    # Lightning's own chatter on a tiny CPU run; none of it concerns logging values.
    "ignore::lightning.fabric.utilities.warnings.PossibleUserWarning",
    "ignore:.*LeafSpec.*is deprecated:DeprecationWarning",
    "ignore:.*treespec, LeafSpec.*:UserWarning",
    "ignore:The '.*dataloader' does not have many workers:UserWarning",
)


class Model(pl.LightningModule):
    """Logs what users log: on-step with prog_bar, on_step+on_epoch, a Python float, a metric
    logged every third batch, an epoch-only metric, a metric from a hook, and validation."""

    def __init__(self, fail_at=None, lr=0.1):
        super().__init__()
        self.net = torch.nn.Linear(8, 1)
        self.fail_at = fail_at
        self.lr = lr

    def training_step(self, batch, i):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        if self.fail_at is not None and self.global_step == self.fail_at:
            raise RuntimeError("boom")
        self.log("loss", loss, prog_bar=True)
        self.log("both", loss * 2, on_step=True, on_epoch=True, prog_bar=True)
        self.log_dict({"lr": 0.1, "n": float(i)})
        if i % 3 == 0:
            self.log("sparse", loss + 1)
        self.log("ep", loss, on_step=False, on_epoch=True, prog_bar=True)
        self.log("mx", loss, on_step=True, on_epoch=True, reduce_fx="max", logger=True)
        return loss

    def on_before_optimizer_step(self, optimizer):
        self.log("wnorm", self.net.weight.norm())

    def validation_step(self, batch, i):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), prog_bar=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def _data():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(48, 8, generator=g), torch.randn(48, 1, generator=g)
    return (DataLoader(TensorDataset(x, y), batch_size=4),
            DataLoader(TensorDataset(x[:16], y[:16]), batch_size=8))


class PbarSeen(Callback):
    """What the progress bar would display after each batch."""

    def __init__(self):
        self.seen = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen.append(dict(trainer.progress_bar_metrics))


def _fit(tmp_path, syncless, *, callbacks=(), model_kw=None, **trainer_kw):
    pl.seed_everything(0, verbose=False)
    train, val = _data()
    kind = "syncless" if syncless else "native"
    loggers = [CSVLogger(tmp_path / kind, name="csv"),
               TensorBoardLogger(tmp_path / kind, name="tb")]
    seen = PbarSeen()
    cbs = ([SynclessLogging(every=4)] if syncless else []) + list(callbacks) + [seen]
    kw = dict(max_epochs=3, logger=loggers, callbacks=cbs, log_every_n_steps=3,
              enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False,
              accelerator="cpu", default_root_dir=tmp_path / kind)
    kw.update(trainer_kw)
    trainer = pl.Trainer(**kw)
    model = Model(**(model_kw or {}))              # after the seed: the same initial weights
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")          # Lightning's tips and dataloader advice
        try:
            trainer.fit(model, train, val)
        except RuntimeError as exc:
            if str(exc) != "boom":
                raise
    return trainer, seen.seen


def _csv(trainer):
    with open(os.path.join(trainer.loggers[0].log_dir, "metrics.csv")) as f:
        return list(csv.reader(f))


def _tb(trainer):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(trainer.loggers[1].log_dir)
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.mark.parametrize("kw", [
    dict(log_every_n_steps=3),
    dict(log_every_n_steps=1, accumulate_grad_batches=2),
    dict(log_every_n_steps=2, max_steps=17),                 # stops mid-epoch
    dict(log_every_n_steps=5, val_check_interval=5),         # validation inside the epoch
], ids=["every3", "every1-accumulate2", "max_steps", "val-in-epoch"])
def test_loggers_receive_what_lightning_sends(tmp_path, kw):
    native, native_bar = _fit(tmp_path, False, **kw)
    fast, fast_bar = _fit(tmp_path, True, **kw)
    rows = _csv(native)
    assert len(rows) > 10 and "loss" in rows[0] and "both_step" in rows[0]
    assert _csv(fast) == rows                           # same rows, same order, same digits
    assert _tb(fast) == _tb(native)
    assert fast.progress_bar_metrics == native.progress_bar_metrics
    assert list(fast.progress_bar_metrics) == list(native.progress_bar_metrics)
    assert {k: float(v) for k, v in fast.callback_metrics.items()} == \
        {k: float(v) for k, v in native.callback_metrics.items()}
    assert fast.global_step == native.global_step
    # The bar showed values Lightning showed at the same or an earlier batch, a few batches late.
    history = [b.get("loss") for b in native_bar]
    for i, shown in enumerate(fast_bar):
        if "loss" in shown:
            assert shown["loss"] in history[:i + 1]
    late = [i - history.index(b["loss"]) for i, b in enumerate(fast_bar) if "loss" in b]
    assert late and max(late) <= 2 * 4 + 1


def test_every_step_with_log_every_n_steps_1(tmp_path):
    native, _ = _fit(tmp_path, False, log_every_n_steps=1, max_epochs=1)
    fast, _ = _fit(tmp_path, True, log_every_n_steps=1, max_epochs=1)
    steps = [r[rows_index(native, "step")] for r in _csv(fast)[1:] if r[rows_index(native, "loss")]]
    assert steps == [str(s) for s in range(12)]         # every batch, at its global_step
    assert _csv(fast) == _csv(native)


def rows_index(trainer, name):
    return _csv(trainer)[0].index(name)


def test_checkpoint_and_early_stopping_unchanged(tmp_path):
    def callbacks(kind):
        return [ModelCheckpoint(dirpath=tmp_path / kind / "best", monitor="val_loss", save_top_k=1,
                                filename="{epoch}-{step}-{val_loss:.5f}"),
                ModelCheckpoint(dirpath=tmp_path / kind / "steps", monitor="loss", mode="min",
                                every_n_train_steps=5, save_top_k=2, filename="{step}-{loss:.5f}"),
                EarlyStopping(monitor="both_epoch", mode="max", patience=1)]
    out = {}
    for kind, fast in (("native", False), ("syncless", True)):
        cbs = callbacks(kind)
        trainer, _ = _fit(tmp_path, fast, callbacks=cbs, max_epochs=8, enable_checkpointing=True,
                          model_kw=dict(lr=0.05))
        out[kind] = (os.path.basename(cbs[0].best_model_path), float(cbs[0].best_model_score),
                     sorted(os.listdir(tmp_path / kind / "steps")), float(cbs[1].best_model_score),
                     cbs[2].stopped_epoch, trainer.current_epoch, trainer.global_step)
    assert out["native"][4] > 0 and out["native"][5] < 8      # early stopping did stop it
    assert out["syncless"] == out["native"]


def test_exception_keeps_every_logged_step(tmp_path):
    native, _ = _fit(tmp_path, False, model_kw=dict(fail_at=14), log_every_n_steps=1)
    fast, _ = _fit(tmp_path, True, model_kw=dict(fail_at=14), log_every_n_steps=1)
    rows = _csv(native)
    assert rows[-1][rows[0].index("step")] == "13"
    assert _csv(fast) == rows


def test_float_values_sinks_and_log_restored(tmp_path):
    rows = []
    sink = syncless.sinks.Callback(lambda step, t, values: rows.append((step, values)))
    pl.seed_everything(0, verbose=False)
    train, _val = _data()
    fast = pl.Trainer(max_epochs=1, callbacks=[SynclessLogging(every=5, sinks=[sink])],
                      logger=False, enable_checkpointing=False, enable_model_summary=False,
                      enable_progress_bar=False, accelerator="cpu", accumulate_grad_batches=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast.fit(Model(), train)
    model = fast.lightning_module
    assert "log" not in model.__dict__               # the module's own log() is back
    cb = next(c for c in fast.callbacks if isinstance(c, SynclessLogging))
    assert cb.syncless.closed and cb.syncless.stats.steps == 12
    assert cb.syncless.latest["lr"] == float(torch.tensor(0.1))    # float32, as Lightning logs it
    # One row per batch at Lightning's step (two batches per optimizer step here), with its keys.
    assert [step for step, _ in rows] == [i // 2 for i in range(12)]
    assert [v["n"] for _, v in rows] == [float(i) for i in range(12)]
    assert set(rows[0][1]) == {"loss", "both_step", "lr", "n", "sparse", "mx_step"}
    assert set(rows[1][1]) == {"loss", "both_step", "lr", "n", "mx_step", "wnorm"}


def test_pytorch_lightning_package(tmp_path):
    """The same callback built on the standalone `pytorch_lightning` package."""
    ptl = pytest.importorskip("pytorch_lightning")
    from syncless.lightning import SynclessLoggingPL

    class Small(ptl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(8, 1)

        def training_step(self, batch, i):
            loss = torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])
            self.log("loss", loss, prog_bar=True)
            self.log("lr", 0.1)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    out = {}
    for kind in ("native", "syncless"):
        ptl.seed_everything(0, verbose=False)
        trainer = ptl.Trainer(max_epochs=1, log_every_n_steps=2, accelerator="cpu",
                              logger=ptl.loggers.CSVLogger(tmp_path / kind),
                              callbacks=[SynclessLoggingPL(every=3)] if kind == "syncless" else [],
                              enable_checkpointing=False, enable_model_summary=False,
                              enable_progress_bar=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(Small(), _data()[0])
        out[kind] = (_csv(trainer), trainer.progress_bar_metrics)
    assert len(out["native"][0]) == 7 and out["syncless"] == out["native"]


def test_import_syncless_imports_no_framework():
    code = ("import syncless, syncless.lightning, syncless.hf, sys; "
            "bad = [m for m in ('lightning', 'pytorch_lightning', 'transformers', 'accelerate') "
            "if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ})


# ---- sync_dist across two processes (gloo) ---------------------------------------------------

DDP_SCRIPT = r"""
import os, sys, warnings
import torch

def main(rank, world, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world),
                      RANK=str(rank), LOCAL_RANK=str(rank), NODE_RANK="0")
    warnings.simplefilter("ignore")
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger
    from torch.utils.data import DataLoader, TensorDataset
    from syncless.lightning import SynclessLogging

    class M(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, b, i):
            x, y = b
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.log("loss", loss, prog_bar=True, sync_dist=True)
            self.log("rank_sum", float(self.global_rank + i), sync_dist=True, reduce_fx="sum",
                     on_step=True, on_epoch=True)
            self.log("local", loss + self.global_rank)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    for kind in ("native", "syncless"):
        pl.seed_everything(0, verbose=False)
        g = torch.Generator().manual_seed(rank)
        ds = TensorDataset(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g))
        t = pl.Trainer(accelerator="cpu", devices=world, strategy="ddp", max_epochs=2,
                       logger=CSVLogger(out, name=kind), log_every_n_steps=1,
                       callbacks=[SynclessLogging(every=3)] if kind == "syncless" else [],
                       enable_checkpointing=False, enable_model_summary=False,
                       enable_progress_bar=False, use_distributed_sampler=False)
        t.fit(M(), DataLoader(ds, batch_size=4))
    # Lightning leaves the group alive; destroyed here, while the interpreter is alive, not in
    # its teardown (see test_ranks.py's ACCELERATE: the abort at exit that otherwise comes).
    del t
    torch.distributed.destroy_process_group()
    import gc
    gc.collect()                          # the trainer's cycles hold the DDP model, and it the group

if __name__ == "__main__":
    import torch.multiprocessing as mp
    mp.spawn(main, args=(2, int(sys.argv[1]), sys.argv[2]), nprocs=2)
"""


@pytest.mark.slow
def test_sync_dist_two_processes(tmp_path):
    """Two gloo ranks, each with its own data: `sync_dist=True` step and epoch values are the
    reduced ones, unsynced ones rank 0's, exactly as in the plain run."""
    from _gloo import child_env, free_port, rerun_on_mesh_flake
    script = tmp_path / "ddp_fit.py"
    script.write_text(DDP_SCRIPT)

    def fit(attempt):
        out_dir = tmp_path / f"out{attempt}"
        out = subprocess.run([sys.executable, str(script), str(free_port()), str(out_dir)],
                             env=child_env(), capture_output=True, text=True, timeout=300)
        return out.returncode, out.stderr, out_dir

    rc, stderr, out_dir = rerun_on_mesh_flake(fit)
    assert rc == 0, stderr[-3000:]
    rows = {}
    for kind in ("native", "syncless"):
        with open(out_dir / kind / "version_0" / "metrics.csv") as f:
            rows[kind] = list(csv.reader(f))
    header = rows["native"][0]
    assert "rank_sum_step" in header and "rank_sum_epoch" in header
    first = dict(zip(header, rows["native"][1]))
    assert float(first["rank_sum_step"]) == 1.0        # rank 0 + rank 1 at batch 0
    assert rows["syncless"] == rows["native"]


# ---- CUDA: count the syncs of steady-state steps -------------------------------------------

class SyncCounter(Callback):
    """Sync-debug warnings raised from batch `start` to batch `stop` (both hooks included)."""

    def __init__(self, start, stop):
        self.start, self.stop = start, stop
        self.syncs = SyncCount()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.start:
            self.syncs.start()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == self.stop:
            self.syncs.stop()


@pytest.mark.cuda
def test_cuda_zero_syncs_per_step(tmp_path):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 8, generator=g).cuda()
    y = torch.randn(512, 1, generator=g).cuda()
    counts = {}
    for fast in (False, True):
        pl.seed_everything(0, verbose=False)
        counter = SyncCounter(10, 49)               # 40 steady-state batches
        cbs = ([SynclessLogging(every=8)] if fast else []) + [counter]
        trainer = pl.Trainer(max_epochs=1, callbacks=cbs, log_every_n_steps=10,
                             logger=CSVLogger(tmp_path / str(fast)),
                             enable_checkpointing=False, enable_model_summary=False,
                             enable_progress_bar=True, accelerator="gpu", devices=1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(Model(), DataLoader(TensorDataset(x, y), batch_size=8))
        counts[fast] = (counter.syncs.count, counter.syncs.sites)
    assert counts[False][0] >= 40 * 2, counts        # native: at least the 2 prog_bar reads
    assert counts[True][0] == 0, counts
