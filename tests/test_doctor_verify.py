"""--verify: settings applied from outside the script, measured in fresh paired runs."""
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from syncless.doctor import _verify, cli
from syncless.doctor.findings import Finding, Fix


def test_worker_sweep_counts():
    assert _verify.worker_candidates(0, None, 2) == [0, 1, 2]
    assert _verify.worker_candidates(2, 12, 16) == [1, 2, 4, 8, 12, 16]
    # Where side loaders measured the count: no sweep (the pairs time the current count and
    # that one); without a measured count, the sweep.
    measured = Finding("starvation", "DataLoader starvation", 50.0, "",
                       extra={"workers_needed": 10, "sweep": {"period_ms": {1: 40.0, 8: 9.0}}})
    assert _verify.finding_candidates(measured, 4, 16) == []
    measured.extra["workers_needed"] = 4                    # the current count: sweep
    assert _verify.finding_candidates(measured, 4, 16) == [1, 2, 4, 8, 16]
    modelled = Finding("starvation", "DataLoader starvation", 50.0, "",
                       extra={"workers_needed": 3})
    assert _verify.finding_candidates(modelled, 0, 2) == [0, 1, 2, 3]


MEASURED = """
    import json, torch
    from torch.utils.data import DataLoader, TensorDataset
    loader = DataLoader(TensorDataset(torch.randn(64, 4)), batch_size=4, num_workers=0)
    with open("settings.json", "w") as f:
        json.dump({"num_workers": loader.num_workers,
                   "persistent_workers": loader.persistent_workers}, f)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(100):
        for (x,) in loader:
            opt.zero_grad(); model(x).sum().backward(); opt.step()
"""


def test_measure_applies_loader_settings_from_outside_and_times_plain_steps(tmp_path,
                                                                              monkeypatch):
    from torch.utils.data import DataLoader
    init = DataLoader.__init__
    (tmp_path / "train.py").write_text(textwrap.dedent(MEASURED))
    monkeypatch.chdir(tmp_path)
    apply = {"loader": {"num_workers": 1, "persistent_workers": True}}
    assert cli.main(["--measure", "m.json", "--apply", json.dumps(apply), "--warmup", "2",
                     "--plain-steps", "12", "train.py"]) == 0
    assert json.loads((tmp_path / "settings.json").read_text()) == \
        {"num_workers": 1, "persistent_workers": True}
    m = json.loads((tmp_path / "m.json").read_text())
    assert m["steps"] >= 12 and m["plain_step_ms"] > 0     # more when a stall came once
    assert m["warmup_steps"] >= 2
    assert DataLoader.__init__ is init, "undone after the run"


WORKERS_WRITE_PIDS = """
    import os, torch
    from torch.utils.data import DataLoader, Dataset
    class Pids(Dataset):
        def __len__(self): return 64
        def __getitem__(self, i): return torch.ones(4)
    def note(_):
        with open("pids.txt", "a") as f:          # the run's working directory: its scratch copy
            f.write(f"{os.getpid()}\\n")
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(Pids(), batch_size=4, num_workers=2, persistent_workers=True,
                        worker_init_fn=note)
    for epoch in range(1000):
        for x in loader:
            opt.zero_grad(); model(x).sum().backward(); opt.step()
        with open("/PIDS_OUT", "w") as f:
            f.write(open("pids.txt").read())
"""


@pytest.mark.parametrize("fork", ["1", "0"])
def test_a_verifying_run_ends_when_measured_and_leaves_no_worker(tmp_path, monkeypatch, fork):
    """A verifying run exits once its step is written (the script's teardown, its loader
    workers joined and its CUDA context, measures nothing) and its workers go with it, as a
    fork of the server and as a fresh interpreter."""
    monkeypatch.setenv("SYNCLESS_DOCTOR_FORKSERVER", fork)
    out = tmp_path / "pids_out.txt"
    (tmp_path / "train.py").write_text(
        textwrap.dedent(WORKERS_WRITE_PIDS).replace("/PIDS_OUT", str(out)))
    v = _verify.Verifier(str(tmp_path / "train.py"), [], 2, 20, cwd=str(tmp_path))
    try:
        ms = v.measure({})
    finally:
        v.close()
    assert ms is not None and ms > 0
    [run] = v.log
    assert run["ended"] and run["ms"] == ms and run["fork"] == (fork == "1"), run
    pids = [int(p) for p in out.read_text().split()]
    assert len(pids) == 2, pids                 # the workers were up when the window was timed
    import time
    deadline = time.monotonic() + 5             # SIGKILLed: gone as soon as they are reaped
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [p for p in pids if _running(p)]
        time.sleep(0.05)
    assert not alive, f"loader workers outlived their run: {alive}"


def test_the_server_imports_the_scripts_frameworks_once_and_never_a_thread(tmp_path,
                                                                            monkeypatch):
    """Each verifying run imported its frameworks again (lightning 3.2 s, transformers 1.9 s on
    this 2-core host): the server imports those the script imported, once. One that fails to
    import is left to the run; one that starts a thread (a fork keeps only the forking thread)
    makes the server start again without any."""
    from syncless.doctor._forkserver import PRELOAD, Runner
    monkeypatch.setenv("SYNCLESS_DOCTOR_FORKSERVER", "1")
    (tmp_path / "thready.py").write_text(
        "import threading, time\n"
        "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n")
    (tmp_path / "train.py").write_text(
        "import sys\nopen('seen.txt', 'w').write(' '.join(m for m in "
        "('wave', 'thready', 'no_such_module_here') if m in sys.modules))\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        filter(None, (str(tmp_path), os.environ.get("PYTHONPATH")))))
    argv = ["--measure", str(tmp_path / "m.json"), "--exit-when-measured", "train.py"]
    for preload, seen in ((("wave", "no_such_module_here"), "wave"), (("wave", "thready"), "")):
        r = Runner(_verify.run_env(), preload)
        try:
            assert r.run(argv, str(tmp_path), 120) == 0
            assert r.forks, "a fork of the server, with or without the preloads"
            assert (tmp_path / "seen.txt").read_text() == seen
            assert r.preload == (preload if seen else ()), r.preload
        finally:
            r.close()
    assert {"transformers", "lightning"} <= set(PRELOAD)
    # The doctor's Verifier asks for the modules of those the script (here: this process)
    # imported, in their order; past a limit, only the packages themselves.
    pytest.importorskip("lightning.fabric.utilities")
    v = _verify.Verifier(str(tmp_path / "train.py"), [], 1, 5, cwd=str(tmp_path))
    v.close()
    mods = [m for m in sys.modules if m.partition(".")[0] in PRELOAD]
    assert v.runner.preload == tuple(mods) and "lightning.fabric.utilities" in mods
    assert "lightning" in _verify.preloads(limit=10)
    assert not [m for m in _verify.preloads(limit=10) if "." in m]


def _running(pid: int) -> bool:
    """The process exists and is no zombie (killed, not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return not f.read().rsplit(") ", 1)[1].startswith("Z")
    except OSError:
        return False


CPU_BOUND_LOADER = """
    import torch
    from torch.utils.data import DataLoader, Dataset
    class Computed(Dataset):                    # batches made by torch ops: CPU work
        def __len__(self): return 100000
        def __getitem__(self, i):
            x = torch.randn(64, 64)
            for _ in range(20):
                x = torch.tanh(x @ x.T / 64)
            return x[0]
    if __name__ == "__main__":
        model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(),
                                    torch.nn.Linear(512, 64))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for x in DataLoader(Computed(), batch_size=8):
            opt.zero_grad(); model(x).square().mean().backward(); opt.step()
"""


@pytest.mark.slow
@pytest.mark.timing
def test_verify_keeps_a_worker_only_when_it_wins_on_this_machine(tmp_path):
    # A CPU loop whose batches are computed by torch: torch's threads take this machine's CPUs
    # for the share of the step they are busy, so the doctor prescribes no worker without
    # measuring one, and --verify keeps one only when its paired runs' 95% interval says the
    # loop got faster.
    (tmp_path / "train.py").write_text(textwrap.dedent(CPU_BOUND_LOADER))
    r = subprocess.run([sys.executable, "-m", "syncless", "doctor", "--quick", "--verify",
                        "--json", "d.json", "train.py"], capture_output=True, text=True,
                       timeout=1200, cwd=tmp_path, env=dict(os.environ))
    assert r.returncode == 0, r.stderr
    d = json.loads((tmp_path / "d.json").read_text())
    [f] = [f for f in d["findings"] if f["kind"] == "starvation"]
    import torch
    first = f["fixes"][0]
    if torch.get_num_threads() >= len(os.sched_getaffinity(0)):
        # Either no CPU is left by torch's threads, or what the side loaders measured decides
        # (a CPU is left where they are busy for part of the step only): never a count that
        # the machine's CPUs alone suggest.
        assert first["text"].startswith("no CPU is free for a worker") or \
            "measured: side loaders" in first["text"], f["fixes"]
    v = f["verified"]
    assert v is not None and d["verify_runs"] >= 3, d["verify"]
    if f.get("workers_needed") and "measured: side loaders" in first["text"]:
        # The count the side loaders measured, paired against the current one: no sweep.
        assert v["sweep"] == {} and len(v["runs"]["with"]) >= 3, v
    else:
        assert set(v["sweep"]) >= {"0", "1"}, v["sweep"]
    if "verdict" in v:
        assert v["kept"] == (v["verdict"] == "win")
    line = d["verify"][0]
    if v["kept"]:
        assert line.endswith(": kept") or ": kept;" in line, line
    else:
        assert "not kept" in line or "no loader fix kept" in line, line


# ---- the fix in the framework's words: TrainingArguments, Lightning's DataLoader -----------------

def test_loader_fix_in_each_frameworks_words():
    extra = {"persistent_workers": True, "pin_memory": True}
    assert _verify.loader_fix(4, extra, "transformers") == (
        "TrainingArguments(dataloader_num_workers=4, dataloader_persistent_workers=True, "
        "dataloader_pin_memory=True, accelerator_config={'non_blocking': True})",
        {"hf": {"dataloader_num_workers": 4, "dataloader_persistent_workers": True,
                "dataloader_pin_memory": True, "accelerator_config": {"non_blocking": True}}})
    assert _verify.loader_fix(0, {"persistent_workers": True}, "transformers") == (
        "TrainingArguments(dataloader_num_workers=0)", {"hf": {"dataloader_num_workers": 0}})
    # Lightning runs the user's own DataLoader: its arguments are the fix there, as anywhere.
    assert _verify.loader_fix(3, {"persistent_workers": True}, "lightning") == (
        "num_workers=3, persistent_workers=True",
        {"loader": {"num_workers": 3, "persistent_workers": True}})
    assert _verify.loader_fix(0, {"persistent_workers": True}) == (
        "num_workers=0", {"loader": {"num_workers": 0}})


def test_training_arguments_take_the_settings_from_outside_and_are_restored(tmp_path):
    from transformers import TrainingArguments
    from transformers.trainer_pt_utils import AcceleratorConfig
    post_init = TrainingArguments.__post_init__
    undo = _verify.apply({"hf": {"dataloader_num_workers": 3,
                                 "dataloader_persistent_workers": True,
                                 "accelerator_config": {"non_blocking": True}}})
    try:
        args = TrainingArguments(output_dir=str(tmp_path), report_to="none",
                                 dataloader_num_workers=0, dataloader_pin_memory=False)
        given = TrainingArguments(output_dir=str(tmp_path), report_to="none",
                                  accelerator_config=AcceleratorConfig(split_batches=True))
    finally:
        undo()
    assert (args.dataloader_num_workers, args.dataloader_persistent_workers) == (3, True)
    assert args.dataloader_pin_memory is False, "a setting the fix does not name stays the user's"
    assert args.accelerator_config.non_blocking is True
    assert given.accelerator_config.non_blocking is True
    assert given.accelerator_config.split_batches is True, "the user's own config is kept"
    assert TrainingArguments.__post_init__ is post_init, "undone after the run"
    plain = TrainingArguments(output_dir=str(tmp_path), report_to="none")
    assert plain.dataloader_num_workers == 0


HF_SLOW_DATA = """
    import time
    import torch
    from torch.utils.data import Dataset
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

    class SlowData(Dataset):               # each example takes 10 ms to make (a disk read, say)
        def __len__(self):
            return 100000

        def __getitem__(self, i):
            time.sleep(0.01)
            return {"input_ids": torch.tensor([(i + k) % 97 + 1 for k in range(8)]),
                    "labels": torch.tensor(i % 2)}

    if __name__ == "__main__":
        torch.manual_seed(0)
        torch.set_num_threads(1)           # see verified_loader_fix
        config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1,
                            num_attention_heads=2, intermediate_size=64,
                            max_position_embeddings=16)
        args = TrainingArguments(output_dir="out", per_device_train_batch_size=4, max_steps=400,
                                 logging_steps=1000, save_strategy="no", report_to="none",
                                 disable_tqdm=True)
        Trainer(model=BertForSequenceClassification(config), args=args,
                train_dataset=SlowData()).train()
"""

LIGHTNING_SLOW_DATA = """
    import time
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, Dataset

    class SlowData(Dataset):               # each example takes 10 ms to make (a disk read, say)
        def __len__(self):
            return 100000

        def __getitem__(self, i):
            time.sleep(0.01)
            return torch.full((16,), float(i % 7)), torch.tensor(float(i % 2))

    class Model(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(),
                                           torch.nn.Linear(64, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x).squeeze(-1), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def train_dataloader(self):
            return DataLoader(SlowData(), batch_size=4)

    if __name__ == "__main__":
        torch.manual_seed(0)
        torch.set_num_threads(1)           # see verified_loader_fix
        trainer = L.Trainer(max_steps=400, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False,
                            accelerator="cpu", devices=1)
        trainer.fit(Model())
"""


def verified_loader_fix(tmp_path, script):
    """`doctor --quick --verify` on a script whose batches take 40 ms to make (4 examples of a
    10-ms sleep each, no workers) for a step of a few ms: data-bound by construction, and any
    worker count that the sweep tries beats none by several times. The scripts run torch on one
    thread: two intra-op threads on a loaded 2-core host made the HF step swing between 50 and
    700 ms, with or without the doctor."""
    (tmp_path / "train.py").write_text(textwrap.dedent(script))
    r = subprocess.run([sys.executable, "-m", "syncless", "doctor", "--quick", "--verify",
                        "--json", "d.json", "train.py"], capture_output=True, text=True,
                       timeout=1500, cwd=tmp_path, env=dict(os.environ))
    assert r.returncode == 0, r.stderr
    d = json.loads((tmp_path / "d.json").read_text())
    assert d["verdict"] == "data-bound", r.stdout
    [f] = [f for f in d["findings"] if f["kind"] == "starvation"]
    v = f["verified"]
    assert v is not None and v["kept"] is True, d["verify"]
    assert v["ratio_high"] < 1 and v["measured_ms"] < 0.6 * v["baseline_ms"], v
    return d, f, r.stdout


@pytest.mark.slow
@pytest.mark.timing
def test_verify_measures_the_training_arguments_fix_of_an_hf_trainer(tmp_path):
    d, f, out = verified_loader_fix(tmp_path, HF_SLOW_DATA)
    assert d["framework"] == "transformers"
    assert f["fixes"][0]["text"].startswith("TrainingArguments(dataloader_num_workers="), f
    [line] = [x for x in d["verify"] if x.startswith("TrainingArguments(")]
    assert "dataloader_num_workers=" in line and line.split(";")[0].endswith(": kept"), line


@pytest.mark.slow
@pytest.mark.timing
def test_verify_measures_the_dataloader_fix_of_a_lightning_trainer(tmp_path):
    d, f, out = verified_loader_fix(tmp_path, LIGHTNING_SLOW_DATA)
    assert d["framework"] == "lightning"
    assert f["fixes"][0]["text"].startswith("DataLoader(..., num_workers="), f
    assert "in your train_dataloader()" in f["fixes"][0]["text"], f
    [line] = [x for x in d["verify"] if x.startswith("num_workers=")]
    assert line.split(";")[0].endswith(": kept"), line


# ---- syncless's drop-ins: SynclessTrainer for Trainer, SynclessLogging() in Lightning's ---------

DROPIN_SCRIPT = """
    import json
    import lightning.pytorch as pl
    import pytorch_lightning
    import torch
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments
    from syncless.lightning import SynclessLogging

    config = BertConfig(vocab_size=50, hidden_size=8, num_hidden_layers=1, num_attention_heads=1,
                        intermediate_size=8, max_position_embeddings=8)
    args = TrainingArguments(output_dir="out", report_to="none", use_cpu=True)
    trainer = Trainer(model=BertForSequenceClassification(config), args=args)
    quiet = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False,
                 enable_model_summary=False, accelerator="cpu", devices=1)
    mine = pl.Callback()
    fit = pl.Trainer(callbacks=[mine], **quiet)
    own = pl.Trainer(callbacks=[SynclessLogging()], **quiet)
    legacy = pytorch_lightning.Trainer(**quiet)
    names = lambda t: [type(c).__name__ for c in t.callbacks if "Syncless" in type(c).__name__]
    with open("seen.json", "w") as f:
        json.dump({"trainer": [c.__name__ for c in type(trainer).__mro__[:2]],
                   "fit": names(fit), "mine_kept": mine in fit.callbacks, "own": names(own),
                   "legacy": names(legacy)}, f)
"""

DROPIN_RUN = """
import json, runpy, sys
import lightning.pytorch as pl, pytorch_lightning, transformers, transformers.trainer
from syncless.doctor import _verify
before = (transformers.Trainer, transformers.trainer.Trainer, pl.Trainer.__init__,
          pytorch_lightning.Trainer.__init__)
undo = _verify.apply(json.loads(sys.argv[1]))
try:
    runpy.run_path("train.py", run_name="__main__")
finally:
    undo()
after = (transformers.Trainer, transformers.trainer.Trainer, pl.Trainer.__init__,
         pytorch_lightning.Trainer.__init__)
print("restored" if after == before else f"not restored: {before} -> {after}")
"""


@pytest.mark.slow
def test_apply_makes_the_scripts_trainers_syncless_and_restores_them(tmp_path):
    (tmp_path / "train.py").write_text(textwrap.dedent(DROPIN_SCRIPT))
    r = subprocess.run([sys.executable, "-c", DROPIN_RUN,
                        json.dumps({"dropin": ["transformers", "lightning"]})],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       env=dict(os.environ))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("restored"), r.stdout
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen["trainer"] == ["SynclessTrainer", "SynclessTrainerMixin"]
    assert seen["fit"] == ["SynclessLogging"] and seen["mine_kept"] is True
    assert seen["own"] == ["SynclessLogging"], "a Trainer that has one gets no second"
    assert seen["legacy"] == ["SynclessLogging"], "pytorch_lightning's Trainer too"
    # Without the setting the same script runs the frameworks' own classes.
    r = subprocess.run([sys.executable, "-c", DROPIN_RUN, "{}"], capture_output=True,
                       text=True, timeout=300, cwd=tmp_path, env=dict(os.environ))
    assert r.returncode == 0, r.stderr
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen["trainer"][0] == "Trainer"
    assert (seen["fit"], seen["legacy"]) == ([], [])


def test_apply_names_the_drop_ins_it_knows():
    with pytest.raises(ValueError, match="no syncless drop-in for 'keras'"):
        _verify.apply({"dropin": ["keras"]})


def test_apply_swaps_the_trainer_classes_in_process_and_puts_them_back():
    # The quick twin of the test above: the classes a script would import, without running one.
    import lightning.pytorch as pl
    import transformers
    import transformers.trainer
    from syncless import hf, lightning
    trainer, init = transformers.Trainer, pl.Trainer.__init__
    undo = _verify.apply({"dropin": ["transformers", "lightning"]})
    try:
        from transformers import Trainer
        assert Trainer is hf.SynclessTrainer and transformers.trainer.Trainer is Trainer
        mine = pl.Callback()
        fit = pl.Trainer(callbacks=mine, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         accelerator="cpu", devices=1)
        added = [c for c in fit.callbacks if isinstance(c, lightning.SynclessLogging)]
        assert len(added) == 1 and mine in fit.callbacks
    finally:
        undo()
    assert (transformers.Trainer, transformers.trainer.Trainer) == (trainer, trainer)
    assert pl.Trainer.__init__ is init


def test_apply_sets_lightning_trainer_arguments_in_process_and_puts_them_back():
    import lightning.pytorch as pl
    init = pl.Trainer.__init__
    kwargs = dict(logger=False, enable_checkpointing=False, enable_model_summary=False,
                  accelerator="cpu", devices=1)
    assert pl.Trainer(**kwargs).progress_bar_callback is not None, "Lightning's default"
    undo = _verify.apply({"lightning": {"enable_progress_bar": False},
                          "dropin": "lightning"})
    try:
        fit = pl.Trainer(enable_progress_bar=True, **kwargs)   # the script's own value loses
        assert fit.progress_bar_callback is None
        assert [type(c).__name__ for c in fit.callbacks].count("SynclessLogging") == 1
    finally:
        undo()
    assert pl.Trainer.__init__ is init
    assert pl.Trainer(**kwargs).progress_bar_callback is not None


def test_a_framework_finding_verifies_its_setting_and_its_drop_in():
    from syncless.doctor._frameworks import applied_label
    from syncless.doctor.diagnose import Diagnosis
    from syncless.doctor.findings import Finding
    both = Finding("framework", "lightning syncs 2×/step (prog_bar)", 1.0, "", [], "",
                   {"apply": {"lightning": {"enable_progress_bar": False}},
                    "dropin": "lightning"})
    dropin_only = Finding("framework", "lightning syncs 1×/step (logged step values)", 1.0, "",
                          [], "", {"apply": None, "dropin": "lightning"})
    neither = Finding("framework", "torchmetrics syncs 1×/step (nan_strategy)", 1.0, "", [], "",
                      {"apply": None, "dropin": ""})
    d = Diagnosis.__new__(Diagnosis)
    d.findings, d.gpu, d.framework = [both, dropin_only, neither], True, "lightning"
    d.verdict_kind, d.speedups = "CPU-bound", []
    label = "Trainer(callbacks=[syncless.lightning.SynclessLogging()])"
    assert applied_label(both.extra["apply"]) == "Trainer(enable_progress_bar=False)"
    assert _verify.setting_fixes(d) == [
        (both, "Trainer(enable_progress_bar=False)", {"lightning": {"enable_progress_bar": False}},
         "verified"),
        (both, label, {"dropin": "lightning"}, "dropin_verified"),
        (dropin_only, label, {"dropin": "lightning"}, "verified")]

    class Canned:                     # paired results as runs would give them: the setting wins
        runs, seconds = 0, 0.0

        def paired(self, settings):
            wins = "lightning" in settings
            return {"measured_ms": 8.0 if wins else 10.1, "ci_low_ms": 7.0 if wins else 9.0,
                    "ci_high_ms": 9.0 if wins else 11.0, "baseline_ms": 10.0, "kept": wins,
                    "runs": {}}
    lines = _verify.verify(d, Canned(), {}, cpus=2)
    assert both.verified["kept"] and not both.extra["dropin_verified"]["kept"]
    assert dropin_only.verified is both.extra["dropin_verified"], "one setting, measured once"
    assert lines[0].startswith("Trainer(enable_progress_bar=False): 10.00 -> 8.00 ms/step")
    assert lines[0].endswith(": kept")
    assert lines[-1].startswith("torchmetrics syncs 1×/step (nan_strategy): a change in the code")
    assert neither.verified is None


def _frame_at(module, function, needle):
    """A Frame at the first line of `function` in the installed `module` that holds `needle`."""
    import inspect
    from syncless.doctor._frames import Frame
    src = inspect.getsource(module).splitlines()
    start = next(i for i, l in enumerate(src) if f"def {function}(" in l)
    line = next(i for i, l in enumerate(src[start:], start + 1) if needle in l)
    return Frame(module.__file__, line, function)


def test_trainer_internal_syncs_name_synclesstrainer_beside_training_arguments():
    from syncless.doctor._frameworks import framework_fix
    trainer = pytest.importorskip("transformers.trainer")
    ops = pytest.importorskip("accelerate.utils.operations")
    run = _frame_at(trainer, "_run_epoch", "torch.isnan(tr_loss_step)")
    logging_step = _frame_at(trainer, "_maybe_log_save_evaluate", "parallel_mode).mean().item()")
    tokens = _frame_at(trainer, "_track_num_input_tokens", ".sum().item()")
    copy = _frame_at(ops, "send_to_device", "non_blocking=non_blocking)")
    said = "syncless.hf.SynclessTrainer(...) in place of Trainer(...): "
    cases = [((run,), "logging_nan_inf_filter", "TrainingArguments(logging_nan_inf_filter=False)",
              "runs the same filter on the device"),
             ((logging_step, run), "logging step", "TrainingArguments(logging_steps=",
              "keeps the logging step's loss and grad norm on the device"),
             ((tokens, run), "include_num_input_tokens_seen",
              "TrainingArguments(include_num_input_tokens_seen='no')",
              "counts the tokens without a host read"),
             ((copy, run), "blocking batch copy", "the batch is copied to the GPU",
              "makes the Trainer's batch copies non-blocking when its loader pins memory")]
    for chain, setting, fix, dropin in cases:
        fw = framework_fix(chain)
        assert fw is not None and fw.setting == setting, (setting, fw)
        assert fw.fix.startswith(fix), fw.fix
        assert fw.dropin == "transformers" and fw.dropin_fix.startswith(said + dropin), fw
    assert "TrainingArguments(accelerator_config={'non_blocking': True})" in \
        framework_fix((copy, run)).fix
    # The same copy made by accelerate in a loop of the user's own: no Trainer to swap.
    alone = framework_fix((copy,))
    assert (alone.setting, alone.dropin, alone.dropin_fix) == ("blocking batch copy", "", "")
    # The evaluation loop's NaN check: SynclessTrainer leaves evaluation as it is.
    evaluation = _frame_at(trainer, "evaluation_loop", "logging_nan_inf_filter and finite")
    fw = framework_fix((evaluation,))
    assert fw.setting == "logging_nan_inf_filter" and fw.dropin == ""
    # What --verify applies from outside: each setting that has one value; the logging interval
    # is the user's to choose, and accelerate alone has no Trainer to take the setting.
    applied = {setting: framework_fix(chain).apply for chain, setting, _, _ in cases}
    assert applied == {
        "logging_nan_inf_filter": {"hf": {"logging_nan_inf_filter": False}},
        "logging step": None,
        "include_num_input_tokens_seen": {"hf": {"include_num_input_tokens_seen": "no"}},
        "blocking batch copy": {"hf": {"dataloader_pin_memory": True,
                                       "accelerator_config": {"non_blocking": True}}}}
    assert fw.apply == {"hf": {"logging_nan_inf_filter": False}} and alone.apply is None


def test_lightning_logging_syncs_name_synclesslogging():
    from syncless.doctor._frameworks import framework_fix
    result = pytest.importorskip("lightning.pytorch.trainer.connectors.logger_connector.result")
    from lightning.pytorch.core import module
    from lightning.pytorch.trainer.connectors.logger_connector import logger_connector
    pbar = _frame_at(result, "metrics", 'metrics["pbar"]')
    to_loggers = _frame_at(logger_connector, "log_metrics", "convert_tensors_to_scalars")
    step = _frame_at(logger_connector, "update_train_step_metrics", "self.log_metrics(")
    epoch = _frame_at(logger_connector, "update_train_epoch_metrics", "self.log_metrics(")
    number = _frame_at(module, "__to_tensor", "torch.tensor(value")
    said = "Trainer(callbacks=[syncless.lightning.SynclessLogging()]): "
    for chain, setting in (((pbar,), "prog_bar"), ((to_loggers, step), "logged step values"),
                           ((number,), "self.log(float)")):
        fw = framework_fix(chain)
        assert fw is not None and fw.setting == setting, (setting, fw)
        assert fw.dropin == "lightning" and fw.dropin_fix.startswith(said), fw
    assert "log_every_n_steps" in framework_fix((to_loggers, step)).fix
    assert framework_fix((pbar,)).apply == {"lightning": {"enable_progress_bar": False}}
    assert framework_fix((to_loggers, step)).apply is None, "the interval is the user's to choose"
    # Epoch values: Lightning reads each once an epoch, with or without the callback.
    assert framework_fix((to_loggers, epoch)) is None


HF_TINY = """
    import torch
    from torch.utils.data import Dataset
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

    class Tokens(Dataset):
        def __len__(self):
            return 100000

        def __getitem__(self, i):
            return {"input_ids": torch.tensor([(i + k) % 47 + 1 for k in range(8)]),
                    "labels": torch.tensor(i % 2)}

    if __name__ == "__main__":
        torch.manual_seed(0)
        torch.set_num_threads(1)
        config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,
                            num_attention_heads=2, intermediate_size=32,
                            max_position_embeddings=8)
        args = TrainingArguments(output_dir="out", per_device_train_batch_size=4, max_steps=200,
                                 logging_steps=10, save_strategy="no", report_to="none",
                                 disable_tqdm=True, use_cpu=True)
        trainer = Trainer(model=BertForSequenceClassification(config), args=args,
                          train_dataset=Tokens())
        with open("classes.txt", "a") as f:
            print(f"{type(trainer).__name__}:{trainer.args.logging_nan_inf_filter}", file=f)
        trainer.train()
"""


@pytest.mark.slow
def test_verify_measures_the_trainers_setting_and_the_drop_in_in_paired_runs(tmp_path):
    # A finding for the Trainer's NaN/Inf filter, as the CUPTI audit makes it on a GPU (the line
    # is the installed Trainer's own), verified on CPU in real runs of a tiny HF Trainer script:
    # its TrainingArguments setting and the drop-in, each applied in exactly its "with" runs and
    # kept only if its interval wins (on a CPU there is no sync to remove, so whether either wins
    # is this host's noise).
    import inspect
    trainer = pytest.importorskip("transformers.trainer")
    from syncless.doctor._frames import Frame, caller_site
    from syncless.doctor.audit import SYNC, Audit
    from syncless.doctor.diagnose import Measured, assess
    from syncless.doctor.monitor import MonitorSummary
    src = inspect.getsource(trainer).splitlines()
    nan_line = next(i for i, l in enumerate(src, 1) if "torch.isnan(tr_loss_step)" in l)
    frame = Frame(trainer.__file__, nan_line, "_run_epoch")
    site = caller_site(0)._replace(code="trainer.train()", via=frame.where, chain=(frame,))
    audit = Audit(steps=4)
    audit.backend, audit.elapsed_s = "cupti", 0.01
    for _ in range(4):
        audit._add(audit.sites, site, "cudaStreamSynchronize", SYNC, 2_000_000, True)
    d = assess(Measured(MonitorSummary(20, 0.0, 12.0, 12.0, None, 0, None, 0.0, {}), audit, 2,
                        12.0, True, 11.0, 9.0, 3))
    [f] = [f for f in d.findings if f.kind == "framework"]
    assert _verify.setting_fixes(d) == [
        (f, "TrainingArguments(logging_nan_inf_filter=False)",
         {"hf": {"logging_nan_inf_filter": False}}, "verified"),
        (f, "syncless.hf.SynclessTrainer(...) in place of Trainer(...)",
         {"dropin": "transformers"}, "dropin_verified")]
    (tmp_path / "train.py").write_text(textwrap.dedent(HF_TINY))
    v = _verify.Verifier(str(tmp_path / "train.py"), [], warmup=5, steps=20, pairs=2,
                         timeout_s=300, cwd=str(tmp_path))
    lines = _verify.verify(d, v, {}, cpus=2)
    print("\n".join(lines))
    runs = (tmp_path / "classes.txt").read_text().split()
    # A B, B A, ... for the setting, then for the drop-in (2 pairs, more while unclear); the
    # baseline is the script as written.
    def interleaved(a, b, pairs):
        return [x for i in range(pairs) for x in ((a, b) if i % 2 == 0 else (b, a))]
    n1, n2 = len(f.verified["runs"]["with"]), len(f.extra["dropin_verified"]["runs"]["with"])
    assert v.runs == 2 * (n1 + n2) and 2 <= n1 <= 8 and 2 <= n2 <= 8
    assert runs == interleaved("Trainer:True", "Trainer:False", n1) + \
        interleaved("Trainer:True", "SynclessTrainer:True", n2), runs
    for r, line, label in ((f.verified, lines[0], "TrainingArguments(logging_nan_inf_filter="
                            "False)"),
                           (f.extra["dropin_verified"], lines[1],
                            "syncless.hf.SynclessTrainer(...) in place of Trainer(...)")):
        assert r is not None and len(r["runs"]["with"]) == len(r["runs"]["without"]) >= 2
        assert r["kept"] == (r["verdict"] == "win")
        assert line.startswith(f"{label}: {r['baseline_ms']:.2f} -> {r['measured_ms']:.2f} "
                               f"ms/step, {r['win']} over {r['pairs']} pairs"), line
        assert line.endswith(": kept" if r["kept"] else ": not kept (" + _verify._NOT_KEPT[
            r["verdict"]] + ")"), line
    assert json.loads(json.dumps(f.as_dict()))["dropin_verified"]["runs"] == \
        f.extra["dropin_verified"]["runs"], "in the --json file"


class _TimedRunner:
    """Measured runs that take `seconds` each and read `ms` (the baseline) or `fixed_ms` (a
    fix applied): the Verifier's timing without the script."""
    forks = False

    def __init__(self, seconds, ms=10.0, fixed_ms=(5.0,), fixed_seconds=None):
        self.seconds, self.ms, self.fixed_ms = seconds, ms, list(fixed_ms)
        self.fixed_seconds = seconds if fixed_seconds is None else fixed_seconds
        self.timeouts = []

    def start(self):
        pass

    def close(self):
        pass

    def fresh(self):
        pass

    def run(self, argv, cwd, timeout_s):
        import time
        self.timeouts.append(timeout_s)
        if self.seconds > timeout_s:
            time.sleep(timeout_s)
            return None                               # stopped at its timeout
        fixed = json.loads(argv[argv.index("--apply") + 1])
        time.sleep(self.fixed_seconds if fixed else self.seconds)
        if fixed:                                     # the fix's readings, in turn
            self.fixed_ms.append(self.fixed_ms.pop(0))
        with open(argv[argv.index("--measure") + 1], "w") as f:
            json.dump({"plain_step_ms": self.fixed_ms[-1] if fixed else self.ms}, f)
        return 0


def test_default_verification_stops_at_its_deadline_and_says_so(tmp_path, monkeypatch):
    # By default the doctor's 120 s hold its runs too: a compiled run can take many times the
    # plain one (lightning_docs on an H100 ran past 125 s before). A run that cannot finish is
    # not started, one under way is stopped at the deadline, and the fix reads as unmeasured.
    from time import perf_counter
    monkeypatch.setattr(_verify, "MIN_RUN_S", 0.05)
    v = _verify.Verifier(str(tmp_path / "train.py"), [], warmup=1, steps=5, pairs=2,
                         timeout_s=60, cwd=str(tmp_path), deadline=perf_counter() + 0.75)
    v.runner = runner = _TimedRunner(0.2)
    assert v.paired({"compile": "reduce-overhead"}) is None and v.out_of_time
    assert len(runner.timeouts) == 3, "the 4th run of 2 pairs would have ended past it"
    assert all(t <= 0.75 for t in runner.timeouts), "each run's timeout is the time left"
    best, seen = v.sweep_workers([0, 1, 2, 4], {})
    assert (best, seen) == (None, {}), "the sweep starts no run either"
    # Extra pairs (an unclear comparison) stop there too: the pairs so far decide.
    v = _verify.Verifier(str(tmp_path / "train.py"), [], warmup=1, steps=5, pairs=2,
                         timeout_s=60, cwd=str(tmp_path), deadline=perf_counter() + 1.1)
    v.runner = _TimedRunner(0.2, ms=10.0, fixed_ms=(7.0, 12.0))   # unclear in 2 pairs
    r = v.paired({"compile": "reduce-overhead"})
    assert r is not None and r["pairs"] == 2 and v.out_of_time and not r["kept"], r
    # Without a deadline (--verify given), the runs take what they take.
    v = _verify.Verifier(str(tmp_path / "train.py"), [], warmup=1, steps=5, pairs=2,
                         timeout_s=60, cwd=str(tmp_path))
    v.runner = runner = _TimedRunner(0.01)
    assert v.paired({"compile": "reduce-overhead"})["kept"] and not v.out_of_time
    assert runner.timeouts == [60] * 4


def test_the_run_that_estimates_verification_is_the_first_pairs_baseline(tmp_path):
    # The default doctor times one run without a fix to estimate the rest; when the first pair
    # comes next, that run is its run without the fix, not one more (imagenet -j 4 on an H100:
    # 6 runs of 9.8 s with 72 s left, so verification was off). A run between them (a sweep's)
    # makes it stale: the pair then times its own.
    v = _verify.Verifier(str(tmp_path / "train.py"), [], warmup=1, steps=5, pairs=3,
                         timeout_s=60, cwd=str(tmp_path))
    v.runner = runner = _TimedRunner(0.0, ms=10.0, fixed_ms=(5.0,))
    assert v.measure_baseline() == 10.0 and v.has_spare
    r = v.paired({"compile": "reduce-overhead"})
    assert len(runner.timeouts) == 6, "the baseline's run and 5 more make 3 pairs"
    assert r["runs"] == {"without": [10.0] * 3, "with": [5.0] * 3} and r["kept"], r
    assert not v.has_spare
    # Used once: the next fix's pairs time their own runs.
    v.paired({"compile": "reduce-overhead"})
    assert len(runner.timeouts) == 12
    # Stale once another run came between.
    v = _verify.Verifier(str(tmp_path / "train.py"), [], warmup=1, steps=5, pairs=3,
                         timeout_s=60, cwd=str(tmp_path))
    v.runner = runner = _TimedRunner(0.0)
    v.measure_baseline()
    v.sweep_workers([2], {})
    assert not v.has_spare
    v.paired({"compile": "reduce-overhead"})
    assert len(runner.timeouts) == 2 + 6


def test_default_verification_measures_the_leading_fixes_that_fit(tmp_path, monkeypatch):
    # An HF Trainer on an H100 had three framework findings, each a setting and the drop-in
    # they share: 30 runs of ~17 s were estimated, so none was measured. By default the doctor
    # now measures the fixes in the report's order as far as its time goes (a shared setting
    # once), and says which it left and why.
    from time import perf_counter
    from types import SimpleNamespace
    from syncless.doctor.diagnose import Diagnosis
    monkeypatch.setattr(_verify, "MIN_RUN_S", 0.05)
    monkeypatch.setattr(_verify, "Runner", lambda env, preload: _TimedRunner(0.3))
    monkeypatch.setattr(cli, "REPORT_S", 0.0)

    def diagnosis():
        fs = [Finding("framework", f"lightning syncs {n}×/step ({what})", 1.0, "", [], "",
                      {"apply": {"lightning": {what: False}}, "dropin": "lightning"})
              for n, what in ((3, "enable_progress_bar"), (2, "enable_model_summary"),
                              (1, "enable_checkpointing"))]
        d = Diagnosis.__new__(Diagnosis)
        d.findings, d.gpu, d.framework = fs, True, "lightning"
        d.verdict_kind, d.speedups, d.summary = "CPU-bound", [], SimpleNamespace(loader={})
        d.verify_lines, d.verify_runs = [], (0, 0.0)
        return d, fs

    ns = SimpleNamespace(verify=None, verify_pairs=3, script=str(tmp_path / "train.py"),
                         args=[])
    session = SimpleNamespace(done={"warm-up": 1}, plan={"plain": 5})
    d, (a, b, c) = diagnosis()
    assert _verify.fix_runs(_verify.setting_fixes(d), 3, 0, 2) == [6, 6, 6, 0, 6, 0]
    # 24 runs of 0.3 s do not fit 4.8 s: one is timed (the first pair's baseline), then the
    # first finding's setting (5 more runs) and the drop-in (6) fit; the second's setting
    # would end at 5.4 s. (The runs take 3.6 s: 1.2 s to spare for a loaded host's overhead.)
    monkeypatch.setattr(cli, "VERIFY_BUDGET_S", 4.8)
    cli._verify_fixes(ns, session, d, str(tmp_path), 0.3, None, perf_counter())
    assert d.verify_runs[0] == 12, d.verify_lines
    label = "Trainer(callbacks=[syncless.lightning.SynclessLogging()])"
    assert d.verify_lines[0].startswith("Trainer(enable_progress_bar=False): 10.00 -> 5.00 ")
    assert d.verify_lines[0].endswith(": kept")
    assert d.verify_lines[1].startswith(f"{label}: 10.00 -> 5.00 ")
    assert a.verified["kept"] and a.extra["dropin_verified"]["kept"]
    assert b.extra["dropin_verified"] is c.extra["dropin_verified"] is \
        a.extra["dropin_verified"], "the shared drop-in, measured once, stands for all three"
    assert b.verified is None and c.verified is None
    for line, what in zip(d.verify_lines[2:], ("enable_model_summary", "enable_checkpointing")):
        m = re.fullmatch(rf"Trainer\({what}=False\): not measured \(by default verification "
                         r"ends at 5 s; its 12 runs would take about (\d) s more: python -m "
                         r"syncless doctor --verify measures every fix\)", line)
        assert m and m[1] in "45", line              # 12 runs of 0.3 s and their overhead
    assert len(d.verify_lines) == 4, d.verify_lines
    # Not even the first fix fits: verification is off, with the timed run's seconds.
    d, _ = diagnosis()
    monkeypatch.setattr(cli, "VERIFY_BUDGET_S", 0.9)
    cli._verify_fixes(ns, session, d, str(tmp_path), 0.3, None, perf_counter())
    assert d.verify_runs[0] == 0
    [line] = d.verify_lines
    m = re.match(r"off: its 24 runs would take about (\d) s \(one, timed in a scratch copy of "
                 r"the working directory, took 0\.[34] s\)", line)
    assert m and m[1] in "789", line


def test_a_loader_fixs_runs_are_estimated_at_its_shorter_step(tmp_path, monkeypatch):
    # imagenet -j 4 on an H100: the timed run took 10.0 s, ~8 s of it 37 steps at 216 ms; its 6
    # runs were estimated at 69 s with 64 s left, so verification was off, though the runs with
    # 16 workers (a step of ~70 ms predicted) take about half. The pairs are estimated with the
    # fixed runs' window at the predicted step, and the fix is measured.
    from time import perf_counter
    from types import SimpleNamespace
    from syncless.doctor.diagnose import Diagnosis
    monkeypatch.setattr(_verify, "MIN_RUN_S", 0.05)
    monkeypatch.setattr(cli, "REPORT_S", 0.0)
    # Runs of 0.4 s, 0.36 s of it the window (1 + 5 steps of 60 ms); with the fix, 15 ms
    # steps (estimated 0.13 s a run; 0.05 s here, leaving a loaded host time to spare).
    monkeypatch.setattr(_verify, "Runner", lambda env, preload: _TimedRunner(
        0.4, ms=60.0, fixed_ms=(15.0,), fixed_seconds=0.05))

    def diagnosis():
        f = Finding("starvation", "DataLoader starvation", 75.0, "", [Fix("num_workers=16", 25.0)],
                    "", {"workers_needed": 16, "sweep": {"period_ms": 25.0}})
        d = Diagnosis.__new__(Diagnosis)
        d.findings, d.gpu, d.framework, d.step_ms = [f], True, None, 100.0
        d.verdict_kind, d.speedups = "data-bound", []
        d.summary = SimpleNamespace(loader={"num_workers": 4})
        d.verify_lines, d.verify_runs = [], (0, 0.0)
        return d, f

    ns = SimpleNamespace(verify=None, verify_pairs=3, script=str(tmp_path / "train.py"),
                         args=[])
    session = SimpleNamespace(done={"warm-up": 1}, plan={"plain": 5})
    d, f = diagnosis()
    fixes = _verify.setting_fixes(d)
    assert _verify.fix_runs(fixes, 3, 4, 16) == [6], "the pairs alone: side loaders measured"
    assert _verify.fix_ratio(d, fixes[0], 4, 16) == 0.25
    # 6 runs at 0.4 s: 2.4 s, over the 2.2 s; with the fixed runs at 0.4 - 0.36 * 0.75 = 0.13 s:
    # 1.6 s, which fits.
    monkeypatch.setattr(cli, "VERIFY_BUDGET_S", 2.2)
    cli._verify_fixes(ns, session, d, str(tmp_path), 0.4, None, perf_counter())
    assert d.verify_runs[0] == 6, d.verify_lines
    assert f.verified is not None, d.verify_lines
    assert f.verified["kept"] and f.verified["runs"] == {"without": [60.0] * 3,
                                                         "with": [15.0] * 3}, f.verified
    assert d.verify_lines[0].startswith("num_workers=16, ")
    # Where the fix's step is not known (a sweep of the loop, compile), the runs are the timed
    # one's: the same 2.2 s say off.
    d, f = diagnosis()
    f.extra["sweep"] = {}
    assert _verify.fix_ratio(d, _verify.setting_fixes(d)[0], 4, 16) is None
    d.findings[0].kind = "launch-bound"
    cli._verify_fixes(ns, session, d, str(tmp_path), 0.4, None, perf_counter())
    assert d.verify_runs[0] == 0 and d.verify_lines[0].startswith(
        "off: its 6 runs would take about 2 s (one, timed"), d.verify_lines
