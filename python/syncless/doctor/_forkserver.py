"""--verify's runs of the script, forked from one process that has imported torch and syncless.

A measured run is `python -m syncless doctor --measure ...`: the interpreter's start and the
imports of torch and syncless come before the script's first line, the same for every run and
measured at 5-6 s on a loaded 2-core host, most of a small script's run. The server pays them
once; each run is a fork of it, which then runs the script as the doctor's own run does (torch is
imported in that one too, before the script). The server never initialises CUDA (a fork of a
process that has cannot use it); each run initialises its own.

Protocol, one JSON line each way: {"argv", "cwd", "env"} in; {"pid"} when the run started, then
{"rc"} when it ended. A run is its own session (os.setsid): killing its process group ends it and
the loader workers it started. SYNCLESS_DOCTOR_FORKSERVER=0 runs each as a fresh interpreter."""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import weakref
import sys
from time import perf_counter
from typing import IO, Any

__all__ = ["PRELOAD", "Runner", "serve"]


# Frameworks a run imports again each time, when the script imported them: their modules the
# doctor's own run imported are imported once in the server instead (this 2-core host, torch
# already imported: lightning 3.2 s, transformers with its Trainer 1.9 s). None starts a thread
# or CUDA on import; should one, the server starts again without them (a fork keeps only the
# forking thread, and cannot use CUDA).
PRELOAD = ("transformers", "accelerate", "lightning", "pytorch_lightning", "torchvision",
           "torchmetrics", "timm")


def serve() -> None:
    """The server's loop (stdin: requests, stdout: replies)."""
    import contextlib
    import importlib
    import threading
    import torch
    import torch._dynamo  # noqa: F401  (every optimizer's first step imports it: 1-2 s)
    import torch.utils.data  # noqa: F401
    from . import cli  # noqa: F401  (imported once here: what the runs would each import)
    for name in filter(None, os.environ.pop("SYNCLESS_DOCTOR_PRELOAD", "").split(",")):
        try:
            with contextlib.redirect_stdout(sys.stderr):    # stdout is for the replies
                importlib.import_module(name)
        except Exception:                      # the run imports it (and fails) as it would
            pass
    if threading.active_count() > 1:
        sys.exit(4)                            # a fork would lose a thread: again, without
    if torch.cuda.is_initialized():            # type: ignore[no-untyped-call]
        sys.exit(3)                            # forks could not use CUDA: no server
    requests, replies = sys.stdin.buffer, sys.stdout.buffer
    replies.write(b'{"ready": true}\n')
    replies.flush()
    while True:
        line = requests.readline()
        if not line:
            return
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(req)                        # raises SystemExit: never returns
        replies.write(json.dumps({"pid": pid}).encode() + b"\n")
        replies.flush()
        _, status = os.waitpid(pid, 0)
        replies.write(json.dumps({"rc": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
        replies.flush()


def _child(req: dict[str, Any]) -> None:
    os.setsid()
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    # A fresh interpreter's randomness, not the server's (a script that does not seed).
    import random
    import torch
    random.seed()
    torch.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    from . import cli
    code: Any = 1
    try:
        code = cli.main(req["argv"])
    except SystemExit as e:
        code = e.code
    except BaseException:
        code = 1
    raise SystemExit(code)


class Runner:
    """Runs `python -m syncless doctor ARGV` in a directory, through the server when it starts,
    else as a fresh interpreter."""

    def __init__(self, env: dict[str, str], preload: tuple[str, ...] = ()) -> None:
        self.env = env
        self.preload = preload                 # modules the server imports first
        self._proc: subprocess.Popen[bytes] | None = None
        self._tried = os.environ.get("SYNCLESS_DOCTOR_FORKSERVER", "1") == "0" or \
            not hasattr(os, "fork")

    def run(self, argv: list[str], cwd: str, timeout_s: float) -> int | None:
        """The run's exit code; None when it timed out (and was killed)."""
        proc = self._server()
        if proc is None:
            run = subprocess.Popen([sys.executable, "-m", "syncless", "doctor", *argv], cwd=cwd,
                                   env=self.env, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL, start_new_session=True)
            try:
                return run.wait(timeout_s)
            except subprocess.TimeoutExpired:
                return None
            finally:
                _end_group(run.pid)
                run.wait()
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(json.dumps({"argv": argv, "cwd": cwd, "env": self.env}).encode()
                         + b"\n")
        proc.stdin.flush()
        pid = _reply(proc.stdout, 60.0).get("pid")
        if pid is None:
            self.close()
            return None
        got = _reply(proc.stdout, timeout_s)
        _end_group(pid)                        # the run (timed out) or its loader workers
        if "rc" in got:
            return int(got["rc"])
        _reply(proc.stdout, 30.0)
        return None

    def start(self) -> None:
        """Start the server now (else at the first run)."""
        self._server()

    def _server(self) -> subprocess.Popen[bytes] | None:
        if self._proc is not None or self._tried:
            return self._proc
        self._tried = True
        proc = _serve(self.env, self.preload)
        if proc is None and self.preload:      # a preload made a thread or CUDA: without
            self.preload = ()
            proc = _serve(self.env, ())
        if proc is None:
            return None
        self._proc = proc
        # A Runner dropped without close() (a Verifier a caller never closed) still ends its
        # server: the callback holds the process, not the Runner.
        self._stop = weakref.finalize(self, _stop, proc)
        return proc

    @property
    def forks(self) -> bool:
        """Whether runs are forks of the server (so far)."""
        return self._proc is not None

    def fresh(self) -> None:
        """From now on, each run a fresh interpreter."""
        self.close()
        self._tried = True

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            self._stop()


def _serve(env: dict[str, str], preload: tuple[str, ...]) -> subprocess.Popen[bytes] | None:
    """A started server (importing `preload` first), or None."""
    # NVML's device count, not CUDA's, should an import ask whether CUDA is there: CUDA's
    # initialises the driver, which a forked process then cannot use.
    proc = subprocess.Popen([sys.executable, "-c",
                             "from syncless.doctor._forkserver import serve; serve()"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, bufsize=0,
                            env=dict(env, PYTORCH_NVML_BASED_CUDA_CHECK="1",
                                     SYNCLESS_DOCTOR_PRELOAD=",".join(preload)))
    assert proc.stdout is not None
    if not _reply(proc.stdout, 300.0).get("ready"):
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
        if proc.stdin is not None:
            proc.stdin.close()
        return None
    return proc


def _end_group(pid: int) -> None:
    """Kill what is left of a run, its own session: a run that measured exits at once
    (--exit-when-measured), leaving its loader workers, and one that timed out is ended."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """End the server: its input closed, it exits (killed after 30 s)."""
    assert proc.stdin is not None
    proc.stdin.close()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


def _reply(stream: IO[bytes], timeout_s: float) -> dict[str, Any]:
    """One reply line, or {} when none came within `timeout_s` (or the server is gone)."""
    line = b""
    end = perf_counter() + timeout_s
    while not line.endswith(b"\n"):
        left = end - perf_counter()
        if left <= 0 or not select.select([stream], [], [], left)[0]:
            return {}
        chunk = stream.read(1)
        if not chunk:
            return {}
        line += chunk
    try:
        reply: dict[str, Any] = json.loads(line)
        return reply
    except ValueError:
        return {}
