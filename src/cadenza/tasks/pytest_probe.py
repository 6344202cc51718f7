"""pytest plugin `cadenza_probe`, copied into each project's environment and loaded with -p.

It records pytest's own per-test reports as one outcome per test id, switches coverage.py's
dynamic context to the running test's id (discovery), and can restrict a run to listed ids.
It imports nothing from cadenza: it runs inside the project's own interpreter.

Environment: CADENZA_PROBE_OUT (JSON written at session end), CADENZA_PROBE_SELECT (file
with one test id per line: everything else is deselected), CADENZA_PROBE_REPEAT (run the
selected tests that many times in a row; outcomes of every repetition are reported).
"""

import json
import os

import pytest

_outcomes = {}  # test id -> outcome of its latest repetition
_repeats = {}  # test id -> outcome per repetition
_collect_errors = []


def _coverage():
    try:
        import coverage
    except ImportError:
        return None
    return coverage.Coverage.current()


def pytest_collection_modifyitems(session, config, items):
    path = os.environ.get("CADENZA_PROBE_SELECT")
    if path:
        with open(path) as f:
            wanted = set(f.read().splitlines())
        keep = [i for i in items if i.nodeid in wanted]
        drop = [i for i in items if i.nodeid not in wanted]
        items[:] = keep
        if drop:
            config.hook.pytest_deselected(items=drop)
    repeat = int(os.environ.get("CADENZA_PROBE_REPEAT", "1"))
    if repeat > 1:
        items[:] = items * repeat


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    cov = _coverage()
    if cov is not None:
        cov.switch_context(item.nodeid)
    _outcomes.pop(item.nodeid, None)
    yield
    if cov is not None:
        cov.switch_context("")
    _repeats.setdefault(item.nodeid, []).append(_outcomes.get(item.nodeid, "absent"))


def pytest_runtest_logreport(report):
    nid = report.nodeid
    xfail = hasattr(report, "wasxfail")
    if report.when == "setup":
        if report.failed:
            _outcomes[nid] = "error"
        elif report.skipped:
            _outcomes[nid] = "xfailed" if xfail else "skipped"
    elif report.when == "call":
        if xfail:
            _outcomes[nid] = "xpassed" if report.passed else "xfailed"
        else:
            _outcomes[nid] = report.outcome
    elif report.when == "teardown" and report.failed:
        _outcomes[nid] = "error"


def pytest_collectreport(report):
    if report.failed:
        _collect_errors.append(report.nodeid or "<session>")


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("CADENZA_PROBE_OUT")
    if not path:
        return
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(
            {
                "tests": _outcomes,
                "repeats": _repeats,
                "collect_errors": _collect_errors,
                "exitstatus": int(exitstatus),
            },
            f,
        )
    os.replace(tmp, path)
