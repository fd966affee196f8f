"""`python -m syncless doctor` on scripts written as their authors write them (argparse and
main(), sys.exit, sibling imports, gradient accumulation, GANs, manual SGD, inference, loaders
that starve, scripts that fail, end early, print a lot or swallow exceptions, Lightning), each run
unmodified in a subprocess. Asserted: the script runs (its arguments, output and exit code are its
own), the step boundary the report names, the step counts, the lines it names, and that every run
finishes. No timing is asserted."""
import os
import re
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAST = ("--warmup", "1", "--steps", "4", "--audit-steps", "1")


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def unobserved(options) -> tuple:
    """No unobserved window unless a test asks for one: these tests count the steps of scripts
    that end (the window's own tests are in test_doctor_window.py)."""
    if "--verify" not in options:        # its fresh runs are test_doctor_verify.py's
        options = ("--no-verify", *options)
    return options if "--plain-steps" in options or "--quick" in options else \
        ("--plain-steps", "0", *options)


def doctor(tmp_path, script, *options, args=(), cwd=None, timeout=180):
    """Run the doctor on `script` (a path, or the text of tmp_path/train.py)."""
    options = unobserved(options)
    if isinstance(script, str):
        script = write(tmp_path / "train.py", script)
    env = dict(os.environ, NCCL_NVLS_ENABLE="0")
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.join(ROOT, "python")] + [p for p in [env.get("PYTHONPATH")] if p])
    return subprocess.run([sys.executable, "-m", "syncless", "doctor", *options, str(script),
                           *args], capture_output=True, text=True, timeout=timeout,
                          cwd=cwd or tmp_path, env=env)


def doctor_all(tmp_path, cases: dict, timeout=180) -> dict:
    """`doctor` on several scripts at once (each in its own folder; the runs wait mostly on
    imports, so on 2 cores they finish in about half the time): name -> (script, options)."""
    env = dict(os.environ, NCCL_NVLS_ENABLE="0")
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.join(ROOT, "python")] + [p for p in [env.get("PYTHONPATH")] if p])
    procs = {}
    for name, (text, options) in cases.items():
        folder = tmp_path / name
        script = write(folder / "train.py", text)
        procs[name] = subprocess.Popen(
            [sys.executable, "-m", "syncless", "doctor", *unobserved(options), str(script)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=folder, env=env)
    out = {}
    try:
        for name, p in procs.items():
            stdout, stderr = p.communicate(timeout=timeout)
            out[name] = subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


def boundary(r) -> str:
    m = re.search(r"^a step ends at each (.*)$", r.stdout, re.M)
    assert m, r.stdout
    return m.group(1)


def measured(r) -> tuple:
    m = re.search(r"^syncless doctor: (\d+) measured steps? \(\+(\d+) warm-up", r.stdout, re.M)
    assert m, r.stdout
    return int(m.group(1)), int(m.group(2))


def lines_named(r) -> list:
    """The file:line entries of the sampled host-time table."""
    return re.findall(r"^\s+\d+%\s+(\S+?:\d+)", r.stdout, re.M)


ARGPARSE_MAIN = """
    import argparse, sys
    import torch

    def main():
        p = argparse.ArgumentParser()
        p.add_argument("--iters", type=int, default=1000)
        p.add_argument("--lr", type=float, default=0.1)
        a = p.parse_args()
        print(f"args: iters={a.iters} lr={a.lr} argv0={sys.argv[0].endswith('train.py')}")
        model = torch.nn.Linear(8, 1)
        opt = torch.optim.SGD(model.parameters(), lr=a.lr)
        for i in range(a.iters):
            loss = model(torch.randn(4, 8)).pow(2).mean()
            opt.zero_grad(); loss.backward(); opt.step()
        print("main finished")
        return 3

    if __name__ == "__main__":
        sys.exit(main())
"""


def test_argparse_main_sys_exit_code_is_the_scripts(tmp_path):
    r = doctor(tmp_path, ARGPARSE_MAIN, "--warmup", "1", "--steps", "50", args=("--iters", "20",
                                                                              "--lr", "0.5"))
    assert r.returncode == 3, (r.stdout, r.stderr)
    assert "args: iters=20 lr=0.5 argv0=True" in r.stdout
    out = r.stdout
    assert out.index("main finished") < out.index("syncless doctor:"), "the report comes last"
    assert boundary(r) == "optimizer.step() (SGD)"
    assert measured(r) == (18, 1), "20 boundaries: 19 steps between them, 1 of them warm-up"
    assert "note: the script exited with code 3 after 20 steps: the monitor ran 18 of 50" in out


def test_exit_before_the_first_step_gets_no_table_of_zeros(tmp_path):
    r = doctor(tmp_path, ARGPARSE_MAIN, args=("--no-such-option",))
    assert r.returncode == 2, "argparse's exit code"
    assert "unrecognized arguments: --no-such-option" in r.stderr
    assert "0 measured steps" in r.stdout
    assert "verdict" not in r.stdout and "ms/step" not in r.stdout, r.stdout
    assert "the script exited with code 2 before its first step boundary" in r.stdout


def test_sibling_import_and_data_file_next_to_the_script(tmp_path):
    import torch
    project = tmp_path / "project"
    write(project / "helpers.py", """
        import torch
        def make_model():
            return torch.nn.Linear(8, 2)
    """)
    torch.save({"x": torch.randn(64, 8), "y": torch.randint(0, 2, (64,))}, project / "data.pt")
    script = write(project / "train.py", """
        import os, torch
        from helpers import make_model
        d = torch.load(os.path.join(os.path.dirname(__file__), "data.pt"))
        model = make_model()
        opt = torch.optim.Adam(model.parameters(), 1e-2)
        print("running as", __name__)
        for epoch in range(100):
            for i in range(0, 64, 16):
                loss = torch.nn.functional.cross_entropy(model(d["x"][i:i + 16]),
                                                         d["y"][i:i + 16])
                opt.zero_grad(); loss.backward(); opt.step()
    """)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # 40 measured steps: 4 of these 0.3-ms steps fit inside one 2-ms sample interval, and the
    # host-time table (whose paths this test checks) could come out empty.
    r = doctor(tmp_path, script, "--warmup", "1", "--steps", "40", "--audit-steps", "1",
               cwd=elsewhere)
    assert r.returncode == 0, r.stderr
    assert "running as __main__" in r.stdout
    assert boundary(r) == "optimizer.step() (Adam)"
    assert measured(r) == (40, 1)
    assert "note:" not in r.stdout, "every phase ran: the script was stopped (exit code 0)"
    assert lines_named(r) and all(w.startswith(os.path.join("..", "project", "train.py:"))
                                  for w in lines_named(r)), r.stdout


ACCUMULATION = """
        import torch
        model = torch.nn.Linear(16, 2); opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for i in range(4000):
            loss = model(torch.randn(4, 16)).pow(2).mean() / 4
            loss.backward()
            if (i + 1) % 4 == 0:
                opt.step(); opt.zero_grad()
    """

GAN = """
        import torch
        from torch import nn
        G = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8))
        D = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
        oD = torch.optim.Adam(D.parameters(), 2e-4); oG = torch.optim.SGD(G.parameters(), 0.01)
        bce = nn.BCEWithLogitsLoss()
        for it in range(2000):
            fake = G(torch.randn(8, 4))
            lD = bce(D(torch.randn(8, 8)), torch.ones(8, 1)) + bce(D(fake.detach()),
                                                                   torch.zeros(8, 1))
            oD.zero_grad(); lD.backward(); oD.step()
            lG = bce(D(fake), torch.ones(8, 1))
            oG.zero_grad(); lG.backward(); oG.step()
    """

MARKER = """
        import torch, syncless
        G = torch.nn.Linear(4, 4); D = torch.nn.Linear(4, 1)
        oG = torch.optim.SGD(G.parameters(), 0.1); oD = torch.optim.SGD(D.parameters(), 0.1)
        for i in range(2000):
            for _ in range(2):
                lD = D(G(torch.randn(8, 4)).detach()).mean()
                oD.zero_grad(); lD.backward(); oD.step()
            lG = -D(G(torch.randn(8, 4))).mean(); oG.zero_grad(); lG.backward(); oG.step()
            syncless.step()
    """

# A global module hook makes torch.compile'd modules warn (an error under -W error, which this
# script sets): the doctor finds the first module call without one.
COMPILED = """
        import warnings
        warnings.simplefilter("error")
        import torch
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        cmodel = torch.compile(model, backend="eager")      # dynamo only: fast on CPU
        opt = torch.optim.SGD(model.parameters(), 0.1)
        for i in range(2000):
            loss = cmodel(torch.randn(4, 8)).pow(2).mean()
            opt.zero_grad(); loss.backward(); opt.step()
    """


@pytest.mark.slow
def test_what_a_step_holds(tmp_path):
    runs = doctor_all(tmp_path, {"accumulation": (ACCUMULATION, FAST), "gan": (GAN, FAST),
                                 "marker": (MARKER, FAST), "compiled": (COMPILED, FAST)})
    want = {
        "accumulation": "optimizer.step() (SGD), 4 backward() calls per step",
        "gan": ("optimizer.step() of the first optimizer stepped (Adam; 1 other stepped too: "
                "SGD), 2 backward() calls per step"),
        "marker": "syncless.step() (per step: 3 × optimizer.step(), 3 × backward())",
        "compiled": "optimizer.step() (SGD)"}
    for name, r in runs.items():
        assert r.returncode == 0, (name, r.stderr)
        assert boundary(r) == want[name], name
        assert measured(r) == (4, 1), name
    assert "torch.compile'd" in runs["compiled"].stdout


NO_OPTIMIZER = {
        "manual-sgd": """
            model = torch.nn.Linear(16, 1)
            for i in range(5000):
                loss = model(torch.randn(8, 16)).pow(2).mean()
                model.zero_grad()
                loss.backward()
                with torch.no_grad():
                    for p in model.parameters():
                        p.data -= 0.01 * p.grad
        """,
        "inference-loader": """
            from torch.utils.data import DataLoader, TensorDataset
            model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU()).eval()
            with torch.no_grad():
                for (x,) in DataLoader(TensorDataset(torch.randn(4000, 8)), batch_size=4):
                    model(x).argmax(1)
        """,
        "inference-model": """
            model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU()).eval()
            xs = torch.randn(1000, 1, 8)
            with torch.inference_mode():
                for x in xs:
                    model(x)
        """}


def test_steps_without_an_optimizer(tmp_path):
    runs = doctor_all(tmp_path, {kind: ("import torch\n" + textwrap.dedent(body), FAST)
                                 for kind, body in NO_OPTIMIZER.items()})
    want = {"manual-sgd": "backward()", "inference-loader": "DataLoader next()",
            "inference-model": "end of the outermost nn.Module call (Sequential)"}
    for kind, r in runs.items():
        assert r.returncode == 0, (kind, r.stderr)
        assert boundary(r) == want[kind], kind
        assert measured(r) == (4, 1), kind


FAILING = """
    import torch
    model = torch.nn.Linear(16, 1); opt = torch.optim.SGD(model.parameters(), 0.1)
    for i in range(100):
        loss = model(torch.randn(8, 16)).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
        if i == 20:
            raise {error}
"""


def test_script_error_reaches_the_user_after_the_report(tmp_path):
    errors = {"ValueError": 'ValueError("bad batch at 20")',
              "KeyboardInterrupt": "KeyboardInterrupt"}
    runs = doctor_all(tmp_path, {name: (FAILING.format(error=e), ("--warmup", "1", "--steps",
                                                                  "50"))
                                 for name, e in errors.items()})
    for name, r in runs.items():
        # What python train.py exits with: 1, or killed by SIGINT (Ctrl-C) as python is.
        assert r.returncode == (-2 if name == "KeyboardInterrupt" else 1), (name, r.stderr)
        err = r.stderr.strip().splitlines()
        assert err[0] == "Traceback (most recent call last):", r.stderr
        assert err[1].strip().startswith('File "') and 'train.py", line 8, in <module>' in err[1]
        assert err[-1] == ("KeyboardInterrupt" if name == "KeyboardInterrupt"
                           else "ValueError: bad batch at 20")
        assert "cli.py" not in r.stderr and "runpy" not in r.stderr, \
            "the doctor's frames are not the script's"
        assert measured(r) == (19, 1), name
        assert f"note: the script stopped with {name} after 21 steps" in r.stdout, r.stdout


def test_while_true_break_much_output_then_exit(tmp_path):
    r = doctor(tmp_path, """
        import torch
        model = torch.nn.Linear(16, 1); opt = torch.optim.AdamW(model.parameters())
        step = 0
        while True:
            loss = model(torch.randn(8, 16)).pow(2).mean()
            opt.zero_grad(); loss.backward(); opt.step()
            step += 1
            for k in range(100):
                print("line", step, k, loss.item())
            if step >= 30:
                break
        print("stopped at", step, "progress 100%", end="")   # a progress bar leaves it open
        exit()
    """, "--warmup", "2")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("\nline ") == 30 * 100 - 1
    # The report starts on a line of its own, after all of the script's output.
    assert "stopped at 30 progress 100%\nsyncless doctor: 27 measured steps (+2 warm-up)\n" \
        in r.stdout
    assert ("note: the script exited after 30 steps: the monitor ran 27 of 30 steps, the audit "
            "did not run") in r.stdout


def test_a_script_that_swallows_the_stop_is_stopped_again(tmp_path):
    # It also points sys.stdout at a log file of its own (a tee without the terminal side) and
    # leaves it so: the report still reaches the doctor's stdout.
    r = doctor(tmp_path, """
        import sys, torch
        sys.stdout = open("log.txt", "w")
        model = torch.nn.Linear(4, 1); opt = torch.optim.SGD(model.parameters(), 0.1)
        caught = 0
        for epoch in range(300):
            try:
                for i in range(20):
                    loss = model(torch.randn(2, 4)).sum()
                    opt.zero_grad(); loss.backward(); opt.step()
            except:                     # noqa: E722 (scripts do this)
                caught += 1
        print("caught", caught)
    """, *FAST, timeout=120)
    assert r.returncode == 0, r.stderr
    assert measured(r) == (4, 1)
    log = (tmp_path / "log.txt").read_text()
    assert "syncless doctor" not in log and r.stdout.startswith("\nsyncless doctor: ")
    caught = int(re.search(r"^caught (\d+)$", log, re.M).group(1))
    # Every phase ran in epoch 0; that epoch and each one after it is stopped at its first step
    # again (not run to its end unmeasured).
    assert caught == 300


STEP_AT_SCRIPT = """
    import torch
    model = torch.nn.Linear(16, 1)

    def train_step(x):
        loss = model(x).pow(2).mean()
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.01 * p.grad
                p.grad = None
        return loss.detach()

    for i in range(40):
        train_step(torch.randn(8, 16))
    print("ran 40 steps")
"""


def test_step_at_a_line_inside_a_helper_function(tmp_path):
    r = doctor(tmp_path, STEP_AT_SCRIPT, "--warmup", "1", "--steps", "100",
               "--step-at", "train.py:12")
    assert r.returncode == 0, r.stderr
    assert "ran 40 steps" in r.stdout
    assert boundary(r) == "pass over train.py:12 (--step-at) (per step: 1 × backward())"
    assert measured(r) == (38, 1)
    assert "note: the script ended after 40 steps" in r.stdout


@pytest.mark.parametrize("line,problem", [(99, "has 16 lines: line 99 is past its end"),
                                          (4, "line 4 of {path} has no code (blank)"),
                                          (1, "line 1 of {path} has no code (a comment)")])
def test_step_at_a_line_that_cannot_run_is_an_error(tmp_path, line, problem):
    # Such a line never runs: the steps would silently end at another boundary.
    from syncless.doctor._boundary import parse_step_at
    path = write(tmp_path / "train.py", "# a training script" + STEP_AT_SCRIPT)
    with pytest.raises(ValueError) as e:
        parse_step_at(f"{path}:{line}")
    assert problem.format(path=path) in str(e.value)
    assert parse_step_at(f"{path}:12") == (str(path), 12)


def test_starved_loader_with_waiting_workers_gets_more_workers(tmp_path):
    r = doctor(tmp_path, """
        import time, torch
        from torch.utils.data import DataLoader, Dataset
        class Slow(Dataset):                      # a network or disk read: waits, no CPU
            def __len__(self): return 100000
            def __getitem__(self, i):
                time.sleep(0.05)
                return torch.randn(8), torch.randn(1)
        if __name__ == "__main__":
            model = torch.nn.Linear(8, 1); opt = torch.optim.SGD(model.parameters(), 0.01)
            for x, y in DataLoader(Slow(), batch_size=1, num_workers=2):
                loss = (model(x) - y).pow(2).mean()
                opt.zero_grad(); loss.backward(); opt.step()
    """, "--warmup", "2", "--steps", "12", "--audit-steps", "1")
    assert r.returncode == 0, r.stderr
    assert "DataLoader(num_workers=2," in r.stdout
    # Measured: side loaders of the same dataset, from the loader's own 2 workers up (2, 4, 8),
    # each waiting 50 ms a batch (no CPU): more of them than the CPUs.
    m = re.search(r"num_workers=2 cannot keep up: num_workers=(\d+) \(measured: side loaders "
                  r"of this loader's dataset, sampler and collate made a batch every 2: [\d.]+, "
                  r"4: [\d.]+, .*; the workers wait", r.stdout)
    assert m, r.stdout
    assert int(m.group(1)) > 2, "more workers than the two that starve the step"


def test_code_torch_generates_is_not_the_users_line():
    import selectors
    from syncless.doctor._frames import _kind, short
    assert short(selectors.__file__) == "selectors.py", "the standard library's, shortened"
    assert _kind("/tmp/torchinductor_alice/nd/cndwnzyq.py") == "torch"
    assert _kind("/home/alice/.triton/cache/ab/kernel.py") == "torch"
    assert _kind("<eval_with_key>.12") == "torch"
    assert _kind("/home/alice/project/train.py") == "user"


def test_an_evaluation_loader_is_not_the_training_loaders_data_wait(tmp_path):
    r = doctor(tmp_path, """
        import time, torch
        from torch.utils.data import DataLoader, Dataset, TensorDataset
        class SlowVal(Dataset):
            def __len__(self): return 8
            def __getitem__(self, i):
                time.sleep(0.01)
                return torch.randn(8), torch.randn(1)
        train = DataLoader(TensorDataset(torch.randn(4000, 8), torch.randn(4000, 1)),
                           batch_size=32)
        val = DataLoader(SlowVal(), batch_size=4)
        model = torch.nn.Linear(8, 1); opt = torch.optim.SGD(model.parameters(), 0.01)
        for step, (x, y) in enumerate(train):
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad(); loss.backward(); opt.step()
            if step % 5 == 0:
                with torch.no_grad():
                    val_loss = sum(torch.nn.functional.mse_loss(model(a), b) for a, b in val)
    """, "--warmup", "1", "--steps", "10", "--audit-steps", "1", "--plain-steps", "10")
    assert r.returncode == 0, r.stderr
    # The evaluation every 5 steps (2 batches of 4 x 10 ms) is periodic work, apart from the
    # steady step, named by its loader; the steady step's data wait is the training loader's.
    m = re.search(r"^  - every 5 steps, ([\d.]+) ms each \(\d+% of the wall time\): an evaluation "
                  r"\(another DataLoader: 3 next\(\) of SlowVal; 2 forward-only model calls\)",
                  r.stdout, re.M)
    assert m and float(m.group(1)) >= 70, r.stdout
    m = re.search(r"^  data wait\s+([\d.]+)\s", r.stdout, re.M)
    assert m and float(m.group(1)) < 10, r.stdout
