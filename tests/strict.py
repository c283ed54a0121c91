"""Strict mode: in CI a skipped test is a failed test.

One switch, ``VOLTAFORGE_STRICT``: ``1`` (ci/test.sh exports it, and .ci/run runs ci/test.sh)
turns every skip of the suite into a failure that names the skip's reason -- ``skipif`` marks,
``pytest.skip()`` in a test or fixture, module-level skips and ``importorskip`` alike, so a
skip added later is covered too. ``0`` turns it off. When it is unset, a ``CI`` variable set
by a runner switches it on.

Why: a test that cannot run on the machine at hand (no root, a toolkit missing, a wheel not
reachable) reports itself as skipped, which a green CI run would otherwise hide; the proof the
test stands for then silently never ran. xfail is not a skip and is left alone.

The hooks below are imported into tests/conftest.py; `python -m pytest -p strict` (with
tests/ on PYTHONPATH) loads them as a plugin on their own (tests/test_strict.py does).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import pytest

STRICT_ENV = "VOLTAFORGE_STRICT"


def strict_mode(environ: Mapping[str, str] = os.environ) -> bool:
    """True when skips must fail: VOLTAFORGE_STRICT, else CI, is set to something true."""
    flag = environ.get(STRICT_ENV)
    if flag is None:
        flag = environ.get("CI", "")
    return flag.strip().lower() not in ("", "0", "false", "no", "off")


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # (path, lineno, "Skipped: why")
        path, lineno, message = longrepr
        return f"{path}:{lineno}: {message.removeprefix('Skipped: ')}"  # lineno is 1-based
    return str(longrepr)


def _fail_if_skipped(report) -> None:
    if report.skipped and not hasattr(report, "wasxfail") and strict_mode():
        report.outcome = "failed"
        report.longrepr = f"{STRICT_ENV}=1: a skip is a failure here (the test did not run): {_skip_reason(report)}"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Skips in setup (skipif marks, fixtures) and in the test body."""
    report = yield
    _fail_if_skipped(report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    """Module-level skips (`pytest.skip(allow_module_level=True)`, a failed importorskip)."""
    report = yield
    _fail_if_skipped(report)
    return report
