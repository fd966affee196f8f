"""C hygiene: no leaks over 10^6 calls, re-import of the multi-phase-init module, clean import."""
import json
import os
import subprocess
import sys

import pytest


LEAK_LOOP = """
import gc, json, sys
import torch, syncless

def rss_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))

dev, calls = sys.argv[1], 1_000_000
x = torch.tensor(1.5, device=dev)
y = torch.tensor(7, device=dev)
seen = [0]

class Count:
    def write(self, rows):
        seen[0] += len(rows)

log = syncless.Logger(every=1000, sinks=Count())
checkpoints = []
for i in range(calls):
    log(loss=x, n=y, lr=0.1)
    if i % 200_000 == 199_999:
        log.flush()
        gc.collect()
        checkpoints.append((len(gc.get_objects()), rss_kib()))
log.close()
print(json.dumps({"seen": seen[0], "checkpoints": checkpoints}))
"""


@pytest.mark.parametrize("dev", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_a_million_calls_leak_neither_objects_nor_memory(dev):
    # A fresh process: what earlier tests left behind (a profiler's buffers, say) stays out.
    out = subprocess.run([sys.executable, "-c", LEAK_LOOP, dev], capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.splitlines()[-1])
    checkpoints = result["checkpoints"]
    assert result["seen"] == 1_000_000
    # After warm-up the object count and RSS settle: later checkpoints grow by (almost) nothing.
    objects = [c[0] for c in checkpoints[1:]]
    rss = [c[1] for c in checkpoints[1:]]
    assert max(objects) - min(objects) < 200, checkpoints
    if not os.environ.get("SYNCLESS_SANITIZE"):     # ASan's quarantine holds freed memory
        assert max(rss) - min(rss) < 8 * 1024, checkpoints          # < 8 MiB drift


def test_the_extension_reimports_cleanly():
    script = (
        "import sys, importlib, torch\n"
        "import syncless._C as a\n"
        "del sys.modules['syncless._C']\n"
        "b = importlib.import_module('syncless._C')\n"
        "assert a is not b and a.Ring is not b.Ring\n"
        "import syncless\n"
        "log = syncless.Logger(every=2)\n"
        "log(x=torch.tensor(3.0)); log(x=4.0)\n"
        "log.close()\n"
        "assert log.stats.delivered == 2\n"
        "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_import_never_initialises_cuda():
    script = ("import torch, syncless\n"
              "print(torch.cuda.is_initialized())\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
