"""Shared pytest fixtures and hooks for voltaforge's tests.

Real SSH test hosts (private sshd, sshd in a network namespace, Debian 12 booted with
systemd-nspawn) live in tests/testhosts.py; importing them here registers them as fixtures.
Strict mode (VOLTAFORGE_STRICT=1, set by ci/test.sh: every skip is a failure) lives in
tests/strict.py; importing its hooks here puts them in force for the whole suite.
"""

import os

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


# -- the order and the priority of a run (docs/tests.md, "Where the time goes") ---------------
#
# The tests that hold cpu_alone run one after another whatever the order: together they are
# the run's critical path. Where they sat among the others (by file name), the worker that
# reached one while the other held the lock waited idle, for minutes (a setup of 889 s seen).
# So their modules go first: xdist's worksteal hands the first worker the first half of the
# collection and the second the rest, so one worker walks the chain while the other runs the
# rest, and steals from the first's tail (never from its head, where the chain is). The other
# real (slow) modules come next, before the quick ones: they need the static tools the chain
# builds first, and reach them once they exist.

CHAIN, REAL, QUICK = 0, 1, 2
GROUPS = pytest.StashKey[dict[str, int]]()


def _module(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    group: dict[str, int] = {}
    for item in items:
        rank = CHAIN if "cpu_alone" in item.fixturenames else REAL if item.get_closest_marker("slow") else QUICK
        group[_module(item)] = min(group.get(_module(item), QUICK), rank)
    config.stash[GROUPS] = group
    # a stable sort: within a module the file's own order, so its module fixtures are set up once
    items.sort(key=lambda item: group[_module(item)])


# The chain's modules run at the normal priority and the rest at nice 10 (root can go back):
# when the chain compiles or measures, the other worker's tests get the CPU it leaves, so the
# chain is not slowed by them and a measurement (the bench's client clock against the
# server's) does not share the cores with a neighbour's load. Set before any fixture of the
# test (module-scoped ones included), so what it starts inherits the priority.
QUICK_NICE = 10


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if os.geteuid() != 0:  # only root lowers a nice value again: leave the priority alone
        return
    chain = item.config.stash.get(GROUPS, {}).get(_module(item)) == CHAIN
    os.setpriority(os.PRIO_PROCESS, 0, 0 if chain else QUICK_NICE)
