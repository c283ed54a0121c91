"""tests/helpers.cpu_alone, the run-wide lock of the CPU-heavy tests: one holder at a time,
across processes (xdist workers) that share the run's id."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from tests.helpers import ROOT, cpu_alone

HOLDER = (
    "import sys, time; sys.path.insert(0, 'tests'); from helpers import cpu_alone\n"
    "with cpu_alone():\n    print('in', flush=True)\n"
)


def test_a_second_worker_waits_until_the_first_lets_go(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_TESTRUNUID", f"cpu-alone-{os.getpid()}")
    with cpu_alone():
        other = subprocess.Popen([sys.executable, "-c", HOLDER], cwd=ROOT, stdout=subprocess.PIPE, text=True)
        time.sleep(1.5)
        assert other.poll() is None  # still waiting: this process holds the lock
    assert other.communicate(timeout=30)[0] == "in\n" and other.returncode == 0


def test_another_run_does_not_wait(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_TESTRUNUID", f"cpu-alone-{os.getpid()}")
    with cpu_alone():
        env = {**os.environ, "PYTEST_XDIST_TESTRUNUID": f"cpu-alone-other-{os.getpid()}"}
        cmd = [sys.executable, "-c", HOLDER]
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=30)
    assert done.stdout == "in\n"


def test_a_holder_takes_it_again_and_still_holds_it_after(monkeypatch):
    """Re-entrant in one process (a test holding it reaches the static build, which takes it
    too); the outer hold still keeps other processes out after the inner one ends."""
    monkeypatch.setenv("PYTEST_XDIST_TESTRUNUID", f"cpu-alone-{os.getpid()}")
    with cpu_alone():
        with cpu_alone():
            pass  # would wait forever on its own lock if it were not re-entrant
        other = subprocess.Popen([sys.executable, "-c", HOLDER], cwd=ROOT, stdout=subprocess.PIPE, text=True)
        time.sleep(1.5)
        assert other.poll() is None
    assert other.communicate(timeout=30)[0] == "in\n"
