"""tests/helpers.cpu_alone, the run-wide lock of the CPU-heavy tests: one holder at a time,
across processes (xdist workers) that share the run's id."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

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
    """Re-entrant in one process (a test holding it reaches the tools' build, which takes it
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
    """conftest's order: every module with a cpu_alone or cpu_quiet test before all others (worksteal gives
    the first worker the head of the collection, so the chain runs back to back on it), then
    the modules with slow (real) tests, then the quick ones; within a module, the file's order."""
    ids = _collected()
    modules = list(dict.fromkeys(i.split("::", 1)[0] for i in ids))
    holds = ('usefixtures("cpu_alone")', 'usefixtures("cpu_quiet")')
    chain = [m for m in modules if any(h in (ROOT / m).read_text() for h in holds) and m != "tests/test_cpu_alone.py"]
    real = {i.split("::", 1)[0] for i in _collected("-m", "slow")} - set(chain)
    assert "tests/test_build.py" in chain and "tests/test_bench_real.py" in chain and real
    assert modules[: len(chain)] == chain
    assert set(modules[len(chain) : len(chain) + len(real)]) == real
    # a module's tests stay together and in the file's order (its module fixtures once)
    assert [i for i in ids if i.startswith("tests/test_build.py::")][:2] == [
        "tests/test_build.py::test_cuda_build_for_sm70_in_one_toolkit_only",
        "tests/test_build.py::test_arch_comes_from_the_hosts_gpus",
    ]
    assert len(modules) == len({i.split("::", 1)[0] for i in ids})  # no module split in two


def _in_process(program: str, run: str) -> subprocess.Popen:
    """``program`` in a process of its own, a worker of the run ``run``, helpers imported."""
    code = "import sys, time; from pathlib import Path; sys.path.insert(0, 'tests'); import helpers\n" + program
    env = {**os.environ, "PYTEST_XDIST_TESTRUNUID": run}
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)


def _said(p: subprocess.Popen) -> str:
    assert p.stdout is not None
    return p.stdout.readline().strip()


def _blocked(p: subprocess.Popen) -> None:
    """Until ``p`` waits on a lock (a ``->`` line of /proc/locks with its pid): not a sleep that
    a slow start could outlast."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for line in Path("/proc/locks").read_text().splitlines():
            fields = line.split()
            if len(fields) > 5 and fields[1] == "->" and fields[5] == str(p.pid):
                return
        assert p.poll() is None, "it ended instead of waiting"
        time.sleep(0.05)
    raise AssertionError(f"pid {p.pid} never waited on a lock")


def _holds(kind: str, seconds: float) -> str:
    return f"with helpers.{kind}():\n    print('in', flush=True); time.sleep({seconds})\n"


@pytest.mark.timeout(60)  # a lock that waits on itself hangs: fail instead
def test_a_measurement_waits_for_the_running_test_and_stops_the_next():
    """cpu_quiet against sharing_the_cpu, in three processes as two workers run them: the
    measurement waits while a test shares the CPU; once it waits, the next test waits behind it
    (the gate), and goes on only when the measurement ends."""
    run = f"cpu-quiet-{os.getpid()}"
    go = Path(tempfile.mkdtemp()) / "go"
    running = _in_process(
        "with helpers.sharing_the_cpu():\n"
        "    print('in', flush=True)\n"
        f"    while not Path({str(go)!r}).exists(): time.sleep(0.05)\n",
        run,
    )
    assert _said(running) == "in"
    quiet = _in_process(_holds("cpu_quiet", 2) + "print('out', flush=True)\n", run)
    _blocked(quiet)
    nxt = _in_process(_holds("sharing_the_cpu", 0), run)
    _blocked(nxt)
    go.touch()  # the running test ends
    assert quiet.poll() is None and nxt.poll() is None  # both wait for the running test
    assert _said(quiet) == "in"  # the running test ended: the measurement, not the next test
    assert nxt.poll() is None
    assert _said(quiet) == "out" and _said(nxt) == "in"
    assert running.wait(30) == quiet.wait(30) == nxt.wait(30) == 0


@pytest.mark.timeout(60)  # a lock that waits on itself hangs: fail instead
def test_a_sharing_test_that_needs_the_lock_lets_its_share_go():
    """A test sharing the CPU that reaches cpu_alone (the tools' build) lets its share go
    while it waits: the measurement holding cpu_alone and waiting for that share would
    otherwise wait forever, and so would the test."""
    run = f"cpu-quiet-{os.getpid()}"
    go = Path(tempfile.mkdtemp()) / "go"
    sharing = _in_process(
        "with helpers.sharing_the_cpu():\n"
        "    print('shared', flush=True)\n"
        f"    while not Path({str(go)!r}).exists(): time.sleep(0.05)\n"
        "    with helpers.cpu_alone():\n"
        "        print('in', flush=True)\n",
        run,
    )
    assert _said(sharing) == "shared"
    quiet = _in_process(_holds("cpu_quiet", 1), run)
    _blocked(quiet)  # it holds cpu_alone and waits for the share
    go.touch()  # now the sharing test waits for cpu_alone, and lets its share go meanwhile
    assert _said(quiet) == "in" and quiet.wait(30) == 0
    assert _said(sharing) == "in" and sharing.wait(30) == 0


PROBE = """
import time
from pathlib import Path

import pytest


@pytest.fixture(scope="{scope}")
def made():
    print("setting up", flush=True)  # a model made, a container booted: the cores, for a while
    while not Path({go!r}).exists():
        time.sleep(0.05)
    return 1


def test_uses_it(made):
    assert made == 1
"""


@pytest.mark.parametrize("scope", ["module", "session"])
@pytest.mark.timeout(120)  # a lock that waits on itself hangs: fail instead
def test_a_wider_fixture_is_set_up_under_the_share(tmp_path, scope):
    """conftest.pytest_fixture_setup, in a real pytest run with the suite's conftest: a module's
    or the session's fixture is set up before any function-scoped one (the autouse share
    included), and a measurement waits for it all the same (cold run 86: without it, a worker's
    module fixtures ran beside the bench's unchanged runs)."""
    run = f"cpu-quiet-{os.getpid()}"
    go = tmp_path / "go"
    (tmp_path / "test_probe.py").write_text(PROBE.format(scope=scope, go=str(go)))
    env = {**os.environ, "PYTEST_XDIST_TESTRUNUID": run, "PYTHONPATH": str(ROOT / "tests")}
    cmd = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-p", "conftest"]
    cmd += ["--rootdir", str(tmp_path), "-c", os.devnull, str(tmp_path / "test_probe.py")]
    probe = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        seen = [_said(probe)]
        while seen[-1] != "setting up" and len(seen) < 20:  # pytest's own lines first, if any
            seen.append(_said(probe))
        assert seen[-1] == "setting up", seen
        quiet = _in_process(_holds("cpu_quiet", 0), run)
        _blocked(quiet)  # the measurement waits while the fixture is set up
        go.touch()
        assert _said(quiet) == "in" and quiet.wait(30) == 0
        out = probe.communicate(timeout=60)[0]
        assert probe.returncode == 0, out
    finally:
        go.touch()
        probe.kill()
