"""An index or source that cannot be reached is one line naming it and how to stage the file.

The classifier (playbooks/facts/unreachable.py) is tested on pip's and the hub probe's real
output (tests/fixtures/thishost-pip-*.txt, thishost-hub-fetch-*.txt, each with its command);
then each step for real on this machine: pip against an index that does not resolve (the
toolchain's torch install, build's sdist download) and the hub probe's answer in quantize.
"""

from __future__ import annotations

import json
import sys

import pytest

from playbooks.config.recipe import Toolchain
from playbooks.errors import HostError, VoltaforgeError
from playbooks.facts.artifacts import parse_hub_fetch
from playbooks.facts.unreachable import Unreachable, network_cause, pip_unreachable
from playbooks.host import LocalHost
from playbooks.host.ops import OperationError, run_ops
from playbooks.steps.build.llamacpp_source import fetch_sdist
from playbooks.steps.build.toolchain import EnsureTorch, index_named, run_pip
from playbooks.steps.weights.fetch import EnsureHubWeights
from playbooks.steps.weights.model_layout import ModelLayout
from playbooks.steps.weights.sources import HubWeights
from tests.helpers import FIXTURES, fixture_body

PIP = {
    "thishost-pip-torch-index-dns-pip23.0.1.txt": Unreachable("Name or service not known", ("/whl/cu118/torch/",)),
    "thishost-pip-torch-index-dns-pip23.2.1.txt": Unreachable("Name or service not known", ("/whl/cpu/torch/",)),
    "thishost-pip-torch-index-dns-resolution-impossible.txt": Unreachable(
        "Name or service not known", ("/whl/cpu/torch/",)
    ),
    "thishost-pip-index-refused.txt": Unreachable("Connection refused", ("/whl/cu118/torch/",)),
    "thishost-pip-proxy-refused.txt": Unreachable("proxy: Connection refused", ("/whl/cu118/torch/",)),
    "thishost-pip-index-tls-intercepted.txt": Unreachable("TLS failed (CertificateError)", ("/whl/cu118/torch/",)),
    "thishost-pip-sdist-index-dns.txt": Unreachable("Name or service not known", ("/simple/llama-cpp-python/",)),
    # the index answered: not a reachability problem, pip's own last line stands
    "thishost-pip-index-has-no-such-version.txt": None,
    "thishost-pip-pypi-no-such-version.txt": None,
}


def test_every_pip_fixture_is_classified():
    assert {p.name for p in FIXTURES.glob("thishost-pip-*.txt")} == set(PIP)


@pytest.mark.parametrize("name", sorted(PIP))
def test_pip_output_is_classified(name):
    assert pip_unreachable(fixture_body(name)) == PIP[name]


def test_a_failure_that_is_not_the_network_is_not_called_unreachable():
    # retries that recovered, then a build that failed: pip reached the index
    text = (
        fixture_body("thishost-pip-index-refused.txt").splitlines()[0]
        + "\nerror: subprocess-exited-with-error\n  × Building wheel for llama-cpp-python (pyproject.toml) did not run"
        " successfully.\n"
    )
    assert pip_unreachable(text) is None
    assert pip_unreachable("") is None


def test_index_named():
    gone = pip_unreachable(fixture_body("thishost-pip-torch-index-dns-pip23.0.1.txt"))
    assert gone is not None
    assert index_named(gone, "https://download.pytorch.org/whl/cu118") == (
        "PyTorch's index https://download.pytorch.org/whl/cu118"
    )
    assert index_named(gone, "https://download.pytorch.org/whl/cpu") == "the package index (/whl/cu118/torch/)"
    assert index_named(Unreachable("x", ()), None) == "the package index"


HUB = {
    "thishost-hub-fetch-unreachable-dns.txt": "Name or service not known",
    "thishost-hub-fetch-unreachable-refused.txt": "Connection refused",
    "thishost-hub-fetch-offline.txt": "offline mode is enabled (HF_HUB_OFFLINE)",
}


def test_every_hub_fixture_is_classified():
    assert {p.name for p in FIXTURES.glob("thishost-hub-fetch-*.txt")} == set(HUB)


@pytest.mark.parametrize("name", sorted(HUB))
def test_hub_unreachable_is_one_line_naming_model_path(name):
    result = parse_hub_fetch(fixture_body(name))
    assert result["error"] == "unreachable" and network_cause(result["message"]) == HUB[name]
    weights = HubWeights("Qwen/Qwen2.5-7B-Instruct", "a09a35458c702b33eeacc393d103063234e8bc28", None)
    op = EnsureHubWeights(ModelLayout("/opt/vf", "qwen"), weights, "/opt/vf/venv", 10**9)
    text = op._error(result)
    assert len(text.splitlines()) == 1 and len(text) < 500, text
    assert text.startswith(f"the host cannot reach huggingface.co ({HUB[name]}): give it access, or stage the weights")
    assert (
        "huggingface-cli download Qwen/Qwen2.5-7B-Instruct --revision a09a35458c702b33eeacc393d103063234e8bc28" in text
    )
    assert "set model.path to it instead of model.repo" in text


# ------------------------------------------------------------------------------------------
# the steps, for real
# ------------------------------------------------------------------------------------------


@pytest.fixture
def plain_pip(monkeypatch):
    """pip as on a plain host: none of this machine's pip configuration, one retry (not five)."""
    for name in [k for k in list(__import__("os").environ) if k.startswith("PIP_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_RETRIES", "1")  # with 0, pip prints nothing about the connection
    monkeypatch.setenv("PIP_DISABLE_PIP_VERSION_CHECK", "1")


def test_run_pip_names_the_index_and_the_staging(tmp_path):
    tc = Toolchain(torch="2.7.1+cu118", torch_index="https://download.pytorch.org/whl/cu118")
    fixture = FIXTURES / "thishost-pip-torch-index-dns-pip23.0.1.txt"
    # what pip printed, replayed by a command that fails like it
    replay = f"sed '1,/^# ---$/d' {fixture} >&2; exit 1"
    with pytest.raises(OperationError) as err:
        run_pip(LocalHost(), replay, tc)
    text = str(err.value)
    assert len(text.splitlines()) == 1
    assert text.startswith(
        "pip cannot reach PyTorch's index https://download.pytorch.org/whl/cu118 (Name or service not known): "
        "give the host access to it, or stage the wheels"
    )
    assert (
        "`pip download torch==2.7.1+cu118 --extra-index-url https://download.pytorch.org/whl/cu118 -d wheels`" in text
    )
    assert "set toolchain.torch_find_links to that directory and toolchain.torch_index to ''" in text
    # any other failure keeps the command's own error
    with pytest.raises(HostError) as other:
        run_pip(LocalHost(), "echo 'error: no space' >&2; exit 2", tc)
    assert not isinstance(other.value, OperationError) and "command failed (exit 2)" in str(other.value)


def test_torch_from_an_index_that_does_not_resolve_is_one_line(tmp_path, plain_pip):
    """The real failure: the venv's pip (this interpreter's, through a bin/pip wrapper) asked for
    torch on an index that never resolves (.invalid)."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "pip").write_text(f'#!/bin/sh\nexec {sys.executable} -m pip "$@"\n')
    (venv / "bin" / "pip").chmod(0o755)
    tc = Toolchain(torch="0.0.1+cu118", torch_index="https://download.pytorch.invalid/whl/cu118")
    op = EnsureTorch(str(venv), tc)
    host = LocalHost()
    (change,) = run_ops(host, [op])
    assert change.status == "failed" and len(change.why.splitlines()) == 1, change.why
    assert change.why.startswith("pip cannot reach PyTorch's index https://download.pytorch.invalid/whl/cu118 ("), (
        change.why
    )
    assert "toolchain.torch_find_links" in change.why and "Retrying" not in change.why


def test_sdist_from_an_index_that_does_not_resolve_is_one_line(tmp_path, plain_pip, monkeypatch):
    monkeypatch.setenv("PIP_INDEX_URL", "https://pypi.invalid/simple")
    with pytest.raises(VoltaforgeError) as err:
        fetch_sdist("llama-cpp-python==0.3.36", "0c1e570", cache=tmp_path)
    text = str(err.value)
    where = tmp_path / "llama-cpp-python-0.3.36"
    assert len(text.splitlines()) == 1, text
    assert text.startswith(
        "cannot reach the package index (/simple/llama-cpp-python/) for llama-cpp-python==0.3.36, the llama.cpp "
        "source (toolchain.llamacpp_sdist) ("
    ), text
    assert (
        f"`pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36` and copy the .tar.gz into {where}/"
        in (text)
    )


def test_hub_probe_output_is_one_json_line():
    for name in HUB:
        (line,) = fixture_body(name).strip().splitlines()
        assert json.loads(line)["probe"] == "voltaforge-hub-fetch"
