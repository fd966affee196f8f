"""The loader remedy, measured: side loaders of the user's own dataset, sampler, batch size and
collate timed with k workers (doctor/_sweep.py), in watch(), doctor() and the script doctor."""
import json
import os
import statistics
import subprocess
import sys
import textwrap
import time
import warnings

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import syncless
from syncless.doctor import _sweep

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPUS = len(os.sched_getaffinity(0))


class Storage(Dataset):
    """Each sample waits 10 ms (a disk or network read): workers need no CPU each."""

    def __len__(self):
        return 100000

    def __getitem__(self, i):
        time.sleep(0.01)
        return torch.full((8,), float(i))


class Decode(Dataset):
    """Each sample computes for 10 ms of its thread's CPU time (a JPEG decode)."""

    def __len__(self):
        return 100000

    def __getitem__(self, i):
        t = time.thread_time()
        while time.thread_time() - t < 0.01:
            pass
        return torch.full((8,), float(i))


def children():
    """Live child processes of this one (Linux)."""
    with open(f"/proc/{os.getpid()}/task/{os.getpid()}/children") as f:
        return f.read().split()


def test_the_sweep_times_the_users_own_loader_and_leaves_its_rng_alone():
    g = torch.Generator().manual_seed(7)
    loader = DataLoader(Storage(), batch_size=4, shuffle=True, generator=g)
    state, gstate = torch.get_rng_state(), g.get_state()
    before = children()
    # A step of its own 15 ms: 4 workers (10 ms a batch) keep up, the sweep stops there (8 on
    # a host loaded enough to slow 4 down by half).
    s = _sweep.sweep(_sweep.recipe(loader), 15.0, CPUS)
    assert list(s.period_ms) in ([1, 2, 4], [1, 2, 4, 8]), s
    assert s.ended == f"stopped at {max(s.period_ms)} workers: they keep up with the step"
    # 4 samples x 10 ms a batch per worker: 40 ms with one, halved by each doubling.
    assert s.period_ms[1] >= 39 and s.period_ms[4] <= 0.35 * s.period_ms[1], s.text()
    assert not s.computes and max(s.cpu_share.values()) < _sweep.COMPUTES, s.cpu_share
    # The prefetch, then whole rounds for at least 0.5 s (3 rounds of 40 ms take less).
    rounds = {k: (s.batches[k] - 2 * k) / k for k in s.period_ms}
    assert all(r == int(r) and r > _sweep.ROUNDS for r in rounds.values()), s.batches
    assert torch.equal(torch.get_rng_state(), state) and torch.equal(g.get_state(), gstate), \
        "the loop's next epoch sees the order it would have seen"
    assert children() == before, "every side worker is gone"


def measured_step(dataset, workers, step, seconds=1.0, repeats=3):
    """ms/step of `step` over a DataLoader of `dataset` (batch 4) with `workers` workers, past
    the prefetch, over whole rounds (a batch from each worker: waiting workers deliver theirs
    together) for `seconds`: the median of `repeats` (the host's load comes in bursts)."""
    with warnings.catch_warnings():         # torch's: more workers than CPUs (they wait)
        warnings.simplefilter("ignore", UserWarning)
        it = iter(DataLoader(dataset, batch_size=4, num_workers=workers,
                             persistent_workers=True))
    for _ in range(2 * workers):
        step(next(it))
    readings = []
    for _ in range(repeats):
        t, steps = time.perf_counter(), 0
        while steps % workers or time.perf_counter() - t < seconds:
            step(next(it))
            steps += 1
        readings.append((time.perf_counter() - t) / steps * 1e3)
    it._shutdown_workers()
    return statistics.median(readings)


def tiny_step():
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(batch):
        opt.zero_grad()
        model(batch).sum().backward()
        opt.step()
    return step


@pytest.mark.slow
@pytest.mark.timing
def test_watch_prescribes_the_measured_workers_for_a_storage_bound_loader():
    # The loader: 41.8 ms/step with no worker, 21.0 with 2, 10.4 with 4, 5.6 with 8 on
    # 2 cores, where the model allowed at most one worker per CPU.
    step = tiny_step()
    w = syncless.watch(DataLoader(Storage(), batch_size=4))
    for i, batch in enumerate(w):
        step(batch)
        if i == 12:
            break
    [f] = w.findings(w.summary(skip=2))
    workers, predicted = f.extra["workers_needed"], f.fixes[0].predicted_ms
    assert workers >= 4, f.fixes[0]
    assert f"num_workers={workers} (measured: side loaders" in f.fixes[0]
    assert str(w).count("measured: side loaders") == 1, "the report shows the sweep"
    assert w.findings(w.summary(skip=2))[0].extra["sweep"] == f.extra["sweep"], "swept once"
    measured = measured_step(Storage(), workers, step)
    assert abs(predicted - measured) <= 0.25 * measured, (predicted, measured, f.fixes[0])


@pytest.mark.slow
@pytest.mark.timing
def test_a_cpu_bound_loader_gets_no_more_workers_than_the_cpus_left():
    # Workers that decode compete for the CPUs with the loop's own torch threads: the count
    # stops at the CPUs those leave (one here: torch on one thread, 2 CPUs), whatever the
    # batch time asks for.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        d = syncless.doctor(tiny_step(), steps=8, warmup=1, audit_steps=1, file=None,
                            loader=DataLoader(Decode(), batch_size=4))
    finally:
        torch.set_num_threads(threads)
    f = d.finding("starvation")
    assert f is not None and "sweep" in f.extra, d.report()
    sweep = f.extra["sweep"]
    assert sweep["cpu_share"][1] >= _sweep.COMPUTES, sweep
    assert f.extra["workers_needed"] in (None, *range(1, CPUS)), f.fixes[0]
    assert max(sweep["period_ms"]) <= 2 * CPUS, "a saturated sweep stops doubling"


SCRIPT = """
    import sys, time, torch
    from torch.utils.data import DataLoader, Dataset
    class Storage(Dataset):
        def __len__(self): return 100000
        def __getitem__(self, i):
            time.sleep(0.01)
            return torch.full((8,), float(i))
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(100):
        for b in DataLoader(Storage(), batch_size=4, shuffle=True):
            opt.zero_grad(); model(b).sum().backward(); opt.step()
"""


@pytest.mark.slow
@pytest.mark.timing
def test_the_script_doctor_prescribes_the_measured_workers(tmp_path):
    (tmp_path / "train.py").write_text(textwrap.dedent(SCRIPT))
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    r = subprocess.run([sys.executable, "-m", "syncless", "doctor", "--quick", "--no-verify",
                        "--json", "d.json", "train.py"], capture_output=True, text=True,
                       timeout=300, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    d = json.loads((tmp_path / "d.json").read_text())
    [f] = [f for f in d["findings"] if f["kind"] == "starvation"]
    workers, predicted = f["workers_needed"], f["fixes"][0]["predicted_ms"]
    assert workers >= 4, f["fixes"][0]["text"]
    assert set(f["sweep"]["period_ms"]) >= {"1", "2", "4"}, f["sweep"]
    measured = measured_step(Storage(), workers, tiny_step())
    assert abs(predicted - measured) <= 0.25 * measured, (predicted, measured, f["fixes"][0])


class Broken(Dataset):
    def __len__(self):
        return 100

    def __getitem__(self, i):
        raise OSError(f"sample {i}: no such file")


class Stuck(Dataset):
    def __len__(self):
        return 100

    def __getitem__(self, i):
        time.sleep(4)                      # a read that comes back too late


def test_a_failing_dataset_ends_the_sweep_not_the_doctor():
    before = children()
    s = _sweep.sweep(_sweep.recipe(DataLoader(Broken(), batch_size=4)), 1.0, CPUS)
    assert s.period_ms == {} and s.ended.startswith(
        "stopped: a side loader of 1 workers failed: OSError: Caught OSError in DataLoader "
        "worker process 0"), s.ended
    assert children() == before
    # Nothing measured: the finding falls back to the model, and says nothing of a sweep.
    from syncless.doctor.findings import starvation_finding
    f = starvation_finding(40.0, 42.0, None, {"num_workers": 0}, cpus=2, data_cpu=0.0,
                           sweeper=lambda target: s)
    assert "measured: side loaders" not in f.fixes[0] and f.extra["workers_needed"] is not None


@pytest.mark.slow
def test_a_stuck_dataset_ends_the_sweep_not_the_doctor():
    before = children()
    t = time.perf_counter()
    s = _sweep.sweep(_sweep.recipe(DataLoader(Stuck(), batch_size=4)), 1.0, CPUS, budget_s=1.5)
    assert time.perf_counter() - t < 10, "the batch's timeout ends it, with the workers"
    assert s.period_ms == {} and "failed: RuntimeError: DataLoader timed out" in s.ended, s.ended
    assert children() == before


def test_workers_that_win_nothing_leave_the_wait_ranked_not_predicted():
    # Under load one worker made batches no faster than the training thread (117.8 ms against a
    # 121.9-ms step): no count is prescribed, and the finding still ranks by the wait.
    from syncless.doctor.findings import starvation_finding
    s = _sweep.Sweep(period_ms={1: 125.0, 2: 124.0}, cpu_share={1: 0.9, 2: 0.5})
    f = starvation_finding(118.6, 121.9, None, {"num_workers": 0}, cpus=2, data_cpu=0.9,
                           sweeper=lambda target: s)
    assert f.fixes[0].predicted_ms is None and f.extra["workers_needed"] is None
    assert f.fixes[0].startswith("no worker count the sweep tried beyond num_workers=0 makes "
                                 "the step faster than its 121.90 ms (measured: "), f.fixes[0]
    assert f.cost_ms == pytest.approx(118.6), "what removing the wait wins: not minor"
