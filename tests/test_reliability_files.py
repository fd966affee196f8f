"""Issue 27: what the Logger touches around it. File sinks write only the files they create (never
a user's `metrics.1.csv`, never the parent's run from a spawned worker's re-import, never a file
another sink writes), a run directory deleted mid-run is named as such; a Logger refuses to be
copied or pickled with an error that names the fix; attached values follow log()'s rules.
Cases that start processes run in a fresh interpreter with a timeout."""
import copy
import csv
import json
import logging
import os
import pathlib
import pickle
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import syncless
from syncless.sinks import CSV, JSONL
from _sinks import Collect

ROOT = pathlib.Path(__file__).resolve().parent.parent


def read_csv(path):
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.reader(f))


def jsonl(path, field):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)[field] for line in f]


def table(path):
    """The CSV as {step: {column: float}} (empty cells left out), and its header."""
    rows = read_csv(path)
    header = rows[0]
    return header, [(int(r[0]), {h: float(v) for h, v in zip(header[2:], r[2:]) if v})
                     for r in rows[1:]]


def run_script(tmp_path, code, timeout=300):
    """Run `code` as a script file (spawn re-imports it as __mp_main__) in a fresh interpreter."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(code))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "python"), str(ROOT)] +
                                                       sys.path))
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=tmp_path)


def value(v, device):
    return torch.tensor(float(v), device=device)


# ---- files the sink did not create --------------------------------------------------------------

USER_FILES = {"metrics.1.csv": b"epoch,acc\r\n1,0.5\r\n", "metrics.2.csv": b"user data 2\n",
              "metrics.3.csv": b"\x00\xffbinary", "metrics.csv.1234.tmp": b"keep me",
              ".metrics.csv.parts": b"not ours either"}


@pytest.mark.parametrize("grow", [False, True], ids=["one_header", "columns_grow"])
def test_user_files_beside_the_csv_are_untouched(tmp_path, device, grow):
    """metrics.1.csv..metrics.3.csv (and other names near the sink's) are a user's: the run that
    writes metrics.csv, also one whose columns grow (so it writes parts), leaves them byte for
    byte, merges its own parts and removes them and their folder, nothing else."""
    for name, data in USER_FILES.items():
        (tmp_path / name).write_bytes(data)
    path = tmp_path / "metrics.csv"
    sink = CSV(path)
    with syncless.Logger(every=4, sinks=[sink]) as log:
        for step in range(20):
            extra = {f"m{step // 4}": value(step, device)} if grow else {}
            log(loss=value(step / 2, device), **extra)
        log.flush()
        assert len(sink.files) == (5 if grow else 1)
        assert all(f == str(path) or "/.metrics.csv.syncless-" in f for f in sink.files)
    header, rows = table(path)
    assert header == ["step", "time", "loss"] + ([f"m{k}" for k in range(5)] if grow else [])
    assert rows == [(s, {"loss": s / 2, **({f"m{s // 4}": float(s)} if grow else {})})
                    for s in range(20)]
    assert sorted(os.listdir(tmp_path)) == sorted(list(USER_FILES) + ["metrics.csv"])
    for name, data in USER_FILES.items():
        assert (tmp_path / name).read_bytes() == data


def test_two_sinks_never_share_a_file(tmp_path):
    """CSV("m.1.csv") and CSV("m.csv") each keep their own parts (the merge used to fold one
    into the other); a second sink on a path an open sink writes is refused at construction,
    through a symlink too; once the first is closed, the path is free."""
    a, b = CSV(tmp_path / "m.1.csv"), CSV(tmp_path / "m.csv")
    with syncless.Logger(every=1, sinks=[a]) as la, syncless.Logger(every=1, sinks=[b]) as lb:
        for step in range(6):
            la(**{f"a{step}": float(step)})
            lb(**{f"b{step}": -float(step)})
        la.flush()
        lb.flush()
        assert not set(a.files) & set(b.files) and len(a.files) == len(b.files) == 6
        for other in (lambda: CSV(tmp_path / "m.csv"), lambda: JSONL(tmp_path / "m.csv"),
                      lambda: CSV(tmp_path / "." / "m.1.csv")):
            with pytest.raises(ValueError, match=r"CSV\('.*m\.(1\.)?csv'\) already writes .*"
                                                 r"m\.(1\.)?csv in this process"):
                other()
        os.symlink(tmp_path / "m.csv", tmp_path / "link.csv")
        with pytest.raises(ValueError, match="already writes"):
            CSV(tmp_path / "link.csv")
    assert table(tmp_path / "m.1.csv")[1] == [(s, {f"a{s}": float(s)}) for s in range(6)]
    assert table(tmp_path / "m.csv")[1] == [(s, {f"b{s}": -float(s)}) for s in range(6)]
    assert sorted(os.listdir(tmp_path)) == ["link.csv", "m.1.csv", "m.csv"]
    with syncless.Logger(every=1, sinks=[JSONL(tmp_path / "m.csv", mode="w")]) as log:
        log(c=1.0)                                      # closed sinks leave the path free
    assert jsonl(tmp_path / "m.csv", "c") == [1.0]


def test_sinks_open_their_files_at_the_first_write(tmp_path):
    """Constructing a sink touches no file (a module-level sink made again must not truncate a
    run); a path that cannot be written still fails at construction."""
    for name in ("m.csv", "m.jsonl"):
        (tmp_path / name).write_text("a run's rows\n")
    csv_sink, jsonl_sink = CSV(tmp_path / "m.csv"), JSONL(tmp_path / "m.jsonl", mode="w")
    assert (tmp_path / "m.csv").read_text() == (tmp_path / "m.jsonl").read_text() == \
        "a run's rows\n"
    with syncless.Logger(every=2, sinks=[csv_sink, jsonl_sink]) as log:
        log(loss=1.5)
        log(loss=2.5)
    assert table(tmp_path / "m.csv")[1] == [(0, {"loss": 1.5}), (1, {"loss": 2.5})]
    assert jsonl(tmp_path / "m.jsonl", "loss") == [1.5, 2.5]
    (tmp_path / "dir.csv").mkdir()
    with pytest.raises(IsADirectoryError, match=r"CSV .*dir\.csv: is a directory"):
        CSV(tmp_path / "dir.csv")
    if os.geteuid() != 0:                               # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(PermissionError, match=r"JSONL .*m\.jsonl: not writable"):
            JSONL(locked / "m.jsonl")


SPAWN_SCRIPT = """
    import json, csv, sys
    import torch
    import syncless
    from syncless.sinks import CSV, JSONL, TensorBoard

    # Module level: every spawned worker runs these lines again when it re-imports __main__.
    log = syncless.Logger(every=5, sinks=[CSV("m.csv"), JSONL("m.jsonl", mode="w"),
                                          TensorBoard("tb")])


    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return 24

        def __getitem__(self, i):
            if WORKER_LOGS:
                log(in_worker=float(i))          # the worker's own copy: refused, reported
            return torch.tensor(float(i))


    WORKER_LOGS = len(sys.argv) > 1

    if __name__ == "__main__":
        loader = torch.utils.data.DataLoader(Data(), batch_size=None, num_workers=2,
                                             multiprocessing_context="spawn")
        for step, x in enumerate(loader):
            log(x=x, twice=x * 2)
        log.close()
        rows = list(csv.DictReader(open("m.csv", newline="")))
        lines = [json.loads(line) for line in open("m.jsonl")]
        print(json.dumps({"csv": [(int(r["step"]), float(r["x"]), float(r["twice"]))
                                  for r in rows],
                          "jsonl": [(r["step"], r["x"], r["twice"]) for r in lines]}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("workers, worker_logs", [(1, False), (2, False), (2, True)],
                         ids=["one_worker", "two", "two_logging"])
def test_spawn_dataloader_workers_keep_every_row(tmp_path, workers, worker_logs):
    """A module-level Logger with CSV and JSONL(mode="w") sinks is made again in each spawn
    DataLoader worker: the parent's files keep all 24 rows (9 of 24 before). A worker that logs
    into its copy gets a clear error naming the cause, never the parent's file. (Slow: each
    worker is an interpreter importing torch; the quick suite has the in-process version.)"""
    code = SPAWN_SCRIPT.replace("WORKER_LOGS = len(sys.argv) > 1", f"WORKER_LOGS = {worker_logs}")
    out = run_script(tmp_path, code.replace("num_workers=2", f"num_workers={workers}"))
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    expected = [[s, float(s), 2.0 * s] for s in range(24)]
    assert got == {"csv": expected, "jsonl": expected}
    assert sorted(os.listdir(tmp_path)) == ["m.csv", "m.jsonl", "script.py", "tb"]
    (events,) = os.listdir(tmp_path / "tb")            # the parent's only: none per worker
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(tmp_path / "tb" / events))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("twice")] == [(s, 2.0 * s) for s in range(24)]
    if worker_logs:
        assert "was made while this spawned process re-imported its parent's modules" in \
            out.stderr
        assert "Traceback" not in out.stderr


def test_sinks_made_during_a_spawn_re_import_never_touch_the_parents_files(tmp_path,
                                                                          monkeypatch, caplog):
    """The quick version of the spawn case above, in this process: while a spawned child
    re-imports its parent's modules, multiprocessing marks the process `_inheriting`; sinks
    made then open, create and truncate nothing, and a row logged to them is refused clearly."""
    import multiprocessing.process
    for name in ("m.csv", "m.jsonl"):
        (tmp_path / name).write_text("the parent's rows\n")
    monkeypatch.setattr(multiprocessing.process.current_process(), "_inheriting", True,
                        raising=False)
    sinks = [CSV(tmp_path / "m.csv"), JSONL(tmp_path / "m.jsonl", mode="w"),
             syncless.sinks.TensorBoard(tmp_path / "tb"), CSV(tmp_path / "new" / "m.csv")]
    monkeypatch.undo()
    with syncless.Logger(every=1, sinks=sinks) as log:
        log(loss=1.0)
    assert sorted(os.listdir(tmp_path)) == ["m.csv", "m.jsonl"]
    assert (tmp_path / "m.csv").read_text() == (tmp_path / "m.jsonl").read_text() == \
        "the parent's rows\n"
    assert log.stats.sink_errors == 4
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 4 and all("was made while this spawned process re-imported its "
                                    "parent's modules" in e for e in errors)


def test_run_directory_deleted_mid_run(tmp_path, device, caplog):
    """The run directory is removed while the run writes into it (parts included): the error
    says the directory was deleted and which rows went with it, never points at parts that no
    longer exist; the table starts again with every column, and the other sinks lose nothing."""
    run = tmp_path / "run"
    got = Collect()
    csv_sink, jsonl_sink = CSV(run / "m.csv"), JSONL(run / "m.jsonl")
    with syncless.Logger(every=2, sinks=[csv_sink, jsonl_sink, got]) as log:
        for step in range(4):
            log(loss=value(step, device), **({"acc": value(-step, device)} if step > 1 else {}))
        log.flush()
        assert len(csv_sink.files) == 2                 # a part in the folder beside m.csv
        shutil.rmtree(run)
        for step in range(4, 8):
            log(loss=value(step, device), acc=value(-step, device))
        log.flush()
        assert log.stats.sink_errors == 2
        for step in range(8, 10):
            log(loss=value(step, device), acc=value(-step, device))
    assert got.rows == [(s, {"loss": float(s), **({"acc": -float(s)} if s > 1 else {})})
                        for s in range(10)]
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 2, errors                     # each sink reported once
    for kind in ("CSV", "JSONL"):
        (msg,) = [e for e in errors if f"{kind} {run}" in e]
        assert f"its directory {run} was deleted during the run, and the rows written before " \
               f"step 4 went with it; from that step on rows go to a new {run}" in msg
        assert "syncless-" not in msg                   # no part file named
    header, rows = table(run / "m.csv")
    assert header == ["step", "time", "loss", "acc"]
    assert rows == [(s, {"loss": float(s), "acc": -float(s)}) for s in range(4, 10)]
    assert jsonl(run / "m.jsonl", "step") == list(range(4, 10))
    assert sorted(os.listdir(run)) == ["m.csv", "m.jsonl"]


def test_run_directory_deleted_before_the_merge(tmp_path, caplog):
    """Deleted after the last write, before close() merges the parts: the error names the
    directory, not the parts as if they still held the rows."""
    run = tmp_path / "run"
    sink = CSV(run / "m.csv")
    log = syncless.Logger(every=1, sinks=[sink])
    log(a=1.0)
    log(b=2.0)
    log.flush()
    shutil.rmtree(run)
    log.close()
    (msg,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert f"CSV {run / 'm.csv'}: its directory {run} was deleted during the run, so its parts " \
           "cannot be merged; every row went with it" in msg
    assert "is still in" not in msg and "syncless-" not in msg
    assert log.stats.sink_errors == 1 and not run.exists()


# ---- copies -------------------------------------------------------------------------------------

def refused(fn):
    with pytest.raises(TypeError) as info:
        fn()
    text = str(info.value)
    assert text.startswith("syncless.Logger cannot be copied or pickled")
    assert "cannot pickle '_thread.lock'" not in text
    return text


class Net(torch.nn.Module):
    def __init__(self, log):
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)
        self.log = log


def test_copies_and_pickles_of_a_logger_are_refused_and_it_goes_on(tmp_path):
    """copy.copy used to share the queue but not the steps ([0, 1, 1, 0, 1, 1, 2]); deepcopy and
    pickle failed on a lock. Each is a TypeError naming the Logger and the fix, and the Logger
    keeps logging at the right steps afterwards."""
    got = Collect()
    with syncless.Logger(every=2, sinks=[got]) as log:
        log(a=0.0)
        attempts = [lambda: copy.copy(log), lambda: copy.deepcopy(log),
                    lambda: torch.save(Net(log), tmp_path / "net.pt")]
        attempts += [lambda p=p: pickle.dumps(log, protocol=p)
                     for p in range(pickle.HIGHEST_PROTOCOL + 1)]
        for fn in attempts:
            assert "Share the one Logger instead of copying it" in refused(fn)
            log(a=float(log.last_step + 1))
    assert got.rows == [(s, {"a": float(s)}) for s in range(len(attempts) + 1)]


def test_deepcopy_of_a_model_holding_a_logger_names_it_and_the_memo_fix_shares_it():
    """An EMA copy (AveragedModel deep-copies the model) names the attribute; the fix the error
    gives, copy.deepcopy(model, {id(log): log}), copies the weights and keeps the one Logger."""
    got = Collect()
    with syncless.Logger(every=1, sinks=[got]) as log:
        model = Net(log)
        text = refused(lambda: torch.optim.swa_utils.AveragedModel(model))
        assert "It is Net.log, being deep-copied." in text
        assert "copy.deepcopy(model, {id(log): log})" in text
        assert "It is the value of 'log' in" in refused(lambda: copy.deepcopy({"log": log}))
        ema = copy.deepcopy(model, {id(log): log})
        assert ema.log is log and ema.lin.weight is not model.lin.weight
        assert torch.equal(ema.lin.weight, model.lin.weight)
        ema.log(loss=1.0)
        model.log(loss=2.0)
    assert got.rows == [(0, {"loss": 1.0}), (1, {"loss": 2.0})]


LIGHTNING_SCRIPT = """
    import json, sys
    import torch
    import lightning as L
    import syncless

    IGNORE = sys.argv[1:]


    class Tiny(L.LightningModule):
        def __init__(self, lr=0.1, metrics=None):
            super().__init__()
            self.save_hyperparameters(ignore=IGNORE)
            self.metrics = metrics
            self.lin = torch.nn.Linear(2, 1)

        def training_step(self, batch, i):
            loss = self.lin(batch).pow(2).mean()
            self.metrics(loss=loss.detach(), step=self.global_step)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


    torch.manual_seed(0)
    log = syncless.Logger(every=2)
    try:
        model = Tiny(metrics=log)
    except TypeError as exc:
        log.close()
        print(json.dumps({"error": str(exc)}))
        sys.exit(0)
    trainer = L.Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(model, torch.utils.data.DataLoader(torch.randn(8, 2), batch_size=2))
    trainer.save_checkpoint("tiny.ckpt")
    log.close()
    ckpt = torch.load("tiny.ckpt", weights_only=False)
    print(json.dumps({"hparams": dict(model.hparams), "saved": dict(ckpt["hyper_parameters"]),
                      "steps": log.stats.steps, "delivered": log.stats.delivered}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("ignore", [[], ["metrics"]], ids=["plain", "ignored"])
def test_lightning_save_hyperparameters_with_a_logger_argument(tmp_path, ignore):
    """Real Lightning, CPU: save_hyperparameters() with a Logger passed to __init__ fails at
    construction (not at the first checkpoint, hours later) with the exact call to write;
    with that call, fit and checkpoint work and every step is logged."""
    out = run_script(tmp_path, LIGHTNING_SCRIPT.replace("sys.argv[1:]", repr(ignore)))
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    if not ignore:
        assert "Lightning's save_hyperparameters() copies every __init__ argument, and " \
               "'metrics' is a Logger: call self.save_hyperparameters(ignore=['metrics'])" in \
               got["error"]
    else:
        assert got == {"hparams": {"lr": 0.1}, "saved": {"lr": 0.1}, "steps": 4,
                       "delivered": 4}


def test_lightning_save_hyperparameters_names_the_argument_to_ignore():
    """The quick version of the above: construction only, in this process."""
    L = pytest.importorskip("lightning")

    class Tiny(L.LightningModule):
        def __init__(self, lr=0.1, metrics=None, ignore=()):
            super().__init__()
            self.save_hyperparameters(ignore=list(ignore))
            self.metrics = metrics

    with syncless.Logger() as log:
        assert "call self.save_hyperparameters(ignore=['metrics'])" in \
            refused(lambda: Tiny(metrics=log))
        model = Tiny(metrics=log, ignore=["metrics", "ignore"])
        assert dict(model.hparams) == {"lr": 0.1} and model.metrics is log


# ---- attach: the same rules as log() ------------------------------------------------------------

@pytest.mark.parametrize("delivery", ["thread", "caller"])
def test_attached_values_follow_the_rules_of_log(device, delivery, caplog):
    """A string "1.5" is refused as log() refuses it (used to be parsed), as is a complex or a
    vector; resolve() raising is reported once per name; each counts in stats.late_errors, and
    the rows and every good value arrive. A one-element tensor is read (on CUDA too)."""
    got = Collect()
    with syncless.Logger(every=2, sinks=[got], delivery=delivery) as log:
        for step in range(4):
            log(loss=value(step, device))
            log.attach("text", lambda: "1.5")
            log.attach("vector", lambda: torch.ones(2, device=device))
            log.attach("boom", lambda: 1 / 0)
            log.attach("good", lambda s=step: value(s * 10, device))
            log.attach("np", lambda s=step: torch.tensor(s, dtype=torch.int64).numpy()[()])
        log.flush()
        assert log.stats.late_errors == 12
    assert got.rows == [(s, {"loss": float(s), "good": 10.0 * s, "np": float(s)})
                        for s in range(4)]
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 3, errors                     # once per name
    assert any("late value 'text' for step 0 failed: TypeError: metric 'text' must be a real "
               "number or a one-element tensor, got str" in e for e in errors)
    assert any("late value 'vector' for step 0 failed: ValueError: metric 'vector' must hold "
               "one element, got shape (2,)" in e for e in errors)
    assert any("late value 'boom' for step 0 failed: ZeroDivisionError" in e for e in errors)


def test_attach_under_a_logged_name_is_refused_or_counted(device, caplog):
    """A name log() wrote is refused at attach(); one log() takes up only after the attach
    keeps log()'s value (never the sum) and the collision is reported and counted."""
    got = Collect()
    with syncless.Logger(every=2, sinks=[got]) as log:
        log(loss=value(1, device))
        with pytest.raises(ValueError, match=r"metric 'loss' is written by log\(\); an "
                                             r"attached value under the same name"):
            log.attach("loss", lambda: 100.0)
        log.attach("extra", lambda: 5.0, step=1)       # log() has not used 'extra' yet
        log.attach("extra", lambda: 2.0, step=1)       # two attached values still add up
        log(loss=value(2, device), extra=value(7, device))     # step 1: log() writes it too
        log(loss=value(3, device))
        log.attach("t", lambda: 0.25)
        log.attach("t", lambda: 0.5)
        log.flush()
        assert log.stats.late_errors == 2
    assert got.rows == [(0, {"loss": 1.0}), (1, {"loss": 2.0, "extra": 7.0}),
                        (2, {"loss": 3.0, "t": 0.75})]
    (msg,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert "late value 'extra' for step 1 was not added: log() wrote 'extra' at that step, and " \
           "its value is kept" in msg


def test_the_tensorboard_drop_in_refuses_deep_copies_like_the_logger(tmp_path):
    """syncless.tensorboard.SummaryWriter holds a Logger: a deepcopy or pickle (torch's writer
    fails on a lock there) says what it is and how to share it; a shallow copy, as torch's,
    shares the one writer and everything logged through either arrives once."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from syncless.tensorboard import SummaryWriter

    writer = SummaryWriter(tmp_path, every=2)
    model = Net(None)
    model.writer = writer
    for step in range(3):
        writer.add_scalar("loss", torch.tensor(float(step)), step)
        for fn in (lambda: copy.deepcopy(model), lambda: pickle.dumps(writer)):
            with pytest.raises(TypeError, match=r"syncless.tensorboard: this object cannot be "
                                                r"deep-copied or pickled .* copy.deepcopy\(model, "
                                                r"\{id\(writer\): writer\}\)"):
                fn()
    ema = copy.deepcopy(model, {id(writer): writer})
    ema.writer.add_scalar("loss", torch.tensor(3.0), 3)
    copy.copy(writer).add_scalar("loss", torch.tensor(4.0), 4)
    writer.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(s, float(s)) for s in range(5)]


def test_a_file_deleted_after_the_last_window_is_reported_at_close(tmp_path, caplog):
    got = Collect()
    sink = JSONL(tmp_path / "m.jsonl")
    with syncless.Logger(every=1, sinks=[sink, got]) as log:
        log(loss=1.0)
        log.flush()
        os.unlink(tmp_path / "m.jsonl")
    (msg,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert f"JSONL {tmp_path / 'm.jsonl'}: {tmp_path / 'm.jsonl'} was deleted during the run, " \
           "and every row written to it went with it" in msg
    assert got.rows == [(0, {"loss": 1.0})] and log.stats.sink_errors == 1


def test_the_csv_deleted_while_its_parts_live_names_where_the_rest_is(tmp_path, caplog):
    """Only m.csv deleted (the directory stays) while later rows go to a part: close() cannot
    merge; the error says which rows went and where the others still are, and keeps them."""
    sink = CSV(tmp_path / "m.csv")
    with syncless.Logger(every=1, sinks=[sink]) as log:
        log(a=1.0)
        log(b=2.0)
        log.flush()
        os.unlink(tmp_path / "m.csv")
        log(b=3.0)
    part = sink.files[1]
    (msg,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert f"CSV {tmp_path / 'm.csv'}: {tmp_path / 'm.csv'} was deleted during the run, so its " \
           f"parts cannot be merged; the rows written to {tmp_path / 'm.csv'} went with it; the " \
           f"others are in {part} (each a complete CSV)" in msg
    assert table(part) == (["step", "time", "a", "b"], [(1, {"b": 2.0}), (2, {"b": 3.0})])


@pytest.mark.parametrize("when", ["before_the_rename", "after_the_rename"])
def test_a_csv_close_interrupted_in_its_merge_is_finished_by_the_next(tmp_path, monkeypatch,
                                                                      when):
    """A Ctrl-C that lands in CSV.close()'s merge of its parts (a second Ctrl-C during a
    Logger's close()): the close() called again merges what is left, every row once."""
    from syncless import sinks as sinks_module
    from syncless.logger import Row
    path = tmp_path / "m.csv"
    sink = CSV(path)
    for step in range(8):                 # a new column every 2 steps: parts
        sink.write([Row(step, 1.0, {"loss": step / 2, f"m{step // 2}": float(step)})])
    real, calls = os.replace, []

    def replace(src, dst):
        calls.append(dst)
        if len(calls) == 1 and when == "before_the_rename":
            raise KeyboardInterrupt
        real(src, dst)
        if len(calls) == 1:
            raise KeyboardInterrupt

    monkeypatch.setattr(sinks_module.os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        sink.close()
    sink.close()
    header, rows = table(path)
    assert header == ["step", "time", "loss"] + [f"m{k}" for k in range(4)]
    assert rows == [(s, {"loss": s / 2, f"m{s // 2}": float(s)}) for s in range(8)]
    assert sorted(os.listdir(tmp_path)) == ["m.csv"]          # parts and their folder gone
