"""The TensorBoard and W&B drop-ins and sinks, against the real backends.

Each test logs the same calls twice: a reference with plain Python numbers through the backend's
own API, and tensors through syncless. The files are read back with the backends' own readers
(TensorBoard's EventAccumulator; `wandb leet inspect --json` for the offline run's .wandb log) and
compared value by value. On CUDA the syncless calls run under torch's sync-debug mode "error".
"""
import contextlib
import importlib
import json
import math
import os
import subprocess
import sys
import time

import pytest
import torch

import syncless
from syncless import sinks

pytestmark = [
    # protobuf and wandb's pydantic settings warn about their own internals on some versions.
    pytest.mark.filterwarnings("ignore::DeprecationWarning:google.protobuf.*"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:wandb.*"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:pydantic.*"),
]

VALUES = [i / 8 - 2 for i in range(64)]          # exact in float32, so TensorBoard stores them as is


@contextlib.contextmanager
def no_syncs(device):
    """Any host-device sync in the block raises (CUDA); nothing to check on CPU."""
    if device != "cuda":
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def device_values(device):
    """VALUES as 0-dim views of one device tensor (made before any no_syncs block), and steps."""
    return (torch.tensor(VALUES, dtype=torch.float32, device=device),
            torch.arange(64, device=device))


# ---- TensorBoard -------------------------------------------------------------------------------

def tb_calls(w, v, steps):
    """A training loop's TensorBoard calls: v[i] is VALUES[i] (a float or a tensor view)."""
    for i in range(12):
        w.add_scalar("train/loss", v[i], i)
        w.add_scalar("train/acc", v[40 - i], i)
        if i % 4 == 0:
            w.add_scalars("lr", {"a": v[i + 1], "b": v[20]}, i)
            w.add_text("note", f"step {i}", i)           # a pass-through method
    w.add_scalar("train/loss", 0.375, 12)                # a Python float between tensors
    w.add_scalar("eval/loss", v[50], 3)                  # an earlier step, another tag
    w.add_scalar("fixed", v[7], 20, walltime=1234.5)
    w.add_scalar("nostep", v[9])                         # global_step None: torch writes 0
    w.add_scalar("tensor_step", v[11], steps[30])        # a tensor step (int64 on the device)
    w.add_scalar("new_style", v[13], 5, new_style=True)


def read_tb(logdir):
    """{(subdir, tag): [(step, value, wall_time), ...]} for scalars, and steps of tensor tags."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util
    out = {}
    for root, _dirs, files in os.walk(logdir):
        if not any(f.startswith("events.out.tfevents") for f in files):
            continue
        acc = EventAccumulator(root, size_guidance={"scalars": 0, "tensors": 0})
        acc.Reload()
        sub = os.path.relpath(root, logdir)
        for tag in acc.Tags()["scalars"]:
            out[sub, tag] = [(e.step, e.value, e.wall_time) for e in acc.Scalars(tag)]
        for tag in acc.Tags()["tensors"]:
            out[sub, tag] = [(e.step, tensor_util.make_ndarray(e.tensor_proto).tolist(),
                              e.wall_time) for e in acc.Tensors(tag)]
    return out


def strip_time(events):
    return {key: [(step, value) for step, value, _ in evs] for key, evs in events.items()}


@pytest.fixture(scope="module")
def tb_reference(tmp_path_factory):
    from torch.utils.tensorboard import SummaryWriter
    logdir = tmp_path_factory.mktemp("tb_ref")
    with SummaryWriter(logdir) as w:
        tb_calls(w, VALUES, list(range(64)))
    return read_tb(logdir)


def test_tensorboard_writer_matches_reference(device, tmp_path, tb_reference):
    from syncless.tensorboard import SummaryWriter
    v, steps = device_values(device)
    t0 = time.time()
    with no_syncs(device):
        with SummaryWriter(tmp_path, every=5) as w:     # 5: several windows and a remainder
            tb_calls(w, v, steps)
    t1 = time.time()
    got = read_tb(tmp_path)

    assert strip_time(got) == strip_time(tb_reference)
    assert [s for s, _, _ in got[".", "train/loss"]] == list(range(13))
    assert got[".", "nostep"][0][:2] == (0, VALUES[9])
    assert got[".", "tensor_step"][0][:2] == (30, VALUES[11])
    assert got["lr_a", "lr"][1][:2] == (4, VALUES[5])
    assert got[".", "fixed"][0][2] == 1234.5
    # Every other wall time is the host time of its call: within the run, in call order.
    walls = [wall for key, evs in got.items() if key != (".", "fixed") for _, _, wall in evs]
    assert all(t0 <= wall <= t1 for wall in walls)
    loss_walls = [wall for _, _, wall in got[".", "train/loss"]]
    assert loss_walls == sorted(loss_walls)
    assert w.latest["train/loss"] == 0.375 and w.latest["lr/b"] == VALUES[20]


def test_tensorboard_defers_until_flush(device, tmp_path):
    from syncless.tensorboard import SummaryWriter
    v, _ = device_values(device)
    w = SummaryWriter(tmp_path, every=1000, max_delay=None)
    try:
        with no_syncs(device):
            for i in range(3):
                w.add_scalar("loss", v[i], i)
        super(SummaryWriter, w).flush()                 # torch's flush alone: nothing yet
        assert read_tb(tmp_path) == {}
        with no_syncs(device):
            w.flush()
        assert strip_time(read_tb(tmp_path)) == {(".", "loss"): [(i, VALUES[i]) for i in range(3)]}
    finally:
        w.close()


def test_tensorboard_rejects_bad_values(tmp_path):
    from syncless.tensorboard import SummaryWriter
    with SummaryWriter(tmp_path) as w:
        with pytest.raises(ValueError, match=r"'loss' must hold one element, got shape \(3,\)"):
            w.add_scalar("loss", torch.ones(3), 0)
        w.add_scalar("loss", 1.5, 1)                    # the writer still works
    assert strip_time(read_tb(tmp_path)) == {(".", "loss"): [(1, 1.5)]}


def odd_inputs():
    """(case, method, args): what users pass to add_scalar/add_scalars besides a clean float.
    Each case writes under its own tag (or the odd tag it is about), at steps 0.. of its own."""
    from decimal import Decimal
    from fractions import Fraction

    import numpy as np
    values = {
        "str number": "1.5", "str word": "abc", "bytes number": b"2.5", "None": None,
        "list": [1.5], "dict": {"a": 1}, "bool": True, "int": 3, "int 2**70": 2**70,
        "int64 max": 2**63 - 1, "Decimal": Decimal("1.1"), "Fraction": Fraction(1, 3),
        "complex": 1 + 2j, "nan": math.nan, "-inf": -math.inf,
        "np.float32": np.float32(1.25), "np.int64": np.int64(7), "np.bool_": np.bool_(True),
        "np 0-d": np.array(3.5), "np (1,)": np.array([3.5]), "np (2,)": np.array([1.0, 2.0]),
        "np str (1,)": np.array(["1.5"]),
        "tensor 0-d": torch.tensor(1.5), "tensor (1, 1)": torch.tensor([[2.5]]),
        "tensor (2,)": torch.tensor([1.0, 2.0]), "tensor (0,)": torch.empty(0),
        "tensor bool": torch.tensor(True), "tensor int64 2**40+1": torch.tensor(2**40 + 1),
        "tensor bf16": torch.tensor(1.1, dtype=torch.bfloat16),
        "tensor complex": torch.tensor(1 + 2j),
        "tensor grad": torch.tensor(1.5, requires_grad=True),
        "tensor nan": torch.tensor(math.nan),
    }
    cases = [(name, "add_scalar", (f"v/{name}", value, 0)) for name, value in values.items()]
    for name, tag in {"tag int": 3, "tag None": None, "tag bytes": b"t/bytes",
                      "tag surrogate": "t/\ud800", "tag empty": "", "tag spaces": "a b/c"}.items():
        cases.append((name, "add_scalar", (tag, 1.0, 1)))
    steps = {"str": "5", "float": 3.7, "None": None, "bad str": "x", "negative": -4,
             "np.int32": np.int32(9), "tensor": torch.tensor(11), "tensor float": torch.tensor(3.7),
             "tensor bool": torch.tensor(True), "tensor (2,)": torch.tensor([1, 2]),
             "tensor complex": torch.tensor(1 + 1j), "2**64": 2**64, "-2**63": -2**63,
             "bool": True, "list": [3], "Decimal": Decimal("4.5"), "nan": math.nan,
             "inf": math.inf}
    cases += [(f"step {name}", "add_scalar", (f"s/{name}", 0.5, step))
              for name, step in steps.items()]
    walls = {"int": 7, "str": "8", "np.float64": np.float64(9.5), "bytes": b"1",
             "tensor": torch.tensor(10.5, dtype=torch.float64), "tensor int": torch.tensor(5),
             "tensor (2,)": torch.tensor([1.0, 2.0]), "bool": True, "nan": math.nan,
             "Decimal": Decimal("2.5"), "list": [1.0], "np (1,)": np.array([1.0]),
             "complex": 1j}
    cases += [(f"walltime {name}", "add_scalar", (f"w/{name}", 0.25, 2, wall))
              for name, wall in walls.items()]
    cases += [
        ("scalars str values", "add_scalars", ("m1", {"a": "2.5", "b": np.float32(0.5)}, 3)),
        ("scalars empty", "add_scalars", ("m2", {}, 3)),
        ("scalars main_tag int", "add_scalars", (3, {"a": 1.0}, 3)),
        ("scalars tag int", "add_scalars", ("m3", {3: 1.0}, 3)),
        ("scalars value None", "add_scalars", ("m4", {"a": None}, 3)),
        ("scalars value (2,)", "add_scalars", ("m5", {"a": torch.ones(2)}, 3)),
        ("scalars not a dict", "add_scalars", ("m6", [("a", 1.0)], 3)),
        ("scalars step x", "add_scalars", ("m7", {"a": 1.0}, "x")),
        ("scalars walltime str", "add_scalars", ("m8", {"a": 1.0}, 3, "x")),
        ("scalars step tensor", "add_scalars", ("m9", {"a": 1.0}, torch.tensor(6))),
    ]
    return cases


def read_tb_exact(logdir):
    """{(subdir, tag): [(step, repr(value), wall_time)]}: NaN compares equal, nothing purged."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    out = {}
    for root, _dirs, files in os.walk(logdir):
        if any(f.startswith("events.out.tfevents") for f in files):
            acc = EventAccumulator(root, size_guidance={"scalars": 0}, purge_orphaned_data=False)
            acc.Reload()
            for tag in acc.Tags()["scalars"]:
                out[os.path.relpath(root, logdir), tag] = [
                    (e.step, repr(e.value), repr(e.wall_time)) for e in acc.Scalars(tag)]
    return out


def test_tensorboard_takes_and_refuses_what_torchs_writer_does(tmp_path):
    """Every odd input through torch's SummaryWriter and syncless's: either both raise (syncless
    an exception that `except <torch's type>` catches, at the call), or both write the same
    step, value and (when given) walltime, read back by TensorBoard's own reader."""
    from torch.utils.tensorboard import SummaryWriter as TorchWriter

    from syncless.tensorboard import SummaryWriter
    cases = odd_inputs()
    raised = {}
    with TorchWriter(tmp_path / "torch") as ref, SummaryWriter(tmp_path / "syncless", every=7) as w:
        for name, method, args in cases:
            outcome = []
            for writer in (ref, w):
                try:
                    getattr(writer, method)(*args)
                    outcome.append(None)
                except Exception as exc:       # noqa: PERF203 - each case once
                    outcome.append(exc)
            raised[name] = outcome
    mismatched = {name: (type(a).__name__, type(b).__name__) for name, (a, b) in raised.items()
                  if (a is None) != (b is None) or (a is not None and not isinstance(b, type(a)))}
    assert mismatched == {}
    assert w.errors == 0
    want, got = read_tb_exact(tmp_path / "torch"), read_tb_exact(tmp_path / "syncless")
    explicit = {args[0] for _, _, args in cases if len(args) == 4 and args[3] is not None}
    for key in set(want) | set(got):
        if key[1] not in explicit:
            want[key] = [e[:2] for e in want.get(key, [])]      # walltime: the host's clock
            got[key] = [e[:2] for e in got.get(key, [])]
    assert got == want
    # the values a user cares about, spelled out
    assert want[".", "v/str number"] == [(0, "1.5")]
    assert want[".", "v/Decimal"] == [(0, repr(float(torch.tensor(1.1))))]     # float32 on disk
    assert want[".", "s/float"] == [(3, "0.5")] and want[".", "s/tensor float"] == [(3, "0.5")]
    assert want[".", "w/np.float64"] == [(2, "0.25", "9.5")]
    assert want["m1_a", "m1"] == [(3, "2.5")] and ("m2_a", "m2") not in want
    writes = sum(1 for a, _ in raised.values() if a is None)
    refusals = {name for name, (a, _) in raised.items() if a is not None}
    assert (writes, len(refusals)) == (48, 31), sorted(refusals)


def test_tensorboard_sink(device, tmp_path):
    from syncless.tensorboard import SummaryWriter
    v, _ = device_values(device)
    own = SummaryWriter(tmp_path / "shared", every=1000, max_delay=None)
    t0 = time.time()
    with no_syncs(device):
        with syncless.Logger(every=3, sinks=[sinks.TensorBoard(tmp_path / "own"),
                                             sinks.TensorBoard(own)]) as log:
            for i in range(7):
                log(loss=v[i], acc=v[60 - i])
            log.log({"loss": v[30]}, step=10)
    t1 = time.time()
    own.close()
    for sub in ("own", "shared"):
        got = read_tb(tmp_path / sub)
        assert strip_time(got) == {
            (".", "loss"): [(i, VALUES[i]) for i in range(7)] + [(10, VALUES[30])],
            (".", "acc"): [(i, VALUES[60 - i]) for i in range(7)]}
        assert all(t0 <= wall <= t1 for evs in got.values() for _, _, wall in evs)


# ---- Weights & Biases ----------------------------------------------------------------------------

WANDB_SETTINGS = dict(console="off", x_disable_stats=True, x_disable_machine_info=True,
                      save_code=False, disable_git=True, x_save_requirements=False, silent=True)


def wb_calls(log, v, ints, flags, nan, histogram):
    """wandb.log calls covering its step rules: v/ints/flags[i] and nan are Python numbers or
    tensors; `histogram` is a wandb object passed through in order."""
    log({"loss": v[0], "epoch": 0})
    log({"loss": v[1], "count": ints[3]}, commit=False)  # accumulates into step 1
    log({"acc": v[2], "ok": flags[1]})                   # commits step 1
    log({"loss": v[3], "nested": {"x": v[4], "tag": "a"}}, step=10)
    log({"text": "hello", "hist": histogram}, step=10)   # same step: merged
    log({"loss": v[5]}, step=5)                          # behind the run: wandb drops it
    log({"loss": v[6], "epoch": 1})                      # step 11
    log({"loss": v[7]}, commit=True)
    log({"nan": nan, "loss": v[8]})
    log({})                                              # an empty commit: a step of its own
    log({"loss": v[9], "count": ints[4]})


def wb_history(run):
    """The history records of the run's offline .wandb log, read by wandb's own reader."""
    run_dir = os.path.dirname(run.dir)
    path = next(os.path.join(run_dir, f) for f in os.listdir(run_dir) if f.endswith(".wandb"))
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", path],
                         capture_output=True, text=True, check=True, timeout=120).stdout
    records = [json.loads(line) for line in out.splitlines()]
    return [r["history"] for r in records if r.get("type") == "history"]


def untimed(history):
    return [({k: v for k, v in h["item"].items() if k not in ("_runtime", "_timestamp")},
             h["step"]["num"]) for h in history]


@pytest.fixture(scope="module")
def wandb_env(tmp_path_factory):
    pytest.importorskip("wandb")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_MODE", "offline")
        mp.setenv("WANDB_SILENT", "true")
        mp.setenv("WANDB_DIR", str(tmp_path_factory.mktemp("wandb")))
        yield


@pytest.fixture(scope="module")
def wb_reference(wandb_env, tmp_path_factory):
    import wandb
    run = wandb.init(project="syncless-test", dir=str(tmp_path_factory.mktemp("wb_ref")),
                     settings=wandb.Settings(**WANDB_SETTINGS))
    hist = wandb.Histogram([1.0, 2.0, 2.5, 4.0])
    wb_calls(run.log, VALUES, [0, 1, 2, 3, 4], [False, True], float("nan"), hist)
    run.finish()
    return wb_history(run)


def test_wandb_log_matches_reference(device, wandb_env, wb_reference, tmp_path):
    import wandb
    import syncless.wandb as swandb
    v, _ = device_values(device)
    ints = torch.arange(5, device=device)
    flags = torch.tensor([False, True], device=device)
    nan = torch.tensor(float("nan"), device=device)
    hist = wandb.Histogram([1.0, 2.0, 2.5, 4.0])
    run = swandb.init(project="syncless-test", dir=str(tmp_path), every=3,
                      settings=wandb.Settings(**WANDB_SETTINGS))
    t0 = time.time()
    with no_syncs(device):
        wb_calls(swandb.log, v, ints, flags, nan, hist)
        t1 = time.time()
        run.finish()                  # wandb's own finish delivers the deferred calls first
    got = wb_history(run)

    assert untimed(got) == untimed(wb_reference)
    assert [step for _, step in untimed(got)] == [0, 1, 10, 11, 12, 13, 14]
    assert untimed(got)[1][0]["count"] == 3 and untimed(got)[1][0]["ok"] is True
    stamps = [h["item"]["_timestamp"] for h in got]
    assert all(t0 <= t <= t1 for t in stamps) and stamps == sorted(stamps)


def test_wandb_module_is_a_drop_in(wandb_env, tmp_path):
    import wandb
    import syncless.wandb as swandb
    assert swandb.Histogram is wandb.Histogram and swandb.Settings is wandb.Settings
    with pytest.raises(wandb.Error, match="wandb.init"):
        swandb.log({"loss": torch.tensor(1.0)})
    run = wandb.init(project="syncless-test", dir=str(tmp_path),   # plain wandb.init works too
                     settings=wandb.Settings(**WANDB_SETTINGS))
    try:
        with pytest.raises(TypeError, match="must be strings"):
            swandb.log({1: torch.tensor(1.0)})
        for i in range(4):
            swandb.log({"loss": torch.tensor(VALUES[i]), "i": i})
        assert run.step == 0                        # deferred: the run has not seen them yet
        swandb.flush()
        assert run.step == 4
        assert swandb.latest == {"loss": VALUES[3], "i": 3}
    finally:
        swandb.finish()
    assert untimed(wb_history(run)) == [({"loss": VALUES[i], "i": i, "_step": i}, i)
                                        for i in range(4)]


def test_direct_run_log_calls_keep_every_row_in_step_order(device, wandb_env, tmp_path):
    """run.log and the real wandb.log, called between syncless.wandb.log calls, go through the
    same queue: every row reaches the run's history, in call order, with its exact values."""
    import wandb
    import syncless.wandb as swandb
    v, _ = device_values(device)
    # every=8: the first window is due after the direct call below, so the run has seen
    # nothing when it is checked (with every=4 a GPU's copy could land before the check).
    run = swandb.init(project="syncless-test", dir=str(tmp_path), every=8, max_delay=None,
                      settings=wandb.Settings(**WANDB_SETTINGS))
    try:
        with no_syncs(device):
            for i in range(6):
                swandb.log({"loss": v[i], "acc": i / 10})
                if i == 2:
                    run.log({"direct": 7.5, "t": v[40]})          # a tensor too: no sync
                    assert run.step == 0                          # queued behind rows 0..2
                if i == 4:
                    wandb.log({"module": 8.5})                    # the real wandb.log
            run.log({"late": 1.25}, step=20)                      # an explicit step
    finally:
        swandb.finish()
    assert run.log == wandb.Run.log.__get__(run)                  # wandb's own method again
    rows = [({"loss": VALUES[i], "acc": i / 10}) for i in range(6)]
    rows[3:3] = [{"direct": 7.5, "t": VALUES[40]}]
    rows[6:6] = [{"module": 8.5}]
    rows.append({"late": 1.25})
    steps = list(range(8)) + [20]
    assert untimed(wb_history(run)) == [({**row, "_step": step}, step)
                                        for row, step in zip(rows, steps)]


def test_wandb_init_takes_every_and_max_delay_and_dir_shows_wandb(wandb_env, tmp_path):
    import wandb
    import syncless.wandb as swandb
    assert set(dir(wandb)) <= set(dir(swandb))
    assert {"init", "log", "flush", "finish", "errors", "latest"} <= set(dir(swandb))
    with pytest.raises(ValueError, match="max_delay must be None or a number of seconds"):
        swandb.init(project="syncless-test", dir=str(tmp_path), max_delay=-1)
    assert wandb.run is None                                      # refused before wandb.init
    run = swandb.init(project="syncless-test", dir=str(tmp_path), every=1000, max_delay=0,
                      settings=wandb.Settings(**WANDB_SETTINGS))
    try:
        swandb.log({"loss": torch.tensor(0.5)})
        swandb.log({"loss": torch.tensor(0.25)})    # max_delay=0: each call hands rows over
        deadline = time.monotonic() + 60            # a bound, not a speed: no flush() called
        while run.step < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert run.step == 2 and swandb.latest == {"loss": 0.25}
    finally:
        swandb.finish()


def test_wandb_sink(device, wandb_env, tmp_path):
    import wandb
    v, _ = device_values(device)
    run = wandb.init(project="syncless-test", dir=str(tmp_path),
                     settings=wandb.Settings(**WANDB_SETTINGS))
    t0 = time.time()
    with no_syncs(device):
        with syncless.Logger(every=3, sinks=[sinks.WandB(run)]) as log:
            for i in range(5):
                log(loss=v[i])
            log.log({"acc": v[40]}, step=4)          # the same step: merged into one row
            log.log({"loss": v[9]}, step=8)
    t1 = time.time()
    run.finish()
    got = wb_history(run)
    assert untimed(got) == (
        [({"loss": VALUES[i], "_step": i}, i) for i in range(4)]
        + [({"loss": VALUES[4], "acc": VALUES[40], "_step": 4}, 4),
           ({"loss": VALUES[9], "_step": 8}, 8)])
    assert all(t0 <= h["item"]["_timestamp"] <= t1 for h in got)


# ---- the adapters' shared core: the same rules, the same errors ---------------------------------

@pytest.fixture
def swandb(request):
    """syncless.wandb with an offline W&B, or None where wandb is not installed (the GPU
    machine): the shared-core tests then check the TensorBoard side alone."""
    try:
        import wandb  # noqa: F401
    except ImportError:
        return None
    request.getfixturevalue("wandb_env")
    import syncless.wandb
    return syncless.wandb


def wb_init(swandb, tmp_path, every):
    import wandb
    return swandb.init(project="syncless-test", dir=str(tmp_path), every=every,
                       settings=wandb.Settings(**WANDB_SETTINGS))


def bad_inputs(device):
    """(call(tb_writer), call(syncless.wandb), error type, TensorBoard's message, W&B's): the
    same mistake made through each adapter, and the error each must raise at the call. Every
    tensor is made here, before any no_syncs block."""
    meta = torch.empty((), device="meta")
    steps = torch.tensor([1, 2], device=device)
    half = torch.tensor(1.5, device=device)
    cplx = torch.tensor(1j, device=device)
    wide_tb = {**{f"k{i}": float(i) for i in range(300)}, "k150": meta}
    wide_wb = {**{f"k{i}": torch.tensor(float(i), device=device) for i in range(300)},
               "k150": meta}
    return [
        (lambda w: w.add_scalar("bad\udc80", 1.0, 0), lambda wb: wb.log({"bad\udc80": 1.0}),
         ValueError, r"tag 'bad\\udc80' is not valid UTF-8 text",
         r"key 'bad\\udc80' is not valid UTF-8 text \(surrogates not allowed"),
        # torch's writer takes int() of a float step tensor; a complex one is its RuntimeError
        (lambda w: w.add_scalar("loss", 1.0, cplx),
         lambda wb: wb.log({"loss": 1.0}, step=half), (RuntimeError, TypeError),
         r"^global_step: a torch.complex64 tensor cannot be converted to int64$",
         r"^step must be an integer tensor, got torch.float32$"),
        (lambda w: w.add_scalar("loss", 1.0, steps), lambda wb: wb.log({"loss": 1.0}, step=steps),
         ValueError, r"^global_step must hold one element, got shape \(2,\)$",
         r"^step must hold one element, got shape \(2,\)$"),
        (lambda w: w.add_scalar("loss", meta, 0), lambda wb: wb.log({"loss": meta}),
         (TypeError, ValueError), r"^metric 'loss'[: ]", r"^metric 'loss'[: ]"),
        (lambda w: w.add_scalars("wide", wide_tb), lambda wb: wb.log(wide_wb),   # row 2 of 2
         (TypeError, ValueError), r"^metric 'wide/k150'[: ]", r"^metric 'k150'[: ]"),
        (lambda w: w.add_scalar("loss", 1.0, [3]), lambda wb: wb.log({"loss": 1.0}, step=2.5),
         TypeError, r"^global_step must be an integer, got list \[3\]$",
         r"^step must be an integer, got float 2.5$"),
    ]


def test_both_adapters_refuse_bad_input_alike_and_lose_nothing(device, swandb, tmp_path):
    """Every mistake raises at the call, naming the metric or parameter in the same words in
    both adapters; what was logged before and after each is written exactly."""
    from syncless.tensorboard import SummaryWriter
    v, _ = device_values(device)
    cases = bad_inputs(device)
    run = wb_init(swandb, tmp_path, every=4) if swandb else None
    with SummaryWriter(tmp_path / "tb", every=4) as w:
        with no_syncs(device):
            for i, (tb_call, wb_call, error, tb_text, wb_text) in enumerate(cases):
                w.add_scalar("loss", v[i], i)
                with pytest.raises(error, match=tb_text):
                    tb_call(w)
                if swandb:
                    swandb.log({"loss": v[i]})
                    with pytest.raises(error, match=wb_text):
                        wb_call(swandb)
            w.add_scalar("loss", v[len(cases)], len(cases))
            if swandb:
                swandb.log({"loss": v[len(cases)]})
    good = range(len(cases) + 1)
    assert strip_time(read_tb(tmp_path / "tb")) == {(".", "loss"): [(i, VALUES[i]) for i in good]}
    assert w.errors == 0
    if swandb:
        swandb.finish()
        assert untimed(wb_history(run)) == [({"loss": VALUES[i], "_step": i}, i) for i in good]


def test_a_record_refused_at_delivery_is_reported_by_name_and_the_rest_written(
        device, swandb, tmp_path, caplog):
    """A step tensor whose value is no int64 (a uint64 at its maximum) can only be found once
    the row is read: both adapters report it once, naming the metric, count it, and write every
    other record of the window."""
    from syncless.tensorboard import SummaryWriter
    huge = torch.tensor(2**64 - 1, dtype=torch.uint64, device=device)
    v, steps = device_values(device)
    run = wb_init(swandb, tmp_path, every=8) if swandb else None
    with SummaryWriter(tmp_path / "tb", every=8) as w:
        with no_syncs(device):
            for i in range(6):
                step = huge if i in (2, 4) else steps[i]
                w.add_scalar("loss", v[i], step)
                if swandb:
                    swandb.log({"loss": v[i]}, step=step)
        assert w.errors == 0                                 # nothing delivered yet
    assert w.errors == 2
    good = [0, 1, 3, 5]
    assert strip_time(read_tb(tmp_path / "tb")) == {(".", "loss"): [(i, VALUES[i]) for i in good]}
    expected = [                                             # once per metric, in the same words
        "syncless.tensorboard: add_scalar('loss') was not written: ValueError: global_step "
        "1.8446744073709552e+19 (from a tensor) is not an int64 (reported once per metric; "
        "writer.errors counts them; the other records go on)",
        "syncless.wandb: log({'loss'}) was not written: ValueError: step "
        "1.8446744073709552e+19 (from a tensor) is not an int64 (reported once per metric; "
        "syncless.wandb.errors counts them; the other records go on)"]
    if swandb:
        before = swandb.errors                               # counts every run of the process
        swandb.flush()
        assert swandb.errors == before + 2
        swandb.finish()
        assert swandb.errors == before + 2
        assert untimed(wb_history(run)) == [({"loss": VALUES[i], "_step": i}, i) for i in good]
    reports = [r.getMessage() for r in caplog.records if "was not written" in r.getMessage()]
    assert reports == (expected if swandb else expected[:1])


def test_calls_wider_than_one_kernel_launch(device, swandb, tmp_path):
    """More values in one call than the gather kernel takes (MAX_CELLS): the record spans
    several rows and is replayed whole, with its tensor step and walltime."""
    from syncless import _deferred
    from syncless.tensorboard import SummaryWriter
    n = _deferred.MAX_CELLS + 2                      # with the step and walltime: 4 cells over
    values = torch.arange(3 * n, dtype=torch.float64, device=device) / 4
    wall = torch.tensor(1234.5, device=device)
    _, steps = device_values(device)
    with SummaryWriter(tmp_path / "tb", every=2) as w:
        with no_syncs(device):
            w.add_scalars("wide", {f"k{i}": values[i] for i in range(n)}, steps[7], wall)
            w.add_scalar("after", values[0], 8)
    got = read_tb(tmp_path / "tb")
    assert len(got) == n + 1
    assert all(got[f"wide_k{i}", "wide"] == [(7, i / 4, 1234.5)] for i in range(n))
    assert strip_time(got)[".", "after"] == [(8, 0.0)]
    if not swandb:
        return
    run = wb_init(swandb, tmp_path, every=2)
    with no_syncs(device):
        swandb.log({f"k{i}": values[i] for i in range(3 * n)}, step=steps[3])
        swandb.log({"after": values[1]}, step=4)
        run.finish()
    assert untimed(wb_history(run)) == [
        ({**{f"k{i}": i / 4 for i in range(3 * n)}, "_step": 3}, 3),
        ({"after": 0.25, "_step": 4}, 4)]


@pytest.mark.cuda
def test_adapters_refuse_cuda_graph_capture(swandb, tmp_path):
    """A replayed graph would append rows no call made and shift every later record onto the
    wrong values: a call during capture raises, and the writer goes on exactly after it."""
    from syncless.tensorboard import SummaryWriter
    x = torch.tensor(VALUES[:4], device="cuda")
    y = torch.zeros((), device="cuda")
    run = wb_init(swandb, tmp_path, every=2) if swandb else None
    with SummaryWriter(tmp_path / "tb", every=2) as w:
        w.add_scalar("loss", x[0], 0)                  # binds the private logger to the GPU
        if swandb:
            swandb.log({"loss": x[0]})
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            y.add_(1)                                  # warm-up outside capture
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with pytest.raises(RuntimeError, match="syncless.tensorboard: called during CUDA "
                                               "graph capture"):
            with torch.cuda.graph(g):
                y.add_(1)
                w.add_scalar("loss", y, 1)
        if swandb:
            with pytest.raises(RuntimeError, match="syncless.wandb: called during CUDA graph"):
                with torch.cuda.graph(torch.cuda.CUDAGraph()):
                    y.add_(1)                          # an empty capture warns (an error here)
                    swandb.log({"loss": y})
        for i in (1, 2, 3):
            w.add_scalar("loss", x[i], i)
            if swandb:
                swandb.log({"loss": x[i]})
    assert strip_time(read_tb(tmp_path / "tb")) == {(".", "loss"): [(i, VALUES[i])
                                                                    for i in range(4)]}
    if swandb:
        swandb.finish()
        assert untimed(wb_history(run)) == [({"loss": VALUES[i], "_step": i}, i)
                                            for i in range(4)]


def test_every_and_max_delay_are_checked_before_anything_starts(wandb_env, tmp_path):
    import wandb
    import syncless.wandb as swandb
    from syncless.tensorboard import SummaryWriter
    for bad in (0, -1, 2.5, True, "10"):
        with pytest.raises(ValueError, match=rf"every must be a positive int, got {bad!r}"):
            SummaryWriter(tmp_path / "tb", every=bad)
        with pytest.raises(ValueError, match=rf"every must be a positive int, got {bad!r}"):
            swandb.init(project="syncless-test", dir=str(tmp_path), every=bad)
    with pytest.raises(ValueError, match=r"max_delay must be None or a number of seconds >= 0, "
                                         r"got '2'"):
        SummaryWriter(tmp_path / "tb", max_delay="2")
    assert not (tmp_path / "tb").exists() and wandb.run is None    # no writer, no run


def _tb_rank_worker(rank, world, tmp):
    import torch.distributed as dist
    from syncless.tensorboard import SummaryWriter
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank,
                            world_size=world)
    try:
        with SummaryWriter(os.path.join(tmp, f"rank{rank}"), every=3) as w:
            for i in range(5):
                w.add_scalar("loss", torch.tensor(VALUES[i] + rank), i)
    finally:
        dist.destroy_process_group()


def test_tensorboard_writer_on_every_rank_writes_its_own(tmp_path):
    """Under torch.distributed each rank's writer is its own: rank 1 writes too (the private
    logger must not keep its sinks to rank 0)."""
    from _gloo import spawn_ranks
    out = spawn_ranks(_tb_rank_worker, tmp_path)
    for rank in (0, 1):
        assert strip_time(read_tb(out / f"rank{rank}")) == {
            (".", "loss"): [(i, VALUES[i] + rank) for i in range(5)]}


def test_sinks_write_every_record_but_a_refused_one(wandb_env, tmp_path, caplog):
    """The TensorBoard and W&B sinks: a record the backend refuses (a name that is not UTF-8)
    costs only itself; the sink raises once per window, naming it, and the logger counts it."""
    import wandb
    run = wandb.init(project="syncless-test", dir=str(tmp_path),
                     settings=wandb.Settings(**WANDB_SETTINGS))
    with syncless.Logger(every=4, sinks=[sinks.TensorBoard(tmp_path / "tb"),
                                         sinks.WandB(run)]) as log:
        for i in range(4):
            log(loss=VALUES[i], **({"bad\udc80": 1.0} if i == 1 else {}))
    run.finish()
    assert log.stats.sink_errors == 2
    assert strip_time(read_tb(tmp_path / "tb")) == {(".", "loss"): [(i, VALUES[i])
                                                                    for i in range(4)]}
    assert untimed(wb_history(run)) == [({"loss": VALUES[i], "_step": i}, i) for i in (0, 2, 3)]
    text = caplog.text
    assert ("TensorBoard: 1 record(s) of this window were not written, the first: metric "
            "'bad\\udc80' at step 1: UnicodeEncodeError") in text
    assert ("WandB: 1 record(s) of this window were not written, the first: metric 'loss', "
            "'bad\\udc80' at step 1: UnicodeEncodeError") in text


# ---- optional backends -----------------------------------------------------------------------

def test_missing_backends_name_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError, match=r"pip install wandb .*pip install -e '\.\[wandb\]'"):
        sinks.WandB()
    with pytest.raises(ImportError, match=r"pip install tensorboard .*pip install -e '\.\[tensorboard\]'"):
        sinks.TensorBoard("unused")
    for module, extra in (("syncless.wandb", "wandb"), ("syncless.tensorboard", "tensorboard")):
        monkeypatch.delitem(sys.modules, module, raising=False)
        with pytest.raises(ImportError, match=rf"pip install {extra} .*pip install -e '\.\[{extra}\]'"):
            importlib.import_module(module)
