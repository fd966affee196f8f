"""Running the multi-process CPU tests' gloo ranks, and the one failure of gloo's own that they
repeat rather than report.

Gloo's TCP set-up (connectFullMesh, inside `init_process_group`) now and then fails on a loaded
2-core host with "Connection closed by peer" although no rank crashed: CI saw it once under ASan,
where every process runs several times slower. It happens before the test's own code runs, so a
try that fails there is repeated, in a fresh directory with a fresh store; any other failure is
reported at once."""
import os
import random
import socket
import subprocess
import sys

import torch.multiprocessing as mp

MESH_FLAKE = "Gloo connectFullMesh failed"
TRIES = 3


def spawn_ranks(worker, tmp_path, *args, world=2):
    """Runs `worker(rank, world, dir, *args)` on `world` spawned ranks and returns the directory
    (a new one under `tmp_path` per try) that the ranks wrote to."""
    for attempt in range(TRIES):
        directory = tmp_path / f"try{attempt}"
        directory.mkdir()
        try:
            mp.start_processes(worker, args=(world, str(directory), *args), nprocs=world,
                               start_method="spawn")
            return directory
        except mp.ProcessRaisedException as exc:
            if MESH_FLAKE not in str(exc) or attempt == TRIES - 1:
                raise


def rerun_on_mesh_flake(run):
    """`run(attempt)` returns (returncode, stderr, result); it is called again, up to TRIES
    times, while it failed in gloo's mesh set-up. Returns the last call's triple."""
    for attempt in range(TRIES):
        rc, stderr, result = run(attempt)
        if rc == 0 or MESH_FLAKE not in stderr:
            break
    return rc, stderr, result


def ranks_or_flake(children):
    """Waits for the child processes of one run (objects with `.proc`, a Popen, and `.wait()`,
    which returns (returncode, stdout, stderr)); returns their results, or None when one failed in
    gloo's mesh set-up, after ending the others (they would wait for it)."""
    from concurrent.futures import ThreadPoolExecutor, as_completed
    flaked = False
    with ThreadPoolExecutor(len(children)) as pool:
        for done in as_completed([pool.submit(child.wait) for child in children]):
            rc, _, stderr = done.result()
            if rc != 0 and MESH_FLAKE in stderr:
                flaked = True
                for child in children:
                    if child.proc.poll() is None:
                        child.proc.kill()
                break
    return None if flaked else [child.wait() for child in children]


def child_env(**extra):
    """The environment of a launched script: this checkout's syncless first, no GPU, NVLink
    multicast off."""
    python = os.path.join(os.path.dirname(__file__), "..", "python")
    return dict(os.environ, CUDA_VISIBLE_DEVICES="", NCCL_NVLS_ENABLE="0", **extra,
                PYTHONPATH=os.pathsep.join([python, os.environ.get("PYTHONPATH", "")]))


def free_port():
    """A TCP port no process listens on now (for a script's MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(script, nproc, env, timeout=300):
    """`python -m torch.distributed.run --nproc_per_node <nproc> script`: the finished process."""
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                           str(nproc), "--master_port", str(29500 + random.randrange(1000)),
                           str(script)], env=env, capture_output=True, text=True,
                          timeout=timeout)
