"""Shared pytest fixtures and hooks for voltaforge's tests.

Real SSH test hosts (private sshd, sshd in a network namespace, Debian 12 booted with
systemd-nspawn) live in tests/testhosts.py; importing them here registers them as fixtures.
Strict mode (VOLTAFORGE_STRICT=1, set by ci/test.sh: every skip is a failure) lives in
tests/strict.py; importing its hooks here puts them in force for the whole suite.
"""

import os
import secrets
from pathlib import Path

import pytest

from helpers import cpu_alone as _cpu_alone
from helpers import cpu_quiet as _cpu_quiet
from helpers import sharing_the_cpu
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
    """The run-wide lock of the tests that keep the CPU busy (helpers.cpu_alone)."""
    with _cpu_alone():
        yield


@pytest.fixture
def cpu_quiet():
    """cpu_alone, with the other worker stopped between two tests: for a measurement
    (helpers.cpu_quiet)."""
    with _cpu_quiet():
        yield


@pytest.fixture
def api_secret():
    """A key in /etc/voltaforge/secrets/ (a local host, or one that shares this machine's
    filesystem), root's, 0600, as an operator leaves it; removed afterwards: (ref, key, path)."""
    ref = f"vf-test-{os.getpid()}"
    path = Path("/etc/voltaforge/secrets") / ref
    path.parent.mkdir(parents=True, exist_ok=True)
    key = secrets.token_urlsafe(24)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.write(fd, (key + "\n").encode())
    os.close(fd)
    yield ref, key, path
    path.unlink(missing_ok=True)


HOLDERS = ("cpu_alone", "cpu_quiet")


@pytest.fixture(autouse=True)
def _shares_the_cpu(request):
    """Every other test holds the run's quiet lock shared while it runs (helpers.sharing_the_cpu):
    autouse fixtures come first among the function-scoped ones, so it covers those too (the
    wider-scoped are set up before it: :func:`pytest_fixture_setup`)."""
    if any(name in request.fixturenames for name in HOLDERS):
        yield
        return
    with sharing_the_cpu():
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    """A module's or the session's fixture is set up under the shared hold too: pytest sets up
    wider-scoped fixtures before every function-scoped one, autouse or not, so a model made by
    a module fixture (convert and quantize: both cores for seconds), a container booted or
    servers forked used to run outside :func:`_shares_the_cpu`, beside the other worker's
    measurement (cold run 86: the bench's unchanged runs fell from 168 to 83 tok/s within 15 s,
    a noise of 26.7% at which no change shows). Their teardown is not covered: pytest has no
    hook around a finalizer, and what they tear down (a server stopped, a directory removed)
    is brief."""
    if fixturedef.scope == "function":
        yield
        return
    with sharing_the_cpu():
        yield


# -- the order of a run (docs/tests.md, "What the suite costs") --------------------------------
#
# The tests that hold cpu_alone (or cpu_quiet) run one after another whatever the order:
# together they are the run's critical path, the chain. Where they sat among the others (by
# file name), the worker that reached one while the other held the lock waited idle, for
# minutes (a setup of 889 s seen). So their modules go first: xdist's worksteal hands the
# first worker the first half of the collection and the second the rest, so one worker walks
# the chain while the other runs the rest, and steals from the first's tail (never from its
# head, where the chain is). The other real (slow) modules come next, before the quick ones:
# they need the tools the chain builds first, and reach them once they exist.

CHAIN, REAL, QUICK = 0, 1, 2


def _module(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    group: dict[str, int] = {}
    for item in items:
        holds = any(name in item.fixturenames for name in HOLDERS)
        rank = CHAIN if holds else REAL if item.get_closest_marker("slow") else QUICK
        mod = _module(item)
        group[mod] = min(group.get(mod, QUICK), rank)
    # a stable sort: within a module the file's own order, so its module fixtures are set up once
    items.sort(key=lambda item: group[_module(item)])
