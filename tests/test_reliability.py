"""The Logger never crashes, hangs, lies or loses rows, on the cases a real run meets (issue 11):
forks, threads, sinks that call back into the logger, interrupts, garbage collection, sinks that
raise anything, reserved names, sinks that mutate rows, and bad steps. Cases that could hang or
kill the process run in a subprocess with a timeout, so a regression fails instead of stalling."""
import gc
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

import syncless
from syncless.sinks import JSONL, Callback


class Collect:
    def __init__(self):
        self.rows = []

    def write(self, rows):
        self.rows.extend((r.step, dict(r.values)) for r in rows)


def value(v, device):
    return torch.tensor(float(v), device=device)


def run_python(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = dict(os.environ, NCCL_NVLS_ENABLE="0")
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout, env=env)


# ---- forks --------------------------------------------------------------------------------------

@pytest.mark.parametrize("child", ["exit", "close", "log"])
def test_forked_child_exits_cleanly_and_never_delivers_the_parents_rows(device, tmp_path, child):
    path = tmp_path / "m.jsonl"
    r = run_python(f"""
        import os, sys, torch, syncless
        log = syncless.Logger(every=100, sinks=[syncless.sinks.JSONL({str(path)!r})])
        for i in range(5):
            log(loss=torch.tensor(float(i), device={device!r}))
        log.flush()                          # the delivery thread is running when we fork
        log(loss=torch.tensor(5.0, device={device!r}))   # and one row is still pending
        pid = os.fork()
        if pid == 0:
            if {child!r} == "close":
                log.close()                  # no-op in the child: its rows are the parent's
            elif {child!r} == "log":
                try:
                    log(loss=99.0)
                except RuntimeError as e:
                    print("child refused:", e, flush=True)
            sys.exit(0)                      # atexit runs: must not hang or write
        _, status = os.waitpid(pid, 0)
        print("child status", status, flush=True)
        log(loss=torch.tensor(6.0, device={device!r}))
        log.close()
    """, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "child status 0" in r.stdout
    if child == "log":
        assert "child refused: this Logger belongs to the process that forked" in r.stdout
    steps = [json.loads(line)["step"] for line in path.read_text().splitlines()]
    assert steps == list(range(7))           # each row once: the child delivered nothing


# ---- sinks that call back into their logger -------------------------------------------------

@pytest.mark.parametrize("call", ["flush", "close", "log"])
def test_a_sink_calling_its_logger_gets_a_clear_error_not_a_hang(call):
    r = run_python(f"""
        import logging, syncless
        logging.basicConfig(level=logging.ERROR)
        got = []
        class Rude:
            def write(self, rows):
                got.extend(r.step for r in rows)
                if {call!r} == "log":
                    log(echo=1.0)
                else:
                    getattr(log, {call!r})()
        log = syncless.Logger(every=2, sinks=[Rude()])
        for i in range(6):
            log(x=float(i))
        log.close()
        print("steps", got, "errors", log.stats.sink_errors, "delivered", log.stats.delivered)
    """, timeout=30)
    assert r.returncode == 0, r.stderr
    assert "steps [0, 1, 2, 3, 4, 5] errors 3 delivered 6" in r.stdout
    assert "from a sink's write(), on the logger's own delivery thread" in r.stderr


# ---- interrupts ---------------------------------------------------------------------------------

def test_ctrl_c_while_log_waits_for_a_window_loses_nothing(device):
    gate = threading.Event()
    got = Collect()

    class Slow:
        def write(self, rows):
            gate.wait(60)
            got.write(rows)

    log = syncless.Logger(every=2, windows=1, sinks=[Slow()])
    main = threading.get_ident()

    def interrupt_once_waiting():
        # The first window blocks in the sink; the second flush (step 3) waits for a free
        # window. The SIGINT is sent once that wait has begun, however slow the host is.
        deadline = time.monotonic() + 60
        while log._pool.waits == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        signal.pthread_kill(main, signal.SIGINT)

    threading.Thread(target=interrupt_once_waiting, daemon=True).start()
    interrupted_at = None
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)   # Python's Ctrl-C
    try:
        for i in range(8):
            interrupted_at = i
            log(x=value(i, device))
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGINT, handler)
    gate.set()
    accepted = log.stats.steps
    log.close()
    assert interrupted_at == 3                  # the interrupt landed in the wait of step 3
    assert [s for s, _ in got.rows] == list(range(accepted))
    assert [v["x"] for _, v in got.rows] == [float(i) for i in range(accepted)]
    assert log.stats.delivered == accepted and log.stats.lost == 0


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs POSIX interval timers")
@pytest.mark.parametrize("delivery", ["thread", "caller"])
def test_interrupts_landing_anywhere_never_hang_repeat_or_lose_a_row(device, delivery):
    """A signal handler that raises, fired at random moments of a logging loop (600 times):
    every interrupt reaches the loop as itself, and the rows are the calls that completed, each
    once, at consecutive steps. Before the hand-over ran with signals deferred, an interrupt
    between handing rows over and counting it made a later flush wait forever, and one inside
    threading.Condition.wait came out as "cannot release un-acquired lock", and on CUDA one
    handled as the gather returned left the host's step count one behind the ring's (each row's
    value, the host's count at its call, was then one less than its step). With
    delivery="caller" the interrupts also land in the delivery, which runs in the loop."""
    r = run_python(f"""
        import collections, random, signal, sys
        import torch, syncless

        class Interrupt(BaseException):
            pass

        def handler(signum, frame):
            raise Interrupt()

        got, other = [], collections.Counter()

        class Sink:
            def write(self, rows):
                got.extend(rows)

        torch.zeros(1, device={device!r})    # torch's own CUDA start-up: not under test
        log = syncless.Logger(every=2, windows=1, sinks=[Sink()], delivery={delivery!r})
        signal.signal(signal.SIGALRM, handler)
        random.seed(7)
        raised = 0
        for trial in range(600):
            try:
                signal.setitimer(signal.ITIMER_REAL, random.uniform(1e-5, 4e-4))
                for i in range(20000):
                    log(x=torch.tensor(float(log.stats.steps), device={device!r}))
            except Interrupt:
                raised += 1
            except Exception as exc:
                other[type(exc).__name__ + ": " + str(exc)] += 1
        signal.setitimer(signal.ITIMER_REAL, 0)
        log.close()
        print("raised", raised, dict(other))
        print("steps", [r.step for r in got] == list(range(len(got))), len(got))
        print("values", all(r.values["x"] == float(r.step) for r in got))
        print("lost", log.stats.lost, "delivered", log.stats.delivered == len(got))
    """, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "raised 600 {}" in r.stdout, r.stdout
    assert "steps True" in r.stdout and "lost 0 delivered True" in r.stdout, r.stdout
    assert "values True" in r.stdout, r.stdout


# ---- threads ------------------------------------------------------------------------------------

@pytest.mark.parametrize("delivery", ["thread", "caller"])
def test_threads_true_serialises_calls_in_order_and_drops_nothing(device, delivery):
    got = Collect()
    with syncless.Logger(every=7, sinks=[got], threads=True, delivery=delivery) as log:
        def work(k):
            for i in range(200):
                log(**{f"t{k}": value(i, device)})
        threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    steps = [s for s, _ in got.rows]
    assert steps == list(range(800))            # one row per call, steps in call order
    for k in range(4):                          # every thread's values, in its own order
        assert [v[f"t{k}"] for _, v in got.rows if f"t{k}" in v] == [float(i) for i in range(200)]


def test_a_second_thread_on_a_default_logger_is_refused_and_loses_nothing(device):
    got = Collect()
    errors = []
    with syncless.Logger(every=3, sinks=[got]) as log:
        log(x=value(0, device))

        def other():
            try:
                log(x=value(99, device))
            except RuntimeError as e:
                errors.append(str(e))
        t = threading.Thread(target=other)
        t.start()
        t.join()
        log(x=value(1, device))
    assert "log() from a second thread" in errors[0] and "threads=True" in errors[0]
    assert got.rows == [(0, {"x": 0.0}), (1, {"x": 1.0})]


# ---- garbage collection -------------------------------------------------------------------------

@pytest.mark.parametrize("delivery", ["thread", "caller"])
def test_a_logger_dropped_without_close_still_delivers(device, tmp_path, delivery):
    path = tmp_path / "m.jsonl"

    def train():
        log = syncless.Logger(every=3, sinks=[JSONL(path)], delivery=delivery)
        for i in range(5):                      # a window handed over (pending), two rows not
            log(loss=value(i, device))
        # no close(): the local goes out of scope here

    train()
    gc.collect()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in rows] == [(i, float(i)) for i in range(5)]


# ---- sinks that raise anything, or change what they get -------------------------------------

def test_a_sink_raising_keyboardinterrupt_does_not_stop_the_others(device, caplog):
    class Bad:
        def write(self, rows):
            raise KeyboardInterrupt("from a sink")

    got = Collect()
    with syncless.Logger(every=2, sinks=[Bad(), got]) as log:
        for i in range(5):
            log(x=value(i, device))
    assert [s for s, _ in got.rows] == list(range(5))
    assert log.stats.sink_errors == 3
    assert any("KeyboardInterrupt" in r.getMessage() for r in caplog.records)


def test_a_sink_mutating_rows_cannot_change_what_others_see(device):
    class Vandal:
        def write(self, rows):
            for r in rows:
                r.values["x"] = -1.0
                r.values["junk"] = 1.0
                r.values.pop("y", None)

    got = Collect()
    with syncless.Logger(every=2, sinks=[Vandal(), got]) as log:
        for i in range(4):
            log(x=value(i, device), y=value(10 + i, device))
    assert got.rows == [(i, {"x": float(i), "y": 10.0 + i}) for i in range(4)]
    assert log.latest == {"x": 3.0, "y": 13.0}


# ---- names and steps ----------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["step", "time"])
def test_reserved_names_are_refused_and_nothing_is_lost(device, name, tmp_path):
    got = Collect()
    with syncless.Logger(every=2, sinks=[got, JSONL(tmp_path / "m.jsonl")]) as log:
        log(loss=value(1, device))
        with pytest.raises(ValueError, match=f"metric name '{name}' is reserved"):
            log.log({name: value(5, device), "loss": value(2, device)})
        log(loss=value(3, device))
    assert got.rows == [(0, {"loss": 1.0}), (1, {"loss": 3.0})]
    lines = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in lines] == [(0, 1.0), (1, 3.0)]


def test_step_keyword_is_the_rows_step_not_a_metric(device):
    got = Collect()
    with syncless.Logger(sinks=[got]) as log:
        log(loss=value(1, device), step=7)
    assert got.rows == [(7, {"loss": 1.0})]


@pytest.mark.parametrize("call, error, text", [
    (lambda log, d: log(x=value(1, d), step=True), TypeError, "got the bool True"),
    (lambda log, d: log(x=value(1, d), step=torch.tensor(15)), TypeError, "would sync"),
    (lambda log, d: log.log({"x": value(1, d)}, step=2.0), TypeError, "step must be an int"),
    (lambda log, d: log(5, x=value(1, d), step=6), TypeError, "got the step twice"),
    (lambda log, d: log(5, 6, x=value(1, d)), TypeError, "at most one positional"),
    (lambda log, d: log(x=value(1, d), step=-1), ValueError, "step must be >= 0"),
])
def test_bad_steps_are_clear_errors_and_lose_nothing(device, call, error, text):
    got = Collect()
    with syncless.Logger(sinks=[got]) as log:
        log(x=value(0, device))
        with pytest.raises(error, match=text):
            call(log, device)
        log(x=value(2, device))
    assert got.rows == [(0, {"x": 0.0}), (1, {"x": 2.0})]


@pytest.mark.parametrize("sinks, text", [
    ("runs/m.jsonl", r"sinks=\[syncless.sinks.JSONL\('runs/m.jsonl'\)\]"),
    ([print], "has no write"),
    (5, "must be a sink"),
])
def test_bad_sinks_are_refused_with_a_hint(sinks, text):
    with pytest.raises(TypeError, match=text):
        syncless.Logger(sinks=sinks)


@pytest.mark.parametrize("kw, text", [({"rep": 2.5}, r"bench\(rep=...\) must be an int"),
                                      ({"rep": "3"}, r"bench\(rep=...\) must be an int"),
                                      ({"warmup": 1.0}, r"bench\(warmup=...\) must be an int")])
def test_bench_names_the_bad_parameter(kw, text):
    with pytest.raises(TypeError, match=text):
        syncless.bench(lambda: None, **kw)


# ---- late values --------------------------------------------------------------------------------

def test_attach_joins_the_row_of_its_step_or_comes_at_that_step(device, caplog):
    got = Collect()
    log = syncless.Logger(every=2, sinks=[got])
    log(loss=value(0, device))
    log.attach("late", lambda: 1.5)                      # step 0, before its row went out
    log(loss=value(1, device))                           # the window closes here (step 1)
    log.attach("late", lambda: 2.0)                      # step 1: its row was held for it
    log.attach("late", lambda: 0.5, step=1)              # values of one name at one step add up
    log(loss=value(2, device))
    log.attach("broken", lambda: 1 / 0, step=2)          # reported, the row still arrives
    log.flush()
    log.attach("after", lambda: 7.0, step=0)             # step 0 went out: a row of its own
    log.close()
    assert got.rows == [(0, {"loss": 0.0, "late": 1.5}), (1, {"loss": 1.0, "late": 2.5}),
                        (2, {"loss": 2.0}), (0, {"after": 7.0})]
    assert log.stats.delivered == 3                      # rows of log() calls
    assert any("'broken' for step 2 failed: ZeroDivisionError" in r.getMessage()
               for r in caplog.records)
    with pytest.raises(ValueError, match="closed"):
        log.attach("x", lambda: 1.0)


def test_attach_refuses_bad_input():
    with syncless.Logger() as log:
        with pytest.raises(ValueError, match="reserved"):
            log.attach("step", lambda: 1.0)
        with pytest.raises(TypeError, match="callable"):
            log.attach("x", 1.0)
        with pytest.raises(TypeError, match="step must be an int"):
            log.attach("x", lambda: 1.0, step="3")


def test_gpu_time_on_cpu_rows_adds_no_columns():
    got = Collect()
    with syncless.Logger(every=2, sinks=[got], gpu_time=True) as log:
        for i in range(3):
            log(x=float(i))
        log.flush()
        assert log.gpu_steps() == []              # no GPU clock on host rows
    assert got.rows == [(0, {"x": 0.0}), (1, {"x": 1.0}), (2, {"x": 2.0})]
