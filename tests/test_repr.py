"""What a notebook user sees when they look at syncless.audit()'s, syncless.doctor()'s and
syncless.watch()'s objects: IPython's own pretty printer and display formatter, as Jupyter calls
them. The report shows once: doctor() printed it, so its result then shows as one line."""
import html
import io

import pytest
import torch

import syncless
from syncless.doctor._frames import caller_site
from syncless.doctor.audit import SYNC, Audit
from syncless.doctor.diagnose import Measured, assess
from syncless.doctor.monitor import MonitorSummary

IPython = pytest.importorskip("IPython")
from IPython.core.interactiveshell import InteractiveShell  # noqa: E402
from IPython.lib.pretty import pretty  # noqa: E402


@pytest.fixture(scope="module")
def shown():
    """The mime bundle a notebook gets for an object (what Jupyter displays: html over text)."""
    shell = InteractiveShell.instance()
    yield lambda obj: shell.display_formatter.format(obj)[0]
    InteractiveShell.clear_instance()


def audit_with_item_syncs(steps=4, per_step=2, ns=250_000):
    """An audit as CUPTI leaves it: `per_step` .item() syncs a step at one line, each blocked `ns`."""
    a = Audit(steps=steps)
    a.backend, a.elapsed_s = "cupti", 0.02
    site = caller_site(0)._replace(code="total += loss.item()")
    for _ in range(steps * per_step):
        a._add(a.sites, site, "cudaMemcpyAsync", SYNC, ns, True)
    return a


def pre(text):
    return f"<pre style='font-family:monospace'>{html.escape(text)}</pre>"


def test_an_audit_says_what_it_found_in_one_line_and_shows_its_report(shown):
    a = audit_with_item_syncs()
    assert repr(a) == ("<syncless.Audit: 4 step(s), 2 sync(s)/step (8 at 1 line(s)), "
                       "0.500 ms blocked/step (CUPTI)>")
    report = a.report()
    assert report.startswith("syncless audit: 4 step(s), 20.0 ms\n")
    assert "total += loss.item()" in report
    assert pretty(a) == report
    bundle = shown(a)
    assert bundle["text/html"] == pre(report) and bundle["text/plain"] == report


def test_an_audit_not_run_or_running_shows_its_state(shown):
    a = syncless.audit()
    assert repr(a) == "<syncless.Audit: not run yet (with syncless.audit() as a: ...)>"
    assert shown(a) == {"text/plain": repr(a)}
    with a:
        assert repr(a).startswith("<syncless.Audit: running (")
        assert pretty(a) == repr(a)
    with syncless.audit() as done:
        torch.ones(4).sum()
    if not torch.cuda.is_available():
        assert repr(done) == ("<syncless.Audit: 1 step(s), 0 sync(s)/step (0 at 0 line(s)) "
                              "(no sync finder)>")
    assert pretty(done) == done.report()


def diagnosis():
    """doctor()'s result for a 10 ms step of which 2 .item() syncs a step block 0.5 ms."""
    summary = MonitorSummary(20, 0.0, 10.0, 10.0, None, 0, None)
    return assess(Measured(summary, audit_with_item_syncs(), 2, 10.0, True, 9.0, 6.0, 3))


def test_a_diagnosis_is_one_line_not_a_dataclass_dump():
    d = diagnosis()
    top = d.findings[0]
    assert top.kind == "sync"
    assert repr(d) == (f"<syncless.Diagnosis: {d.verdict_kind}, 10.000 ms/step over 20 step(s); "
                       f"{len(d.findings)} finding(s), the first: {top.title} (wins back "
                       f"{top.cost_ms:.3f} ms/step); print() it for the report>")
    assert "summary=" not in repr(d) and "MonitorSummary" not in repr(d)
    assert str(d) == d.report() and d.report().startswith("syncless doctor: 20 measured steps")


def test_a_diagnosis_not_printed_shows_as_its_report_once(shown):
    d = diagnosis()
    report = d.report()
    assert pretty(d) == report
    assert shown(d) == {"text/html": pre(report), "text/plain": report}


def test_doctor_prints_the_report_once_and_its_result_shows_as_one_line(shown):
    out = io.StringIO()
    d = syncless.doctor(lambda: torch.ones(32, 32) @ torch.ones(32, 32), steps=3, warmup=1,
                        file=out)
    assert out.getvalue() == d.report() + "\n"
    assert out.getvalue().count("syncless doctor: 3 measured steps") == 1
    bundle = shown(d)
    assert bundle == {"text/plain": repr(d)}               # no html: the report is not shown again
    assert bundle["text/plain"].startswith("<syncless.Diagnosis: ")
    assert "over 3 step(s)" in bundle["text/plain"]
    assert pretty(d) == repr(d)
    quiet = syncless.doctor(lambda: torch.ones(32, 32) @ torch.ones(32, 32), steps=3,
                            warmup=1, file=None)
    assert shown(quiet)["text/html"] == pre(quiet.report())


def test_reports_returned_as_text_show_as_text_not_a_quoted_string(shown):
    w = syncless.watch(range(5))
    for _ in w:
        pass
    report = w.report()
    assert isinstance(report, str) and report.startswith("syncless.watch: 5 steps, ")
    assert pretty(report) == report                        # not "'syncless.watch: ...\\n...'"
    assert shown(report) == {"text/plain": report, "text/html": pre(report)}
    assert pretty(audit_with_item_syncs().report()).startswith("syncless audit: 4 step(s)")
    assert pretty(w) == report                             # the Watch itself: the same text
    assert shown(w)["text/html"].startswith("<p><b>syncless.watch</b>: 5 steps, ")
