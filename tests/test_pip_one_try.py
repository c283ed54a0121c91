"""pip against an index it cannot reach, when a local wheel directory holds the pin (issue 22:
130 "Retrying ... NewConnectionError" lines on an offline quick start whose torch came from
the local directory all along). The toolchain's own install command, run for real by pip into
a fresh venv: the index is asked once and briefly, the pin comes from the directory. The
wheel is a generated package named torch (pip's behaviour is the subject, not torch's).
Measured here with pip's defaults (the same command without ONE_TRY): 5 "Retrying" lines and
8.0 s for the one refused index URL; with it, none."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from playbooks.config.recipe import Toolchain
from playbooks.facts.python import PIP_FIND_LINKS_COMMAND, parse_pip_find_links
from playbooks.steps.build.toolchain import ONE_TRY, torch_install_command
from tests.testhosts import free_port


def _wheel(where: Path, version: str) -> Path:
    """A minimal valid wheel of a package named torch (PEP 427: the module, METADATA, WHEEL, RECORD)."""
    where.mkdir(parents=True, exist_ok=True)
    dist = f"torch-{version}.dist-info"
    path = where / f"torch-{version}-py3-none-any.whl"
    files = {
        "torch/__init__.py": f"__version__ = {version!r}\n",
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: voltaforge-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
        z.writestr(f"{dist}/RECORD", "".join(f"{n},,\n" for n in [*files, f"{dist}/RECORD"]))
    return path


def test_a_local_wheel_directory_makes_the_index_a_single_short_try(tmp_path):
    _wheel(tmp_path / "wheels", "0.0.1")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    nothing = f"http://127.0.0.1:{free_port()}/simple"  # nothing listens: refused at once
    tc = Toolchain(torch="0.0.1", torch_index=nothing, torch_find_links=str(tmp_path / "wheels"))
    command = torch_install_command(str(venv), tc)
    assert " ".join(ONE_TRY) in command
    r = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    retried = [line for line in (r.stdout + r.stderr).splitlines() if "Retrying" in line]
    assert retried == [], retried  # pip's default: 5 retries per URL, each a warning line
    got = subprocess.run(
        [str(venv / "bin/python"), "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True
    )
    assert got.stdout.strip() == "0.0.1"


@pytest.mark.parametrize(
    ("output", "local"),
    [
        ("env /opt/wheels\n", True),  # this machine: PIP_FIND_LINKS=/opt/wheels
        ("env \nfind-links = /srv/wheels\n", True),  # a staged lab host's /etc/pip.conf
        ("env \n", False),
        ("env \nfind-links =\n", False),
    ],
)
def test_the_hosts_own_find_links_count_as_a_local_source(output, local):
    assert parse_pip_find_links(output) is local


def test_the_find_links_fact_reads_the_environment_and_pip_conf_for_real(tmp_path):
    conf = tmp_path / ".config" / "pip"
    conf.mkdir(parents=True)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}

    def run(**extra: str) -> str:
        command = ["bash", "-c", PIP_FIND_LINKS_COMMAND]
        return subprocess.run(command, capture_output=True, text=True, env={**env, **extra}).stdout

    assert not parse_pip_find_links(run())
    assert parse_pip_find_links(run(PIP_FIND_LINKS="/opt/wheels"))
    (conf / "pip.conf").write_text("[global]\nfind-links = /srv/wheels\n")
    assert parse_pip_find_links(run())
    assert not parse_pip_find_links(run(PIP_CONFIG_FILE="/dev/null"))  # pip then reads no file
