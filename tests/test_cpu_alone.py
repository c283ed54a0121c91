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


def _collected(*args: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args, "tests"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    ids = [ln for ln in done.stdout.splitlines() if "::" in ln]
    assert len(ids) > 100, done.stdout[-2000:] + done.stderr[-2000:]
    return ids


def test_the_chain_comes_first_then_the_real_modules():
    """conftest's order: every module with a cpu_alone test before all others (worksteal gives
    the first worker the head of the collection, so the chain runs back to back on it), then
    the modules with slow (real) tests, then the quick ones; within a module, the file's order."""
    ids = _collected()
    modules = list(dict.fromkeys(i.split("::", 1)[0] for i in ids))
    chain = [m for m in modules if "cpu_alone" in (ROOT / m).read_text() and m != "tests/test_cpu_alone.py"]
    real = {i.split("::", 1)[0] for i in _collected("-m", "slow")} - set(chain)
    assert "tests/test_build.py" in chain and "tests/test_bench_real.py" in chain and real
    assert modules[: len(chain)] == chain  # this module only names the lock: its tests are quick
    assert set(modules[len(chain) : len(chain) + len(real)]) == real
    # a module's tests stay together and in the file's order (its module fixtures once)
    assert [i for i in ids if i.startswith("tests/test_build.py::")][:2] == [
        "tests/test_build.py::test_cuda_build_for_sm70_in_one_toolkit_only",
        "tests/test_build.py::test_arch_comes_from_the_hosts_gpus",
    ]
    assert len(modules) == len({i.split("::", 1)[0] for i in ids})  # no module split in two


def test_a_quick_test_runs_behind_the_chain():
    """conftest's priority: outside the chain's modules a test runs at nice 10 (as root, who can
    go back to 0 for the chain), so a compile or a measurement in the chain gets the cores."""
    from tests.conftest import QUICK_NICE

    if os.geteuid() != 0:
        assert os.getpriority(os.PRIO_PROCESS, 0) >= 0  # left alone
        return
    assert os.getpriority(os.PRIO_PROCESS, 0) == QUICK_NICE
