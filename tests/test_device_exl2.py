"""scripts/device_exl2.py's own logic that a lent GPU found wanting, run here for real: the venv
it makes on the device, and the status it gives a phase."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from tests.helpers import ROOT

spec = importlib.util.spec_from_file_location("device_exl2", ROOT / "scripts" / "device_exl2.py")
assert spec is not None and spec.loader is not None
device_exl2 = importlib.util.module_from_spec(spec)
sys.modules["device_exl2"] = device_exl2  # its dataclass looks its module up there
spec.loader.exec_module(device_exl2)

# a package this venv holds and its base interpreter does not (the suite runs in .venv)
PACKAGE = "gguf"


def _base_lacks_it() -> None:
    if sys.prefix == sys.base_prefix:
        pytest.fail("the suite runs in a venv (.venv): this test needs its interpreter to be a venv's")
    base = subprocess.run([f"{sys.base_prefix}/bin/python3", "-c", f"import {PACKAGE}"], capture_output=True)
    assert base.returncode != 0, f"the base interpreter imports {PACKAGE}: nothing to prove"


def test_a_venv_made_from_a_venvs_interpreter_sees_its_packages(tmp_path):
    """A lent H200's python3 is /opt/torch/.venv's: `--system-site-packages` alone gives the new
    venv /usr's site-packages, not that venv's, and torch was not found. make_venv names the
    interpreter's own site-packages too. Here the interpreter is this suite's venv's."""
    _base_lacks_it()
    plain = tmp_path / "plain"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(plain)], check=True)
    seen = subprocess.run([plain / "bin/python", "-c", f"import {PACKAGE}"], capture_output=True, text=True)
    assert seen.returncode != 0 and "ModuleNotFoundError" in seen.stderr  # the defect, as the H200 showed it
    made = tmp_path / "made"
    device_exl2.make_venv(made, see_interpreter=True)
    seen = subprocess.run(
        [made / "bin/python", "-c", f"import {PACKAGE}; print({PACKAGE}.__file__)"], capture_output=True, text=True
    )
    assert seen.returncode == 0, seen.stderr
    assert seen.stdout.strip().startswith(sys.prefix)
    # what the venv installs itself comes first: its own site-packages precede the interpreter's
    order = subprocess.run(
        [made / "bin/python", "-c", "import sys; print('\\n'.join(sys.path))"], capture_output=True, text=True
    )
    paths = order.stdout.split()
    own = next(i for i, p in enumerate(paths) if p.startswith(str(made)) and p.endswith("site-packages"))
    theirs = next(i for i, p in enumerate(paths) if p.startswith(sys.prefix) and p.endswith("site-packages"))
    assert own < theirs


def test_the_rehearsals_venv_stays_clean():
    """The rehearsal's venv sees nothing but what the wheelhouse installs into it: it proves the
    wheelhouse complete."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        device_exl2.make_venv(Path(tmp) / "v", see_interpreter=False)
        seen = subprocess.run([f"{tmp}/v/bin/python", "-c", f"import {PACKAGE}"], capture_output=True)
    assert seen.returncode != 0


def test_a_phase_whose_result_says_it_failed_is_not_done(monkeypatch, tmp_path):
    """The H200's bench phase wrote "done" while its gate said the server was never deployed."""
    call = device_exl2.Call(tmp_path, tmp_path, tmp_path, rehearse=True)
    monkeypatch.setattr(device_exl2, "phase_bench", lambda c: {"error": "voltaforge-tabbyapi was never deployed"})
    got = device_exl2.one_phase("bench", call)
    assert got["status"] == "failed" and got["why"] == "voltaforge-tabbyapi was never deployed"
    monkeypatch.setattr(device_exl2, "phase_bench", lambda c: {"error": None, "levels": [1]})
    assert device_exl2.one_phase("bench", call)["status"] == "done"
