"""Logger(delivery="caller"): the logging thread delivers its own rows at its flushes, once their
copies have landed, so no second thread takes the GIL from a host-bound loop. The rows must be
the ones the delivery thread gives, nothing may wait for the GPU that did not have to, and
backpressure, timers, failing sinks and sinks that call back must behave as they do there."""
import math
import threading
import time

import pytest
import torch

import syncless
from _sinks import Collect


def value(v, device):
    return torch.tensor(float(v), device=device)


def run_loop(device, delivery, every, windows):
    """A loop with what real ones do: default and explicit steps, two calls at one step, a
    metric only on some steps, a new metric half-way (the ring grows), NaN, numbers, flushes."""
    sink = Collect()
    log = syncless.Logger(every=every, windows=windows, sinks=[sink], delivery=delivery)
    step = 0
    for i in range(250):
        metrics = {"loss": value(1.0 / (i + 1), device), "lr": 1e-3 * (i % 7)}
        if i % 3 == 0:
            metrics["acc"] = value(i % 10 / 10, device)
        if i >= 125:
            metrics.update({f"late{k}": value(i + k, device) for k in range(40)})
        if i == 77:
            metrics["loss"] = value(float("nan"), device)
        if i % 50 == 10:
            log(step, extra=value(-i, device))       # a second call at this step
        log.log(metrics, step=step)
        step += 1 + (i % 11 == 0)                     # steps skipped now and then
        if i % 60 == 59:
            log.flush(wait=False)
    log.close()
    return sink, log.stats


@pytest.mark.parametrize("every,windows", [(1, 1), (3, 1), (7, 4), (100, 4)])
def test_caller_delivery_gives_the_rows_and_counts_of_the_thread(device, every, windows):
    by_thread, stats_thread = run_loop(device, "thread", every, windows)
    by_caller, stats_caller = run_loop(device, "caller", every, windows)
    assert len(by_caller.rows) == len(by_thread.rows) == stats_caller.steps == 255
    for (s1, v1), (s2, v2) in zip(by_thread.rows, by_caller.rows):
        assert s1 == s2
        assert v1.keys() == v2.keys()
        assert all(v1[k] == v2[k] or (math.isnan(v1[k]) and math.isnan(v2[k])) for k in v1)
    assert stats_caller.delivered == stats_thread.delivered == 255
    assert stats_caller.nonfinite == stats_thread.nonfinite == {"loss": 1}
    assert stats_caller.lost == 0 and stats_caller.sink_errors == 0
    # On the main thread the sinks run on the logger's helper while the loop waits for them
    # (so a Ctrl-C never cuts a write() short; see _whole): one thread, never the loop's.
    assert len(by_caller.threads) == 1 and threading.get_ident() not in by_caller.threads


def test_the_logging_thread_delivers_at_its_flushes_and_starts_only_the_sinks_helper(device):
    """The rows go out at the loop's own flushes; the only thread started is the helper that
    runs the sinks' calls while the main thread waits for them, and it ends with close()."""
    before = {t.ident for t in threading.enumerate()}
    sink = Collect()
    log = syncless.Logger(every=10, sinks=[sink], delivery="caller")
    for i in range(10):
        log(x=value(i, device))
    if device == "cuda":
        torch.cuda.synchronize()       # the first window's copy has landed...
        assert log.delivered_step == -1
        for i in range(10, 20):
            log(x=value(i, device))    # ...and the next flush delivers it
    assert log.delivered_step == 9 and [s for s, _ in sink.rows] == list(range(10))
    assert {t.name for t in threading.enumerate() if t.ident not in before} == {"syncless-sinks"}
    log.close()
    time.sleep(0.1)
    assert {t.ident for t in threading.enumerate()} == before
    assert [v["x"] for _, v in sink.rows] == [float(i) for i in range(len(sink.rows))]
    assert log.stats.delivered == log.stats.steps


def test_timers_join_their_rows(device):
    sink = Collect()
    log = syncless.Logger(every=4, sinks=[sink], delivery="caller")
    x = torch.ones(64, 64, device=device)
    for i in range(10):
        with syncless.timer("step_ms", log=log):
            y = x @ x
            log(loss=y.mean())
    log.close()
    assert [s for s, _ in sink.rows] == list(range(10))
    assert all(v["step_ms"] > 0 and v["loss"] == 64.0 for _, v in sink.rows)


def test_a_failing_sink_is_reported_once_and_the_others_get_every_row(device, caplog):
    class Bad:
        def write(self, rows):
            raise KeyboardInterrupt("from a sink")     # the sink's own: reported, raised once

    got = Collect()
    with pytest.raises(KeyboardInterrupt, match="from a sink"):
        with syncless.Logger(every=2, sinks=[Bad(), got], delivery="caller") as log:
            for i in range(5):
                log(x=value(i, device))
    assert log.closed and [s for s, _ in got.rows] == list(range(5))
    assert log.stats.sink_errors == 3
    assert sum("KeyboardInterrupt" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("call", ["log", "flush", "close"])
def test_a_sink_calling_its_logger_is_refused_and_loses_nothing(device, call, caplog):
    got, seen = [], []

    class Rude:
        def write(self, rows):
            got.extend(r.step for r in rows)
            try:
                log(echo=1.0) if call == "log" else getattr(log, call)()
            except RuntimeError as exc:
                seen.append(str(exc))
                raise

    log = syncless.Logger(every=2, sinks=[Rude()], delivery="caller")
    for i in range(6):
        log(x=value(i, device))
    log.close()
    assert got == list(range(6)) and log.stats.delivered == 6 and log.stats.steps == 6
    assert seen and all("from a sink's write()" in m and "must not call the logger" in m
                        for m in seen)


def test_a_bad_delivery_is_refused():
    with pytest.raises(ValueError, match="delivery must be 'thread'.*or 'caller'.*'main'"):
        syncless.Logger(delivery="main")


# ---- what only a GPU can show ---------------------------------------------------------------

@pytest.mark.cuda
def test_thousands_of_calls_never_sync():
    sink = Collect()
    x = torch.randn(256, 256, device="cuda")
    log = syncless.Logger(every=100, sinks=sink, device="cuda", delivery="caller")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(3000):
            y = x @ x
            log(loss=y.mean(), gn=y.norm(), lr=1e-3)
            if step % 700 == 0:
                log.flush(wait=False)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    log.close()
    assert [s for s, _ in sink.rows] == list(range(3000))
    assert sink.rows[-1][1]["loss"] == pytest.approx(float((x @ x).mean()), rel=1e-6)


@pytest.mark.cuda
def test_a_timer_on_another_stream_holds_its_row_back_instead_of_waiting():
    sink = Collect()
    log = syncless.Logger(every=5, sinks=[sink], delivery="caller")
    side = torch.cuda.Stream()
    log(x=value(0, "cuda"))
    with torch.cuda.stream(side):
        with syncless.timer("side", log=log, step=1) as slow:
            torch.cuda._sleep(2_000_000_000)          # about a second on the side stream
    for i in range(1, 5):
        log(x=value(i, "cuda"))                        # the flush: steps 0-4 copied
    torch.cuda.current_stream().synchronize()         # that copy landed; the side stream runs
    for i in range(5, 10):
        log(x=value(i, "cuda"))                        # this flush delivers what it can
    assert not slow.ready                              # nothing waited for the timer...
    assert log.delivered_step == 0                     # ...so its step waits, with those after
    log.close()
    assert [s for s, _ in sink.rows] == list(range(10))
    assert sink.rows[1][1]["side"] == pytest.approx(slow.ms) and slow.ms > 100
    assert [v["x"] for _, v in sink.rows] == [float(i) for i in range(10)]


@pytest.mark.cuda
def test_backpressure_waits_for_the_oldest_copy_and_loses_nothing():
    sink = Collect()
    log = syncless.Logger(every=2, windows=1, sinks=[sink], delivery="caller")
    for i in range(20):
        torch.cuda._sleep(20_000_000)                  # the GPU falls behind the host
        log(x=value(i, "cuda"))
    assert log.stats.waits > 0
    log.close()
    assert [s for s, _ in sink.rows] == list(range(20))
    assert [v["x"] for _, v in sink.rows] == [float(i) for i in range(20)]
    assert log.stats.lost == 0
