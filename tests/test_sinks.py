"""The file sinks (CSV, JSONL) under what a long run meets: thousands of metric names, names that
are not valid Unicode, symlinks, a full disk, a file size limit. Files are read back with the csv
and json modules, as a user would."""
import ast
import csv
import io
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

import syncless
from syncless.sinks import CSV, JSONL, Callback


def read_csv(path):
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.reader(f))


# ---- CSV: new columns cost the rows that bring them, never a rewrite -----------------------------

def test_csv_ten_thousand_names_are_written_once(tmp_path):
    """10,000 distinct names, 10 new ones per step, every=10: 100 windows that each widen the
    table. Each window starts a part; nothing written is rewritten until close() merges once."""
    path = tmp_path / "m.csv"
    sink = CSV(path)
    names = [f"layer{i // 10}/w{i % 10}" for i in range(10_000)]
    with syncless.Logger(every=10, sinks=[sink]) as log:
        for step in range(1000):
            log(**{names[step * 10 + j]: float(step * 10 + j) for j in range(10)},
                loss=step / 4)
        log.flush()
        parts = CSV.parts(path)
        assert len(parts) == 100                       # one part per widening window
        on_disk = sum(os.path.getsize(p) for p in parts)
        headers = 0
        for k, part in enumerate(parts):               # each part is a complete CSV
            table = read_csv(part)
            assert len(table) == 11 and table[0][:3] == ["step", "time", names[0]]
            assert len(table[0]) == 2 + 1 + 100 * (k + 1)
            assert all(len(row) == len(table[0]) for row in table[1:])
            headers += len(",".join(table[0])) + 2
    table = read_csv(path)
    assert CSV.parts(path) == [str(path)]              # merged at close, parts removed
    merged = os.path.getsize(path)
    # The bytes the parts held are the merged file's rows, narrower, plus one header per part:
    # O(bytes of the rows), where rewriting at each new column wrote ~50x the final file.
    assert on_disk <= merged + headers
    header = table[0]
    assert header == ["step", "time"] + names[:10] + ["loss"] + names[10:]
    column = {name: i for i, name in enumerate(header)}
    assert len(table) == 1001
    for step, row in enumerate(table[1:]):
        assert len(row) == len(header) and int(row[0]) == step
        assert float(row[column["loss"]]) == step / 4
        filled = {header[i]: float(v) for i, v in enumerate(row) if i >= 2 and v}
        assert filled == {**{names[step * 10 + j]: float(step * 10 + j) for j in range(10)},
                          "loss": step / 4}


def test_csv_reopened_leaves_the_parts_of_an_earlier_run_alone(tmp_path):
    """Parts live in a hidden folder of the sink's own; a crashed run's folder stays as it was
    (the new run did not create it), and the new run's table holds only its own rows."""
    path = tmp_path / "m.csv"
    with syncless.Logger(every=1, sinks=[CSV(path)]) as log:
        log(a=1.0)
        log(b=2.0)
        log.flush()
        parts = CSV.parts(path)
        assert len(parts) == 2 and parts[1].endswith("1.csv")
        assert os.path.basename(os.path.dirname(parts[1])).startswith(".m.csv.syncless-")
        os.link(parts[1], tmp_path / "kept.csv")                # what a crash would leave
    os.mkdir(os.path.dirname(parts[1]))
    os.link(tmp_path / "kept.csv", parts[1])
    left = pathlib.Path(parts[1]).read_bytes()
    with syncless.Logger(every=1, sinks=[CSV(path)]) as log:
        log(c=3.0)
    assert CSV.parts(path) == [str(path), parts[1]]
    assert pathlib.Path(parts[1]).read_bytes() == left
    assert [r[:1] + r[2:] for r in read_csv(path)] == [["step", "c"], ["0", "3.0"]]


def test_csv_without_rows_is_an_empty_table(tmp_path):
    with syncless.Logger(every=1, sinks=[CSV(tmp_path / "m.csv")]):
        pass
    assert read_csv(tmp_path / "m.csv") == [["step", "time"]]


def test_csv_to_a_stream_repeats_the_header_when_columns_grow(tmp_path):
    """A path that is not a regular file (a FIFO here) cannot have parts: the wider header is
    the next line of the stream, and nothing is ever read back from it."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    reader = subprocess.Popen(["cat", str(fifo)], stdout=subprocess.PIPE, text=True)
    with syncless.Logger(every=1, sinks=[CSV(fifo)]) as log:
        log(a=1.0)
        log(a=2.0, b=3.0)
    out, _ = reader.communicate(timeout=30)
    table = list(csv.reader(io.StringIO(out)))
    assert [r[:1] + r[2:] for r in table] == [
        ["step", "a"], ["0", "1.0"], ["step", "a", "b"], ["1", "2.0", "3.0"]]


# ---- names that are not valid Unicode ------------------------------------------------------------

def test_unencodable_names_are_written_and_nothing_fails(tmp_path):
    bad = "bad\udc80"
    with syncless.Logger(every=2, sinks=[CSV(tmp_path / "m.csv"),
                                         JSONL(tmp_path / "m.jsonl")]) as log:
        log(loss=1.0)
        log(**{bad: 2.0})
        log(loss=3.0, ok=4.0)
        log(loss=5.0)
    assert log.stats.sink_errors == 0
    table = read_csv(tmp_path / "m.csv")
    assert table[0] == ["step", "time", "loss", "bad\\udc80", "ok"]
    assert [r[:1] + r[2:] for r in table[1:]] == [
        ["0", "1.0", "", ""], ["1", "", "2.0", ""], ["2", "3.0", "", "4.0"], ["3", "5.0", "", ""]]
    lines = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [{k: v for k, v in d.items() if k != "time"} for d in lines] == [
        {"step": 0, "loss": 1.0}, {"step": 1, bad: 2.0}, {"step": 2, "loss": 3.0, "ok": 4.0},
        {"step": 3, "loss": 5.0}]
    assert sorted(os.listdir(tmp_path)) == ["m.csv", "m.jsonl"]        # no temp file left


# ---- symlinks ------------------------------------------------------------------------------------

def test_a_symlinked_path_writes_its_target(tmp_path):
    (tmp_path / "data").mkdir()
    for name in ("m.csv", "m.jsonl"):
        (tmp_path / "data" / name).write_text("")
        os.symlink(tmp_path / "data" / name, tmp_path / name)
    with syncless.Logger(every=1, sinks=[CSV(tmp_path / "m.csv"),
                                         JSONL(tmp_path / "m.jsonl")]) as log:
        log(a=1.0)
        log(a=2.0, b=3.0)                        # a second part: close() merges into the target
    for name in ("m.csv", "m.jsonl"):
        assert os.path.islink(tmp_path / name)
    assert [r[:1] + r[2:] for r in read_csv(tmp_path / "data" / "m.csv")] == [
        ["step", "a", "b"], ["0", "1.0", ""], ["1", "2.0", "3.0"]]
    lines = (tmp_path / "data" / "m.jsonl").read_text().splitlines()
    assert [json.loads(line)["a"] for line in lines] == [1.0, 2.0]
    assert sorted(os.listdir(tmp_path / "data")) == ["m.csv", "m.jsonl"]


# ---- a full disk, a file size limit --------------------------------------------------------------

# Both in one fresh interpreter (a hang fails the test, not the suite; the size limit is the
# process's): each part's stderr follows a line naming it.
WRITE_FAILURES = """
import os, resource, signal, sys
import syncless
from syncless.sinks import CSV, JSONL, Callback

print("== full disk", file=sys.stderr, flush=True)
rows = []
log = syncless.Logger(every=10, sinks=[CSV("/dev/full"), JSONL("/dev/full"),
                                       Callback(lambda s, t, v: rows.append(s))])
for i in range(30):
    log(loss=float(i), **{f"new{i // 10}": 1.0})
log.close()
print("rows", rows == list(range(30)), "errors", log.stats.sink_errors, flush=True)

print("== size limit", file=sys.stderr, flush=True)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)      # EFBIG instead of a signal
for sink in (CSV(sys.argv[1]), JSONL(sys.argv[2])):
    log = syncless.Logger(every=10, sinks=[sink])
    for i in range(20):
        log(loss=i / 8, acc=float(i))
    log.flush()
    size = os.path.getsize(sink.path)               # the next window would be ~300+ bytes
    resource.setrlimit(resource.RLIMIT_FSIZE, (size + 100, resource.RLIM_INFINITY))
    for i in range(20, 30):
        log(loss=i / 8, acc=float(i))
    log.flush()
    print("after failure", os.path.getsize(sink.path) == size, flush=True)
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)
    for i in range(30, 40):
        log(loss=i / 8, acc=float(i))
    log.close()
    print("errors", log.stats.sink_errors, flush=True)
"""


@pytest.fixture(scope="module")
def write_failures(tmp_path_factory):
    """{part: (stdout lines, stderr)} of WRITE_FAILURES, and the size-limited files' paths."""
    folder = tmp_path_factory.mktemp("write_failures")
    paths = (folder / "m.csv", folder / "m.jsonl")
    r = subprocess.run([sys.executable, "-c", WRITE_FAILURES, *map(str, paths)],
                       capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    _, full_err, limit_err = re.split(r"^== (?:full disk|size limit)\n", r.stderr, flags=re.M)
    return {"full disk": (out[:1], full_err), "size limit": (out[1:], limit_err)}, paths


def test_full_disk_raises_once_per_window_and_never_hangs(write_failures):
    """/dev/full: every write fails with ENOSPC. Each sink raises an OSError naming the steps
    (the logger reports it once per sink and counts each), the other sinks get every row, and
    close() returns."""
    out, err = write_failures[0]["full disk"]
    assert out == ["rows True errors 6"]                  # 3 windows x 2 sinks
    reports = [line for line in err.splitlines() if "No space left on device" in line]
    assert len(reports) == 2, err                        # reported once per sink
    assert "/dev/full: steps 0-9 were not written" in err


def test_a_failed_write_leaves_whole_rows_and_the_next_window_goes_on(write_failures):
    """A file size limit (RLIMIT_FSIZE, as a full disk would) makes one window's write fail
    part-way: each file is cut back to the rows before it, and once the space is back the next
    windows are written after them."""
    (out, err), (csv_path, jsonl_path) = write_failures[0]["size limit"], write_failures[1]
    assert out == ["after failure True", "errors 1"] * 2
    for path in (csv_path, jsonl_path):
        assert (f"{path}: steps 20-29 were not written (the file keeps every row before them); "
                "the next window tries again") in err
    table = read_csv(csv_path)
    assert table[0] == ["step", "time", "loss", "acc"]
    steps = [*range(20), *range(30, 40)]
    assert [(int(row[0]), float(row[2]), float(row[3])) for row in table[1:]] == \
        [(i, i / 8, float(i)) for i in steps]
    lines = [json.loads(line) for line in jsonl_path.read_text().splitlines()]
    assert [(d["step"], d["loss"], d["acc"]) for d in lines] == [(i, i / 8, float(i)) for i in steps]


def test_sinks_refuse_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="JSONL mode must be 'a' or 'w', got 'r'"):
        JSONL(tmp_path / "m.jsonl", mode="r")
    with pytest.raises(TypeError, match="Callback needs a callable, got str"):
        Callback("print")
    sink = CSV(tmp_path / "m.csv")
    sink.close()
    sink.close()                                         # idempotent
    assert read_csv(tmp_path / "m.csv") == [["step", "time"]]


def test_jsonl_appends_by_default(tmp_path):
    path = tmp_path / "m.jsonl"
    for start in (0, 2):
        with syncless.Logger(every=1, sinks=[JSONL(path)]) as log:
            for i in range(start, start + 2):
                log(i, loss=torch.tensor(i / 2))
    assert [json.loads(line)["loss"] for line in path.read_text().splitlines()] == \
        [0.0, 0.5, 1.0, 1.5]



# ---- the layer rule: sinks and their files know rows.py, never the logger ------------------------

PACKAGE = pathlib.Path(syncless.__file__).parent


def _imports(module):
    """The syncless modules `module` (a dotted name) imports, wherever in the file (a
    TYPE_CHECKING block and a function body count), read from its source."""
    path = PACKAGE.joinpath(*module.split(".")[1:]).with_suffix(".py")
    if not path.exists():
        path = path.with_suffix("") / "__init__.py"
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "syncless"}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] != "syncless":
                continue
            found.add(base)
            for a in node.names:                 # `from . import rows` names a module
                if PACKAGE.joinpath(*f"{base}.{a.name}".split(".")[1:]).with_suffix(".py").exists():
                    found.add(f"{base}.{a.name}")
    return found


@pytest.mark.parametrize("module", ["syncless.sinks", "syncless._files"])
def test_the_sinks_import_nothing_from_the_logger(module):
    """sinks.py and _files.py reach the logger through no import, direct or by way of another
    syncless module; what they share with it (Row, the reserved names) lives in rows.py."""
    assert "syncless.rows" in _imports(module)
    seen, todo = set(), [module]
    while todo:
        for name in _imports(todo.pop()) - seen:
            seen.add(name)
            todo.append(name)
    assert "syncless.logger" not in seen, sorted(seen)
    assert seen <= {"syncless", "syncless.rows", "syncless._files"}, sorted(seen)


def test_the_sinks_write_the_reserved_names_from_rows():
    """"step" and "time" are written once, in rows.py: no string of code in the sinks retypes
    them (docstrings may show them)."""
    from syncless.rows import RESERVED, STEP, TIME, Row
    assert (STEP, TIME) == Row._fields[:2] and RESERVED == {STEP, TIME}
    for module in ("sinks", "_files"):
        tree = ast.parse((PACKAGE / f"{module}.py").read_text())
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef))
                      and node.body and isinstance(node.body[0], ast.Expr)}
        retyped = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Constant)
                   and node.value in RESERVED and id(node) not in docstrings]
        assert retyped == [], f"{module}.py retypes a reserved name at lines {retyped}"
