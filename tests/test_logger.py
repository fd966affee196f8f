"""Logger behaviour, read back from real sinks. Every test runs on CPU tensors (CI) and on CUDA
tensors (marker `cuda`, the GPU machine) through the `device` fixture."""
import csv
import json
import math
import threading
import time

import pytest
import torch

import syncless
from syncless.sinks import CSV, JSONL, Callback
from _sinks import Collect, Gated


def scalar(value, device, dtype=torch.float32):
    return torch.tensor(value, dtype=dtype, device=device)


def test_steps_and_values_reach_every_sink(device, tmp_path):
    sink = Collect()
    with syncless.Logger(every=4, sinks=[sink, JSONL(tmp_path / "m.jsonl"),
                                         CSV(tmp_path / "m.csv")]) as log:
        for i in range(10):
            log(loss=scalar(i * 0.5, device), acc=scalar(i, device, torch.int64), lr=0.1)
    expected = [(i, {"loss": i * 0.5, "acc": float(i), "lr": 0.1}) for i in range(10)]
    assert sink.rows == expected
    assert sink.closed
    lines = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [(d.pop("step"), d.pop("time") > 0, d) for d in lines] == \
        [(s, True, v) for s, v in expected]
    with open(tmp_path / "m.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert [int(r["step"]) for r in table] == list(range(10))
    assert [float(r["loss"]) for r in table] == [i * 0.5 for i in range(10)]
    assert log.stats.steps == 10 and log.stats.delivered == 10


def test_explicit_steps_and_log_method(device):
    sink = Collect()
    with syncless.Logger(every=3, sinks=sink) as log:
        log.log({"loss": scalar(1.0, device)}, step=5)
        log.log({"loss": scalar(2.0, device)}, step=5)        # same step again is allowed
        log(loss=scalar(3.0, device))                           # continues after 5
        log(7, loss=scalar(4.0, device))
        log(loss=scalar(5.0, device), step=100)
    assert sink.rows == [(5, {"loss": 1.0}), (5, {"loss": 2.0}), (6, {"loss": 3.0}),
                         (7, {"loss": 4.0}), (100, {"loss": 5.0})]


def test_step_going_backwards_is_refused_and_nothing_is_lost(device):
    sink = Collect()
    with syncless.Logger(every=2, sinks=sink) as log:
        log(loss=scalar(1.0, device), step=10)
        with pytest.raises(ValueError, match="step 9 is before the last logged step 10"):
            log(loss=scalar(2.0, device), step=9)
        with pytest.raises(TypeError, match="step must be an int"):
            log(loss=scalar(2.0, device), step=1.5)
        log(loss=scalar(3.0, device))
    assert sink.rows == [(10, {"loss": 1.0}), (11, {"loss": 3.0})]


@pytest.mark.parametrize("dtype, value", [
    (torch.float16, 0.333251953125), (torch.bfloat16, 0.333984375), (torch.float32, 0.1),
    (torch.float64, 0.1), (torch.int8, -7), (torch.int16, -300), (torch.int32, 123456),
    (torch.int64, -(2 ** 40)), (torch.uint8, 250), (torch.bool, True)])
def test_every_dtype_is_delivered_exactly(device, dtype, value):
    t = torch.tensor(value, dtype=dtype, device=device)
    expected = float(torch.tensor(value, dtype=dtype).double())
    sink = Collect()
    with syncless.Logger(every=1, sinks=sink) as log:
        log(x=t, y=t.reshape(1), z=t.reshape(1, 1, 1))
    assert sink.rows == [(0, {"x": expected, "y": expected, "z": expected})]


def test_requires_grad_views_and_python_numbers(device):
    w = torch.full((3,), 2.0, device=device, requires_grad=True)
    loss = (w * w).sum()                                   # requires_grad, 12.0
    big = torch.arange(10.0, device=device)
    sink = Collect()
    with syncless.Logger(every=5, sinks=sink) as log:
        log(loss=loss, view=big[7], num=3, flag=True, f=2.5)
    assert sink.rows == [(0, {"loss": 12.0, "view": 7.0, "num": 3.0, "flag": 1.0, "f": 2.5})]


def test_value_is_taken_at_the_call_even_if_modified_or_freed(device):
    sink = Collect()
    with syncless.Logger(every=50, sinks=sink) as log:
        t = torch.zeros((), device=device)
        for i in range(20):
            t.fill_(float(i))
            log(x=t)
            t.add_(1000.0)                                  # in place, after the call
            tmp = torch.full((), float(i) * 2, device=device)
            log(y=tmp)
            del tmp                                         # freed right after the call
            torch.full((), -1.0, device=device)             # likely reuses tmp's block
    xs = [v["x"] for _, v in sink.rows if "x" in v]
    ys = [v["y"] for _, v in sink.rows if "y" in v]
    assert xs == [float(i) for i in range(20)]
    assert ys == [float(i) * 2 for i in range(20)]


def test_absent_metrics_stay_absent_and_new_names_appear_midrun(device, tmp_path):
    sink = Collect()
    with syncless.Logger(every=3, sinks=[sink, CSV(tmp_path / "m.csv")]) as log:
        log(a=scalar(1.0, device))
        log(b=scalar(2.0, device))
        log(a=scalar(3.0, device), c=scalar(4.0, device))
        log(d=5.0)
    assert sink.rows == [(0, {"a": 1.0}), (1, {"b": 2.0}), (2, {"a": 3.0, "c": 4.0}),
                         (3, {"d": 5.0})]
    with open(tmp_path / "m.csv", newline="") as f:
        table = list(csv.reader(f))
    assert table[0] == ["step", "time", "a", "b", "c", "d"]
    assert [r[:1] + r[2:] for r in table[1:]] == [
        ["0", "1.0", "", "", ""], ["1", "", "2.0", "", ""], ["2", "3.0", "", "4.0", ""],
        ["3", "", "", "", "5.0"]]


def test_many_metrics_in_one_call_and_columns_growing_past_a_block(device):
    sink = Collect()
    with syncless.Logger(every=2, sinks=sink) as log:
        for step in range(3):
            log.log({f"m{i}": scalar(i + step * 1000, device) for i in range(64)})
        # 150 metric names in all: the ring widens twice while running
        log.log({f"n{i}": scalar(-i, device) for i in range(86)})
        log.log({"m0": scalar(7.0, device), "n85": scalar(8.0, device)})
    assert len(sink.rows) == 5
    for step in range(3):
        assert sink.rows[step] == (step, {f"m{i}": float(i + step * 1000) for i in range(64)})
    assert sink.rows[3] == (3, {f"n{i}": float(-i) for i in range(86)})
    assert sink.rows[4] == (4, {"m0": 7.0, "n85": 8.0})


def test_too_many_metrics_in_one_call(device):
    with syncless.Logger(every=2) as log:
        with pytest.raises(ValueError, match="at most 248 metrics per call"):
            log.log({f"m{i}": scalar(i, device) for i in range(249)})


def test_nan_and_inf_are_delivered_as_is_and_counted(device):
    sink = Collect()
    with syncless.Logger(every=3, sinks=sink) as log:
        log(loss=scalar(float("nan"), device), gn=scalar(1.0, device))
        log(loss=scalar(float("inf"), device), gn=scalar(float("-inf"), device))
        log(loss=scalar(2.0, device))
    assert math.isnan(sink.rows[0][1]["loss"])
    assert sink.rows[1] == (1, {"loss": math.inf, "gn": -math.inf})
    assert log.stats.nonfinite == {"loss": 2, "gn": 1}


@pytest.mark.parametrize("value, error, text", [
    (lambda d: torch.ones(3, device=d), ValueError, r"metric 'bad' must hold one element, got shape \(3,\)"),
    (lambda d: torch.ones(2, 2, device=d), ValueError, r"metric 'bad' must hold one element, got shape \(2, 2\)"),
    (lambda d: torch.ones((), device=d, dtype=torch.complex64), TypeError, "metric 'bad' has a dtype"),
    (lambda d: "0.5", TypeError, "metric 'bad' must be a real number or a one-element tensor, got str"),
    (lambda d: 1 + 2j, TypeError, "metric 'bad' .*complex"),
    (lambda d: torch.ones((), device="meta"), TypeError, "metric 'bad'.*meta"),
    (lambda d: [1.0], TypeError, "metric 'bad' must be a real number"),
])
def test_bad_input_names_the_metric_and_loses_nothing(device, value, error, text):
    sink = Collect()
    with syncless.Logger(every=2, sinks=sink) as log:
        log(good=scalar(1.0, device))
        with pytest.raises(error, match=text):
            log(good=scalar(9.0, device), bad=value(device))
        log(good=scalar(2.0, device))
    assert sink.rows == [(0, {"good": 1.0}), (1, {"good": 2.0})]


def test_logging_after_close_is_an_error(device):
    sink = Collect()
    log = syncless.Logger(every=10, sinks=sink)
    log(x=scalar(1.0, device))
    log.close()
    log.close()                                             # idempotent
    with pytest.raises(ValueError, match="closed"):
        log(x=scalar(2.0, device))
    assert sink.rows == [(0, {"x": 1.0})]


def test_flush_delivers_a_partial_window(device):
    sink = Collect()
    with syncless.Logger(every=1000, sinks=sink) as log:
        for i in range(5):
            log(x=scalar(float(i), device))
        log.flush()
        assert [s for s, _ in sink.rows] == [0, 1, 2, 3, 4]
        assert sink.flushed >= 1
        log(x=scalar(5.0, device))
    assert [s for s, _ in sink.rows] == list(range(6))


def test_exception_in_the_loop_loses_no_logged_step(device):
    sink = Collect()
    with pytest.raises(RuntimeError, match="boom"):
        with syncless.Logger(every=100, sinks=sink) as log:
            for i in range(7):
                log(loss=scalar(float(i), device))
                if i == 6:
                    raise RuntimeError("boom")
    assert [v["loss"] for _, v in sink.rows] == [float(i) for i in range(7)]


def test_a_failing_sink_is_reported_once_and_others_keep_everything(device, caplog):
    calls = []

    def broken(step, t, values):
        calls.append(step)
        raise OSError("disk full")

    good = Collect()
    with syncless.Logger(every=2, sinks=[Callback(broken), good]) as log:
        for i in range(6):
            log(x=scalar(float(i), device))
    assert [s for s, _ in good.rows] == list(range(6))
    assert log.stats.sink_errors == 3
    reports = [r for r in caplog.records if "disk full" in r.getMessage()]
    assert len(reports) == 1 and "reported once" in reports[0].getMessage()


def test_slow_sinks_make_the_logger_wait_not_drop(device):
    sink = Gated(timeout=5)
    gate = sink.gate
    log = syncless.Logger(every=2, sinks=sink, windows=1)
    releaser = threading.Timer(0.3, gate.set)
    releaser.start()
    for i in range(12):
        log(x=scalar(float(i), device))
    log.close()
    releaser.join()
    assert [v["x"] for _, v in sink.rows] == [float(i) for i in range(12)]
    assert log.stats.waits >= 1
    assert log.stats.windows == 6


def test_host_time_is_the_call_time(device):
    sink = []
    with syncless.Logger(every=10, sinks=Callback(lambda s, t, v: sink.append(t))) as log:
        before = time.time()
        log(x=scalar(1.0, device))
        time.sleep(0.05)
        log(x=scalar(2.0, device))
        after = time.time()
    assert before <= sink[0] < sink[1] <= after
    assert sink[1] - sink[0] >= 0.04


def test_stats_and_repr(device):
    with syncless.Logger(every=2) as log:
        for i in range(5):
            log(x=scalar(float(i), device))
    s = log.stats
    assert (s.steps, s.delivered, s.windows, s.waits, s.lost) == (5, 5, 3, 0, 0)
    assert "closed" in repr(log)


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="every must be a positive int"):
        syncless.Logger(every=0)
    with pytest.raises(ValueError, match="capacity"):
        syncless.Logger(every=10, capacity=5)
    with pytest.raises(ValueError, match="device must be cpu or cuda"):
        syncless.Logger(device="meta")


def test_unclosed_logger_is_drained_at_interpreter_exit(fresh_interpreter):
    # The script (conftest.FRESH) logs x = 0..24 with every=1000 and never closes its logger.
    assert [row["x"] for row in fresh_interpreter["rows_at_exit"]] == [float(i) for i in range(25)]


def test_print_sink_shows_last_value_and_window_mean(device, capsys):
    with syncless.Logger(every=4, sinks=syncless.sinks.Print()) as log:
        for i in range(6):
            log(loss=scalar(float(i), device), acc=0.5)
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["step 0-3 | loss 3 (mean 1.5) | acc 0.5 (mean 0.5)",
                     "step 4-5 | loss 5 (mean 4.5) | acc 0.5 (mean 0.5)"]


def test_a_user_sink_in_a_few_lines(device):
    class Totals:                                   # the whole sink protocol: write(rows)
        def __init__(self):
            self.sum = {}

        def write(self, rows):
            for row in rows:
                for name, value in row.values.items():
                    self.sum[name] = self.sum.get(name, 0.0) + value

    totals = Totals()
    with syncless.Logger(every=3, sinks=totals) as log:
        for i in range(10):
            log(loss=scalar(float(i), device))
    assert totals.sum == {"loss": 45.0}


def test_rows_is_the_public_home_of_row_reserved_names_and_the_sink_check(tmp_path):
    """Integrations (Lightning's callback, a user's own adapter) check sinks and reserved names
    the way Logger does, through syncless.rows."""
    from syncless import rows
    assert rows.Row is syncless.Row and rows.RESERVED == {"step", "time"}
    sink = syncless.sinks.JSONL(tmp_path / "m.jsonl")
    assert rows.check_sinks(sink) == [sink] and rows.check_sinks((sink,)) == [sink]
    with pytest.raises(TypeError, match=r"sinks=\[syncless.sinks.JSONL\('m.jsonl'\)\]"):
        rows.check_sinks("m.jsonl")
    with pytest.raises(TypeError, match="has no write"):
        rows.check_sinks([print])
    sink.close()
    for name in rows.RESERVED:
        with syncless.Logger() as log, pytest.raises(ValueError, match="is reserved"):
            log.log({name: 1.0})
