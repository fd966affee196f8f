"""What only a GPU can prove: zero syncs, one launch per call, graph replay, stream order."""
import pytest
import torch

import syncless
from _sinks import Collect

pytestmark = pytest.mark.cuda


@pytest.fixture
def no_syncs():
    """Any host-device sync torch can see raises inside the block."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_thousands_of_calls_with_flushes_never_sync(no_syncs):
    sink = Collect()
    x = torch.randn(256, 256, device="cuda")
    log = syncless.Logger(every=100, sinks=sink, device="cuda")
    for step in range(3000):
        y = x @ x
        loss = y.mean()
        log(loss=loss, acc=(y > 0).float().mean(), gn=y.norm(), lr=1e-3)
        if step % 700 == 0:
            log.flush(wait=False)
    torch.cuda.set_sync_debug_mode(0)
    log.close()
    assert [s for s, _ in sink.rows] == list(range(3000))
    ref = (x @ x)
    assert sink.rows[-1][1]["loss"] == pytest.approx(float(ref.mean()), rel=1e-6)
    assert sink.rows[-1][1]["lr"] == 1e-3


@pytest.mark.filterwarnings("ignore:Warning. Profiler clears events:UserWarning")
def test_one_kernel_launch_per_call_whatever_the_number_of_metrics():
    from torch.profiler import ProfilerActivity, profile
    values = [torch.full((), float(i), device="cuda") for i in range(64)]
    with syncless.Logger(every=1000, device="cuda") as log:
        log.log({f"m{i}": v for i, v in enumerate(values)})      # warm: JIT, ring allocation
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for k in (1, 4, 16, 64):
                for _ in range(10):
                    log.log({f"m{i}": values[i] for i in range(k)})
            torch.cuda.synchronize()
    launches = [e for e in prof.events() if e.name.startswith("sl_gather")]
    assert len(launches) == 40


@pytest.mark.parametrize("delivery", ["thread", "caller"])
def test_graph_replay_appends_one_row_per_replay(delivery):
    sink = Collect()
    static_x = torch.zeros((), device="cuda")
    log = syncless.Logger(every=10, sinks=sink, device="cuda", capacity=64, delivery=delivery)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):                                   # warm-up, as torch requires
        for _ in range(3):
            log(x=static_x * 2)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        log(x=static_x * 2)                                      # captured at step 3
    for i in range(25):
        static_x.fill_(float(i))
        g.replay()
        if i % 20 == 19:
            log.flush(wait=False)
    log.close()
    assert [s for s, _ in sink.rows] == [0, 1, 2] + [3 + i for i in range(25)]
    assert [v["x"] for _, v in sink.rows[3:]] == [2.0 * i for i in range(25)]
    assert log.stats.lost == 0


def test_graph_replays_beyond_capacity_are_counted_as_lost():
    sink = Collect()
    x = torch.ones((), device="cuda")
    log = syncless.Logger(every=4, sinks=sink, device="cuda", capacity=8)
    log(x=x)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        log(x=x)
    for _ in range(20):
        g.replay()
    log.close()
    # one eager row + 20 replays, one flush at close: the ring keeps the newest 8 rows
    assert log.stats.lost == 21 - 8
    assert [s for s, _ in sink.rows] == [1 + k for k in range(12, 20)]


def _capture(log, calls):
    """Warm up on a side stream as torch requires (one eager round), then capture `calls`."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        calls()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        calls()
    return g


def test_a_graph_of_two_log_calls_replays_consecutive_steps():
    sink = Collect()
    x = torch.zeros((), device="cuda")
    log = syncless.Logger(every=8, sinks=sink, device="cuda", capacity=128)
    g = _capture(log, lambda: (log(loss=x + 1), log(acc=x * 3)))     # steps 0, 1 eager
    for i in range(30):
        x.fill_(float(i))
        g.replay()
        if i % 10 == 9:
            log.flush(wait=False)
    log.close()
    # Eager code gives every call its own step: so does every replay, two steps a replay.
    assert [s for s, _ in sink.rows] == list(range(62))
    assert sink.rows[2:] == [r for i in range(30)
                             for r in ((2 + 2 * i, {"loss": i + 1.0}), (3 + 2 * i, {"acc": 3.0 * i}))]
    assert log.stats.lost == 0


def test_eager_calls_after_replays_continue_from_the_devices_step():
    sink = Collect()
    x = torch.zeros((), device="cuda")
    log = syncless.Logger(every=8, sinks=sink, device="cuda", capacity=256)
    g = _capture(log, lambda: log(x=x * 1))                          # step 0 eager
    assert log.steps_on_device()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(5):
            g.replay()                                               # steps 1..5
        log(y=x + 7)                                                 # 6: no step= needed
        log(y=x + 8, step=100)                                       # explicit: 100
        for _ in range(3):
            g.replay()                                               # 101..103
        log(y=x + 9)                                                 # 104
    finally:
        torch.cuda.set_sync_debug_mode(0)
    log.close()
    assert [s for s, _ in sink.rows] == [0, 1, 2, 3, 4, 5, 6, 100, 101, 102, 103, 104]
    assert [v for _, v in sink.rows][6:8] == [{"y": 7.0}, {"y": 8.0}]
    assert sink.rows[-1] == (104, {"y": 9.0})


def test_what_cannot_know_the_step_after_a_capture_says_so():
    sink = Collect()
    x = torch.ones((), device="cuda")
    log = syncless.Logger(every=8, sinks=sink, device="cuda")
    g = _capture(log, lambda: log(x=x))                              # step 0 eager
    g.replay()                                                       # 1
    with pytest.raises(ValueError, match="counted on the GPU.*pass step="):
        with syncless.timer("step_ms", log=log):
            g.replay()                                               # never runs
    with pytest.raises(ValueError, match=r"attach\(\) without step="):
        log.attach("late", lambda: 1.0)
    with syncless.timer("step_ms", log=log, step=2):                 # with step=: fine
        g.replay()                                                   # 2
    log.close()
    assert [s for s, _ in sink.rows] == [0, 1, 2]
    assert sink.rows[2][1]["x"] == 1.0 and sink.rows[2][1]["step_ms"] > 0


@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty:UserWarning")
def test_an_explicit_step_under_capture_is_refused_and_loses_nothing():
    sink = Collect()
    x = torch.ones((), device="cuda")
    log = syncless.Logger(every=8, sinks=sink, device="cuda")
    log(x=x)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="step=.*inside CUDA graph capture"):
        with torch.cuda.graph(g):
            log(x=x, step=5)
    log(x=x * 2)
    log.close()
    assert sink.rows == [(0, {"x": 1.0}), (1, {"x": 2.0})]


@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty:UserWarning")
def test_first_cuda_log_inside_capture_is_a_clear_error():
    sink = Collect()
    log = syncless.Logger(every=4, sinks=sink)
    x = torch.ones((), device="cuda")
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    try:
        with pytest.raises(RuntimeError, match="before capture"):
            with torch.cuda.graph(g):
                log(x=x)
        log(x=x)                                    # outside capture the logger just works
    finally:
        log.close()
    assert sink.rows == [(0, {"x": 1.0})]


def test_rows_stay_in_call_order_across_streams():
    sink = Collect()
    side = torch.cuda.Stream()
    with syncless.Logger(every=7, sinks=sink, device="cuda") as log:
        for i in range(40):
            stream = side if i % 3 == 0 else torch.cuda.current_stream()
            with torch.cuda.stream(stream):
                torch.cuda._sleep(20000 if i % 3 == 0 else 10)  # the side stream lags
                log(x=torch.full((), float(i), device="cuda"))
    assert [v["x"] for _, v in sink.rows] == [float(i) for i in range(40)]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_metric_on_another_gpu_is_refused_and_nothing_is_lost():
    sink = Collect()
    with syncless.Logger(every=3, sinks=sink, device="cuda:0") as log:
        log(x=torch.ones((), device="cuda:0"))
        with pytest.raises(ValueError, match="metric 'y' is on cuda:1 but this logger's ring is on cuda:0"):
            log(x=torch.ones((), device="cuda:0"), y=torch.ones((), device="cuda:1"))
        log(x=torch.full((), 2.0, device="cuda:0"))
    assert sink.rows == [(0, {"x": 1.0}), (1, {"x": 2.0})]


def test_host_rows_before_the_first_cuda_metric_keep_their_order():
    sink = Collect()
    with syncless.Logger(every=4, sinks=sink) as log:
        log(x=1.0)
        log(x=torch.tensor(2.0))
        log(x=torch.tensor(3.0, device="cuda"))                 # binds the ring
        log(x=4.0)
    assert sink.rows == [(i, {"x": float(i + 1)}) for i in range(4)]
    assert log.device == torch.device("cuda", 0)


@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty:UserWarning")
def test_flush_and_close_inside_capture_are_refused_and_lose_nothing():
    sink = Collect()
    log = syncless.Logger(every=100, sinks=sink, device="cuda")
    x = torch.full((), 3.0, device="cuda")
    log(x=x)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        with pytest.raises(RuntimeError, match="inside CUDA graph capture"):
            log.flush()
        with pytest.raises(RuntimeError, match="close after capture ends"):
            log.close()
    assert not log.closed
    log.close()
    assert sink.rows == [(0, {"x": 3.0})]


def test_gpu_time_rows_carry_the_gpu_clock_and_step_times(no_syncs):
    keep = []

    class Keep:
        def write(self, rows):
            keep.extend(rows)

    a = torch.randn(2048, 2048, device="cuda")
    start, ends = torch.cuda.Event(enable_timing=True), []
    log = syncless.Logger(every=10, sinks=[Keep()], gpu_time=True, device="cuda")
    log(loss=a.sum())
    start.record()
    for _ in range(30):
        y = a @ a @ a
        log(loss=y.mean())
        ends.append(torch.cuda.Event(enable_timing=True))
        ends[-1].record()
    torch.cuda.set_sync_debug_mode(0)
    log.close()
    assert [r.step for r in keep] == list(range(31))
    assert all(isinstance(r.gpu_ns, int) for r in keep)
    assert [r.gpu_ns for r in keep] == sorted(r.gpu_ns for r in keep)
    assert "gpu/step_ms" not in keep[0].values and "gpu/lag_ms" in keep[0].values
    ev = [start.elapsed_time(ends[0])] + [ends[i - 1].elapsed_time(ends[i]) for i in range(1, 30)]
    gpu = [r.values["gpu/step_ms"] for r in keep[1:]]
    # The same intervals, seen by two clocks: within 2% apart from a few µs of jitter.
    for g, e in zip(gpu[2:], ev[2:]):
        assert abs(g - e) <= 0.02 * e + 0.01
    assert min(r.values["gpu/lag_ms"] for r in keep) == 0.0


def test_gpu_steps_give_the_gpu_time_per_step_whatever_the_rows_per_step(no_syncs):
    a = torch.randn(2048, 2048, device="cuda")
    ends = []
    log = syncless.Logger(every=8, gpu_time=True, device="cuda")
    for step in range(0, 40, 2):                 # two rows a step; every other step logged
        y = a @ a @ a
        log(loss=y.mean(), step=step)
        y = y @ a
        log.log({"other": y.mean()}, step=step)  # the step's last row stands for it
        ends.append(torch.cuda.Event(enable_timing=True))
        ends[-1].record()
    torch.cuda.set_sync_debug_mode(0)
    log.flush()
    got = log.gpu_steps()
    log.close()
    assert [s for s, _, _ in got] == list(range(0, 40, 2))
    assert got[0][1] is None and all(lag is not None and lag >= 0 for _, _, lag in got)
    for (_, gpu, _), e0, e1 in zip(got[3:], ends[2:], ends[3:]):
        per_step = e0.elapsed_time(e1) / 2      # two steps between logged ones
        assert abs(gpu - per_step) <= 0.02 * per_step + 0.01


def test_gpu_time_off_adds_nothing():
    keep = []

    class Keep:
        def write(self, rows):
            keep.extend(rows)

    with syncless.Logger(every=5, sinks=[Keep()], device="cuda") as log:
        for i in range(3):
            log(x=torch.tensor(float(i), device="cuda"))
        log.flush()
        assert log.gpu_steps() == []
    assert [dict(r.values) for r in keep] == [{"x": 0.0}, {"x": 1.0}, {"x": 2.0}]


def test_a_new_metric_is_answered_by_the_gather_not_raised_and_launches_nothing():
    """A name without a column: Ring.gather says so (GATHER_NEW_COLUMN) and launches nothing,
    so a new metric's first call costs no exception; the Logger adds the column (here past the
    ring's first block, so the ring grows) and the row lands once, at its step."""
    from syncless._torch import _C
    sink = Collect()
    log = syncless.Logger(every=1000, sinks=sink, device="cuda")
    log(a=torch.ones((), device="cuda"))
    ring = log._ring
    x = torch.full((), 2.0, device="cuda")
    assert ring.gather({"a": x, "new": x}, log._columns, 99, -1, 0.0) == _C.GATHER_NEW_COLUMN
    assert not ring.wrote(99)                          # nothing launched
    assert ring.gather({"a": x}, log._columns, 98, 5, 0.0) is False and ring.wrote(98)
    wide = {f"m{i}": torch.full((), float(i), device="cuda") for i in range(70)}
    log(step=6, **wide)                                # 70 new names: a wider ring
    log(step=7, a=x, m69=x)
    log.close()
    assert [s for s, _ in sink.rows] == [0, 5, 6, 7]
    assert sink.rows[2][1] == {f"m{i}": float(i) for i in range(70)}
    assert sink.rows[3][1] == {"a": 2.0, "m69": 2.0}
    assert log.stats.steps == 3 and log.stats.delivered == 4
