"""The doctor does no harm: a script run under `syncless doctor` behaves as it does without it,
up to where the doctor stops it. Its objects stay picklable, deep-copyable and torch.save-able as
they were (a saved model loads where syncless is not installed, an EMA copy carries no hook of
ours), its own hooks come and go as it asks, a model compiled after the doctor's hooks runs, spawned
workers work, its output is its own and nothing of the doctor is left on torch afterwards."""
import json
import os
import socket
import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch

from syncless.doctor import _isolate, _scratch, _verify, cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The script: a 30-epoch MLP that saves the whole module each epoch.
SAVES_THE_MODEL = """
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))

        def forward(self, x):
            return self.body(x)

    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    loader = DataLoader(TensorDataset(torch.randn(64, 16), torch.randn(64, 1)), batch_size=8)
    for epoch in range(30):
        for x, y in loader:
            opt.zero_grad()
            nn.functional.mse_loss(net(x), y).backward()
            opt.step()
        torch.save(net, "model.pth")
        print(f"epoch {epoch} saved")
"""

# What a user does with their objects mid-training, recorded per step: an EMA made by
# copy.deepcopy, the optimizer pickled, copy.copy of the model, a hook of their own registered
# and removed, the whole model pickled and saved. Each step appends what it saw to seen.jsonl.
USES_ITS_OBJECTS = """
    import copy, io, json, pickle
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 1)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    ema = None
    calls = []
    handle = None

    def own_hook(module, args, output):         # module-level: the model stays picklable
        calls.append(1)

    x, y = torch.randn(32, 8), torch.randn(32, 1)
    for step in range(200):
        if step == 2:
            handle = net.register_forward_hook(own_hook)
        if step == 6:
            handle.remove()
        opt.zero_grad()
        nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        if ema is None:
            ema = copy.deepcopy(net)
        with torch.no_grad():
            for pe, p in zip(ema.parameters(), net.parameters()):
                pe.mul_(0.9).add_(p, alpha=0.1)
        shallow = copy.copy(net)
        again = pickle.loads(pickle.dumps(opt))
        buf = io.BytesIO()
        torch.save(net, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
        seen = {"step": step,
                "ema_hooks": len(ema._forward_hooks) + len(ema._forward_pre_hooks),
                "copy_hooks": len(loaded._forward_hooks) + len(loaded._forward_pre_hooks),
                "shallow_hooks": len(shallow._forward_hooks) + len(shallow._forward_pre_hooks),
                "own_hook_calls": len(calls), "opt_state": len(again.state),
                "same_output": bool(torch.equal(loaded(x), net(x)))}
        with open("seen.jsonl", "a") as f:
            f.write(json.dumps(seen) + "\\n")
        print("step", step, "loss-free line")
"""

NO_SYNCLESS = """
import sys
class Block:                                   # syncless cannot be imported here
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "syncless":
            raise ImportError("no syncless here")
sys.meta_path.insert(0, Block())
import torch
m = torch.load(sys.argv[1], weights_only=False)
print(type(m).__name__, len(m._forward_hooks) + len(m._forward_pre_hooks))
"""


def write(tmp_path, text, name="train.py"):
    (tmp_path / name).write_text(textwrap.dedent(text))
    return name


def ran_every_phase(d):
    """The report of a script that ran through every phase (--quick: 15 monitored steps), not
    one cut short by an error. (A one-off stall on a loaded host may still make it
    PROVISIONAL: that is the window's honesty, not harm.)"""
    assert d["steps"] >= 15, d                  # more while periodic work is seen
    why = d["provisional_why"] or ""
    assert "stopped with" not in why and "did not run" not in why, why


def torch_as_found():
    return (torch.nn.Module.__call__, "__reduce_ex__" in vars(torch.nn.Module),
            torch.autograd.backward, torch.optim.Optimizer.__init__)


def test_a_script_that_saves_its_whole_model_each_epoch_gets_a_normal_report(tmp_path,
                                                                               monkeypatch,
                                                                               capsys):
    before = torch_as_found()
    monkeypatch.chdir(tmp_path)
    script = write(tmp_path, SAVES_THE_MODEL)
    assert cli.main(["--no-verify", "--quick", "--json", "d.json", script]) == 0
    assert torch_as_found() == before, "every patch undone"
    out = capsys.readouterr().out
    d = json.loads((tmp_path / "d.json").read_text())
    ran_every_phase(d)
    assert "AttributeError" not in out and "Can't pickle" not in out
    assert out.startswith("epoch 0 saved\n")
    # The file it saved loads where syncless is not installed, its class from its __main__ as
    # without the doctor, and holds no hook.
    net_class = SAVES_THE_MODEL[:SAVES_THE_MODEL.index("    torch.manual_seed")]
    loads = NO_SYNCLESS.replace("import torch\nm =", textwrap.dedent(net_class) + "\nm =")
    r = subprocess.run([sys.executable, "-c", loads, "model.pth"],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path,
                       env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["Net", "0"]


@pytest.mark.slow
def test_a_saved_model_loads_without_syncless(tmp_path, monkeypatch):
    """The module saved under the doctor names torch's classes only: a model of torch's own
    layers saved whole loads in a process where syncless cannot be imported."""
    monkeypatch.chdir(tmp_path)
    script = write(tmp_path, SAVES_THE_MODEL.replace("net = Net()", "net = Net().body"))
    assert cli.main(["--no-verify", "--quick", "--plain-steps", "0", script]) == 0
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(NO_SYNCLESS), "model.pth"],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path,
                       env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["Sequential", "0"]


def plain_run(tmp_path, script):
    """The script run as `python script.py` would run it: its stdout and what it wrote."""
    r = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=300,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    seen = (tmp_path / "seen.jsonl").read_text().splitlines()
    (tmp_path / "seen.jsonl").unlink()
    return r.stdout, [json.loads(line) for line in seen]


def doctor_run(tmp_path, *options):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "python")] +
                                        [p for p in [env.get("PYTHONPATH")] if p])
    r = subprocess.run([sys.executable, "-m", "syncless", "doctor", *options], text=True,
                       capture_output=True, timeout=900, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    return r


@pytest.mark.slow
def test_objects_pickle_copy_and_hook_as_without_the_doctor(tmp_path):
    script = write(tmp_path, USES_ITS_OBJECTS)
    plain_out, plain_seen = plain_run(tmp_path, script)
    out = doctor_run(tmp_path, "--no-verify", "--quick", script).stdout
    seen = [json.loads(line) for line in (tmp_path / "seen.jsonl").read_text().splitlines()]
    assert 20 < len(seen) < len(plain_seen), "stopped by the doctor after its phases"
    assert seen == plain_seen[:len(seen)], "every step saw what it sees without the doctor"
    assert {s["ema_hooks"] for s in seen} == {0}, "the EMA copy carries no hook of ours"
    assert [s["copy_hooks"] for s in seen[:8]] == [0, 0, 1, 1, 1, 1, 0, 0], "its own hook only"
    assert [s["shallow_hooks"] for s in seen[:8]] == [0, 0, 1, 1, 1, 1, 0, 0]
    # its own hook, registered at step 2 and removed at step 6: called in steps 2-5 (and by the
    # output check of steps 2-5)
    assert seen[-1]["own_hook_calls"] == 4 * 2 + 4
    # Its stdout is its own up to where the doctor stopped it, then the report.
    script_out, report = out.split("\n\nsyncless doctor:", 1)
    assert plain_out.startswith(script_out + "\n")
    assert script_out.count("\n") + 1 == len(seen)


COMPILED_AFTER_THE_HOOKS = """
    import json, warnings
    import torch
    from torch import nn

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    nn.functional.mse_loss(net(x), y).backward()        # the doctor's hooks are on it now
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fast = torch.compile(net, backend="eager")
        for step in range(300):
            opt.zero_grad()
            nn.functional.mse_loss(fast(x), y).backward()
            opt.step()
            with open("warned.json", "w") as f:
                json.dump([str(w.message) for w in caught], f)
"""


@pytest.mark.slow
def test_a_model_compiled_after_the_hooks_runs_without_a_warning(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    script = write(tmp_path, COMPILED_AFTER_THE_HOOKS)
    assert cli.main(["--no-verify", "--quick", "--json", "d.json", script]) == 0
    ran_every_phase(json.loads((tmp_path / "d.json").read_text()))
    assert json.loads((tmp_path / "warned.json").read_text()) == []


SPAWNED_WORKERS = """
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, Dataset

    class Squares(Dataset):                  # defined in the script: workers import it
        def __len__(self):
            return 4096

        def __getitem__(self, i):
            return torch.full((8,), float(i % 7)), torch.tensor([float(i % 3)])

    if __name__ == "__main__":
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        opt = torch.optim.SGD(net.parameters(), lr=0.01)
        loader = DataLoader(Squares(), batch_size=16, num_workers=1, persistent_workers=True,
                            multiprocessing_context="spawn")
        for epoch in range(5):
            for x, y in loader:
                opt.zero_grad()
                nn.functional.mse_loss(net(x), y).backward()
                opt.step()
            torch.save(net, "model.pth")
"""


@pytest.mark.slow
def test_spawned_workers_get_the_scripts_dataset(tmp_path):
    (tmp_path / "train.py").write_text(textwrap.dedent(SPAWNED_WORKERS))
    r = doctor_run(tmp_path, "--no-verify", "--quick", "--json", "d.json", "train.py")
    d = json.loads((tmp_path / "d.json").read_text())
    ran_every_phase(d)
    assert "num_workers=1" in " ".join(d["settings"]), d["settings"]
    assert "Traceback" not in r.stderr, r.stderr


# ---- --verify's runs leave nothing behind -------------------------------------------------------

# Data-bound by construction (each example sleeps 3 ms, 4 a batch, no workers), so the doctor
# prescribes loader workers and --verify runs the script again for them. It appends a line to
# ./starts.txt at its start and saves a checkpoint under ./out each epoch.
STARTS = """
    import os, time
    import torch
    from torch.utils.data import DataLoader, Dataset

    with open("starts.txt", "a") as f:
        f.write("started\\n")

    class Slow(Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            time.sleep(0.003)
            return torch.full((8,), float(i % 5))

    if __name__ == "__main__":
        torch.manual_seed(0)
        torch.set_num_threads(1)
        net = torch.nn.Linear(8, 1)
        opt = torch.optim.SGD(net.parameters(), lr=0.01)
        os.makedirs("out", exist_ok=True)
        for epoch in range(1000):
            for x in DataLoader(Slow(), batch_size=4):
                opt.zero_grad()
                net(x).square().mean().backward()
                opt.step()
            torch.save(net.state_dict(), "out/ckpt.pt")
"""


@pytest.mark.slow
def test_verify_runs_leave_the_working_directory_as_the_script_left_it(tmp_path):
    write(tmp_path, STARTS)
    (tmp_path / "data.txt").write_text("the user's own file\n")
    r = doctor_run(tmp_path, "--quick", "--verify", "--json", "d.json", "train.py")
    d = json.loads((tmp_path / "d.json").read_text())
    assert d["verify_runs"] >= 3, d["verify"]
    assert (tmp_path / "starts.txt").read_text() == "started\n", "one start: the doctor's own"
    assert sorted(p.name for p in tmp_path.iterdir()) == \
        ["d.json", "data.txt", "out", "starts.txt", "train.py"]
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["ckpt.pt"]
    assert (tmp_path / "data.txt").read_text() == "the user's own file\n"
    where = d["verify_where"]
    assert "fresh copy of the working directory" in where and "trackers off" in where, where
    scratch = where.split(" under ")[1].split(" ")[0]
    assert scratch.startswith(tempfile.gettempdir()) and not os.path.exists(scratch)
    assert f"checked by --verify ({d['verify_runs']} fresh runs" in r.stdout
    assert f"(runs {where})" in r.stdout


# The same loop, given a file to append to at its start: a path outside its working directory.
OUTSIDE = STARTS.replace("import os, time", "import os, sys, time").replace(
    'open("starts.txt", "a")', 'open(sys.argv[1], "a")')


def test_a_script_that_writes_outside_its_directory_is_not_verified_by_default(tmp_path,
                                                                                monkeypatch):
    outside = tmp_path.parent / f"{tmp_path.name}-elsewhere.log"
    monkeypatch.chdir(tmp_path)
    write(tmp_path, OUTSIDE)
    assert cli.main(["--quick", "--json", "d.json", "train.py", str(outside)]) == 0
    d = json.loads((tmp_path / "d.json").read_text())
    assert d["verify_runs"] == 0
    [line] = d["verify"]
    assert line.startswith(f"off: the script wrote outside its working directory ({outside})")
    assert line.endswith("pass --verify to run them anyway")
    assert outside.read_text() == "started\n"


def test_the_watch_tells_writes_inside_from_outside_and_sees_connections(tmp_path,
                                                                         monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "kept.txt").write_text("a")
    (tmp_path / "changed.txt").write_text("a")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "x.bin").write_bytes(b"1234")
    with _isolate.Watch(str(tmp_path), str(tmp_path / "train.py")) as w:
        with open("changed.txt", "a") as f:
            f.write("b")
        os.makedirs("out/deep")
        torch.save({"a": 1}, "out/deep/ckpt.pt")
        with tempfile.NamedTemporaryFile("w") as f:      # temp files are no output
            f.write("x")
    assert w.why_not() is None
    assert w.created == {"out", os.path.join("out", "deep"),
                         os.path.join("out", "deep", "ckpt.pt")}
    assert w.changed == {"changed.txt"}
    with _isolate.Watch(str(tmp_path), str(tmp_path / "train.py")) as w:
        torch.save({"a": 1}, str(tmp_path.parent / f"{tmp_path.name}-ckpt.pt"))
    assert "wrote outside its working directory" in w.why_not()
    with _isolate.Watch(str(tmp_path), str(tmp_path / "train.py")) as w:
        try:
            socket.create_connection(("192.0.2.1", 9), timeout=0.01)   # TEST-NET-1: no host
        except OSError:
            pass
    assert w.why_not() == "the script connected to 192.0.2.1: runs of it could send or " \
                          "change something there"
    # A scratch copy: what the doctor's run created is not there, what it changed is a copy,
    # the rest links to the user's files.
    scratch = _scratch.Scratch(str(tmp_path), w_inside := _watch_of(tmp_path))
    try:
        here = scratch.make()
        assert sorted(os.listdir(here)) == ["changed.txt", "data", "kept.txt", "out"], \
            "new.txt, made by the doctor's run, is not there"
        assert os.path.islink(os.path.join(here, "kept.txt"))
        assert os.path.islink(os.path.join(here, "data"))
        assert not os.path.islink(os.path.join(here, "changed.txt"))
        with open(os.path.join(here, "changed.txt"), "a") as f:
            f.write("run")
        assert (tmp_path / "changed.txt").read_text() == "ab"
    finally:
        scratch.close()
    assert not os.path.exists(scratch.root)
    assert w_inside.created


def test_a_run_reads_beside_the_working_directory_and_writes_only_in_its_scratch(tmp_path):
    # pytorch/examples' vae and mnist read `../data`: each --verify run must find it (in the H100
    # corpus run of 2026-12-06 every vae run failed to, and verification measured nothing).
    (tmp_path / "examples" / "data" / "MNIST").mkdir(parents=True)
    (tmp_path / "examples" / "data" / "MNIST" / "raw.bin").write_bytes(b"images")
    (tmp_path / "examples" / "vae").mkdir()
    (tmp_path / "examples" / "vae" / "main.py").write_text("print(1)")
    (tmp_path / "top.txt").write_text("two up")
    scratch = _scratch.Scratch(str(tmp_path / "examples" / "vae"), None)
    try:
        here = scratch.make()
        assert os.path.basename(here) == "vae" and os.listdir(here) == ["main.py"]
        with open(os.path.join(here, "..", "data", "MNIST", "raw.bin"), "rb") as f:
            assert f.read() == b"images"
        with open(os.path.join(here, "..", "..", "top.txt")) as f:
            assert f.read() == "two up"
        with open(os.path.join(here, "..", "new.txt"), "w") as f:    # a new name: scratch's
            f.write("run")
        assert not (tmp_path / "examples" / "new.txt").exists()
        scratch.drop(here)
        assert os.listdir(scratch.root) == [], "the run's whole tree goes with it"
        assert (tmp_path / "examples" / "data" / "MNIST" / "raw.bin").read_bytes() == b"images"
    finally:
        scratch.close()


def _watch_of(tmp_path):
    (tmp_path / "changed.txt").write_text("a")
    with _isolate.Watch(str(tmp_path), str(tmp_path / "train.py")) as w:
        with open("changed.txt", "a") as f:
            f.write("b")
        with open("new.txt", "w") as f:
            f.write("b")
    return w


def test_measured_runs_have_the_trackers_off_and_share_the_compile_cache():
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    env = _verify.run_env()
    assert env["WANDB_MODE"] == "disabled"
    assert env["COMET_AUTO_LOG_DISABLE"] == "true"
    assert env["DISABLE_MLFLOW_INTEGRATION"] == "TRUE"
    assert env["HF_HUB_OFFLINE"] == "1"
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        assert env["TORCHINDUCTOR_CACHE_DIR"] == default_cache_dir()


def test_quick_says_what_it_left_out():
    ns = cli.parse_args(["--quick", __file__])
    assert cli.quick_skipped(ns) == (
        "--quick: at least 2 warm-up steps (default 3), 15 monitored steps (default 30), "
        "5 audited steps (default 10), 15 steps timed unobserved (default 30): a stall that "
        "comes less often than that is seen as a one-off; the window still starts past the "
        "loader's prefetch and the warm-up")


def test_a_killed_doctors_folders_go_at_the_next_run(tmp_path, monkeypatch):
    # A doctor ended by SIGTERM or SIGKILL removes nothing itself: the folders its runs and its
    # trace used are named by its pid, and the next doctor removes those whose process is gone.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead = int(gone.stdout)
    for name in (f"syncless-verify-{dead}-x1", f"syncless-doctor-{dead}-x2"):
        (tmp_path / name / "run1").mkdir(parents=True)
        (tmp_path / name / "run1" / "model.pth").write_bytes(b"left over")
    alive = tmp_path / f"syncless-verify-{os.getppid()}-x3"   # a doctor still running
    alive.mkdir()
    other = tmp_path / "syncless-verify-notes"                  # not ours: no pid
    other.mkdir()
    made = _scratch.own_tempdir("syncless-verify-")
    assert os.path.basename(made).startswith(f"syncless-verify-{os.getpid()}-")
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted([f"syncless-doctor-{dead}-x2", alive.name, other.name,
                           os.path.basename(made)]), left
    _scratch.own_tempdir("syncless-doctor-")
    assert not (tmp_path / f"syncless-doctor-{dead}-x2").exists()
    assert alive.exists() and other.exists()
