"""log() and timer() inside torch.compile: one custom op in the graph, no graph break, rows exact.

CPU inductor runs in CI (each compile costs seconds on its two cores, so the tests compile few,
small functions; a test's Logger must be closed by the test, so compiled functions, which hold
their Logger, are not shared between tests). CUDA tests prove the reduce-overhead path: the gather
is captured in the CUDA graph and every replay appends one row with its step.
"""
import copy
import re
import time

import pytest
import torch
from torch._dynamo.utils import counters

import syncless
from _sinks import Collect

pytestmark = [
    pytest.mark.skipif(not hasattr(torch.library, "register_fake"),
                       reason="torch.compile support needs torch >= 2.4"),
    # inductor's own imports (torch.utils.mkldnn) warn on some torch versions
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:TensorFloat32 tensor cores:UserWarning"),   # inductor, GPU
    # cudagraph trees capture an empty graph when their manager starts (torch 2.11)
    pytest.mark.filterwarnings("ignore:The CUDA Graph is empty:UserWarning"),
]


def graphs() -> int:
    return counters["stats"]["unique_graphs"]


def step_fn(log):
    """A training-like step that logs 4 metrics: float32, int64, bool tensors and a number."""
    def step(x, w):
        y = (x @ w).relu()
        loss = y.mean()
        big = (y > 0.5).sum()
        ok = loss < 1.0
        log(loss=loss, big=big, ok=ok, lr=0.25)
        return loss, big, ok
    return step


@pytest.mark.parametrize("delivery", ["thread", "caller"])
def test_fullgraph_step_logs_4_metrics_exactly_over_1000_steps(delivery):
    sink = Collect()
    log = syncless.Logger(every=64, sinks=sink, delivery=delivery)
    fn = torch.compile(step_fn(log), fullgraph=True)
    torch.manual_seed(0)
    w = torch.randn(8, 8)
    expected = []
    fn(torch.randn(4, 8), w)                         # compiles
    expected.append(None)
    before = graphs()
    for i in range(1000):
        loss, big, ok = fn(torch.randn(4, 8) * (1 + i % 7), w)
        expected.append({"loss": float(loss), "big": float(big), "ok": float(ok), "lr": 0.25})
    log.close()
    assert graphs() == before, "values changing must not recompile"
    rows = sink.raw[-1000:]
    assert [r.step for r in rows] == list(range(1, 1001))
    assert [r.values for r in rows] == expected[1:]
    assert log.stats.steps == 1001 and log.stats.lost == 0


def test_compiled_training_step_logs_loss_and_grad_norm_exactly_and_backward_runs():
    """A training step as users compile it (default mode): the loss requires grad when it is
    logged, backward and the optimizer run after; the op neither breaks the graph nor touches
    autograd (no warning under filterwarnings=error), and the parameters train as without it."""
    torch.manual_seed(0)
    models = [torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))]
    models.append(copy.deepcopy(models[0]))
    sink = Collect()
    log = syncless.Logger(every=16, sinks=sink)

    def forward(model, x, y, logger):
        loss = torch.nn.functional.mse_loss(model(x), y)
        scale = model[2].weight.abs().mean()
        if logger is not None:
            logger(loss=loss, out_scale=scale)
        return loss, scale

    fns = [torch.compile(lambda x, y, m=m, lg=lg: forward(m, x, y, lg), fullgraph=True)
           for m, lg in zip(models, (None, log))]
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in models]
    xs = [(torch.randn(32, 8), torch.randn(32, 1)) for _ in range(40)]
    want = []
    for x, y in xs:
        for fn, opt, model in zip(fns, opts, models):
            loss, scale = fn(x, y)
            if model is models[1]:
                want.append({"loss": loss.item(), "out_scale": scale.item()})
            loss.backward()
            opt.step()
            opt.zero_grad()
    log.close()
    assert [r.values for r in sink.raw] == want
    assert [r.step for r in sink.raw] == list(range(40))
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(a, b), "logging must not change training"
    with syncless.Logger() as probe:
        explained = torch._dynamo.explain(lambda x, y: forward(models[1], x, y, probe))(*xs[0])
    assert explained.graph_break_count == 0


def test_explain_reports_no_graph_break():
    sink = Collect()
    with syncless.Logger(sinks=sink) as log:
        explanation = torch._dynamo.explain(step_fn(log))(torch.ones(4, 8), torch.ones(8, 8))
    assert explanation.graph_break_count == 0 and explanation.break_reasons == []
    assert explanation.graph_count == 1
    targets = [node.target for g in explanation.graphs for node in g.graph.nodes]
    assert targets.count(torch.ops.syncless.log.default) == 1
    assert [r.values for r in sink.raw] == [{"loss": 8.0, "big": 32.0, "ok": 0.0, "lr": 0.25}]


def test_numbers_are_constants_of_the_op_and_the_trace_adds_no_python_guard():
    """A Python number reaches the op as a float (no tensor made in the graph: no kernel per
    step), and the guards the trace adds are all C++ ones: no Python lambda runs per call."""
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
    sink = Collect()
    log = syncless.Logger(sinks=sink)

    def step(x):
        log(y=x.sum(), lr=0.125, epoch=3, warm=True)
        return x

    def only_numbers(x):
        log(lr=0.5)
        return x * 2

    explanation = torch._dynamo.explain(step)(torch.ones(3))
    nodes = [n for g in explanation.graphs for n in g.graph.nodes if n.op == "call_function"]
    ops = [n for n in nodes if n.target is torch.ops.syncless.log.default]
    assert len(ops) == 1 and ops[0].args[2] == [0.125, 3.0, 1.0]
    assert all(n.target is not torch.full for n in nodes)
    torch._dynamo.reset()
    fn = torch.compile(step, fullgraph=True)
    fn(torch.ones(3))
    guards = str(_debug_get_cache_entry_list(step.__code__)[0].guard_manager)
    python_guards = [g for g in guards.splitlines() if "LAMBDA_GUARD" in g]
    assert not [g for g in python_guards if "syncless" in g], python_guards
    for i in range(3):
        fn(torch.full((3,), float(i)))
    torch.compile(only_numbers, fullgraph=True)(torch.ones(2))
    log.close()
    ones = {"y": 3.0, "lr": 0.125, "epoch": 3.0, "warm": 1.0}          # explain's run, then fn's
    assert [(r.step, r.values) for r in sink.raw] == (
        [(0, ones), (1, ones)]
        + [(2 + i, {"y": 3.0 * i, "lr": 0.125, "epoch": 3.0, "warm": 1.0}) for i in range(3)]
        + [(5, {"lr": 0.5})])


def test_new_names_steps_and_eager_logging_do_not_recompile():
    sink = Collect()
    log = syncless.Logger(every=8, sinks=sink)

    @torch.compile(fullgraph=True)
    def first(x):
        log(a=x * 2)                       # a name this logger has never seen: no eager call first
        return x

    @torch.compile(fullgraph=True)
    def second(x, step):
        log.log({"b": x[0] + 1, "c": x.sum()}, step)
        return x

    for i in range(6):
        first(torch.tensor(float(i)))
        log(eager=float(i))                          # eager, another new name each first time
        second(torch.full((2,), float(i)), 100 + 10 * i)
        if i == 2:
            settled = graphs()
    assert graphs() == settled, "after an explicit step's one dynamic recompile, nothing more"
    log.close()
    got = [(r.step, r.values) for r in sink.raw]
    want = []
    for i in range(6):
        base = 0 if i == 0 else 100 + 10 * (i - 1) + 1
        want += [(base, {"a": 2.0 * i}), (base + 1, {"eager": float(i)}),
                 (100 + 10 * i, {"b": i + 1.0, "c": 2.0 * i})]
    assert got == want


@pytest.mark.parametrize("how", ["tensor", "numbers"])
def test_a_changing_learning_rate_and_count_compile_at_most_twice_and_log_exactly(how):
    """A scheduler's lr and a token count (an int past float32's range) change every step.
    Passed in as tensors they are graph inputs: one graph. As Python numbers (the lr read
    inside the compiled step): one recompile (the second trace makes them dynamic, see
    _compile), not one per value until the recompile limit. Every row exact."""
    sink = Collect()
    log = syncless.Logger(every=8, sinks=sink)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=40)

    @torch.compile(fullgraph=True)
    def step(x, lr, tokens):
        loss = model(x).square().mean()
        log(loss=loss, lr=opt.param_groups[0]["lr"] if lr is None else lr, tokens=tokens,
            warm=True)
        return loss

    counters.clear()
    want = []
    for i in range(20):
        lr, tokens = opt.param_groups[0]["lr"], 2**40 + 3 * i
        args = ((torch.tensor(lr, dtype=torch.float64), torch.tensor(tokens)) if how == "tensor"
                else (None, tokens))
        loss = step(torch.full((2, 3), i / 10), *args)
        want.append((i, {"loss": loss.item(), "lr": lr, "tokens": float(tokens), "warm": 1.0}))
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    assert graphs() == (1 if how == "tensor" else 2)
    log.close()
    assert [(r.step, r.values) for r in sink.raw] == want


def test_bad_value_inside_compiled_code_is_a_clear_error_and_loses_nothing():
    sink = Collect()
    log = syncless.Logger(sinks=sink)
    fn = torch.compile(lambda x: log(v=x * 2), fullgraph=True)
    fn(torch.tensor(3.0))
    with pytest.raises(ValueError, match=r"metric 'v' must hold one element, got shape \(3,\)"):
        fn(torch.ones(3))
    log.close()
    assert [(r.step, r.values) for r in sink.raw] == [(0, {"v": 6.0})]
    with pytest.raises(ValueError, match="this Logger is closed"):
        fn(torch.tensor(1.0))


def test_timer_inside_compiled_code_is_a_stated_graph_break():
    def fn(x):
        with syncless.timer("compiled-block"):
            y = x.sin() + 1
        return y * 2

    with pytest.raises(torch._dynamo.exc.Unsupported, match=re.escape("syncless.timer() inside")):
        torch.compile(fn, fullgraph=True, backend="eager")(torch.ones(3))
    syncless.timers.reset("compiled-block")
    torch._dynamo.reset()
    relaxed = torch.compile(fn, backend="eager")
    for _ in range(3):
        out = relaxed(torch.ones(3))
    assert torch.equal(out, (torch.ones(3).sin() + 1) * 2)
    stats = syncless.timer("compiled-block").stats
    assert stats.count == 3 and stats.min > 0


def test_import_does_not_load_dynamo_and_the_trace_time_flag_is_dynamos(fresh_interpreter):
    # Importing torch._dynamo takes seconds; syncless sets assume_constant_result's flag itself.
    assert fresh_interpreter["dynamo_loaded"] is False
    from syncless import _compile
    marked = torch._dynamo.assume_constant_result(lambda: 0)
    assert {k for k in vars(marked)} == {"_dynamo_marked_constant"}
    assert _compile._site._dynamo_marked_constant is marked._dynamo_marked_constant


# ---- CUDA: the default inductor mode, and reduce-overhead's CUDA graphs --------------------------

@pytest.mark.cuda
def test_cuda_compiled_step_logs_exact_values_without_a_sync():
    sink = Collect()
    log = syncless.Logger(every=16, sinks=sink)
    fn = torch.compile(step_fn(log), fullgraph=True)
    w = torch.randn(8, 8, device="cuda")
    xs = [torch.randn(4, 8, device="cuda") for _ in range(40)]
    fn(xs[0], w)
    outs = []
    torch.cuda.set_sync_debug_mode("error")
    try:
        for x in xs:
            outs.append(fn(x, w))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    log.close()
    want = [{"loss": float(a), "big": float(b), "ok": float(c), "lr": 0.25} for a, b, c in outs]
    assert [r.values for r in sink.raw[1:]] == want
    assert [r.step for r in sink.raw] == list(range(41))


@pytest.mark.cuda
@pytest.mark.parametrize("delivery", ["thread", "caller"])
def test_reduce_overhead_replays_append_one_row_each_with_exact_steps(delivery):
    sink = Collect()
    log = syncless.Logger(every=10, sinks=sink, capacity=256, delivery=delivery)
    model = torch.nn.Linear(16, 16, device="cuda")

    def step(x):
        y = model(x)
        loss = y.square().mean()
        log(loss=loss, peak=y.abs().amax(), lr=0.5)
        return loss

    fn = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    skips = counters["inductor"]["cudagraph_skips"]
    xs = [torch.randn(8, 16, device="cuda") for _ in range(120)]
    losses = []
    with torch.no_grad():
        for i in range(3):                           # warm-up and recording, outside the check
            losses.append(fn(xs[i]).clone())
        torch.cuda.set_sync_debug_mode("error")
        try:
            for i in range(3, 120):
                losses.append(fn(xs[i]).clone())
                if i % 50 == 49:
                    log.flush(wait=False)            # enqueues one copy; never waits
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert counters["inductor"]["cudagraph_skips"] == skips, "the graph must be CUDA-graphed"
    assert log._gen.captured, "the gather must have been captured into the CUDA graph"
    log.close()
    assert [r.step for r in sink.raw] == list(range(120))
    assert [r.values["loss"] for r in sink.raw] == [float(v) for v in losses]
    assert all(r.values["lr"] == 0.5 for r in sink.raw)
    assert log.stats.lost == 0


@pytest.mark.cuda
def test_reduce_overhead_steps_stay_consecutive_across_calls_rerecords_and_eager_logs():
    """Two log() calls a step, a new batch shape half-way (cudagraph trees record a second
    graph, after eager warm-up runs) and an eager log() after the replays: every call takes the
    next step, as in eager code, because the GPU counts them."""
    sink = Collect()
    log = syncless.Logger(every=16, sinks=sink, capacity=512)
    model = torch.nn.Linear(16, 16, device="cuda")

    def step(x):
        y = model(x)
        loss = y.square().mean()
        log(loss=loss)
        log(peak=y.abs().amax())
        return loss

    fn = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    xs = [torch.randn(8 if i < 30 else 4, 16, device="cuda") for i in range(60)]
    losses = []
    with torch.no_grad():
        for i, x in enumerate(xs):
            losses.append(fn(x).clone())
            if i % 20 == 19:
                log.flush(wait=False)
    assert log.steps_on_device()
    log(epoch=1.0)                                   # eager, after the replays: no step= needed
    log.close()
    assert [r.step for r in sink.raw] == list(range(121))
    assert [r.values["loss"] for r in sink.raw[0:120:2]] == [float(v) for v in losses]
    assert all(set(r.values) == {"peak"} for r in sink.raw[1:120:2])
    assert sink.raw[-1].values == {"epoch": 1.0}
    assert log.stats.lost == 0
    torch._inductor.cudagraph_trees.reset_cudagraph_trees()


@pytest.mark.cuda
def test_reduce_overhead_changing_numbers_recompile_once_and_log_exactly():
    """A scheduler's lr and a step count read as Python numbers inside a reduce-overhead step:
    one recompile, and every row holds that step's values (a CUDA graph that kept the value of
    its capture would log it on every replay)."""
    sink = Collect()
    log = syncless.Logger(every=8, sinks=sink, capacity=256)
    model = torch.nn.Linear(16, 1, device="cuda")
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=60)

    @torch.compile(mode="reduce-overhead", fullgraph=True)
    def step(x, seen):
        loss = model(x).square().mean()
        log(loss=loss, lr=opt.param_groups[0]["lr"], seen=seen)
        return loss

    counters.clear()
    want = []
    with torch.no_grad():
        for i in range(40):
            lr = opt.param_groups[0]["lr"]
            loss = step(torch.full((4, 16), i / 40, device="cuda"), 1000 + 7 * i).clone()
            want.append((i, lr, 1000.0 + 7 * i, loss))
            opt.step()                               # no gradients: changes nothing
            sched.step()
    assert graphs() == 2, "one recompile makes the changing numbers dynamic"
    log.close()
    assert [(r.step, r.values["lr"], r.values["seen"], r.values["loss"]) for r in sink.raw] == [
        (i, lr, seen, float(loss)) for i, lr, seen, loss in want]
    assert log.stats.lost == 0
    torch._inductor.cudagraph_trees.reset_cudagraph_trees()


@pytest.mark.cuda
def test_reduce_overhead_rows_past_capacity_are_counted_as_lost():
    sink = Collect()
    log = syncless.Logger(every=4, sinks=sink, capacity=16)
    fn = torch.compile(lambda x: log(x=x.sum()), mode="reduce-overhead", fullgraph=True)
    x = torch.ones(4, device="cuda")
    for _ in range(60):                              # no flush between: the ring wraps
        fn(x)
    log.close()
    assert log.stats.lost + len(sink.raw) == 60
    assert [r.step for r in sink.raw][-16:] == list(range(44, 60))
    assert log.stats.lost > 0


@pytest.mark.cuda
def test_explicit_step_inside_a_cuda_graph_is_refused():
    log = syncless.Logger()
    fn = torch.compile(lambda x, s: log(x=x.sum(), step=s), mode="reduce-overhead")
    x = torch.ones(4, device="cuda")
    try:
        with pytest.raises(RuntimeError, match=re.escape("log(step=...) inside a CUDA graph")):
            for _ in range(3):
                fn(x, 7)                             # warm-up (logged), then the recording
    finally:
        torch._inductor.cudagraph_trees.reset_cudagraph_trees()
    log.close()


# ---- the flush inside a compiled step: no host read, no pinned allocation ------------------------

# What reads a device value on the host (each a sync) or allocates page-locked memory (an
# implicit synchronisation, cudaHostAlloc).
_HOST_READS = {"item", "tolist", "cpu", "numpy", "synchronize", "__float__", "__int__",
               "__bool__", "float", "int", "bool", "Window", "empty", "pin_memory"}


def _flush_path():
    """The functions a flush inside a compiled step runs on the training thread (delivery
    "thread", the default): Logger._flush_window and what it calls on the logger, its hand-over
    and the window pool, followed through the source (so a renamed or new helper is walked too)."""
    import ast
    import inspect
    import textwrap
    from syncless import _handover, logger as logger_mod
    owners = {"self": None, "_handover": _handover.ThreadHandover, "pool": _handover.Pool}
    modules = {logger_mod.Logger: logger_mod, _handover.ThreadHandover: _handover,
               _handover.Pool: _handover}
    todo, seen = [(logger_mod.Logger, "_flush_window")], {}
    while todo:
        cls, name = todo.pop()
        fn = getattr(cls, name, None)
        if fn is None:                                  # a module-level function
            fn = getattr(modules[cls], name)
        key = f"{getattr(fn, '__qualname__', name)}"
        if key in seen or not callable(fn) or not hasattr(fn, "__code__"):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
        seen[key] = tree
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            if isinstance(f, ast.Attribute):
                base = f.value.attr if isinstance(f.value, ast.Attribute) else \
                    f.value.id if isinstance(f.value, ast.Name) else None
                if base in owners:
                    todo.append((owners[base] or cls, f.attr))
            elif isinstance(f, ast.Name) and hasattr(modules[cls], f.id):
                todo.append((cls, f.id))
    return seen


def test_a_flush_in_a_compiled_step_reads_no_device_value_and_allocates_no_pinned_memory():
    """The CPU half of the no-sync promise for flushes (every-th call or max_delay) inside
    compiled code: the training thread's flush path calls nothing that reads a device value on
    the host, and allocates a pinned window only when none is free, which after
    Handover.reserve (run where the ring is made) happens only after an interrupt parked one.
    test_cuda_max_delay_flushes_inside_a_compiled_step_never_sync proves it on the GPU."""
    import ast
    import inspect
    import textwrap
    from syncless import _handover, logger as logger_mod
    path = _flush_path()
    assert {"Logger._flush_window", "Handover.send_window", "Pool.reuse", "Pool.wait"} <= set(path)
    calls = {}
    for name, tree in path.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                f = node.func
                called = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
                if called in _HOST_READS:
                    calls.setdefault(name, []).append(ast.unparse(node))
    assert calls == {"Handover.send_window": ["Window(ring.device, ring.nbytes)"]}
    fallback = [node for node in ast.walk(path["Handover.send_window"])
                if isinstance(node, ast.If) and ast.unparse(node.test) == "w is None"]
    assert [ast.unparse(n) for n in fallback[0].body] == ["w = Window(ring.device, ring.nbytes)"]
    # The windows are made with each ring (the first CUDA log() and a wider ring)
    for made in (logger_mod.Logger._bind, logger_mod.Logger._grow):
        tree = ast.parse(textwrap.dedent(inspect.getsource(made)))
        assert any(ast.unparse(n.func) == "self._handover.reserve" for n in ast.walk(tree)
                   if isinstance(n, ast.Call)), made.__name__
    reserve = ast.parse(textwrap.dedent(inspect.getsource(_handover.Handover.reserve)))
    assert "Window(ring.device, ring.nbytes)" in {ast.unparse(n) for n in ast.walk(reserve)}


class _SlowSink(Collect):
    """Collect, 3 ms a write: the windows pile up, as behind a slow file system or a network
    sink, so a flush finds every window still out unless they were all made in advance."""

    def write(self, rows):
        time.sleep(0.003)
        super().write(rows)


LAUNCHES = {"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx"}


def _pinned_handouts() -> int:
    stats = torch.cuda.host_memory_stats()
    return stats.get("active_requests.allocated", stats.get("num_host_alloc", 0))


@pytest.mark.cuda
def test_cuda_max_delay_flushes_inside_a_compiled_step_make_no_blocking_call():
    """The same run under syncless.audit (CUPTI, the training thread's every driver call): no
    sync, no blocking copy, and no call but a kernel launch that took over 1 ms (a pinned
    allocation was one; a launch waits for a GPU that other processes share: 2.0 ms in an H100
    run with 4 test processes)."""
    sink = _SlowSink()
    log = syncless.Logger(every=64, sinks=sink, max_delay=0.002)
    fn = torch.compile(step_fn(log), fullgraph=True)
    w = torch.randn(8, 8, device="cuda")
    xs = [torch.randn(4, 8, device="cuda") for _ in range(401)]
    fn(xs[0], w)
    torch.cuda.synchronize()
    with syncless.audit() as a:
        for x in xs[1:]:
            fn(x, w)
            torch.cuda._sleep(20_000)
    if a.backend != "cupti":
        log.close()
        pytest.skip(f"CUPTI unavailable: {a.reason}")
    windows = log.stats.windows
    log.close()
    assert windows > 400 // 64 + 2
    assert (a.sites, a.unattributed) == ({}, 0), a.report()
    assert all(set(s.what) <= LAUNCHES for s in a.slow.values()), a.report()


@pytest.mark.cuda
@pytest.mark.parametrize("delivery", ["thread", "caller"])
def test_cuda_max_delay_flushes_inside_a_compiled_step_never_sync(delivery):
    """torch.compile(fullgraph=True), default mode, 400 steps after warm-up with every=64 and
    max_delay=2 ms: most windows go out by max_delay, from the op inside the compiled step,
    while earlier ones are still with a slow sink. torch's sync-debug mode raises at any sync
    (on the delivery thread too: the row would then be missing), no pinned memory is handed
    out after the warm-up call, and every row is exact."""
    sink = _SlowSink()
    log = syncless.Logger(every=64, sinks=sink, max_delay=0.002, delivery=delivery)
    fn = torch.compile(step_fn(log), fullgraph=True)
    w = torch.randn(8, 8, device="cuda")
    xs = [torch.randn(4, 8, device="cuda") for _ in range(401)]
    outs = [fn(xs[0], w)]                            # compiles, binds the ring, makes the windows
    torch.cuda.synchronize()
    pinned, windows = _pinned_handouts(), log.stats.windows
    torch.cuda.set_sync_debug_mode("error")
    try:
        for x in xs[1:]:
            outs.append(fn(x, w))
            torch.cuda._sleep(20_000)                # ~10 us of GPU work: the GPU stays busy
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert _pinned_handouts() == pinned, "a flush allocated a pinned window mid-run"
    assert log.stats.windows - windows > 400 // 64 + 2, "max_delay must have flushed too"
    log.close()
    want = [{"loss": float(a), "big": float(b), "ok": float(c), "lr": 0.25} for a, b, c in outs]
    assert [r.values for r in sink.raw] == want
    assert [r.step for r in sink.raw] == list(range(401))
    assert log.stats.delivered == 401 and log.stats.lost == 0
