"""Logger(max_delay=...): rows reach the sinks on time even when `every` steps take long.

The loops below sleep to make steps slow (a step's length is a lower bound the host cannot
shorten), and the sinks record which step of the loop was running when a row arrived: the
assertions are about that step, with margins of several steps, never about the host's timing.
"""
import math
import time

import pytest
import torch

import syncless


class StepAtDelivery:
    """A sink that notes, for every row, the loop step that was running when it arrived."""

    def __init__(self):
        self.loop_step = -1
        self.arrived = []                  # (row step, row value, loop step at delivery)

    def write(self, rows):
        self.arrived.extend((r.step, r.values["loss"], self.loop_step) for r in rows)


def slow_loop(log, sink, device, steps, step_s, until=None):
    for i in range(steps):
        sink.loop_step = i
        log(loss=torch.tensor(float(i), device=device))
        if until is not None and until(sink):
            return i
        time.sleep(step_s)
    return steps


@pytest.mark.parametrize("delivery", ["thread", "caller"])
def test_first_row_arrives_within_max_delay_not_at_close(device, delivery):
    # every=100 with 0.3-s steps: without max_delay nothing would arrive for 30 s (here: until
    # close()). The window is handed over at the first call 0.5 s after its first row: step 2
    # (0.6 s in, at the earliest; later on a slow host, never earlier than the clock allows).
    sink = StepAtDelivery()
    with syncless.Logger(every=100, sinks=[sink], max_delay=0.5, delivery=delivery) as log:
        stopped = slow_loop(log, sink, device, 12, 0.3, until=lambda s: bool(s.arrived))
        before_close = list(sink.arrived)
    assert before_close, "no row reached the sink before close()"
    first = before_close[0]
    assert first[:2] == (0, 0.0)
    # Handed over by step 2's call; a thread delivers it within a few steps, a caller-delivered
    # host row at the hand-over itself (a CUDA copy at the next flush, one window later).
    assert first[2] <= 6, f"row 0 arrived at loop step {first[2]}"
    if delivery == "caller" and device == "cpu":
        assert first[2] <= 2                  # 1 only if a 0.3-s sleep overslept by 0.2 s
    assert stopped < 12
    # Every row once, in order, whatever window carried it.
    assert [(s, v) for s, v, _ in sink.arrived] == [(i, float(i)) for i in range(stopped + 1)]
    assert log.stats.delivered == stopped + 1


def test_later_windows_keep_the_bound(device):
    # The deadline belongs to each window's first row: after an early hand-over, the next
    # window is bounded the same way: its first row's call is at least 0.3 s before the next
    # and 0.6 s before the one after, so each row reaches the sink within two steps.
    sink = StepAtDelivery()
    with syncless.Logger(every=100, sinks=[sink], max_delay=0.5, delivery="caller") as log:
        slow_loop(log, sink, device, 9, 0.3)
        log.flush()
        windows = log.stats.windows
    assert [(s, v) for s, v, _ in sink.arrived] == [(i, float(i)) for i in range(9)]
    if device == "cpu":                           # host rows: delivered at each hand-over
        assert all(s <= at <= s + 2 for s, _, at in sink.arrived), sink.arrived
    assert windows >= 3                           # 0-2, 3-5, 6-8 at least; a slow host: more


def test_every_still_counts_and_none_disables_the_bound(device):
    # Quick calls: the `every` trigger alone decides (max_delay is far away), and max_delay=None
    # keeps rows until `every` or flush, however long the steps.
    quick, unbounded = StepAtDelivery(), StepAtDelivery()
    with syncless.Logger(every=4, sinks=[quick], max_delay=60.0, delivery="caller") as log:
        slow_loop(log, quick, device, 10, 0.0)
        assert log.stats.windows == 2                 # at the 4th and 8th calls
    with syncless.Logger(every=100, sinks=[unbounded], max_delay=None,
                         delivery="caller") as log:
        slow_loop(log, unbounded, device, 3, 0.3)
        assert unbounded.arrived == [] and log.stats.windows == 0
    assert [s for s, _, _ in quick.arrived] == list(range(10))
    assert [s for s, _, _ in unbounded.arrived] == [0, 1, 2]
    assert {at for _, _, at in unbounded.arrived} == {2}      # delivered by close()


def test_max_delay_zero_hands_over_every_call(device):
    sink = StepAtDelivery()
    with syncless.Logger(every=100, sinks=[sink], max_delay=0, delivery="caller") as log:
        slow_loop(log, sink, device, 5, 0.0)
        windows = log.stats.windows
    assert windows == 5
    assert [s for s, _, _ in sink.arrived] == list(range(5))


@pytest.mark.parametrize("bad", ["2", -1, -0.5, True, math.nan, [1]])
def test_bad_max_delay_is_refused(bad):
    with pytest.raises(ValueError, match=r"max_delay must be None or a number of seconds >= 0, "
                                         rf"got {bad!r}".replace("[", r"\[").replace("]", r"\]")):
        syncless.Logger(max_delay=bad)


def test_max_delay_is_public_and_defaults_to_two_seconds():
    with syncless.Logger() as log:
        assert log.max_delay == 2.0
    with syncless.Logger(max_delay=None) as log:
        assert log.max_delay is None


def test_max_delay_can_be_changed_between_windows(device):
    sink = StepAtDelivery()
    with syncless.Logger(every=100, sinks=[sink], max_delay=None, delivery="caller") as log:
        slow_loop(log, sink, device, 2, 0.0)
        log.max_delay = 0                        # from the next window on
        assert log.max_delay == 0
        log.flush()
        slow_loop(log, sink, device, 3, 0.0)
        windows = log.stats.windows
        with pytest.raises(ValueError, match="max_delay must be None or a number"):
            log.max_delay = -2
        assert log.max_delay == 0
    assert windows == 1 + 3                      # the flush, then one per call
    assert [s for s, _, _ in sink.arrived] == list(range(5))


def test_the_adapters_use_the_loggers_bound(tmp_path, device):
    """syncless.tensorboard's writer (and syncless.wandb's run) hand their rows over through the
    Logger's max_delay: with every=1000 and 0.3-s steps, a scalar is written within a few steps,
    and every one of them is in the event file after close()."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from syncless.tensorboard import SummaryWriter
    writer = SummaryWriter(tmp_path, every=1000, max_delay=0.5)
    seen_at = None
    try:
        for i in range(12):
            if writer.latest_step >= 0:
                seen_at = i
                break
            writer.add_scalar("loss", torch.tensor(float(i), device=device), i)
            time.sleep(0.3)
    finally:
        writer.close()
    assert seen_at is not None and seen_at <= 7, seen_at       # handed over at step 2
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(i, float(i))
                                                                for i in range(seen_at)]
