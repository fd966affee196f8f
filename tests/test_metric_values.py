"""What log() reads from a tensor: the exact value `.item()` gives, or a clear error naming the
metric (issue 11). Tensors that used to crash the process (FakeTensor, wrapper subclasses,
functionalized tensors, freed storage, DTensor) run in a child process, so a regression fails
these tests instead of killing the suite. Every case logs a good row before and after the bad
one: nothing already logged may be lost."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import syncless
from _gloo import TRIES, ranks_or_flake

# The children import the test sink from tests/_sinks.py.
ENV = dict(os.environ, NCCL_NVLS_ENABLE="0", PYTHONWARNINGS="ignore",
           PYTHONPATH=os.pathsep.join(filter(None, [os.path.dirname(os.path.abspath(__file__)),
                                                   os.environ.get("PYTHONPATH")])))

# The child: one JSON line per case, printed before the next case starts, so a crash names the
# case it happened in. Each case function logs through `log` and returns the expected value
# (None when an error is expected) and the expected error text.
CHILD = r'''
import json, math, sys
import numpy as np
import torch
import syncless

dev = sys.argv[1]
cases = sys.argv[2:]
if dev == "cpu-fallback":
    # torch without the DLPack exchange table (< 2.10): the attribute path must check the same
    dev = "cpu"
    from syncless import _metric, _torch
    assert not _torch._C.bind_torch(torch.Tensor, torch.nn.Parameter, _torch.DTYPE_KINDS, None,
                                    None, _metric.resolve, _metric.number, _metric.REAL_TYPES)

from _sinks import Collect

class Wrapper(torch.Tensor):
    @staticmethod
    def __new__(cls, elem):
        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype,
                                                   device=elem.device)
    def __init__(self, elem):
        self.elem = elem
    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return NotImplemented

class Plain(torch.Tensor):
    pass

def t(v, dtype=torch.float32):
    return torch.tensor(v, dtype=dtype, device=dev)

def case_fake(log):
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        f = torch.tensor(3.0, device=dev) * 2
    log(x=f)

def case_wrapper(log):
    log(x=Wrapper(t(2.0)))

def case_functional(log):
    def fn(x):
        y = x * 2
        y.add_(1)
        log(x=y)
        return y
    torch.func.functionalize(fn)(t(1.5))
    return 4.0

def case_resized(log):
    x = t(3.0)
    x.untyped_storage().resize_(0)
    log(x=x)

def case_resized_view(log):
    base = torch.arange(10.0, device=dev)
    view = base[5]
    base.untyped_storage().resize_(0)
    log(x=view)

def case_neg_view(log):
    x = torch._neg_view(t([5.0]))
    ref = x.item()
    log(x=x)
    return ref

def case_neg_detached(log):
    x = torch._neg_view(t([5.0])).detach()         # not a view, still a negative bit
    ref = x.item()
    log(x=x)
    return ref

def case_conj_imag(log):
    x = torch.tensor([1 + 2j], device=dev).conj().imag
    ref = x.item()
    log(x=x)
    return ref

def case_zero_tensor(log):
    log(x=torch._efficientzerotensor((), device=dev))
    return 0.0

def case_meta(log):
    log(x=torch.ones((), device="meta"))

def case_complex_tensor(log):
    log(x=torch.tensor(3 + 4j, device=dev))

def case_numpy_complex64(log):
    log(x=np.complex64(3 + 4j))

def case_numpy_float32(log):
    log(x=np.float32(1.25))
    return 1.25

def case_float4(log):
    log(x=torch.zeros((), dtype=torch.uint8, device=dev).view(torch.float4_e2m1fn_x2))

def case_parameter(log):
    p = torch.nn.Parameter(t(4.5))
    log(x=p)
    return 4.5

def case_plain_subclass(log):
    log(x=t(2.5).as_subclass(Plain))
    return 2.5

def float8(dtype):
    def case(log):
        # all 256 bit patterns, 128 metrics per call, compared with torch's own conversion
        patterns = torch.arange(256, dtype=torch.int32, device=dev).to(torch.uint8).view(dtype)
        ref = patterns.float().cpu().tolist()
        for half in (0, 1):                  # new names grow the ring: allocations, not strict
            log.plain.log({f"b{i}": patterns[i] for i in range(128 * half, 128 * half + 128)})
        return ref
    return case

for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
              "float8_e8m0fnu"):
    globals()["case_" + _name] = float8(getattr(torch, _name))

class Strict:
    """The logger, with every call made under sync-debug mode "error" on CUDA: reading (and
    resolving) a metric must not sync. The cases build their tensors and read their expected
    values outside it."""
    def __init__(self, log):
        self._log = self.plain = log
    def _strict(self, fn, *args, **kwargs):
        if dev != "cuda":
            return fn(*args, **kwargs)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            return fn(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    def __call__(self, **metrics):
        self._strict(self._log, **metrics)
    def log(self, metrics):
        self._strict(self._log.log, metrics)

for name in cases:
    sink = Collect()
    out = {"case": name, "error": None}
    log = syncless.Logger(every=1000, sinks=sink, device=dev if dev == "cuda" else None)
    try:
        log(before=1.0)
        try:
            out["ref"] = globals()["case_" + name](Strict(log))
        except Exception as exc:
            out["error"] = f"{type(exc).__name__}: {exc}"
        log(after=2.0)
    finally:
        log.close()
    out["rows"] = sink.rows
    print(json.dumps(out), flush=True)
'''

# case -> expected: a number, "float8" (compare with torch's conversion) or an error pattern.
CASES = {
    "fake": "TypeError: metric 'x' is a FakeTensor (no data",
    "wrapper": "TypeError: metric 'x' is a Wrapper with no data of its own",
    "functional": 4.0,
    "resized": "TypeError: metric 'x' has no data: its storage holds 0 bytes",
    "resized_view": "TypeError: metric 'x' has no data: its storage holds 0 bytes but the "
                    "element lies at byte 20",
    "neg_view": -5.0,
    "neg_detached": -5.0,
    "conj_imag": -2.0,
    "zero_tensor": 0.0,
    "meta": "TypeError: metric 'x' is on the meta device",
    "complex_tensor": "TypeError: metric 'x' has a dtype that is not a real number: ",
    "numpy_complex64": "TypeError: metric 'x' is complex (complex64)",
    "numpy_float32": 1.25,
    "float4": "TypeError: metric 'x' has a dtype that packs 2 values of 4 bits",
    "parameter": 4.5,
    "plain_subclass": 2.5,
    "float8_e4m3fn": "float8",
    "float8_e5m2": "float8",
    "float8_e4m3fnuz": "float8",
    "float8_e5m2fnuz": "float8",
    "float8_e8m0fnu": "float8",
}


class Child:
    """A child process started at once and waited for when its result is needed, so the CPU
    children of this module (about 3 s of imports each) run side by side."""

    def __init__(self, *args):
        self.proc = subprocess.Popen([sys.executable, "-c", *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=ENV)
        self.result = None

    def wait(self):
        if self.result is None:
            stdout, stderr = self.proc.communicate(timeout=300)
            self.result = (self.proc.returncode, stdout, stderr)
        return self.result


@pytest.fixture(scope="module")
def cpu_children(tmp_path_factory):
    """The module's CPU children, all started before the first of them is waited for."""
    store = str(tmp_path_factory.mktemp("fsdp") / "store")
    children = {"values": Child(CHILD, "cpu", *CASES),
                "fallback": Child(CHILD, "cpu-fallback", *FALLBACK_CASES),
                "dtensor": Child(DTENSOR_CHILD, "cpu"),
                "fsdp": [Child(FSDP_CHILD, "cpu", str(rank), "2", store) for rank in range(2)]}
    yield children
    for child in [children["values"], children["fallback"], children["dtensor"],
                  *children["fsdp"]]:
        child.wait()                        # reaped and its pipes closed, used or not


def _case_results(child):
    rc, stdout, stderr = child.wait()
    results = {}
    for line in stdout.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            results[row["case"]] = row
    return rc, stderr, results


@pytest.fixture(scope="module")
def child_cuda():
    return _case_results(Child(CHILD, "cuda", *CASES))


def _check(case, rc, stderr, results):
    if case not in results:
        pytest.fail(f"child died (rc {rc}) in case {case!r} or before it; cases done: "
                    f"{list(results)}\n{stderr[-3000:]}")
    out = results[case]
    expected = CASES[case]
    steps = [step for step, _ in out["rows"]]
    first, last = out["rows"][0], out["rows"][-1]
    assert first[1] == {"before": 1.0} and last[1] == {"after": 2.0}, out["rows"]
    if isinstance(expected, str) and expected != "float8":
        assert out["error"] is not None and out["error"].startswith(expected), out["error"]
        assert len(out["rows"]) == 2 and steps == [0, 1]      # nothing lost around the error
        return
    assert out["error"] is None, out["error"]
    if expected == "float8":
        got = {**out["rows"][1][1], **out["rows"][2][1]}
        ref = out["ref"]
        assert len(got) == 256
        for i in range(256):
            g, r = got[f"b{i}"], ref[i]
            assert g == r or (g != g and r != r), (case, i, g, r)
        return
    assert out["ref"] in (None, expected)
    assert [v for _, v in out["rows"][1:-1]] == [{"x": expected}]


@pytest.mark.parametrize("case", list(CASES))
def test_metric_value_cpu(case, cpu_children):
    _check(case, *_case_results(cpu_children["values"]))


FALLBACK_CASES = ["fake", "functional", "resized", "resized_view", "neg_detached", "meta",
                  "complex_tensor", "parameter", "float8_e5m2"]


@pytest.mark.parametrize("case", FALLBACK_CASES)
def test_metric_value_cpu_without_the_exchange_table(case, cpu_children):
    _check(case, *_case_results(cpu_children["fallback"]))


@pytest.mark.cuda
@pytest.mark.parametrize("case", list(CASES))
def test_metric_value_cuda(case, child_cuda):
    _check(case, *child_cuda)


# ---- numbers that are not tensors (no child needed: they never crashed) ---------------------

@pytest.mark.parametrize("value, expected", [
    (np.float32(0.1), float(np.float32(0.1))),
    (np.int64(2**40 + 1), float(2**40 + 1)),
    (np.bool_(True), 1.0),
    (np.array(2.5), 2.5),
    (np.float64(0.3), 0.3),
])
def test_numpy_reals_are_logged_exactly(value, expected):
    rows = []
    with syncless.Logger(every=10, sinks=syncless.sinks.Callback(
            lambda s, t, v: rows.append(v))) as log:
        log(x=value)
        log(x=value)                     # the second time its type is known real: read in C
    assert rows == [{"x": expected}, {"x": expected}]


@pytest.mark.parametrize("value, text", [
    (np.complex64(3 + 4j), "metric 'x' is complex"),
    (np.complex128(3 + 4j), "metric 'x' is complex"),
    (np.array(1 + 1j), "metric 'x' is complex"),
    (np.array([1.0, 2.0]), r"metric 'x' must hold one element, got shape \(2,\)"),
    (np.str_("1.0"), "metric 'x' must be a real number or a one-element tensor, got str_"),
])
def test_numpy_values_that_are_not_one_real_are_refused(value, text):
    with syncless.Logger(every=10) as log:
        with pytest.raises((TypeError, ValueError), match=text):
            log(x=value)


# ---- DTensor and FSDP2 ----------------------------------------------------------------------

DTENSOR_CHILD = r'''
import json, os, sys, tempfile
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
import syncless

dev = sys.argv[1]
store = os.path.join(tempfile.mkdtemp(), "store")
if dev == "cuda":
    torch.cuda.set_device(0)
dist.init_process_group("gloo" if dev == "cpu" else "nccl", init_method=f"file://{store}",
                        rank=0, world_size=1)
mesh = init_device_mesh(dev, (1,))
rows, errors = [], []
log = syncless.Logger(every=100, sinks=syncless.sinks.Callback(lambda s, t, v: rows.append(v)),
                      device=dev if dev == "cuda" else None)
replicated = DTensor.from_local(torch.tensor(2.5, device=dev), mesh, [Replicate()])
partial = DTensor.from_local(torch.tensor(1.5, device=dev), mesh, [Partial()])
sharded = distribute_tensor(torch.tensor([7.0], device=dev), mesh, [Shard(0)])
two = DTensor.from_local(torch.tensor([1.0, 2.0], device=dev), mesh, [Replicate()])
if dev == "cuda":
    for d in (replicated, partial, sharded):
        d.full_tensor()                               # the communicator's first use: set-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")           # resolving a DTensor must not sync
log(replicated=replicated, partial=partial, sharded=sharded)
try:
    log(two=two)
except ValueError as exc:
    errors.append(str(exc))
if dev == "cuda":
    torch.cuda.set_sync_debug_mode(0)
log.close()
print(json.dumps({"rows": rows, "errors": errors,
                  "ref": [replicated.full_tensor().item(), partial.full_tensor().item(),
                          sharded.full_tensor().item()]}))
dist.destroy_process_group()
'''


def _dtensor(child):
    rc, stdout, stderr = child.wait()
    assert rc == 0, stderr[-3000:]
    out = json.loads(stdout.splitlines()[-1])
    assert out["ref"] == [2.5, 1.5, 7.0]
    assert out["rows"] == [{"replicated": 2.5, "partial": 1.5, "sharded": 7.0}]
    assert out["errors"] == ["metric 'two' must hold one element, got a DTensor of global "
                             "shape (2,)"]


def test_dtensor_one_rank_gloo_logs_the_global_value(cpu_children):
    _dtensor(cpu_children["dtensor"])


@pytest.mark.cuda
def test_dtensor_one_gpu_nccl_logs_the_global_value_without_a_sync():
    _dtensor(Child(DTENSOR_CHILD, "cuda"))


FSDP_CHILD = r'''
import json, os, sys
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
import syncless

dev, rank, world, store = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
if dev == "cuda":
    torch.cuda.set_device(rank)
dist.init_process_group("gloo" if dev == "cpu" else "nccl", init_method=f"file://{store}",
                        rank=rank, world_size=world)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
model.to(dev)
for layer in model:
    if isinstance(layer, torch.nn.Linear):
        fully_shard(layer)
fully_shard(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
torch.manual_seed(1 + rank)
data = [(torch.randn(8, 16, device=dev), torch.randn(8, 1, device=dev)) for _ in range(6)]
rows, kept, placements = [], [], []
log = syncless.Logger(every=4, sinks_on="all", device=dev if dev == "cuda" else None,
                      sinks=syncless.sinks.Callback(lambda s, t, v: rows.append((s, v))))
for step, (x, y) in enumerate(data):
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    strict = dev == "cuda" and step >= 2              # two warm-up steps outside the check
    if strict:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")       # clipping and logging: zero syncs
    try:
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        log(loss=loss, grad_norm=gn)
    finally:
        if strict:
            torch.cuda.set_sync_debug_mode(0)
    kept.append((loss.detach().clone(), gn))
    placements.append(type(gn).__name__ + str(list(gn.placements)))
    opt.step()
log.close()
ref = [{"loss": l.item(), "grad_norm": g.full_tensor().item()} for l, g in kept]
print(json.dumps({"rows": rows, "ref": ref, "placements": sorted(set(placements))}))
dist.destroy_process_group()
'''


def _fsdp(children):
    outs = []
    for child in children:
        rc, stdout, stderr = child.wait()
        assert rc == 0, stderr[-3000:]
        outs.append(json.loads(stdout.splitlines()[-1]))
    for out in outs:
        assert [s for s, _ in out["rows"]] == list(range(6))
        assert [v for _, v in out["rows"]] == out["ref"]
    assert outs[0]["ref"][0]["grad_norm"] > 0
    return outs


def test_fsdp2_two_gloo_ranks_log_clip_grad_norm_exactly(cpu_children, tmp_path):
    children = cpu_children["fsdp"]
    for attempt in range(1, TRIES):
        if ranks_or_flake(children) is not None:
            break
        store = str(tmp_path / f"store{attempt}")       # gloo's own set-up failed: again
        children = [Child(FSDP_CHILD, "cpu", str(rank), "2", store) for rank in range(2)]
    outs = _fsdp(children)
    assert outs[0]["placements"] == ["DTensor[Replicate()]"]       # torch 2.13
    # a replicated norm: the same value on both ranks
    assert [r["grad_norm"] for r in outs[0]["ref"]] == [r["grad_norm"] for r in outs[1]["ref"]]


@pytest.mark.cuda
def test_fsdp2_one_gpu_logs_clip_grad_norm_exactly_with_zero_syncs(tmp_path):
    _fsdp([Child(FSDP_CHILD, "cuda", "0", "1", str(tmp_path / "store"))])


def test_the_dtype_map_comes_from_the_c_kinds():
    from syncless._torch import DTYPE_KINDS, _C
    assert DTYPE_KINDS[torch.float32] == _C.KINDS["float32"]
    assert DTYPE_KINDS[torch.float8_e4m3fn] == _C.KINDS["float8_e4m3fn"]
    assert len(set(DTYPE_KINDS.values())) == len(DTYPE_KINDS)


# ---- the ring's rows as the C core decodes them (the GPU timestamp) -------------------------

@pytest.mark.cuda
def test_ring_rows_carry_a_gpu_timestamp_in_launch_order():
    from syncless._torch import _C
    from syncless.rows import Row
    capacity, columns, rows = 64, _C.COLUMN_BLOCK, 40
    memory = torch.empty(_C.ring_nbytes(capacity, columns), dtype=torch.uint8, device="cuda")
    ring = _C.Ring(0, memory.data_ptr(), capacity, columns)
    ring.clear(0)
    x = torch.zeros((), device="cuda")
    for step in range(rows):
        torch.cuda._sleep(1000)                       # GPU time passes between two rows
        x += 1
        ring.gather({"x": x, "h": 0.5}, {"x": 0, "h": 1}, step, 10 + step, float(step))
    pinned = torch.empty(memory.numel(), dtype=torch.uint8, pin_memory=True)
    window = _C.Window(0, pinned.data_ptr(), pinned.numel())
    ring.copy_to(window)
    window.wait()
    gpu = []
    counter, decoded = window.decode(0, ["x", "h"], {}, Row, -1.0, None, gpu)
    assert counter == rows
    assert decoded == [Row(10 + i, float(i), {"x": float(i + 1), "h": 0.5}) for i in range(rows)]
    assert all(type(r) is Row for r in decoded)
    assert [replayed for _, replayed in gpu] == [False] * rows     # eager: the call's own time
    gpu_ns = [t for t, _ in gpu]
    assert all(isinstance(t, int) for t in gpu_ns)
    assert all(b > a for a, b in zip(gpu_ns, gpu_ns[1:])), gpu_ns


@pytest.mark.cuda
def test_decode_gives_a_replayed_row_the_replay_time_and_says_so():
    """Window.decode chooses each row's time, in one place: the call's for an eager launch, the
    replay_time it is given for a row a CUDA graph replay wrote (no host call stood behind it);
    its gpu list says which rows those were."""
    from syncless._torch import _C
    from syncless.rows import Row
    capacity, columns = 64, _C.COLUMN_BLOCK
    memory = torch.empty(_C.ring_nbytes(capacity, columns), dtype=torch.uint8, device="cuda")
    ring = _C.Ring(0, memory.data_ptr(), capacity, columns)
    ring.clear(0)
    x = torch.zeros((), device="cuda")
    assert ring.gather({"x": x}, {"x": 0}, 0, 5, 1.5) is False          # eager, at step 5
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x.add_(1)
        assert ring.gather({"x": x, "h": 0.25}, {"x": 0, "h": 1}, 1, -1, 2.5) is True
    for _ in range(3):
        graph.replay()
    pinned = torch.empty(memory.numel(), dtype=torch.uint8, pin_memory=True)
    window = _C.Window(0, pinned.data_ptr(), pinned.numel())
    ring.copy_to(window)
    window.wait()
    gpu = []
    counter, decoded = window.decode(0, ["x", "h"], {}, Row, 99.0, None, gpu)
    assert counter == 4
    assert decoded == [Row(5, 1.5, {"x": 0.0})] + \
        [Row(5 + i, 99.0, {"x": float(i), "h": 0.25}) for i in (1, 2, 3)]
    assert [replayed for _, replayed in gpu] == [False, True, True, True]


@pytest.mark.cuda
def test_timer_times_a_block_from_c():
    torch.cuda.synchronize()
    with syncless.timer() as t:                      # enter/exit in C (TimerBase)
        torch.cuda._sleep(2_000_000)                 # a few ms of GPU time
    assert 0 <= t.cpu_ms < 1000
    ms = t.ms                                        # waits for the end event
    assert ms > 0.1
    assert t.ready and t.ms == ms


def _neg_zoo(device):
    """Tensors the probes never saw: other dtypes, expanded and strided views, results of ops,
    clones, neg views of neg views, of parameters and of inference tensors."""
    base = torch.arange(6.0, device=device).reshape(2, 3) + 1
    p = torch.nn.Parameter(torch.ones(2, device=device))
    zoo = [base[1, 2], base.t()[0, 1], base.sum(), base.clone()[0, 0], p[0], p.sum(),
           torch.tensor(7, dtype=torch.int32, device=device), base.expand(4, 2, 3)[3, 1, 1]]
    for dtype in (torch.bfloat16, torch.float64, torch.uint8, torch.bool, torch.float8_e4m3fn):
        zoo.append(torch.ones(3, device=device).to(dtype)[1])
    unsigned = (torch.bool, torch.float8_e4m3fn)     # torch cannot resolve their negation
    zoo += [torch._neg_view(x) for x in list(zoo) if x.dtype not in unsigned]
    zoo += [torch._neg_view(torch._neg_view(base))[0, 1], torch._neg_view(p)[1],
            torch.view_as_real(torch.ones(2, dtype=torch.complex64, device=device))[1, 1],
            torch.ones(1, dtype=torch.complex128, device=device).conj().imag]
    with torch.inference_mode():
        zoo += [torch._neg_view(torch.full((2,), 3.0, device=device))[1],
                torch.full((2,), 3.0, device=device)[0]]
    return zoo


def _read_all(zoo):
    return [syncless._torch._C.read_host_values({"m": x})[1]["m"] for x in zoo]


def test_the_negative_bit_is_read_from_the_key_set_and_agrees_with_is_neg():
    from syncless import _torch
    assert _torch.NEG_BIT_READ                    # this torch: found where the bit lives
    zoo = _neg_zoo("cpu")
    assert sum(x.is_neg() for x in zoo) >= 10 and sum(not x.is_neg() for x in zoo) >= 10
    expected = [x.resolve_neg().item() for x in zoo]
    assert _read_all(zoo) == expected
    # Probes that cannot tell the bit apart (too few, none negative) turn the read off; values
    # stay right through is_neg(); learning again turns it back on.
    try:
        assert not _torch._C.learn_neg_bit([torch.ones(1)] * 4)
        assert not _torch._C.learn_neg_bit([])
        assert _read_all(zoo) == expected
    finally:
        assert _torch._learn_neg_bit()
    assert _read_all(zoo) == expected


@pytest.mark.cuda
def test_cuda_negative_bits_are_logged_as_their_values():
    zoo = [x for x in _neg_zoo("cuda") if x.dtype.is_floating_point or x.dtype == torch.int32]
    expected = [float(x.resolve_neg().item()) for x in zoo]
    rows = []

    class Sink:
        def write(self, batch):
            rows.extend(batch)

    torch.cuda.synchronize()
    with syncless.Logger(sinks=[Sink()], every=4) as log:
        torch.cuda.set_sync_debug_mode("error")
        try:
            for x in zoo:
                log.log({"m": x})
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert [r.values["m"] for r in rows] == expected
