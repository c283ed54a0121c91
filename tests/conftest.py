"""Shared pytest fixtures and hooks for voltaforge's tests.

Real SSH test hosts (private sshd, sshd in a network namespace, Debian 12 booted with
systemd-nspawn) live in tests/testhosts.py; importing them here registers them as fixtures.
Strict mode (VOLTAFORGE_STRICT=1, set by ci/test.sh: every skip is a failure) lives in
tests/strict.py; importing its hooks here puts them in force for the whole suite.
"""

import pytest

from helpers import cpu_alone as _cpu_alone
from strict import pytest_make_collect_report, pytest_runtest_makereport  # noqa: F401  (hooks)
from testhosts import (  # noqa: F401  (imported to register the fixtures)
    make_sshd_host,
    netns_host,
    nspawn_host,
    provisionable_nspawn_host,
    sshd_host,
    testhost_user,
)


@pytest.fixture
def cpu_alone():
    """The run-wide lock of the tests that keep the CPU busy or measure it (helpers.cpu_alone)."""
    with _cpu_alone():
        yield
