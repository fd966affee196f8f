"""The snippets of README.md and docs/*.md run as printed.

A Python block is marked runnable by an HTML comment on the line before its fence (invisible on
GitHub and on the MkDocs site):

    <!-- runnable -->                       runs here, on CPU, in a few seconds
    <!-- runnable: slow -->                 runs with --run-slow (a compile, the doctor)
    <!-- runnable: needs wandb -->          runs where the named modules import (skipped if not)
    <!-- runnable: cuda -->                 runs only with a GPU

Each block runs alone, in a fresh namespace as `__main__`, in an empty temporary directory (it
may write `runs/...`), with W&B offline; a Logger it leaves open is closed after it, as
interpreter exit would. Blocks without a marker are fragments (a line inside the reader's own
loop) and are not run.
"""
import contextlib
import pathlib
import re

import pytest
import torch

import syncless
from syncless.logger import _live

pytestmark = [
    # inductor's own imports (torch.utils.mkldnn) warn on some torch versions (the compile block)
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
MARK = re.compile(r"^<!-- runnable(?::\s*(?P<opts>[^>]*?))?\s*-->\s*$")


def blocks():
    """(page, line, options, code) of every marked block."""
    found = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            m = MARK.match(line)
            if m is None:
                continue
            assert i + 1 < len(lines) and lines[i + 1].strip() == "```python", \
                f"{page.name}:{i + 1}: a runnable marker must sit right above a ```python fence"
            end = lines.index("```", i + 2)
            code = "\n".join(lines[i + 2:end]) + "\n"
            found.append((page.name, i + 3, (m.group("opts") or "").split(), code))
    return found


BLOCKS = blocks()


def _marks(opts):
    marks = []
    if "slow" in opts:
        marks.append(pytest.mark.slow)
    if "cuda" in opts:
        marks.append(pytest.mark.cuda)
    return marks


@pytest.fixture
def in_empty_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    return tmp_path


@pytest.mark.parametrize(
    "page, line, opts, code",
    [pytest.param(*b, id=f"{b[0]}:{b[1]}", marks=_marks(b[2])) for b in BLOCKS])
def test_marked_block_runs_as_printed(page, line, opts, code, in_empty_dir, capsys):
    if "needs" in opts:
        for module in opts[opts.index("needs") + 1:]:
            pytest.importorskip(module)
    before = set(_live)
    namespace = {"__name__": "__main__"}
    try:
        exec(compile(code, f"{page}:{line}", "exec"), namespace)
    finally:
        for log in set(_live) - before:        # what interpreter exit would close
            with contextlib.suppress(Exception):
                log.close()
        syncless.timers.reset()
    left = [log for log in set(_live) - before if log.stats.delivered != log.stats.steps]
    assert not left, f"{page}:{line}: rows not delivered: {left}"


def test_the_pages_mark_their_runnable_blocks():
    """The markers are found (a page edit that drops them fails here, not silently): the
    README's loop, sink, timer and doctor, the getting-started loop and the drop-ins."""
    pages = [page for page, _, _, _ in BLOCKS]
    assert pages.count("README.md") >= 4 and len(pages) >= 9, [b[:3] for b in BLOCKS]
    assert {"index.md", "dropins.md", "logger.md", "timer.md"} <= set(pages)


def test_the_first_loop_writes_every_row(in_empty_dir, capsys):
    """The README's first example, run as printed: 200 rows in runs/metrics.jsonl, steps 0-199,
    and the printed last values are those of step 199."""
    import json
    (code,) = [c for page, _, _, c in BLOCKS if page == "README.md" and "runs/metrics.jsonl" in c]
    torch.manual_seed(0)
    namespace = {"__name__": "__main__"}
    exec(compile(code, "README.md", "exec"), namespace)
    rows = [json.loads(line) for line in in_empty_dir.joinpath("runs/metrics.jsonl").read_text()
            .splitlines()]
    assert [r["step"] for r in rows] == list(range(200))
    log = namespace["log"]
    assert log.latest == {k: v for k, v in rows[-1].items() if k not in ("step", "time")}
    assert log.stats.delivered == 200
