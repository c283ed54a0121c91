"""Strict mode (tests/strict.py) for real: a pytest run of a file that skips in every way a
test can, once without and once with VOLTAFORGE_STRICT=1, in a subprocess."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import strict
from tests.helpers import ROOT

SKIPPING = """
import pytest

@pytest.fixture
def unavailable():
    pytest.skip("a fixture that cannot set up")

@pytest.mark.skipif(True, reason="a skipif mark")
def test_skipif_mark():
    pass

def test_skip_in_body():
    pytest.skip("a skip in the body")

def test_skip_in_fixture(unavailable):
    pass

def test_importorskip():
    pytest.importorskip("voltaforge_no_such_module")

@pytest.mark.xfail(reason="an expected failure is not a skip", strict=True)
def test_xfail():
    assert False

def test_passes():
    pass
"""

MODULE_SKIP = """
import pytest
pytest.skip("a module-level skip", allow_module_level=True)

def test_never_runs():
    pass
"""


def _pytest(path: Path, strict_flag: str | None):
    env = {k: v for k, v in os.environ.items() if k not in ("CI", strict.STRICT_ENV, "PYTEST_ADDOPTS")}
    if strict_flag is not None:
        env[strict.STRICT_ENV] = strict_flag
    env["PYTHONPATH"] = str(ROOT / "tests")
    # -p strict: the plugin module itself, without the suite's conftest (no test hosts needed)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-rA",
            "-p",
            "strict",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            str(path.parent),
            "-c",
            os.devnull,
            str(path),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=path.parent,
    )
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|xfailed|errors?)\b", r.stdout)}
    return r, counts


def test_without_strict_mode_skips_stay_skips(tmp_path):
    f = tmp_path / "test_skipping.py"
    f.write_text(SKIPPING)
    r, counts = _pytest(f, "0")
    assert r.returncode == 0, r.stdout
    assert counts == {"passed": 1, "skipped": 4, "xfailed": 1}, r.stdout


def test_strict_mode_turns_every_skip_into_a_failure_with_its_reason(tmp_path):
    f = tmp_path / "test_skipping.py"
    f.write_text(SKIPPING)
    r, counts = _pytest(f, "1")
    assert r.returncode == 1, r.stdout
    # skips in setup (mark, fixture) become errors, skips in the body failures; xfail stays
    assert counts == {"passed": 1, "failed": 2, "errors": 2, "xfailed": 1}, r.stdout
    for reason in (
        "a skipif mark",
        "a skip in the body",
        "a fixture that cannot set up",
        "could not import 'voltaforge_no_such_module'",
    ):
        assert re.search(rf"VOLTAFORGE_STRICT=1: a skip is a failure here .*{re.escape(reason)}", r.stdout), reason


def test_strict_mode_fails_a_module_level_skip(tmp_path):
    f = tmp_path / "test_module_skip.py"
    f.write_text(MODULE_SKIP)
    r, counts = _pytest(f, None)  # neither CI nor VOLTAFORGE_STRICT: a skip
    assert r.returncode == 5 and counts == {"skipped": 1}, r.stdout  # 5: no test ran
    r, counts = _pytest(f, "1")
    assert r.returncode != 0 and counts == {"error": 1}, r.stdout
    assert "a module-level skip" in r.stdout and "ERROR collecting" in r.stdout


@pytest.mark.parametrize(
    "environ,on",
    [
        ({}, False),
        ({"VOLTAFORGE_STRICT": "1"}, True),
        ({"VOLTAFORGE_STRICT": "0"}, False),
        ({"CI": "true"}, True),
        ({"CI": "true", "VOLTAFORGE_STRICT": "0"}, False),
        ({"CI": ""}, False),
    ],
)
def test_strict_mode_switch(environ, on):
    assert strict.strict_mode(environ) is on


def test_the_suite_runs_with_the_strict_hooks(pytestconfig):
    """tests/conftest.py puts the hooks in force for this very suite."""
    for hook in (
        pytestconfig.pluginmanager.hook.pytest_runtest_makereport,
        pytestconfig.pluginmanager.hook.pytest_make_collect_report,
    ):
        impls = [i.function for i in hook.get_hookimpls()]
        assert any(f.__module__ == "strict" for f in impls), impls


def test_ci_runs_the_suite_in_strict_mode():
    """.ci/run runs ci/test.sh, which exports the switch before the suite starts."""
    assert re.search(r"^exec bash ci/test\.sh$", (ROOT / ".ci" / "run").read_text(), re.M)
    test_sh = (ROOT / "ci" / "test.sh").read_text()
    export = re.search(r"^export VOLTAFORGE_STRICT=1$", test_sh, re.M)
    run = re.search(r"^exec \.venv/bin/invoke test$", test_sh, re.M)
    assert export and run and export.start() < run.start()
