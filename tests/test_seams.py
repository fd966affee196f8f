"""The seams between the logger's rooms (docs/architecture.md): the training side (logger.py)
asks the hand-over and the delivery for what it needs through their public calls, the device
ring is one type, and a job's run says whether it committed."""
import ast
import pathlib

from syncless._delivery import Delivery, LateJob, ReducedJob, RowsJob
from syncless._late import Late
from syncless.rows import Row

PKG = pathlib.Path(__file__).resolve().parent.parent / "python" / "syncless"


def _logger_tree() -> ast.Module:
    return ast.parse((PKG / "logger.py").read_text())


def _refers_to_room(node: ast.expr, names: set[str]) -> bool:
    """Is `node` a Delivery or Handover object: `<x>._delivery`, `<x>._handover`, or a local
    name bound to one of them?"""
    if isinstance(node, ast.Attribute):
        return node.attr in ("_delivery", "_handover")
    return isinstance(node, ast.Name) and node.id in names


def _room_locals(tree: ast.Module) -> set[str]:
    """Local names that hold a Delivery or Handover (`d = self._delivery`, `d, h = ...`)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assign):
            continue
        for target in node.targets:
            pairs = []
            if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                pairs = list(zip(target.elts, node.value.elts))
            else:
                pairs = [(target, node.value)]
            for t, v in pairs:
                if isinstance(t, ast.Name) and _refers_to_room(v, set()):
                    names.add(t.id)
    return names


def test_logger_reads_no_private_member_of_delivery_or_handover():
    tree = _logger_tree()
    names = _room_locals(tree)
    private, public = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _refers_to_room(node.value, names):
            if node.attr.startswith("_") and not node.attr.startswith("__"):
                private.append(f"line {node.lineno}: .{node.attr}")
            else:
                public.add(node.attr)
    assert not private, f"logger.py reads private members of Delivery/Handover: {private}"
    # The walk found the Logger's real uses (it is not vacuous): the stats come as snapshots.
    assert {"stats", "send_window", "send_rows", "drain", "latest"} <= public


def test_one_device_ring_type_is_imported_wherever_the_ring_is_used():
    for module in ("logger.py", "_handover.py", "_delivery.py", "_compile.py"):
        tree = ast.parse((PKG / module).read_text())
        imported = {(node.module, alias.name) for node in ast.walk(tree)
                    if isinstance(node, ast.ImportFrom) for alias in node.names}
        assert ("_ring", "DeviceRing") in imported, module
        text = (PKG / module).read_text()
        assert "_Generation" not in text and "next_seq" not in text, module
    for module in ("_handover.py", "_delivery.py"):
        assert "tuple[Any" not in (PKG / module).read_text(), module


class _Keep:
    """A sink that keeps what it is given."""

    def __init__(self):
        self.rows = []

    def write(self, rows):
        self.rows.extend(rows)


def test_run_says_whether_the_job_committed():
    sink = _Keep()
    d = Delivery([sink], [], gpu_time=False)
    try:
        rows = [Row(0, 1.0, {"a": 1.0}), Row(1, 2.0, {"a": 2.0})]
        job = RowsJob(rows, 2, rows, 1)
        assert d.run(job) is True and d.committed(job)
        assert [r.step for r in sink.rows] == [0, 1]
        # Handed over again (an interrupt between submit and count): committed, nothing twice.
        assert d.run(job) is True
        assert [r.step for r in sink.rows] == [0, 1]
        # A plan made before another commit (a signal handler's delivery) is dropped.
        more = [Row(2, 3.0, {"a": 3.0})]
        stale = RowsJob(more, 1, more, 2)
        assert d.run(stale, epoch=d.epoch - 1) is False and not d.committed(stale)
        assert d.run(stale) is True
        reduced = ReducedJob([Row(3, 4.0, {"a": 4.0})])
        assert d.run(reduced) is True
        assert d.run(LateJob(Late(5, "late", lambda: 1.0))) is False     # kept, not committed
        d.end(float("inf"))
        assert [(r.step, r.values) for r in sink.rows] == [
            (0, {"a": 1.0}), (1, {"a": 2.0}), (2, {"a": 3.0}), (3, {"a": 4.0}),
            (5, {"late": 1.0})]
        stats = d.stats()
        assert (stats.delivered, stats.lost, stats.sink_errors) == (4, 0, 0)
    finally:
        d.close_sinks()
        d.whole.stop()
