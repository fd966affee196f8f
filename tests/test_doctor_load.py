"""Load honesty: the doctor measures whether other processes compete for its CPUs during the run
(/proc/stat less this process tree's own CPU time) and says so above the findings."""
import json
import os
import resource
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from syncless.doctor._load import Load, LoadMeter, tree_cpu_s

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUSY = "import time\nt = time.time()\nwhile time.time() - t < {s}: pass\n"

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc: Linux")


def test_the_process_trees_own_cpu_time_is_not_load():
    # A child that computes is this process's own work (a DataLoader worker, a side loader):
    # its CPU time counts to the tree, whether it is still running or reaped.
    before = tree_cpu_s()
    self_before = resource.getrusage(resource.RUSAGE_SELF)
    kids_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    child = subprocess.Popen([sys.executable, "-c", BUSY.format(s=0.5)])
    time.sleep(0.3)
    live = tree_cpu_s()
    child.wait()
    after = tree_cpu_s()
    self_after = resource.getrusage(resource.RUSAGE_SELF)
    kids_after = resource.getrusage(resource.RUSAGE_CHILDREN)

    def cpu(a, b):
        return (b.ru_utime - a.ru_utime) + (b.ru_stime - a.ru_stime)
    expected = cpu(self_before, self_after) + cpu(kids_before, kids_after)
    # /proc counts in clock ticks (10 ms), getrusage in microseconds.
    assert abs((after - before) - expected) <= 0.05, (after - before, expected)
    assert before <= live <= after, "a live child counts before it is reaped"


def test_a_busy_process_outside_the_tree_is_load():
    meter = LoadMeter()
    # Not our child: started through a shell that exits at once (it goes to init).
    subprocess.run(["sh", "-c", f"{sys.executable} -c '{BUSY.format(s=1.0)}' &"], check=True)
    time.sleep(1.0)
    load = meter.read()
    assert load is not None and load.cpus == len(os.sched_getaffinity(0))
    # The busy loop ran for the whole second: a CPU (less what the host's other load took
    # from it), and nothing of it was this process's own.
    assert load.own_cpus < 0.2, load
    assert load.other_cpus >= 0.5 and load.loaded, load


def test_watch_says_its_steps_were_measured_under_load():
    import torch
    import syncless
    from syncless.doctor.monitor import Watch
    data = [torch.ones(4)] * 8
    brief = syncless.watch(data)
    for _ in brief:
        pass
    assert not brief.load().loaded and not str(brief).startswith("load: "), \
        "a few ms of steps: /proc/stat's ticks cannot tell"
    w = syncless.watch(data * 200)
    # Not our child: started through a shell that exits at once (it goes to init).
    subprocess.run(["sh", "-c", f"{sys.executable} -c '{BUSY.format(s=2.5)}' &"], check=True)
    time.sleep(0.3)                                 # its interpreter starting
    for i, x in enumerate(w):
        time.sleep(0.001)                           # over a second of steps while it spins
        if i == 1000:
            break                                   # the load is read as the loop leaves
    load = w.load()
    assert load is not None and load.loaded and load.other_cpus >= 0.5, load
    time.sleep(0.5)
    assert w.load() is load, "read once, when the iteration ended"
    first, second = str(w).splitlines()[:2]
    assert first.startswith("load: other processes kept ") and first.endswith(
        ": the times below were measured under that load, and may differ without it"), first
    assert second.startswith("syncless.watch: 1001 steps") and \
        second.endswith("(host wall) (measured under load)"), second
    page = w._repr_html_()
    assert page.startswith("<p>load: other processes kept ") and "<table>" in page
    assert "measured under load)</p><table>" in page
    assert isinstance(w, Watch)


def test_the_load_line_and_the_json():
    load = Load(wall_s=12.0, cpus=2, own_cpus=0.9, other_cpus=1.1)
    assert load.loaded and load.as_dict()["other_cpus"] == 1.1
    assert load.text() == ("other processes kept 1.1 of the 2 CPUs this process may use busy "
                           "during the run (12 s; this process and its children 0.9: /proc/stat "
                           "less their own CPU time)")
    assert not Load(12.0, 2, 1.0, 0.3).loaded, "less than half a CPU: not loaded"
    assert not Load(12.0, 16, 1.0, 3.9).loaded and Load(12.0, 16, 1.0, 4.0).loaded
    assert not Load(0.4, 2, 0.0, 2.0).loaded, "under MIN_WALL_S: the ticks cannot tell"


def test_verification_under_load_says_so_above_its_results():
    # Seen: other processes on 0.83 of 2 CPUs during --verify, every run of a CPU loop 4x slower
    # than quiet, and a worker count kept that loses on the quiet host.
    import syncless
    x = torch.randn(16, 16)
    d = syncless.doctor(lambda: torch.tanh(x @ x), steps=4, warmup=1, audit_steps=1, file=None)
    d.verify_lines = ["num_workers=2, persistent_workers=True: 48.78 -> 35.78 ms/step: kept"]
    d.verify_runs = (9, 29.0)
    d.verify_load = Load(29.0, 2, 1.0, 0.9)
    text = d.report()
    assert "  (measured under load: other processes kept 0.9 of the 2 CPUs this process may " \
        "use busy during the run (29 s;" in text, text
    assert text.index("measured under load") < text.index("48.78 -> 35.78"), text
    assert d.as_dict()["verify_load"] == {"wall_s": 29.0, "cpus": 2, "own_cpus": 1.0,
                                          "other_cpus": 0.9, "loaded": True}
    d.verify_load = Load(29.0, 2, 1.0, 0.2)
    assert "measured under load" not in d.report()


SCRIPT = """
    import torch
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(32, 64)
    for _ in range(100000):
        opt.zero_grad(); model(x).sum().backward(); opt.step()
"""


@pytest.mark.slow
@pytest.mark.timing
def test_the_report_says_the_run_was_measured_under_load(tmp_path):
    (tmp_path / "train.py").write_text(textwrap.dedent(SCRIPT))
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    # A busy loop beside the doctor, for all of its run: a sibling process, not the doctor's.
    busy = subprocess.Popen([sys.executable, "-c", BUSY.format(s=120)])
    try:
        r = subprocess.run([sys.executable, "-m", "syncless", "doctor", "--quick", "--no-verify",
                            "--json", "d.json", "train.py"], capture_output=True, text=True,
                           timeout=300, cwd=tmp_path, env=env)
    finally:
        busy.kill()
        busy.wait()
    assert r.returncode == 0, r.stderr
    d = json.loads((tmp_path / "d.json").read_text())
    assert d["load"]["loaded"] is True and d["load"]["other_cpus"] >= 0.5, d["load"]
    lines = r.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("load: other processes kept"))
    verdict = next(i for i, line in enumerate(lines) if line.startswith("verdict"))
    assert at < verdict and lines[verdict].endswith(" (measured under load)"), r.stdout
    assert "every time below was measured under that load" in lines[at]


def test_the_doctors_120_s_count_from_the_interpreters_start():
    # The user's clock starts with `python -m syncless doctor`: the imports before the doctor's
    # own clock count (an HF Trainer's doctor on an H100: 121.4 s by the user's clock).
    r = subprocess.run([sys.executable, "-c", "import time; time.sleep(1.5); "
                        "from syncless.doctor._load import process_age_s; print(process_age_s())"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert 1.5 <= float(r.stdout) < 30, r.stdout


def test_only_the_command_lines_doctor_counts_the_interpreters_start(monkeypatch, tmp_path):
    # A doctor called inside a longer-lived process (a test, a notebook) counts from its call.
    from syncless import __main__ as entry
    from syncless.doctor import cli
    seen = []
    monkeypatch.setattr(cli, "run", lambda ns: seen.append(ns.from_start) or 0)
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    monkeypatch.setattr(sys, "argv", ["syncless", "doctor", str(script)])
    assert entry.main() == 0 and entry.main(["doctor", str(script)]) == 0
    assert seen == [True, False]
    assert cli.parse_args([str(script)]).from_start is False
