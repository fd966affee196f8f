"""Shared test setup: the device parametrisation, the `cuda` marker, and a guard that fails any
test leaving global state behind (sync-debug mode, a live logger) or puts back what a library
changed (the SIGINT handler); and one fresh interpreter that the import and exit checks share."""
import gc
import json
import signal
import subprocess
import sys
import warnings

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true",
                     help="also run the tests marked slow (CI runs them; the quick suite does not)")


def pytest_collection_modifyitems(config, items):
    slow = not config.getoption("--run-slow") and pytest.mark.skip(
        reason="slow: run with --run-slow")
    no_gpu = not HAS_CUDA and pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if no_gpu and "cuda" in item.keywords:
            item.add_marker(no_gpu)
        elif slow and "slow" in item.keywords:
            item.add_marker(slow)


@pytest.fixture(params=DEVICES)
def device(request):
    """Every behavioural test runs on CPU tensors (CI) and on CUDA tensors (the GPU machine)."""
    return request.param


@pytest.fixture(autouse=True)
def no_leftover_state(request):
    sigint = signal.getsignal(signal.SIGINT)
    yield
    if signal.getsignal(signal.SIGINT) is not sigint:
        # A library may change it for good (Lightning sets SIG_IGN once a fit catches a
        # KeyboardInterrupt): a later Ctrl-C test would then wait for nothing. Put it back, and
        # say which test did.
        signal.signal(signal.SIGINT, sigint)
        warnings.warn(f"{request.node.nodeid} left the SIGINT handler changed (restored)")
    if HAS_CUDA:
        mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode(0)
        assert mode == 0, "test left torch.cuda sync-debug mode on"
    from syncless.logger import _live
    if any(not log.closed for log in _live):
        # A full collection costs ~0.5 s once lightning and transformers are imported: only when
        # a logger is still open (one that is garbage in a cycle is collected, not reported).
        gc.collect()
    open_loggers = [log for log in _live if not log.closed]
    for log in open_loggers:
        log.close()
    assert not open_loggers, f"test left loggers open: {open_loggers}"


FRESH = """
import importlib, json, sys
import torch, syncless
out = {"cuda_initialised": torch.cuda.is_initialized(),
       "dynamo_loaded": "torch._dynamo" in sys.modules,
       "heavy_modules": sorted(m for m in sys.modules if m.startswith(
           ("syncless.doctor", "lightning", "transformers", "wandb", "tensorboard")))}
from syncless.doctor import watch            # the package imported by its name, before use
out["lazy"] = {}
for name in ("doctor", "audit", "lightning", "hf"):
    value = getattr(syncless, name)
    out["lazy"][name] = value.__module__ if callable(value) else value.__name__
out["lazy_frameworks"] = sorted(m for m in sys.modules
                                if m.startswith(("lightning", "transformers")))
a = sys.modules["syncless._C"]
del sys.modules["syncless._C"]
b = importlib.import_module("syncless._C")
out["a_new_module"] = a is not b and a.Ring is not b.Ring
log = syncless.Logger(every=2)
log(x=torch.tensor(3.0)); log(x=4.0)
log.close()
out["delivered"] = log.stats.delivered
print(json.dumps(out), flush=True)
# Left open: interpreter exit must deliver its 25 rows.
unclosed = syncless.Logger(every=1000, sinks=[syncless.sinks.JSONL(sys.argv[1])])
for i in range(25):
    unclosed(x=torch.tensor(float(i)))
"""


@pytest.fixture(scope="session")
def fresh_interpreter(tmp_path_factory):
    """What one new interpreter saw: right after `import syncless` (CUDA initialised? dynamo
    loaded?), after re-importing the extension, and (`rows_at_exit`) the JSONL rows that a
    logger left open was drained to at exit. One start for all: each imports torch (seconds)."""
    path = tmp_path_factory.mktemp("fresh") / "m.jsonl"
    out = subprocess.run([sys.executable, "-c", FRESH, str(path)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    facts = json.loads(out.stdout.splitlines()[-1])
    facts["rows_at_exit"] = [json.loads(line) for line in path.read_text().splitlines()]
    return facts
