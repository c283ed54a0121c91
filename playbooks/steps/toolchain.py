"""The pinned toolchain: CUDA 11.8 and a project venv with torch pinned (`invoke toolchain`).

Each piece is an Operation (playbooks/host/ops.py): it reads the host, decides, and returns the
commands that close the gap, so a second run changes nothing and --dry-run shows the apt
and pip lines without running them.

CUDA 11.8 is the newest toolkit that still targets sm_70 and has torch wheels (+cu118, torch
2.7.1 the last). Debian 12 ships it as `nvidia-cuda-toolkit` in non-free; Ubuntu 20.04/22.04
get `cuda-toolkit-11-8` from NVIDIA's repository.
"""

from __future__ import annotations

import json
import shlex
from typing import Optional

from playbooks.errors import HostError, VoltaforgeError
from playbooks.facts import read_fact, cuda, system
from playbooks.host.ops import EnsureDirectory, EnsureFile, Operation, host_lock, render_report, run_ops
from playbooks.config.recipe import Toolchain

NONFREE_SOURCES = "/etc/apt/sources.list.d/voltaforge-nonfree.sources"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
NVIDIA_REPO = "https://developer.download.nvidia.com/compute/cuda/repos/{distro}/x86_64/cuda-keyring_1.1-1_all.deb"
APT_ENV = "DEBIAN_FRONTEND=noninteractive"



def nonfree_sources(mirror: str = DEBIAN_MIRROR) -> str:
    return (
        "# Added by voltaforge: CUDA 11.8 (nvidia-cuda-toolkit) is in Debian's non-free component.\n"
        "Types: deb\n"
        f"URIs: {mirror}\n"
        "Suites: bookworm bookworm-updates\n"
        "Components: contrib non-free\n"
        "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n"
    )


class EnsureCudaToolkit(Operation):
    """Ensure the pinned CUDA toolkit is installed (from the distribution's packages)."""

    sudo = True

    def __init__(self, release: str):
        self.release = tuple(int(x) for x in release.split("."))
        self.name = f"Ensure CUDA {release} toolkit is installed"
        self._added_sources = False

    def check(self, host) -> list[str]:
        toolkits = cuda.parse_toolkits(read_fact(host, cuda.TOOLKITS_COMMAND))
        have = [t for t in toolkits if t.kind == "nvcc" and t.release == self.release]
        if have:
            self.reason = f"CUDA {self.release[0]}.{self.release[1]} already at {have[0].path}"
            return []
        os = system.parse_os_release(read_fact(host, system.OS_RELEASE_COMMAND))
        rel = f"{self.release[0]}.{self.release[1]}"
        if os.id == "debian" and os.version_id == "12" and self.release == (11, 8):
            cmds = []
            enabled = read_fact(host, "grep -rlsE '(^Components:.*|^deb .*)non-free' /etc/apt/sources.list /etc/apt/sources.list.d/ || true").strip()
            if not enabled:
                mirror = read_fact(host, "sed -n 's/^URIs: *//p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -n1").strip()
                if not mirror.startswith(("http://", "https://")) or any(c in mirror for c in " '\"$`\\;"):
                    mirror = DEBIAN_MIRROR
                cmds.append(f"printf %s {shlex.quote(nonfree_sources(mirror))} > {NONFREE_SOURCES}")
            cmds += ["apt-get update -qq", f"{APT_ENV} apt-get install -y -qq --no-install-recommends nvidia-cuda-toolkit"]
            self.reason = f"CUDA {rel} missing; Debian 12 non-free {'enabled' if enabled else 'to be enabled'}"
            return cmds
        if os.id == "ubuntu" and os.version_id in ("20.04", "22.04"):
            distro = "ubuntu" + os.version_id.replace(".", "")
            url = NVIDIA_REPO.format(distro=distro)
            self.reason = f"CUDA {rel} missing; NVIDIA's {distro} repository provides cuda-toolkit-{self.release[0]}-{self.release[1]}"
            return [
                f"curl -fsSL -o /tmp/cuda-keyring.deb {shlex.quote(url)}",
                "dpkg -i /tmp/cuda-keyring.deb",
                "apt-get update -qq",
                f"{APT_ENV} apt-get install -y -qq cuda-toolkit-{self.release[0]}-{self.release[1]}",
            ]
        raise HostError(
            f"{host.name}: no automatic install of CUDA {rel} for {os.pretty_name or 'this OS'}; "
            "supported: Debian 12 (11.8) and Ubuntu 20.04/22.04 - install it by hand, then re-run"
        )

    def apply(self, host, commands: list[str]) -> None:
        added = any(NONFREE_SOURCES in c for c in commands)
        try:
            for cmd in commands:
                host.sudo(cmd)
        except HostError as exc:
            if added:
                # leave the host as it was: drop the sources entry we added, refresh the index
                host.sudo(f"rm -f {NONFREE_SOURCES} && apt-get update -qq", check=False, stream=False)
            text = str(exc)
            if "Unable to locate package" in text or "has no installation candidate" in text:
                raise HostError(
                    f"{host.name}: apt has no nvidia-cuda-toolkit: the non-free component is missing or its "
                    "mirror is unreachable (check /etc/apt/sources.list.d and network access to the mirror)"
                ) from None
            raise


class EnsureVenv(Operation):
    """Ensure the project venv exists (stdlib venv, the host's python3)."""

    def __init__(self, venv: str):
        self.venv = venv
        self.name = f"Ensure the venv {venv} exists"

    def check(self, host) -> list[str]:
        if host.exists(f"{self.venv}/bin/python"):
            self.reason = "venv already exists"
            return []
        self.reason = "venv is missing"
        return [f"python3 -m venv {shlex.quote(self.venv)}"]


def torch_install_command(venv: str, tc: Toolchain) -> str:
    args = [f"{venv}/bin/pip", "install", "--disable-pip-version-check", "-q"]
    if tc.torch_index:
        args += ["--index-url", tc.torch_index]
    if tc.torch_find_links:
        args += ["--find-links", tc.torch_find_links]
    args.append(f"torch=={tc.torch}")
    return " ".join(shlex.quote(a) for a in args)


TORCH_VERSION_CMD = "{venv}/bin/python -c 'import importlib.metadata as m; print(m.version(\"torch\"))' 2>/dev/null || true"


class EnsureTorch(Operation):
    """Ensure the venv holds exactly the pinned torch build."""

    def __init__(self, venv: str, tc: Toolchain):
        self.venv, self.tc = venv, tc
        self.name = f"Ensure torch {tc.torch} is installed in the venv"

    def check(self, host) -> list[str]:
        installed = read_fact(host, TORCH_VERSION_CMD.format(venv=shlex.quote(self.venv))).strip()
        if installed == self.tc.torch:
            self.reason = f"torch {installed} already installed"
            return []
        self.reason = f"torch is {installed or 'not installed'}, want {self.tc.torch}"
        return [torch_install_command(self.venv, self.tc)]


class EnsureToolchainLock(Operation):
    """Ensure <prefix>/toolchain.lock records what the toolchain resolved to."""

    def __init__(self, prefix: str, venv: str, tc: Toolchain):
        self.path, self.venv, self.tc = f"{prefix}/toolchain.lock", venv, tc
        self.name = f"Ensure {self.path} records the toolchain"

    def content(self, host) -> bytes:
        toolkits = cuda.parse_toolkits(read_fact(host, cuda.TOOLKITS_COMMAND))
        rel = tuple(int(x) for x in self.tc.cuda.split("."))
        nvcc = next((t for t in toolkits if t.kind == "nvcc" and t.release == rel), None)
        torch = read_fact(host, TORCH_VERSION_CMD.format(venv=shlex.quote(self.venv))).strip()
        lock = {
            "cuda": {"release": self.tc.cuda, "nvcc": nvcc.path if nvcc else None, "version": nvcc.version if nvcc else None},
            "torch": {"version": torch or None, "index": self.tc.torch_index, "find_links": self.tc.torch_find_links},
            "venv": self.venv,
        }
        return (json.dumps(lock, indent=2, sort_keys=True) + "\n").encode()

    def check(self, host) -> list[str]:
        # the content depends on what the host resolved to; comparing and writing is EnsureFile's job
        self._file = EnsureFile(self.path, self.content(host), 0o644)
        cmds = self._file.check(host)
        self.reason = self._file.reason
        return cmds

    def apply(self, host, commands: list[str]) -> None:
        self._file.apply(host, commands)


def toolchain_ops(prefix: str, tc: Toolchain, owner: Optional[str], needs_cuda: bool, prefix_sudo: bool) -> list[Operation]:
    venv = f"{prefix}/venv"
    ops: list[Operation] = [EnsureDirectory(prefix, 0o755, owner=owner if prefix_sudo else None, sudo=prefix_sudo)]
    if needs_cuda:
        ops.append(EnsureCudaToolkit(tc.cuda))
    ops += [EnsureVenv(venv), EnsureTorch(venv, tc), EnsureToolchainLock(prefix, venv, tc)]
    return ops


def run_toolchain(host_name: str, recipe: Optional[str] = None, dry_run: bool = False,
                  inventory: str = "inventory.yaml") -> int:
    from playbooks.plan.gpus import get_gpu
    from playbooks.host.hosts import connect
    from playbooks.config.inventory import resolve_host
    from playbooks.config.recipe import load_recipe

    spec = resolve_host(host_name, inventory)
    name = recipe or spec.recipe
    if not name:
        raise VoltaforgeError(f"{host_name}: no recipe: pass --recipe or set one in inventory.yaml")
    loaded = load_recipe(name)
    tc = loaded.recipe.toolchain
    needs_cuda = not get_gpu(loaded.recipe.gpu).is_cpu
    with connect(spec) as host:
        # a prefix under a directory the user cannot write (e.g. /opt) is created with sudo
        parent = spec.prefix.rsplit("/", 1)[0] or "/"
        prefix_sudo = host.run(f"test -w {shlex.quote(spec.prefix)} || test -w {shlex.quote(parent)}", check=False, stream=False).exited != 0
        ops = toolchain_ops(spec.prefix, tc, host.user, needs_cuda, prefix_sudo)
        if dry_run:
            changes = run_ops(host, ops, dry_run=True)
        else:
            with host_lock(host, spec.prefix, sudo=prefix_sudo):
                changes = run_ops(host, ops)
    render_report(changes)
    return 1 if any(c.status == "failed" for c in changes) else 0
