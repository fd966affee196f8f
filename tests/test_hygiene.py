"""C hygiene: no leaks over 10^5 calls (10^6 in the slow suite), re-import of the multi-phase-init
module, clean import."""
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

dev, calls = sys.argv[1], int(sys.argv[2])
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
    if i % (calls // 5) == calls // 5 - 1:
        log.flush()
        gc.collect()
        checkpoints.append((len(gc.get_objects()), rss_kib()))
log.close()
print(json.dumps({"seen": seen[0], "checkpoints": checkpoints}))
"""


@pytest.mark.parametrize("calls", [100_000, pytest.param(1_000_000, marks=pytest.mark.slow)])
@pytest.mark.parametrize("dev", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_repeated_calls_leak_neither_objects_nor_memory(dev, calls):
    # A fresh process: what earlier tests left behind (a profiler's buffers, say) stays out.
    # 10^5 calls: a leak of an object a call, or of 100 bytes, fails; 10^6: 10 bytes.
    out = subprocess.run([sys.executable, "-c", LEAK_LOOP, dev, str(calls)], capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.splitlines()[-1])
    checkpoints = result["checkpoints"]
    assert result["seen"] == calls
    # After warm-up the object count and RSS settle: later checkpoints grow by (almost) nothing.
    objects = [c[0] for c in checkpoints[1:]]
    rss = [c[1] for c in checkpoints[1:]]
    assert max(objects) - min(objects) < 200, checkpoints
    if not os.environ.get("SYNCLESS_SANITIZE"):     # ASan's quarantine holds freed memory
        assert max(rss) - min(rss) < 8 * 1024, checkpoints          # < 8 MiB drift


def test_import_never_initialises_cuda(fresh_interpreter):
    assert fresh_interpreter["cuda_initialised"] is False


def test_import_loads_neither_the_doctor_nor_a_framework(fresh_interpreter):
    assert fresh_interpreter["heavy_modules"] == []


def test_lazy_attributes_resolve_after_import_and_doctor_stays_the_function(fresh_interpreter):
    """syncless.doctor(...), .audit, .lightning, .hf work after a bare `import syncless`, also
    when `from syncless.doctor import ...` imported the package first; reaching the
    integrations imports no framework (each imports its own at first use)."""
    assert fresh_interpreter["lazy"] == {"doctor": "syncless.doctor._api",
                                         "audit": "syncless.doctor.audit",
                                         "lightning": "syncless.lightning", "hf": "syncless.hf"}
    assert fresh_interpreter["lazy_frameworks"] == []


def test_every_public_name_resolves_and_is_listed():
    import syncless
    assert all(getattr(syncless, name) is not None for name in syncless.__all__)
    assert set(syncless.__all__) <= set(dir(syncless))
    assert {"lightning", "hf", "wandb", "tensorboard"} <= set(dir(syncless))
    assert syncless.lightning.SynclessLogging.__name__ == "SynclessLogging"
    assert syncless.hf.SynclessTrainer.__name__ == "SynclessTrainer"
    with pytest.raises(AttributeError, match="module 'syncless' has no attribute 'nope'"):
        syncless.nope


def test_the_extension_reimports_cleanly(fresh_interpreter):
    # Multi-phase init: a second module object with its own types, and a logger still works.
    assert fresh_interpreter["a_new_module"] is True
    assert fresh_interpreter["delivered"] == 2
