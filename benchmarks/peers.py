"""Peers' own tests as the contract: upstream test files run without and with syncless injected.

    python -m benchmarks.peers --src .peers [--suite torch lightning transformers] [--out [DIR]]

Each suite runs twice in a fresh pytest process, from the upstream sources under --src (fetched
beforehand, never committed; see SOURCES for the layout and the versions they must match):

    torch         test/test_tensorboard.py, with syncless.tensorboard.SummaryWriter in place of
                  torch.utils.tensorboard.SummaryWriter
    lightning     tests_pytorch/trainer/logging_/, with syncless.lightning.SynclessLogging()
                  appended to the callbacks of every Trainer
    transformers  tests/trainer/ logging and callback tests that run on CPU, with
                  syncless.hf.SynclessTrainer in place of transformers.Trainer

Every test's outcome with syncless is compared with its outcome without it; the table lists the
counts and each test whose outcome differs, with its cause where known (KNOWN, BY_DESIGN), and
the tests that fail both ways. The injection is this module used as a pytest plugin
(`-p benchmarks.peers`), switched on by the environment variable SYNCLESS_PEERS; each run is a
fresh process with a blank pytest configuration (upstream's rules, not syncless's
`filterwarnings = error`).

The sources (an ignored folder; a SOURCE file in each suite's folder says what is there):

    .peers/pytorch/test/test_tensorboard.py (+ test/expect/*.expect)  pytorch/pytorch at the
        installed torch's tag, where reachable
    .peers/lightning/tests/tests_pytorch/...   `git archive <tag> tests/tests_pytorch` of a
        Lightning-AI/pytorch-lightning clone, tag = the installed lightning version
    .peers/transformers/tests/__init__.py, tests/trainer/{__init__,trainer_test_utils,
        test_trainer_callback}.py   huggingface/transformers at the installed version's tag
    .peers/site/   `pip install --target .peers/site expecttest` (torch's test helpers need it)

Where a tag is not reachable, the nearest version is used and SOURCE says so (the results file
repeats it).
"""
from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# suite -> (package whose installed version the sources must match, folder under --src, the
# folder pytest runs in (relative to it), the test paths (relative to that folder), extra
# folders for sys.path (relative to the suite's folder)).
SOURCES = {
    "torch": ("torch", "pytorch", "test", ["test_tensorboard.py"], []),
    "lightning": ("lightning", "lightning", "tests",
                  ["tests_pytorch/trainer/logging_"], ["tests"]),
    "transformers": ("transformers", "transformers", ".",
                     ["tests/trainer/test_trainer_callback.py"], ["."]),
}

# Tests that cannot pass with syncless by design, and why (none known so far), and tests that
# fail with it for a known cause not fixed yet (reported with the cause, not hidden).
BY_DESIGN: dict[str, str] = {}
KNOWN: dict[str, str] = {}


def _commit() -> str:
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10).stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


# ---- the plugin side (inside the pytest process) -----------------------------------------------

_made = [0]          # syncless objects the injected run made: proof that the tests used them


def _counted(cls: type) -> None:
    original = cls.__init__

    def __init__(self, *args, **kwargs):
        _made[0] += 1
        original(self, *args, **kwargs)

    cls.__init__ = __init__


def _inject_torch() -> None:
    import torch.utils.tensorboard as tb

    from syncless.tensorboard import SummaryWriter
    _counted(SummaryWriter)
    tb.SummaryWriter = SummaryWriter


def _inject_lightning() -> None:
    import lightning.pytorch as pl

    from syncless.lightning import SynclessLogging
    _counted(SynclessLogging)
    original = pl.Trainer.__init__

    def __init__(self, *args, **kwargs):
        callbacks = kwargs.get("callbacks")
        if callbacks is None:
            callbacks = []
        elif not isinstance(callbacks, list):
            callbacks = [callbacks]
        kwargs["callbacks"] = [*callbacks, SynclessLogging()]
        original(self, *args, **kwargs)

    pl.Trainer.__init__ = __init__


def _inject_transformers() -> None:
    import transformers
    import transformers.trainer

    from syncless.hf import SynclessTrainer
    _counted(SynclessTrainer)
    if os.environ.get("SYNCLESS_PEERS_HF_AT_STEP"):       # --hf-log-at-step
        counted = SynclessTrainer.__init__

        def __init__(self, *args, **kwargs):
            kwargs.setdefault("syncless_log_at_step", True)
            counted(self, *args, **kwargs)

        SynclessTrainer.__init__ = __init__
    transformers.Trainer = SynclessTrainer
    transformers.trainer.Trainer = SynclessTrainer


def pytest_configure(config) -> None:
    suite = os.environ.get("SYNCLESS_PEERS")
    if suite:
        {"torch": _inject_torch, "lightning": _inject_lightning,
         "transformers": _inject_transformers}[suite]()


def pytest_unconfigure(config) -> None:
    count = os.environ.get("SYNCLESS_PEERS_MADE")
    if count:
        Path(count).write_text(str(_made[0]))


# ---- the runner side ---------------------------------------------------------------------------

def outcomes(junit: Path) -> dict[str, tuple[str, str]]:
    """{test id: (outcome, first line of the message)} from pytest's JUnit XML."""
    rank = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}
    out: dict[str, tuple[str, str]] = {}
    for case in ET.parse(junit).iter("testcase"):
        test = f"{case.get('classname')}::{case.get('name')}"
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed"}.get(child.tag, child.tag)
                message = (child.get("message") or "").strip().splitlines()[:1]
                message = message[0][:160] if message else ""
                break
        if test not in out or rank[outcome] > rank[out[test][0]]:
            out[test] = (outcome, message)
    return out


# Extra injected runs per suite: (label, environment for the plugin).
VARIANTS = {"transformers": [("syncless_log_at_step=True", {"SYNCLESS_PEERS_HF_AT_STEP": "1"})]}


def run_suite(suite: str, src: Path, inject: bool, timeout: int,
              extra_env: dict | None = None) -> tuple[dict, float, int]:
    package, folder, where, paths, extra = SOURCES[suite]
    base = src / folder
    cwd = base / where
    with tempfile.TemporaryDirectory(prefix="peers-") as tmp:
        ini = Path(tmp, "pytest.ini")
        ini.write_text("[pytest]\n")                    # upstream's rules, not syncless's
        junit = Path(tmp, "junit.xml")
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(ROOT / "python"), str(ROOT)] + [str(base / e) for e in extra]
            + [str(src / "site")] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        env["SYNCLESS_PEERS"] = suite if inject else ""
        env.update(extra_env or {})
        made = Path(tmp, "made")
        env["SYNCLESS_PEERS_MADE"] = str(made)
        env.update(WANDB_MODE="offline", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   TOKENIZERS_PARALLELISM="false", MPLBACKEND="Agg")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               "-p", "benchmarks.peers", "-c", str(ini), "--rootdir", str(cwd),
               f"--junitxml={junit}", "-o", "junit_family=xunit1", *paths]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=cwd, env=env, timeout=timeout, capture_output=True,
                              text=True)
        wall = time.perf_counter() - t0
        if not junit.exists():
            raise RuntimeError(f"{suite}: pytest wrote no results (rc {proc.returncode}):\n"
                               f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        return outcomes(junit), wall, int(made.read_text()) if made.exists() else 0


def installed(package: str) -> str:
    from importlib.metadata import version
    return version(package)


def source_note(src: Path, suite: str) -> str:
    note = src / SOURCES[suite][1] / "SOURCE"
    return note.read_text().strip() if note.exists() else "(no SOURCE note)"


def compare(suite: str, without: dict, with_: dict) -> tuple[list[str], list[list[str]]]:
    """The summary line's cells and one row per test whose outcome differs."""
    def count(res, what):
        return sum(1 for outcome, _ in res.values() if outcome == what)
    rows = []
    for test in sorted(set(without) | set(with_)):
        a = without.get(test, ("missing", ""))
        b = with_.get(test, ("missing", ""))
        if a[0] != b[0]:
            reason = BY_DESIGN.get(test) or KNOWN.get(test) or b[1] or a[1]
            rows.append([suite, test, a[0], b[0], reason])
    summary = [suite, str(len(without)), str(count(without, "passed")),
               str(count(with_, "passed")),
               str(sum(1 for t, (o, _) in without.items()
                       if o == "passed" and with_.get(t, ("missing",))[0] != "passed"))]
    return summary, rows


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", type=Path, default=ROOT / ".peers",
                        help="the fetched upstream sources (default: .peers)")
    parser.add_argument("--suite", nargs="+", choices=list(SOURCES), default=list(SOURCES))
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per pytest run")
    parser.add_argument("--out", nargs="?", const=str(ROOT / "benchmarks" / "results"),
                        help="write peers.md there (default folder: benchmarks/results)")
    args = parser.parse_args(argv)
    src = args.src.resolve()
    summaries, diffs, notes, failed_both = [], [], [], []
    for suite in args.suite:
        if not (src / SOURCES[suite][1]).is_dir():
            notes.append(f"- {suite}: no sources under {src / SOURCES[suite][1]}; skipped")
            continue
        without, t_without, _ = run_suite(suite, src, False, args.timeout)
        with_, t_with, made = run_suite(suite, src, True, args.timeout)
        summary, rows = compare(suite, without, with_)
        summaries.append(summary + [str(made), f"{t_without:.0f} / {t_with:.0f}"])
        diffs += rows
        for label, extra in VARIANTS.get(suite, []):
            variant, t_variant, made = run_suite(suite, src, True, args.timeout, extra)
            summary, rows = compare(f"{suite} ({label})", without, variant)
            summaries.append(summary + [str(made), f"{t_without:.0f} / {t_variant:.0f}"])
            diffs += rows
        notes.append(f"- {suite}: installed {SOURCES[suite][0]} "
                     f"{installed(SOURCES[suite][0])}; sources: {source_note(src, suite)}")
        failed_both += [[suite, t, o, m] for t, (o, m) in sorted(without.items())
                        if o in ("failed", "error") and with_.get(t, ("",))[0] == o]
        print(table(["suite", "tests", "passed without", "passed with", "lost", "made", "s"],
                    summaries[-1 - len(VARIANTS.get(suite, [])):]), flush=True)
    text = "\n\n".join([
        "# Peers' tests with syncless injected",
        f"Provenance: commit {_commit()}, {time.strftime('%Y-%m-%d')}, {platform.node() or 'host'} "
        f"({os.cpu_count()} CPUs, {platform.python_version()}).",
        "Command: `python -m benchmarks.peers --src .peers --out` (upstream tests run without "
        "and with syncless; a test is *lost* when it passes without and not with; *syncless "
        "objects made*: the injected writers, callbacks or trainers the tests created).",
        table(["suite", "tests", "passed without", "passed with", "lost",
               "syncless objects made", "wall s (without / with)"], summaries),
        "## Outcomes that differ",
        table(["suite", "test", "without", "with", "reason"], diffs) if diffs else "None.",
        "## Failing both ways (the environment, not syncless)",
        table(["suite", "test", "outcome", "message"], failed_both) if failed_both else "None.",
        "## Sources",
        "\n".join(notes),
    ]) + "\n"
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "peers.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
