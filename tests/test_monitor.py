"""The step monitor's GPU sampling: how often it records events, and what it reports then."""
from __future__ import annotations

import time

import pytest
import torch

import syncless
from syncless.doctor import watch
from syncless.doctor.monitor import _MAX_EVERY, GPU_BUDGET, StepMonitor, sampling_interval


def test_sampling_interval_keeps_event_cost_under_budget():
    cost = 8e-6                                        # two event records + a poll, H200 host
    for wall, expect in [(10e-3, 1), (4e-3, 1), (1.8e-3, 2), (0.5e-3, 7), (1e-6, _MAX_EVERY)]:
        n = sampling_interval(cost, wall)
        assert n == expect, (wall, n)
        assert n == _MAX_EVERY or cost / n <= GPU_BUDGET * wall * (1 + 1e-9)
    assert sampling_interval(cost, 0.0) == _MAX_EVERY


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_gpu_every_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="gpu_every"):
        StepMonitor(gpu_every=bad)
    with pytest.raises(ValueError, match="gpu_every"):
        watch(range(3), gpu_every=bad)


def test_cpu_loop_records_every_step_without_gpu_timing():
    w = watch(range(50))
    assert sum(1 for _ in w) == 50
    m = w.summary()
    assert m.steps == 50 and m.gpu_ms is None and m.gpu_steps == 0 and w.monitor.untimed == 0


def _spin(seconds):
    """Burn `seconds` of this thread's CPU time."""
    t = time.thread_time()
    while time.thread_time() - t < seconds:
        pass


class Spinning(torch.utils.data.Dataset):         # 3 ms of CPU a sample: 12 ms a batch of 4
    def __len__(self):
        return 1000

    def __getitem__(self, i):
        _spin(0.003)
        return torch.zeros(2)


def test_a_cpu_loops_body_cpu_time_leaves_the_batchs_making_out():
    # The CPU time of the step body (what the doctor counts as CPUs the step keeps busy),
    # read around each step on a CPU loop: the batch made on the training thread is not in it,
    # whether it is made between steps (watch) or inside one (the doctor's hooked DataLoader).
    w = watch(torch.utils.data.DataLoader(Spinning(), batch_size=4))
    for i, _ in enumerate(w):
        _spin(0.004)
        if i == 10:
            break
    body = w.summary(skip=1).body_cpu_ms
    assert body is not None and 3.9 <= body <= 6.0, body
    d = syncless.doctor(lambda batch: _spin(0.004), steps=6, warmup=1, audit_steps=1,
                        file=None, loader=torch.utils.data.DataLoader(Spinning(), batch_size=4))
    body = d.summary.body_cpu_ms
    assert body is not None and 3.9 <= body <= 6.0, (body, d.report())


@pytest.mark.cuda
def test_short_steps_are_sampled_long_steps_all_timed():
    small = torch.randn(64, 64, device="cuda")
    w = watch(range(400))                              # ~tens of µs per step: a sample
    for _ in w:
        small = torch.tanh(small @ small)
    w.monitor.drain()
    short = w.summary()
    assert short.steps == 400
    assert 400 // _MAX_EVERY <= short.gpu_steps < 400, short
    assert short.gpu_ms > 0 and w.monitor.untimed == 0

    # Steps of ~17 ms: every one is timed once the first few taught the monitor the event cost
    # (measured inside such a loop on an H200: ~20 µs a step, 0.12% of it).
    # The host waits for the step before the last one, as a real loop does once the launch
    # queue is full; without that the host would run ahead.
    big = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    done = [torch.cuda.Event(), torch.cuda.Event()]
    w = watch(range(20))
    for i in w:
        done[i % 2].synchronize()
        for _ in range(12):
            big = torch.tanh(big @ big) / 8192
        done[i % 2].record()
    w.monitor.drain()
    long = w.summary()
    timed = sorted(w.monitor.gpu_ms)
    assert timed[-10:] == list(range(10, 20)), timed
    assert long.gpu_ms > 6.0, long                     # 12 × 8192³ bf16 matmul: ~17 ms, H200


@pytest.mark.cuda
def test_gpu_every_fixed_interval():
    a = torch.randn(256, 256, device="cuda")
    w = watch(range(30), gpu_every=5)
    for _ in w:
        a = torch.tanh(a @ a)
    w.monitor.drain()
    assert sorted(w.monitor.gpu_ms) == [0, 5, 10, 15, 20, 25]
