"""benchmarks/peers.py: the peers' runner reads pytest's outcomes, compares the two runs, and
really injects syncless (checked end to end on a small upstream-style suite)."""
import pytest

from benchmarks import peers

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="t.A" name="test_ok" />
<testcase classname="t.A" name="test_fails">
<failure message="AssertionError: 1 != 2&#10;second line">...</failure></testcase>
<testcase classname="t.A" name="test_skipped"><skipped message="no GPU" /></testcase>
<testcase classname="t.A" name="test_teardown"><error message="teardown broke" /></testcase>
<testcase classname="t.A" name="test_teardown" />
</testsuite></testsuites>"""


def test_outcomes_read_from_junit_keep_the_worst_phase_and_the_first_line(tmp_path):
    path = tmp_path / "junit.xml"
    path.write_text(JUNIT)
    assert peers.outcomes(path) == {
        "t.A::test_ok": ("passed", ""),
        "t.A::test_fails": ("failed", "AssertionError: 1 != 2"),
        "t.A::test_skipped": ("skipped", "no GPU"),
        "t.A::test_teardown": ("error", "teardown broke"),
    }


def test_compare_counts_lost_tests_and_gives_the_reason():
    without = {"a": ("passed", ""), "b": ("passed", ""), "c": ("failed", "x"), "d": ("skipped", "")}
    with_ = {"a": ("passed", ""), "b": ("failed", "AssertionError: boom"), "c": ("failed", "x"),
             "d": ("skipped", "")}
    summary, rows = peers.compare("s", without, with_)
    assert summary == ["s", "4", "2", "1", "1"]
    assert rows == [["s", "b", "passed", "failed", "AssertionError: boom"]]


UPSTREAM = '''
import tempfile
from torch.utils.tensorboard import SummaryWriter


def test_writes_scalars():
    with SummaryWriter(tempfile.mkdtemp()) as w:
        w.add_scalar("loss", "1.5", 0)
        w.add_scalars("m", {"a": 1.0}, 1)


def test_is_torchs_own_class():
    assert SummaryWriter.__module__ == "torch.utils.tensorboard.writer"


def test_fails_anyway():
    assert False, "broken upstream"
'''


@pytest.mark.slow
def test_a_suite_runs_without_and_with_syncless_injected(tmp_path, monkeypatch):
    (tmp_path / "pytorch" / "test").mkdir(parents=True)
    (tmp_path / "pytorch" / "test" / "test_upstream.py").write_text(UPSTREAM)
    monkeypatch.setitem(peers.SOURCES, "torch",
                        ("torch", "pytorch", "test", ["test_upstream.py"], []))
    without, _, made_without = peers.run_suite("torch", tmp_path, False, 300)
    with_, _, made_with = peers.run_suite("torch", tmp_path, True, 300)
    assert {t: o for t, (o, _) in without.items()} == {
        "test_upstream::test_writes_scalars": "passed",
        "test_upstream::test_is_torchs_own_class": "passed",
        "test_upstream::test_fails_anyway": "failed"}
    assert {t: o for t, (o, _) in with_.items()} == {
        "test_upstream::test_writes_scalars": "passed",
        "test_upstream::test_is_torchs_own_class": "failed",     # syncless's class was used
        "test_upstream::test_fails_anyway": "failed"}
    assert (made_without, made_with) == (0, 1)
    summary, rows = peers.compare("torch", without, with_)
    assert summary == ["torch", "3", "2", "1", "1"]
    assert [row[1] for row in rows] == ["test_upstream::test_is_torchs_own_class"]
