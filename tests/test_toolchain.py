"""The toolchain step for real: over SSH to a private sshd (this machine has Debian's CUDA
11.8, so the CUDA step is a no-op there) and to a booted Debian 12 container (no CUDA, no
network: dry-run shows the apt lines; a real run fails cleanly and leaves apt as it was).

The +cu118 torch pin stays the default; the venv mechanism is tested with the CPU torch
(a recipe override), fetched once into the test cache by llamacpp_tools.cpu_torch_wheel():
no PyTorch index is needed where pip's configuration serves it, and when no source has it the
test fails, it does not skip."""

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from playbooks.cli.toolchain import run_toolchain
from playbooks.config.inventory import resolve_host
from playbooks.config.recipe import load_recipe
from playbooks.host import connect
from playbooks.host.ops import run_ops
from playbooks.steps.build.toolchain import NONFREE_SOURCES, EnsureCudaToolkit, toolchain_ops
from tests.helpers import fixture_body, inventory_for, recipe_with, spec_for
from tests.llamacpp_tools import TORCH_CPU, cpu_torch_wheel

pytestmark = pytest.mark.slow


@pytest.fixture
def cpu_torch_recipe(tmp_path):
    """A recipe whose torch pin is the CPU wheel, served from a find-links directory that
    the test host's unprivileged user can read (the cache under /root is not readable)."""
    wheel = cpu_torch_wheel()
    links = Path(tempfile.mkdtemp(prefix="vf-torch-links-", dir="/tmp"))
    os.chmod(links, 0o755)
    try:
        os.link(wheel, links / wheel.name)
    except OSError:  # another filesystem
        shutil.copyfile(wheel, links / wheel.name)
    os.chmod(links / wheel.name, 0o644)
    override = f"""
toolchain:
  torch: "{TORCH_CPU}"
  torch_index: https://pypi.org/simple
  torch_find_links: {links}
"""
    yield recipe_with(tmp_path, "qwen2.5-14b-v100-16gb", override)
    shutil.rmtree(links, ignore_errors=True)


def _files(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_toolchain_dry_run_then_twice(sshd_host, tmp_path, cpu_torch_recipe, capsys):
    prefix = sshd_host.prefix / "vf"
    inv = inventory_for(tmp_path, "gpu-box", sshd_host, prefix=str(prefix))
    before = _files(sshd_host.prefix)
    # dry run: exact commands, nothing changes
    assert run_toolchain("gpu-box", str(cpu_torch_recipe), dry_run=True, inventory=str(inv)) == 0
    out = capsys.readouterr().out
    assert "would run: mkdir" in out and "python3 -m venv" in out and f"torch=={TORCH_CPU}" in out
    assert "CUDA 11.8 already at" in out
    assert _files(sshd_host.prefix) == before
    # first run: changes
    assert run_toolchain("gpu-box", str(cpu_torch_recipe), inventory=str(inv)) == 0
    out = capsys.readouterr().out
    assert "changed" in out
    lock = json.loads((prefix / "toolchain.lock").read_text())
    assert lock["torch"]["version"] == TORCH_CPU and lock["cuda"]["release"] == "11.8"
    assert lock["cuda"]["nvcc"] == "/usr/bin/nvcc"
    # second run: nothing to do, each step says why
    spec = resolve_host("gpu-box", inv)
    loaded = load_recipe(cpu_torch_recipe)
    with connect(spec) as host:
        changes = run_ops(host, toolchain_ops(spec.prefix, loaded.recipe.toolchain, host.user, True, False))
    assert [c.status for c in changes] == ["ok"] * 6, changes
    whys = " | ".join(c.why for c in changes)
    assert "already" in whys and f"torch {TORCH_CPU} already installed" in whys and "file is already up to date" in whys
    assert "all 5 installed" in whys  # the build tools: this machine has them


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


UBUNTU_2204_OS_RELEASE = """PRETTY_NAME="Ubuntu 22.04.4 LTS"
NAME="Ubuntu"
VERSION_ID="22.04"
VERSION="22.04.4 LTS (Jammy Jellyfish)"
VERSION_CODENAME=jammy
ID=ubuntu
ID_LIKE=debian
UBUNTU_CODENAME=jammy
"""


@pytest.fixture
def as_ubuntu(nspawn_host):
    """The container, answering as Ubuntu 22.04 (its /etc/os-release swapped; the overlay
    keeps the cached rootfs clean). No Ubuntu mirror is reachable here, so only the decision
    and the dry run are exercised, over real SSH."""
    nspawn_host.run_inside(
        "cp -P /etc/os-release /etc/os-release.vf-saved && rm /etc/os-release && "
        f"printf %s '{UBUNTU_2204_OS_RELEASE}' > /etc/os-release"
    )
    yield nspawn_host
    nspawn_host.run_inside("rm -f /etc/os-release && mv /etc/os-release.vf-saved /etc/os-release")


def test_cuda_install_dry_run_on_ubuntu_uses_nvidias_repository(as_ubuntu):
    with connect(spec_for(as_ubuntu)) as host:
        changes = run_ops(host, [EnsureCudaToolkit("11.8")], dry_run=True)
        assert not host.exists("/tmp/cuda-keyring.deb")
    c = changes[0]
    assert c.status == "changed" and "ubuntu2204" in c.why
    assert list(c.commands) == [
        "curl -fsSL -o /tmp/cuda-keyring.deb https://developer.download.nvidia.com/compute/cuda/repos/ubuntu2204/x86_64/cuda-keyring_1.1-1_all.deb",
        "dpkg -i /tmp/cuda-keyring.deb",
        "apt-get update -qq",
        "DEBIAN_FRONTEND=noninteractive apt-get install -y -qq cuda-toolkit-11-8",
    ]


def test_cuda_on_an_unsupported_os_is_refused_with_what_is_supported(as_ubuntu):
    as_ubuntu.run_inside("sed -i 's/^VERSION_ID=.*/VERSION_ID=\"24.04\"/' /etc/os-release")
    with connect(spec_for(as_ubuntu)) as host:
        changes = run_ops(host, [EnsureCudaToolkit("11.8")], dry_run=True)
    assert changes[0].status == "failed"
    assert "no automatic install of CUDA 11.8" in changes[0].why and "Ubuntu 20.04/22.04" in changes[0].why


# -- the distribution's build tools ---------------------------------------------------------


def _os(os_id: str, like: tuple[str, ...] = ()):
    from playbooks.facts.system import OsRelease

    return OsRelease(available=True, id=os_id, version_id="12", pretty_name=os_id, id_like=like)


def test_dpkg_status_is_read_from_real_output():
    from playbooks.facts import apt

    installed = apt.parse_installed(fixture_body("thishost-dpkg-query-status.txt"))
    assert {"build-essential", "cmake", "ccache", "python3-venv", "curl"} <= installed
    assert "nosuchpkg" not in installed
    assert apt.parse_installed("cmake not-installed\nccache config-files\nlibc6:amd64 installed\n") == {"libc6"}


def test_build_tools_installed_only_when_missing():
    from playbooks.host.ops import OperationError, Shell
    from playbooks.steps.build.toolchain import BUILD_PACKAGES, EnsureSystemPackages

    op = EnsureSystemPackages(BUILD_PACKAGES, "test")
    assert op.decide((set(BUILD_PACKAGES), _os("debian"))).commands == ()
    d = op.decide(({"build-essential", "curl"}, _os("ubuntu")))
    assert d.reason == "cmake, ccache, python3-venv missing"
    assert d.commands[-1] == Shell(
        "DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends cmake ccache python3-venv", True
    )
    assert op.decide((set(), _os("linuxmint", ("ubuntu", "debian")))).commands  # a derivative has apt too
    with pytest.raises(OperationError, match="has no apt"):
        op.decide((set(), _os("fedora")))
    with pytest.raises(ValueError, match="not a Debian package name"):
        EnsureSystemPackages(("cmake; rm -rf /",), "test")
