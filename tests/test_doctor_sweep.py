"""The loader remedy, measured: side loaders of the user's own dataset, sampler, batch size and
collate timed with k workers (doctor/_sweep.py), in watch(), doctor() and the script doctor."""
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import syncless
from benchmarks.doctor_sweep import Decode, Storage, measured as measured_step, tiny_step
from syncless.doctor import _sweep

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPUS = len(os.sched_getaffinity(0))


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
def test_a_cpu_bound_loader_gets_the_workers_its_sweep_measured():
    # Workers that decode (10 ms of CPU a sample) compete for the CPUs with each other: the
    # count prescribed is no more than the CPUs (torch on one thread, a ~0.5-ms body), its step
    # predicted within 25% of the step measured with it. A cap of one CPU per torch thread
    # prescribed nothing here, where 2 workers measured 41.3 -> 21.7 ms/step. (How far the
    # sweep doubles depends on the host's load: under load more processes win more CPU.)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        d = syncless.doctor(tiny_step(), steps=8, warmup=1, audit_steps=1, file=None,
                            loader=DataLoader(Decode(), batch_size=4))
        f = d.finding("starvation")
        assert f is not None and "sweep" in f.extra, d.report()
        sweep = f.extra["sweep"]
        assert sweep["cpu_share"][1] >= _sweep.COMPUTES, sweep
        workers, predicted = f.extra["workers_needed"], f.fixes[0].predicted_ms
        assert workers in range(1, CPUS + 1), f.fixes[0]
        measured = measured_step(Decode(), workers, tiny_step())
    finally:
        torch.set_num_threads(threads)
    assert abs(predicted - measured) <= 0.25 * measured, (predicted, measured, f.fixes[0])


def test_a_cpu_loops_own_threads_keep_their_cpus_from_workers_that_compute():
    # Torch's threads keep CPUs busy for their share of the step (or the CPU time measured in
    # its body); workers that compute get only the CPUs left (a loop on one thread leaves them
    # all: its thread waits for the batch).
    from syncless.doctor.findings import starvation_finding
    s = _sweep.Sweep(period_ms={1: 40.0, 2: 20.5, 4: 20.0}, cpu_share={1: 0.95, 2: 0.9, 4: 0.5})

    def finding(trainer_cpus, body_ms, body_cpu_ms=None):
        # a 45-ms step: 40 ms of data wait (made on the training thread), the body the rest
        return starvation_finding(40.0, 40.0 + body_ms, None, {"num_workers": 0}, cpus=4,
                                  data_cpu=1.0, trainer_cpus=trainer_cpus,
                                  sweeper=lambda target: s, body_cpu_ms=body_cpu_ms)
    one = finding(1, 5.0)
    assert one.extra["workers_needed"] == 2 and one.fixes[0].predicted_ms == 20.5, one.fixes[0]
    busy = finding(4, 5.0)                      # 4 threads through the whole body: 4 CPUs
    assert busy.extra["workers_needed"] is None, busy.fixes[0]
    assert busy.fixes[0].startswith("no CPU is free for a worker"), busy.fixes[0]
    assert "torch's own 4 threads (torch.get_num_threads()) keep 4 of this machine's 4 CPUs " \
        "busy through the step" in busy.fixes[0], busy.fixes[0]
    half = finding(2, 5.0)                      # 2 threads: 2 CPUs busy, 2 left
    assert half.extra["workers_needed"] == 2, half.fixes[0]
    # Measured (a CPU loop's body CPU time, all threads): 4 threads that keep 1 CPU busy over
    # the 5-ms body leave 3; 20 ms of CPU time in 5 ms keep all 4.
    small_ops = finding(4, 5.0, body_cpu_ms=5.2)
    assert small_ops.extra["workers_needed"] == 2, small_ops.fixes[0]
    full = finding(4, 5.0, body_cpu_ms=19.5)
    assert full.fixes[0].startswith("no CPU is free for a worker"), full.fixes[0]
    assert "the step keeps 4 of this machine's 4 CPUs busy (measured: its body takes 19.50 ms " \
        "of CPU time, torch's 4 threads included)" in full.fixes[0], full.fixes[0]
    assert "--verify times the loop itself" in full.fixes[0]
    # One thread leaves every CPU, measured or not: it waits while the batch is made.
    assert finding(1, 5.0, body_cpu_ms=5.0).extra["workers_needed"] == 2


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


def test_the_sweep_starts_at_the_loaders_own_count():
    # A loader of 2 workers the step waits for needs more, never fewer: its sweep times 2, 4
    # (imagenet's 4 workers on an H100 spent 9 of the sweep's 32 s on 1 and 2 workers).
    loader = DataLoader(Storage(), batch_size=4, num_workers=2)
    r = _sweep.recipe(loader)
    assert r.workers == 2 and _sweep.recipe(iter(DataLoader(Storage(), batch_size=4))).workers == 0
    s = _sweep.sweep(r, 15.0, CPUS)
    assert min(s.period_ms) == 2 and 4 in s.period_ms, s
    assert s.period_ms[2] >= 19 and s.period_ms[4] <= 0.7 * s.period_ms[2], s.text()
    assert s.text().startswith("2: "), s.text()


def test_side_loaders_pin_as_the_users_loader_does():
    # pin_memory=True: the side loaders' batches go through the same pinning thread (on a GPU
    # host it copies each batch on the taking process's CPU); without an accelerator torch's
    # warning that it pins nothing stays inside the sweep.
    loader = DataLoader(Storage(), batch_size=4, pin_memory=True)
    r = _sweep.recipe(loader)
    assert r.pin_memory and not _sweep.recipe(DataLoader(Storage(), batch_size=4)).pin_memory
    assert r.loader(1).pin_memory
    s = _sweep.sweep(r, 50.0, CPUS)            # one worker (40 ms a batch) keeps up
    assert list(s.period_ms) == [1] and 39.0 <= s.period_ms[1] <= 50.0, s


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


def test_a_sweep_cut_short_while_still_scaling_extrapolates_and_says_so():
    # imagenet resnet18 -j 4 on an H100 (FakeData, 256 images a batch): 1 worker made a batch
    # every 544.7 ms, 2 every 272.9, and the 8-s sweep ended there. The step (125.4 ms) waited
    # 73.9 ms for data and blocked 41.8 ms in .item() behind 55.2 ms of GPU work; its own
    # --verify sweep measured 8 workers at 61 ms and 16 at 59. The syncs wait for GPU work the
    # wait held back: the step needs a batch every 55.2 ms, which 10 workers deliver.
    from syncless.doctor.findings import starvation_finding
    s = _sweep.Sweep(period_ms={1: 544.7, 2: 272.9}, cpu_share={1: 1.0, 2: 1.0},
                     ended="ran out of time at 4 workers")
    assert s.extrapolate(55.164, 16) == (10, pytest.approx(272.9 * 2 / 10))
    f = starvation_finding(73.865, 125.4, 55.164, {"num_workers": 4, "pin_memory": True},
                           cuda=True, cpus=16, data_cpu=1.0, host_ms=125.4 - 41.835,
                           sweeper=lambda target: s)
    assert f.extra["workers_needed"] == 10, f.fixes[0]
    assert f.fixes[0].predicted_ms == pytest.approx(55.164), f.fixes[0]
    assert f.fixes[0].startswith("num_workers=4 cannot keep up: num_workers=10 (measured: "
                                      "side loaders"), f.fixes[0]
    assert "its time ran out while each doubling still cut the period, so 10 workers are " \
        "extrapolated from 2: a batch every 54.6 ms" in f.fixes[0]
    # Not where the last doubling saturated, nor where the sweep ended for another reason.
    assert _sweep.Sweep(period_ms={1: 544.7, 2: 500.0},
                        ended="ran out of time at 4 workers").extrapolate(55.0, 16) is None
    assert _sweep.Sweep(period_ms={1: 544.7, 2: 272.9},
                        ended="stopped at 2 workers, the most it tries on 2 CPUs"
                        ).extrapolate(55.0, 16) is None
    # At most the CPUs workers that compute may take.
    assert s.extrapolate(55.164, 6) == (6, pytest.approx(272.9 * 2 / 6))
