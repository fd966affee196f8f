"""Issue 36's red team as tests: the rows of every log() call that returned reach each sink once,
in both delivery modes, whatever interrupts the sink (Ctrl-C, a signal handler that raises, flushes
or closes, landing anywhere), and a KeyboardInterrupt raised by the user's own code (an attach()
fn, a sink) is reported, raised again where the user can act on it, and never keeps the process
from exiting. Signals and exits run in subprocesses (test_reliability's run_python), several
trials to a process; each trial script prints what it counted and the test asserts it."""
import signal
import time

import pytest

from test_reliability import run_python

needs_timers = pytest.mark.skipif(not hasattr(signal, "setitimer"),
                                  reason="needs POSIX signals and interval timers")

# A sink that writes row by row, slowly (an uploader): a Ctrl-C on the thread that runs it cuts
# it between two rows, so a test with it sees a sink cut short as rows lost or written twice.
SLOW_SINK = """
    import json, os, threading, time

    class Slow:
        def __init__(self, path, per_row):
            self.f = open(path, "w")
            self.per_row = per_row
            self.busy = False                     # inside write() (read by the signal sender)

        def write(self, rows):
            self.busy = True
            for r in rows:
                time.sleep(self.per_row)
                self.f.write(json.dumps([r.step, r.values["x"]]) + "\\n")
                self.f.flush()
            self.busy = False

        def close(self):
            self.f.close()

    def read(path):
        with open(path) as f:
            return [tuple(json.loads(line)) for line in f]
"""


def _counts(stdout: str, key: str) -> list[int]:
    return [int(x) for x in stdout.split(key + " ")[1].split()[:3]]


# ---- Ctrl-C inside a sink's write() -------------------------------------------------------------

CTRL_C_TRIALS = SLOW_SINK + """
    import random, signal, sys, tempfile, threading, time
    import torch, syncless

    delivery, trials, device = {delivery!r}, {trials}, {device!r}
    torch.zeros(1, device=device)                 # torch's own CUDA start-up: not under test

    def value(v):                                 # CPU: host rows; CUDA: the device ring
        return float(v) if device == "cpu" else torch.tensor(float(v), device=device)

    tmp = tempfile.mkdtemp()
    random.seed(36)
    lost = dup = raised = inside = 0
    main = threading.main_thread().ident
    for trial in range(trials):
        path = os.path.join(tmp, f"{{trial}}.jsonl")
        sink = Slow(path, per_row=0.002)
        log = syncless.Logger(every=random.choice([2, 3, 5]), windows=2, sinks=[sink],
                              delivery=delivery)
        returned, fired, sent = 0, [], []

        def ctrl_c(at):
            time.sleep(at)
            fired.append(sink.busy)               # a real Ctrl-C: SIGINT, Python's own handler
            signal.pthread_kill(main, signal.SIGINT)
            sent.append(1)

        threading.Thread(target=ctrl_c, args=(random.uniform(0.005, 0.06),)).start()
        try:
            for i in range(100):
                log(x=value(i))
                returned += 1
            log.close()
            while not sent:                       # it comes after the loop: still a trial
                time.sleep(1e-4)
            for _ in range(5000):                 # and lands here at the latest
                time.sleep(1e-3)
            print("no KeyboardInterrupt in trial", trial)
        except KeyboardInterrupt:
            pass
        try:
            log.close()                           # finishes a close() the Ctrl-C cut short
        except Exception as exc:
            raised += 1
            print("raised", repr(exc))
        inside += fired[0]
        got = read(path)
        steps = [s for s, _ in got]
        want = list(range(max(returned, len(set(steps)))))
        lost += len(set(range(returned)) - set(steps))
        dup += len(steps) - len(set(steps))
        ok = got == [(s, float(s)) for s in want] and len(want) <= returned + 1
        ok = ok and log.stats.delivered == len(got)
        if not ok:
            print("bad trial", trial, returned, got[:3], got[-3:], log.stats)
            lost += 1                             # out of order or a value wrong: counted
    print("lost/dup/raised", lost, dup, raised, "inside", inside)
"""


@needs_timers
@pytest.mark.parametrize("delivery", ["thread", "caller"])
def test_ctrl_c_inside_a_sinks_write_loses_and_repeats_nothing(device, delivery):
    """Issue 36: with delivery="caller" a Ctrl-C that landed in a sink's write() (which runs in
    the loop) stopped that sink there, and the rows of calls that had returned were lost. 20
    trials, a real SIGINT at a random moment, most of them inside the slow sink's write(): each
    returned call's row is in the file once, in order (+ the call the Ctrl-C cut, if it was
    accepted), and nothing raises."""
    r = run_python(CTRL_C_TRIALS.format(delivery=delivery, trials=20, device=device),
                   timeout=120)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    assert _counts(r.stdout, "lost/dup/raised") == [0, 0, 0], r.stdout[-3000:]
    inside = int(r.stdout.split("inside ")[1].split()[0])
    assert inside >= 5, r.stdout                 # the case under test did happen


EXIT_ON_CTRL_C = SLOW_SINK + """
    import signal, sys, threading, time
    import syncless

    delivery, when, path = {delivery!r}, {when!r}, {path!r}
    sink = Slow(path, per_row=0.25)              # a second per batch of 4
    log = syncless.Logger(every=4, sinks=[sink], delivery=delivery, close_timeout=30)

    def ctrl_c():
        while not sink.busy:
            time.sleep(0.01)
        time.sleep(0.3)                           # between two rows of the write
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    threading.Thread(target=ctrl_c, daemon=True).start()
    for i in range(8 if when == "loop" else 4):
        log(x=float(i))
        print("returned", i, flush=True)
    if when == "close":
        log.close()
    time.sleep(10)                                # the Ctrl-C ends it: not reached
"""


@needs_timers
@pytest.mark.parametrize("when", ["loop", pytest.param("close", marks=pytest.mark.slow)])
@pytest.mark.parametrize("delivery", ["thread", "caller"])
def test_ctrl_c_in_a_slow_sink_then_exit_delivers_every_returned_call(delivery, when, tmp_path):
    """Issue 36's first row: a sink that takes a second, Ctrl-C while it writes, nothing caught:
    the KeyboardInterrupt ends the program, and the exit hook delivers the rows of every call
    that returned (with delivery="caller": 0 rows for 4 returned calls, before). `when`: the
    write runs at a hand-over in the loop, or in close()."""
    path = str(tmp_path / "rows.jsonl")
    t = time.monotonic()
    r = run_python(EXIT_ON_CTRL_C.format(delivery=delivery, when=when, path=path), timeout=60)
    assert time.monotonic() - t < 40
    assert "KeyboardInterrupt" in r.stderr and r.returncode in (130, -2), r.stderr[-2000:]
    returned = r.stdout.count("returned ")
    with open(path) as f:
        steps = [int(line.split(",")[0].strip("[")) for line in f]
    assert steps == list(range(len(steps))), steps
    assert returned <= len(steps) <= returned + 1 and returned >= 3, (returned, steps)


# ---- a signal handler that raises, anywhere ------------------------------------------------------

RAISE_ANYWHERE = """
    import collections, random, signal, sys
    import torch, syncless

    delivery, kind, device = {delivery!r}, {kind!r}, {device!r}
    torch.zeros(1, device=device)

    class Interrupt(BaseException):
        pass

    def handler(signum, frame):
        raise Interrupt()

    got, other = [], collections.Counter()

    class RowByRow:                               # Python code between rows: a handler can land
        def write(self, rows):
            for r in rows:
                got.append((r.step, r.values["x"]))

    log = syncless.Logger(every=2, windows=1, sinks=[RowByRow()], delivery=delivery)
    signal.signal(signal.SIGALRM, handler)
    random.seed(36)
    raised = 0
    for trial in range(600):
        try:
            signal.setitimer(signal.ITIMER_REAL, random.uniform(1e-5, 4e-4))
            for i in range(20000):
                v = float(log.stats.steps)
                log(x=v if kind == "float" else torch.tensor(v, device=device))
        except Interrupt:
            raised += 1
        except Exception as exc:
            other[type(exc).__name__ + ": " + str(exc)] += 1
    signal.setitimer(signal.ITIMER_REAL, 0)
    log.close()
    steps = [s for s, _ in got]
    calls = log.stats.steps
    print("lost/dup/raised", len(set(range(calls)) - set(steps)), len(steps) - len(set(steps)),
          sum(other.values()), dict(other))
    print("interrupts", raised, "calls", calls, "in order", steps == list(range(len(steps))),
          "values", all(x == float(s) for s, x in got), "stats", log.stats.delivered == len(got),
          "overwritten", log.stats.lost)
"""


@needs_timers
@pytest.mark.parametrize("kind", ["float", "tensor"])
@pytest.mark.parametrize("delivery", ["thread", "caller"])
def test_a_handler_that_raises_anywhere_loses_no_returned_call(device, delivery, kind):
    """Issue 36's third row: a SIGALRM handler that raises at a random moment (the loop catches
    it and goes on), 600 times, with a sink that has Python code between rows: with
    delivery="caller" 80 and 118 rows of returned calls were missing in the red team's run (3
    and 4 in this one, before). Every call that returned is delivered once, in order, with its
    value; every interrupt reaches the loop as itself."""
    if device == "cuda" and kind == "float":
        pytest.skip("floats alone never reach the device ring: the CPU run covers them")
    r = run_python(RAISE_ANYWHERE.format(delivery=delivery, kind=kind, device=device),
                   timeout=120)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    assert _counts(r.stdout, "lost/dup/raised") == [0, 0, 0], r.stdout
    assert "interrupts 600 " in r.stdout, r.stdout
    assert "in order True values True stats True overwritten 0" in r.stdout, r.stdout


# ---- a handler's flush() or close() inside the sink's write() ------------------------------------

HANDLER_IN_WRITE = SLOW_SINK + """
    import random, signal, sys, tempfile, threading, time
    import torch, syncless

    delivery, trials, device = {delivery!r}, {trials}, {device!r}
    torch.zeros(1, device=device)

    def value(v):
        return float(v) if device == "cpu" else torch.tensor(float(v), device=device)

    tmp = tempfile.mkdtemp()
    random.seed(36)
    lost = dup = raised = late = handled = 0
    main = threading.main_thread().ident

    class Stop(BaseException):                    # the preemption handler's exit
        pass

    class Signalling(Slow):                       # sends the signal from inside its write()
        def write(self, rows):
            if self.at is not None and len(rows) > 0:
                self.at, at = None, self.at
                self.busy = True
                for k, r in enumerate(rows):
                    if k == min(at, len(rows) - 1):
                        signal.pthread_kill(main, signal.SIGUSR1)
                    time.sleep(self.per_row)
                    self.f.write(json.dumps([r.step, r.values["x"]]) + "\\n")
                    self.f.flush()
                self.busy = False
                return
            super().write(rows)

    for trial in range(2 * trials):
        action = ("flush", "close")[trial % 2]
        path = os.path.join(tmp, f"{{trial}}.jsonl")
        sink = Signalling(path, per_row=0.001)
        sink.at = random.randrange(4)
        log = syncless.Logger(every=random.choice([2, 3, 5]), windows=2, sinks=[sink],
                              delivery=delivery)
        state = {{"returned": 0, "seen": None}}

        def handler(signum, frame):
            global raised, handled
            handled += 1
            at = state["returned"]
            try:
                getattr(log, action)()            # a preemption handler: flush (or close) ...
            except Exception as exc:
                raised += 1
                print("raised", repr(exc))
                raise Stop()
            state["seen"] = (at, len(read(path)))  # ... its rows are on disk when it returns
            raise Stop()                          # ... then exit

        signal.signal(signal.SIGUSR1, handler)
        try:
            for i in range(60):
                log(x=value(i))
                state["returned"] += 1
            log.close()
        except Stop:
            pass
        log.close()
        returned, seen = state["returned"], state["seen"]
        got = read(path)
        steps = [s for s, _ in got]
        lost += len(set(range(returned)) - set(steps))
        dup += len(steps) - len(set(steps))
        if seen is not None and seen[1] < seen[0]:
            late += 1                             # the handler's flush returned before its rows
        ok = got == [(s, float(s)) for s in range(len(got))] and len(got) <= returned + 1
        if not ok:
            print("bad trial", trial, action, returned, got[:3], got[-3:], seen, log.stats)
            lost += 1
    signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    print("lost/dup/raised", lost, dup, raised, "late", late, "handled", handled)
"""


@needs_timers
@pytest.mark.parametrize("delivery", ["thread", "caller"])
def test_a_preemption_handler_inside_a_sinks_write_flushes_or_closes_then_exits(device,
                                                                                delivery):
    """Issue 36's second and fourth rows: a handler (flush() or close(), then exit) that lands
    inside a sink's write(). With delivery="caller" its flush() and close() raised RuntimeError
    ("... from a signal handler that interrupted that delivery") and rows of returned calls were
    lost. 20 trials of each action per mode, the signal sent from inside the write at a random
    row: nothing raises, every returned call's row is in the file once and in order, and was on
    disk when the handler's flush() or close() returned."""
    r = run_python(HANDLER_IN_WRITE.format(delivery=delivery, trials=20, device=device),
                   timeout=120)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    assert _counts(r.stdout, "lost/dup/raised") == [0, 0, 0], r.stdout[-3000:]
    assert "late 0 handled 40" in r.stdout, r.stdout[-3000:]


# ---- the user's own KeyboardInterrupt ------------------------------------------------------------

USERS_INTERRUPT = """
    import sys, threading, time
    import syncless

    delivery, where, close = {delivery!r}, {where!r}, {close!r}
    how = None

    def interrupt():
        if how == "raise":
            raise KeyboardInterrupt("the user's")
        # raised from C, at no raise statement: the way a Ctrl-C looks to a traceback
        (_ for _ in ()).throw(KeyboardInterrupt("the user's"))

    class Rows:
        def __init__(self):
            self.rows = []

        def write(self, rows):
            self.rows.extend((r.step, dict(r.values)) for r in rows)

    class Raising(Rows):
        def write(self, rows):
            interrupt()

    for how in ("raise", "from-c"):               # a logger each, left open at exit if not close
        rows = Rows()
        sinks = [Raising(), rows] if where == "sink" else [rows]
        log = syncless.Logger(every=2, sinks=sinks, delivery=delivery, close_timeout=5)
        for i in range(5):
            log(x=float(i))
            if where == "attach":
                log.attach("t", interrupt)
        if close:
            try:
                log.close()
                print(how, "close returned")
            except KeyboardInterrupt as exc:
                print(how, "close raised", exc)
            log.close()                           # the second is quiet
            print(how, "second close returned")
            print(how, "steps", [s for s, _ in rows.rows], "stats", log.stats.sink_errors,
                  log.stats.late_errors)
"""


@pytest.mark.parametrize("close", [True, False], ids=["close", "exit"])
@pytest.mark.parametrize("where", ["attach", "sink"])
@pytest.mark.parametrize("delivery", ["thread", "caller"])
def test_a_keyboardinterrupt_from_the_users_code_is_reported_raised_once_and_exit_is_bounded(
        delivery, where, close):
    """Issue 36's fifth row: an attach() fn (or a sink) that raises KeyboardInterrupt. Before,
    close() re-raised it as the training thread's own Ctrl-C, every later close() ran the fn and
    raised again, and the interpreter never exited (killed after 400 s). Now it is reported when
    it comes (the rows go on without it), close() raises it once after its work, a second close()
    is quiet, and a program that does not close exits at once (rc 0). Raised by a raise
    statement, and from C (a generator's throw(): no raise statement, as a Ctrl-C looks)."""
    t = time.monotonic()
    r = run_python(USERS_INTERRUPT.format(delivery=delivery, where=where, close=close),
                   timeout=60)
    assert time.monotonic() - t < 30                  # close_timeout is 5
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    assert "KeyboardInterrupt" in r.stderr and "the user's" in r.stderr     # reported
    for how in ("raise", "from-c") if close else ():
        assert f"{how} close raised the user's" in r.stdout, r.stdout
        assert f"{how} second close returned" in r.stdout, r.stdout
        errors = "stats 3 0" if where == "sink" else "stats 0 5"
        assert f"{how} steps [0, 1, 2, 3, 4] {errors}" in r.stdout, r.stdout


STUCK_AT_EXIT = """
    import threading, time
    import syncless

    delivery = {delivery!r}

    class Stuck:                                  # its write() of the last rows never returns
        def write(self, rows):
            if rows[-1].step >= 5:
                threading.Event().wait()

    class Good:
        def __init__(self):
            self.n = 0

        def write(self, rows):
            self.n += len(rows)

        def close(self):
            print("good closed with", self.n, flush=True)

    def interrupt():
        raise KeyboardInterrupt("the user's")

    log = syncless.Logger(every=4, sinks=[Stuck(), Good()], delivery=delivery, close_timeout=2)
    for i in range(6):
        log(x=float(i))
    log.attach("t", interrupt)
    print("exiting", flush=True)
"""


@pytest.mark.parametrize("delivery", ["thread", "caller"])
def test_exit_with_a_stuck_sink_and_a_raising_attach_fn_is_bounded_by_close_timeout(delivery):
    """Interpreter exit with a sink whose write() never returns and an attach() fn that raises
    KeyboardInterrupt: the exit hook gives up after close_timeout (2 s) and a grace, says so, and
    the process exits. With delivery="caller" the sink after the stuck one still gets every row
    (its write() runs on the helper, which close() leaves to the stuck call)."""
    t = time.monotonic()
    r = run_python(STUCK_AT_EXIT.format(delivery=delivery), timeout=60)
    took = time.monotonic() - t
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    assert took < 30, took
    assert "gave up" in r.stderr, r.stderr[-2000:]
    if delivery == "caller":
        assert "good closed with 6" in r.stdout, r.stdout
    else:
        assert "good closed with" in r.stdout, r.stdout


# ---- a handler that flushes over and over, two sinks, attached values ---------------------------

FLUSHING_HANDLER = """
    import collections, random, signal
    import syncless

    delivery = {delivery!r}
    random.seed(36)

    class Stop(BaseException):
        pass

    class Keep:                                   # row by row: a handler lands between rows
        def __init__(self):
            self.rows = []

        def write(self, rows):
            for r in rows:
                self.rows.append((r.step, r.values.get("x"), r.values.get("a")))

    bad = raised = handled = 0
    for trial in range(40):
        a, b = Keep(), Keep()
        log = syncless.Logger(every=random.choice([1, 2, 3, 5]), windows=2, sinks=[a, b],
                              delivery=delivery)
        returned, done = 0, False

        # Stop is raised only while `armed`, which the raise itself clears: it lands inside the
        # try blocks below (in log(), a delivery or close()), never between them, where it would
        # end the script instead of the call it interrupts.
        armed = False

        def handler(signum, frame):
            global raised, handled, armed
            if done:
                return
            handled += 1
            try:
                log.flush()
            except Exception as exc:
                raised += 1
                print("raised", repr(exc))
            signal.setitimer(signal.ITIMER_REAL, random.uniform(1e-5, 5e-4))
            if armed and random.random() < 0.1:
                armed = False
                raise Stop()

        signal.signal(signal.SIGALRM, handler)
        try:
            armed = True
            signal.setitimer(signal.ITIMER_REAL, random.uniform(1e-5, 5e-4))
            for i in range(400):
                log(x=float(i))
                log.attach("a", lambda i=i: float(-i))
                returned += 1
            armed = False
        except Stop:
            pass
        for _ in range(30):                       # the handler keeps coming: close() again
            try:
                armed = True
                log.close()
                armed = False
                break
            except Stop:
                pass
        done = True
        signal.setitimer(signal.ITIMER_REAL, 0)
        for k in (a, b):
            steps = [r[0] for r in k.rows if r[1] is not None]
            ok = steps == list(range(len(steps))) and returned <= len(steps) <= returned + 1
            ok = ok and all(r[1] == float(r[0]) for r in k.rows if r[1] is not None)
            attached = collections.Counter(r[0] for r in k.rows if r[2] is not None)
            ok = ok and all(n == 1 for n in attached.values())
            ok = ok and all(r[2] == -float(r[0]) for r in k.rows if r[2] is not None)
            if not ok:
                bad += 1
                print("bad", trial, returned, len(steps), k.rows[:2], k.rows[-3:], log.stats)
        if a.rows != b.rows:
            bad += 1
            print("sinks differ", trial)
    print(delivery, "handled", handled, "bad", bad, "raised", raised)
"""


@needs_timers
@pytest.mark.parametrize("delivery", ["thread", "caller"])
def test_a_handler_flushing_again_and_again_inside_deliveries_keeps_every_sink_exact(delivery):
    """A SIGALRM handler that calls flush() every few hundred microseconds (re-arming itself, and
    raising now and then), over 40 loops that log and attach a value at every step, with two
    sinks that write row by row: both sinks get the same rows, each returned call's once, in
    order, each attached value once in its step's row. With delivery="caller" the handler's
    flush() re-enters the delivery it interrupted; this found a pump that read its queue's head
    after a handler had emptied it (IndexError), and could run an older host-row list again."""
    r = run_python(FLUSHING_HANDLER.format(delivery=delivery), timeout=120)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    assert "bad 0 raised 0" in r.stdout, r.stdout[-3000:]
    handled = int(r.stdout.split("handled ")[1].split()[0])
    assert handled >= 40, r.stdout


# ---- a handler at the first call of a metric on CUDA --------------------------------------------

class _Stop(BaseException):
    pass


@pytest.mark.cuda
@pytest.mark.parametrize("delivery", ["thread", "caller"])
@pytest.mark.parametrize("action", ["close", "flush"])
def test_a_handler_where_a_new_metrics_call_is_made_again_finds_it_not_counted(delivery, action):
    """A metric's first call on CUDA launches nothing (the ring has no column for it): the call
    is taken back, the column added, and the call made again. A signal handler runs at a
    function's start, and one that closed the logger at the start of the function that makes
    it again found the call counted with no row: stats said 1 step, 0 delivered (the handler
    trials on an H100, 1 in 500). Python's trace hook stands in for the signal here, at exactly
    that point: the handler must find the call not counted, and the books must balance after."""
    import sys
    import torch
    import syncless
    got = []

    class Keep:
        def write(self, rows):
            got.extend((r.step, float(r.values["x"])) for r in rows)

    log = syncless.Logger(every=2, sinks=[Keep()], delivery=delivery)
    seen = []

    def handler(frame, event, arg):
        if event == "call" and frame.f_code.co_name == "_new_metric" and not seen:
            seen.append(log.stats.steps)
            getattr(log, action)()
            if action == "close":
                raise _Stop()                      # a preemption handler: close, then exit
        return None

    sys.settrace(handler)
    try:
        log(x=torch.tensor(1.0, device="cuda"))
    except _Stop:
        pass
    finally:
        sys.settrace(None)
    assert seen == [0], "the handler found the call counted, with no row for it"
    if action == "flush":                          # the loop goes on
        log(x=torch.tensor(2.0, device="cuda"))
    log.close()
    s = log.stats
    assert s.steps == s.delivered == len(got), (s, got)
    assert got == ([] if action == "close" else [(0, 1.0), (1, 2.0)])


@pytest.mark.parametrize("delivery", ["thread", "caller"])
def test_calls_that_go_on_while_every_flush_is_cut_short_never_overwrite_the_ring(device,
                                                                                  delivery):
    """A handler that raises at the start of each flush's wait for room (where Python runs a
    signal handler) while the loop catches it and goes on: every call counts and writes its row,
    no hand-over is made. On CUDA the device ring holds `capacity` rows: the calls past it
    would overwrite rows no copy holds yet (counted in stats.lost). A call that would overwrite
    one flushes first, and raises there (not counted, nothing written) while flushes fail; once
    they succeed every returned call is delivered, once, with its value. Python's trace hook stands in for
    the signal, at exactly that point. On the CPU (host rows, no ring) the books balance too."""
    import sys
    import torch
    import syncless
    got = []

    class Keep:
        def write(self, rows):
            got.extend((r.step, float(r.values["x"])) for r in rows)

    log = syncless.Logger(every=2, windows=1, capacity=16, sinks=[Keep()], delivery=delivery)
    cut = [True]

    def handler(frame, event, arg):
        if event == "call" and frame.f_code.co_name == "_wait_room" and cut[0]:
            raise _Stop()
        return None

    log(x=torch.tensor(0.0, device=device))             # the ring exists before the trials
    raised = 0
    sys.settrace(handler)
    try:
        for _ in range(60):
            try:
                log(x=torch.tensor(float(log.stats.steps), device=device))
            except _Stop:
                raised += 1
                sys.settrace(handler)   # a trace function that raises is unset: set it again
        cut[0] = False
        for _ in range(5):
            log(x=torch.tensor(float(log.stats.steps), device=device))
    finally:
        sys.settrace(None)
    log.close()
    s = log.stats
    # Every flush from the 2nd call on was cut short: the calls past a full ring (16 rows since
    # the last hand-over) raised before they counted, at each call from then on.
    assert raised >= 60 - 16, raised
    assert s.lost == 0, s
    assert s.steps == s.delivered == len(got), (s, len(got))
    assert got == [(i, float(i)) for i in range(s.steps)]
    assert s.steps <= 1 + 16 + 5, s
