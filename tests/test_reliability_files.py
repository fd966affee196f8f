"""Issue 27: what the Logger touches around it. File sinks write only the files they create (never
a user's `metrics.1.csv`, never the parent's run from a spawned worker's re-import, never a file
another sink writes), a run directory deleted mid-run is named as such; a Logger refuses to be
copied or pickled with an error that names the fix; attached values follow log()'s rules.
Cases that start processes run in a fresh interpreter with a timeout."""
import copy
import csv
import json
import logging
import os
import pathlib
import pickle
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import syncless
from syncless.sinks import CSV, JSONL, Callback

ROOT = pathlib.Path(__file__).resolve().parent.parent


def read_csv(path):
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.reader(f))


def jsonl(path, field):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)[field] for line in f]


def table(path):
    """The CSV as {step: {column: float}} (empty cells left out), and its header."""
    rows = read_csv(path)
    header = rows[0]
    return header, [(int(r[0]), {h: float(v) for h, v in zip(header[2:], r[2:]) if v})
                     for r in rows[1:]]


def run_script(tmp_path, code, timeout=300):
    """Run `code` as a script file (spawn re-imports it as __mp_main__) in a fresh interpreter."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(code))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "python"), str(ROOT)] +
                                                       sys.path))
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=tmp_path)


class Collect:
    def __init__(self):
        self.rows = []

    def write(self, rows):
        self.rows += [(r.step, dict(r.values)) for r in rows]


def value(v, device):
    return torch.tensor(float(v), device=device)


# ---- files the sink did not create ----------------------------------------------------------------

USER_FILES = {"metrics.1.csv": b"epoch,acc\r\n1,0.5\r\n", "metrics.2.csv": b"user data 2\n",
              "metrics.3.csv": b"\x00\xffbinary", "metrics.csv.1234.tmp": b"keep me",
              ".metrics.csv.parts": b"not ours either"}


@pytest.mark.parametrize("grow", [False, True], ids=["one_header", "columns_grow"])
def test_user_files_beside_the_csv_are_untouched(tmp_path, device, grow):
    """metrics.1.csv..metrics.3.csv (and other names near the sink's) are a user's: the run that
    writes metrics.csv, also one whose columns grow (so it writes parts), leaves them byte for
    byte, merges its own parts and removes them and their folder, nothing else."""
    for name, data in USER_FILES.items():
        (tmp_path / name).write_bytes(data)
    path = tmp_path / "metrics.csv"
    sink = CSV(path)
    with syncless.Logger(every=4, sinks=[sink]) as log:
        for step in range(20):
            extra = {f"m{step // 4}": value(step, device)} if grow else {}
            log(loss=value(step / 2, device), **extra)
        log.flush()
        assert len(sink.files) == (5 if grow else 1)
        assert all(f == str(path) or "/.metrics.csv.syncless-" in f for f in sink.files)
    header, rows = table(path)
    assert header == ["step", "time", "loss"] + ([f"m{k}" for k in range(5)] if grow else [])
    assert rows == [(s, {"loss": s / 2, **({f"m{s // 4}": float(s)} if grow else {})})
                    for s in range(20)]
    assert sorted(os.listdir(tmp_path)) == sorted(list(USER_FILES) + ["metrics.csv"])
    for name, data in USER_FILES.items():
        assert (tmp_path / name).read_bytes() == data


def test_two_sinks_never_share_a_file(tmp_path):
    """CSV("m.1.csv") and CSV("m.csv") each keep their own parts (the merge used to fold one
    into the other); a second sink on a path an open sink writes is refused at construction,
    through a symlink too; once the first is closed, the path is free."""
    a, b = CSV(tmp_path / "m.1.csv"), CSV(tmp_path / "m.csv")
    with syncless.Logger(every=1, sinks=[a]) as la, syncless.Logger(every=1, sinks=[b]) as lb:
        for step in range(6):
            la(**{f"a{step}": float(step)})
            lb(**{f"b{step}": -float(step)})
        la.flush()
        lb.flush()
        assert not set(a.files) & set(b.files) and len(a.files) == len(b.files) == 6
        for other in (lambda: CSV(tmp_path / "m.csv"), lambda: JSONL(tmp_path / "m.csv"),
                      lambda: CSV(tmp_path / "." / "m.1.csv")):
            with pytest.raises(ValueError, match=r"CSV\('.*m\.(1\.)?csv'\) already writes .*"
                                                 r"m\.(1\.)?csv in this process"):
                other()
        os.symlink(tmp_path / "m.csv", tmp_path / "link.csv")
        with pytest.raises(ValueError, match="already writes"):
            CSV(tmp_path / "link.csv")
    assert table(tmp_path / "m.1.csv")[1] == [(s, {f"a{s}": float(s)}) for s in range(6)]
    assert table(tmp_path / "m.csv")[1] == [(s, {f"b{s}": -float(s)}) for s in range(6)]
    assert sorted(os.listdir(tmp_path)) == ["link.csv", "m.1.csv", "m.csv"]
    with syncless.Logger(every=1, sinks=[JSONL(tmp_path / "m.csv", mode="w")]) as log:
        log(c=1.0)                                      # closed sinks leave the path free
    assert jsonl(tmp_path / "m.csv", "c") == [1.0]


def test_sinks_open_their_files_at_the_first_write(tmp_path):
    """Constructing a sink touches no file (a module-level sink made again must not truncate a
    run); a path that cannot be written still fails at construction."""
    for name in ("m.csv", "m.jsonl"):
        (tmp_path / name).write_text("a run's rows\n")
    csv_sink, jsonl_sink = CSV(tmp_path / "m.csv"), JSONL(tmp_path / "m.jsonl", mode="w")
    assert (tmp_path / "m.csv").read_text() == (tmp_path / "m.jsonl").read_text() == \
        "a run's rows\n"
    with syncless.Logger(every=2, sinks=[csv_sink, jsonl_sink]) as log:
        log(loss=1.5)
        log(loss=2.5)
    assert table(tmp_path / "m.csv")[1] == [(0, {"loss": 1.5}), (1, {"loss": 2.5})]
    assert jsonl(tmp_path / "m.jsonl", "loss") == [1.5, 2.5]
    (tmp_path / "dir.csv").mkdir()
    with pytest.raises(IsADirectoryError, match=r"CSV .*dir\.csv: is a directory"):
        CSV(tmp_path / "dir.csv")
    if os.geteuid() != 0:                               # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(PermissionError, match=r"JSONL .*m\.jsonl: not writable"):
            JSONL(locked / "m.jsonl")


SPAWN_SCRIPT = """
    import json, csv, sys
    import torch
    import syncless
    from syncless.sinks import CSV, JSONL

    # Module level: every spawned worker runs these lines again when it re-imports __main__.
    log = syncless.Logger(every=5, sinks=[CSV("m.csv"), JSONL("m.jsonl", mode="w")])


    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return 24

        def __getitem__(self, i):
            if WORKER_LOGS:
                log(in_worker=float(i))          # the worker's own copy: refused, reported
            return torch.tensor(float(i))


    WORKER_LOGS = len(sys.argv) > 1

    if __name__ == "__main__":
        loader = torch.utils.data.DataLoader(Data(), batch_size=None, num_workers=2,
                                             multiprocessing_context="spawn")
        for step, x in enumerate(loader):
            log(x=x, twice=x * 2)
        log.close()
        rows = list(csv.DictReader(open("m.csv", newline="")))
        lines = [json.loads(line) for line in open("m.jsonl")]
        print(json.dumps({"csv": [(int(r["step"]), float(r["x"]), float(r["twice"]))
                                  for r in rows],
                          "jsonl": [(r["step"], r["x"], r["twice"]) for r in lines]}))
"""


@pytest.mark.parametrize("worker_logs", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["quiet_workers", "workers_log"])
def test_spawn_dataloader_workers_keep_every_row(tmp_path, worker_logs):
    """A module-level Logger with CSV and JSONL(mode="w") sinks is made again in each spawn
    DataLoader worker: the parent's files keep all 24 rows (9 of 24 before). A worker that logs
    into its copy gets a clear error naming the cause, never the parent's file."""
    out = run_script(tmp_path, SPAWN_SCRIPT.replace("WORKER_LOGS = len(sys.argv) > 1",
                                                    f"WORKER_LOGS = {worker_logs}"))
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    expected = [[s, float(s), 2.0 * s] for s in range(24)]
    assert got == {"csv": expected, "jsonl": expected}
    assert sorted(os.listdir(tmp_path)) == ["m.csv", "m.jsonl", "script.py"]
    if worker_logs:
        assert "was made while this spawned process re-imported its parent's modules" in \
            out.stderr
        assert "Traceback" not in out.stderr


def test_run_directory_deleted_mid_run(tmp_path, device, caplog):
    """The run directory is removed while the run writes into it (parts included): the error
    says the directory was deleted and which rows went with it, never points at parts that no
    longer exist; the table starts again with every column, and the other sinks lose nothing."""
    run = tmp_path / "run"
    got = Collect()
    csv_sink, jsonl_sink = CSV(run / "m.csv"), JSONL(run / "m.jsonl")
    with syncless.Logger(every=2, sinks=[csv_sink, jsonl_sink, got]) as log:
        for step in range(4):
            log(loss=value(step, device), **({"acc": value(-step, device)} if step > 1 else {}))
        log.flush()
        assert len(csv_sink.files) == 2                 # a part in the folder beside m.csv
        shutil.rmtree(run)
        for step in range(4, 8):
            log(loss=value(step, device), acc=value(-step, device))
        log.flush()
        assert log.stats.sink_errors == 2
        for step in range(8, 10):
            log(loss=value(step, device), acc=value(-step, device))
    assert got.rows == [(s, {"loss": float(s), **({"acc": -float(s)} if s > 1 else {})})
                        for s in range(10)]
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 2, errors                     # each sink reported once
    for kind in ("CSV", "JSONL"):
        (msg,) = [e for e in errors if f"{kind} {run}" in e]
        assert f"its directory {run} was deleted during the run, and the rows written before " \
               f"step 4 went with it; from that step on rows go to a new {run}" in msg
        assert "syncless-" not in msg                   # no part file named
    header, rows = table(run / "m.csv")
    assert header == ["step", "time", "loss", "acc"]
    assert rows == [(s, {"loss": float(s), "acc": -float(s)}) for s in range(4, 10)]
    assert jsonl(run / "m.jsonl", "step") == list(range(4, 10))
    assert sorted(os.listdir(run)) == ["m.csv", "m.jsonl"]


def test_run_directory_deleted_before_the_merge(tmp_path, caplog):
    """Deleted after the last write, before close() merges the parts: the error names the
    directory, not the parts as if they still held the rows."""
    run = tmp_path / "run"
    sink = CSV(run / "m.csv")
    log = syncless.Logger(every=1, sinks=[sink])
    log(a=1.0)
    log(b=2.0)
    log.flush()
    shutil.rmtree(run)
    log.close()
    (msg,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert f"CSV {run / 'm.csv'}: its directory {run} was deleted during the run, so its parts " \
           "cannot be merged; every row went with it" in msg
    assert "is still in" not in msg and "syncless-" not in msg
    assert log.stats.sink_errors == 1 and not run.exists()
