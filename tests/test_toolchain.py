"""The toolchain step for real: over SSH to a private sshd (this machine has Debian's CUDA
11.8, so the CUDA step is a no-op there) and to a booted Debian 12 container (no CUDA, no
network: dry-run shows the apt lines; a real run fails cleanly and leaves apt as it was).

PyTorch's index is not reachable here, so the venv mechanism is tested with the CPU torch
this machine serves from /opt/wheels (a recipe override); the +cu118 pin stays the default."""

import json
import os

import pytest

from playbooks.hosts import connect
from playbooks.inventory import resolve_host
from playbooks.ops import run_ops
from playbooks.recipe import load_recipe
from playbooks.toolchain import NONFREE_SOURCES, EnsureCudaToolkit, run_toolchain, toolchain_ops
from tests.helpers import inventory_for, recipe_with, spec_for

WHEELS = "/opt/wheels"
pytestmark = pytest.mark.slow

TORCH_OVERRIDE = f"""
toolchain:
  torch: "2.13.0+cpu"
  torch_index: https://pypi.org/simple
  torch_find_links: {WHEELS}
"""


@pytest.fixture
def cpu_torch_recipe(tmp_path):
    if not any(n.startswith("torch-2.13.0") for n in os.listdir(WHEELS) if os.path.isdir(WHEELS)):
        pytest.skip(f"needs the local torch 2.13.0 wheel in {WHEELS}")
    return recipe_with(tmp_path, "qwen2.5-14b-v100-16gb", TORCH_OVERRIDE)


def _files(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_toolchain_dry_run_then_twice(sshd_host, tmp_path, cpu_torch_recipe, capsys):
    prefix = sshd_host.prefix / "vf"
    inv = inventory_for(tmp_path, "gpu-box", sshd_host, prefix=str(prefix))
    before = _files(sshd_host.prefix)
    # dry run: exact commands, nothing changes
    assert run_toolchain("gpu-box", str(cpu_torch_recipe), dry_run=True, inventory=str(inv)) == 0
    out = capsys.readouterr().out
    assert "would run: mkdir" in out and "python3 -m venv" in out and "torch==2.13.0+cpu" in out
    assert "CUDA 11.8 already at" in out
    assert _files(sshd_host.prefix) == before
    # first run: changes
    assert run_toolchain("gpu-box", str(cpu_torch_recipe), inventory=str(inv)) == 0
    out = capsys.readouterr().out
    assert "changed" in out
    lock = json.loads((prefix / "toolchain.lock").read_text())
    assert lock["torch"]["version"] == "2.13.0+cpu" and lock["cuda"]["release"] == "11.8"
    assert lock["cuda"]["nvcc"] == "/usr/bin/nvcc"
    # second run: nothing to do, each step says why
    spec = resolve_host("gpu-box", inv)
    loaded = load_recipe(cpu_torch_recipe)
    with connect(spec) as host:
        changes = run_ops(host, toolchain_ops(spec.prefix, loaded.recipe.toolchain, host.user, True, False))
    assert [c.status for c in changes] == ["ok"] * 5, changes
    whys = " | ".join(c.why for c in changes)
    assert "already" in whys and "torch 2.13.0+cpu already installed" in whys and "lock file already up to date" in whys


def test_cuda_install_dry_run_on_a_debian_host_without_cuda(nspawn_host):
    spec = spec_for(nspawn_host)
    with connect(spec) as host:
        changes = run_ops(host, [EnsureCudaToolkit("11.8")], dry_run=True)
        assert not host.exists(NONFREE_SOURCES)
    c = changes[0]
    assert c.status == "changed" and c.why.startswith("dry run: would run 3 commands")
    assert NONFREE_SOURCES in c.commands[0] and "Components: contrib non-free" in c.commands[0]
    assert c.commands[1] == "apt-get update -qq"
    assert c.commands[2].endswith("apt-get install -y -qq --no-install-recommends nvidia-cuda-toolkit")


def test_cuda_install_without_the_package_fails_cleanly(nspawn_host):
    """The container has no network: apt cannot find nvidia-cuda-toolkit. One clear message,
    and the sources entry voltaforge added is removed again."""
    spec = spec_for(nspawn_host)
    with connect(spec) as host:
        sources_before = host.run("ls /etc/apt/sources.list.d/", stream=False).stdout
        changes = run_ops(host, [EnsureCudaToolkit("11.8")])
        sources_after = host.run("ls /etc/apt/sources.list.d/", stream=False).stdout
    c = changes[0]
    assert c.status == "failed"
    assert "apt has no nvidia-cuda-toolkit" in c.why and "non-free" in c.why
    assert sources_after == sources_before

