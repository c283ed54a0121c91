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
import re
import shlex
from dataclasses import dataclass
from urllib.parse import urlparse

from playbooks.config.recipe import Toolchain
from playbooks.errors import HostError
from playbooks.facts import apt, cuda, files, python, read_fact, system
from playbooks.facts.unreachable import Unreachable, pip_unreachable
from playbooks.host.base import Host
from playbooks.host.ops import (
    Decision,
    EnsureDirectory,
    FileFacts,
    Operation,
    OperationError,
    Shell,
    Upload,
    decide_file,
    read_file_facts,
    run_command,
)

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


@dataclass(frozen=True)
class CudaFacts:
    toolkits: tuple[cuda.Toolkit, ...]
    os: system.OsRelease
    nonfree_sources: tuple[str, ...]  # files that enable Debian's non-free component
    debian_mirror: str | None


class EnsureCudaToolkit(Operation):
    """Ensure the pinned CUDA toolkit is installed (from the distribution's packages)."""

    def __init__(self, release: str):
        self.release = tuple(int(x) for x in release.split("."))
        self.name = f"Ensure CUDA {release} toolkit is installed"

    def read(self, host: Host) -> CudaFacts:
        return CudaFacts(
            toolkits=tuple(cuda.parse_toolkits(read_fact(host, cuda.TOOLKITS_COMMAND))),
            os=system.parse_os_release(read_fact(host, system.OS_RELEASE_COMMAND)),
            nonfree_sources=tuple(apt.parse_nonfree_enabled(read_fact(host, apt.NONFREE_ENABLED_COMMAND))),
            debian_mirror=apt.parse_debian_mirror(read_fact(host, apt.DEBIAN_MIRROR_COMMAND)),
        )

    def decide(self, facts: CudaFacts) -> Decision:
        have = [t for t in facts.toolkits if t.kind == "nvcc" and t.release == self.release]
        rel = f"{self.release[0]}.{self.release[1]}"
        if have:
            return Decision.ok(f"CUDA {rel} already at {have[0].path}")
        os = facts.os
        if os.id == "debian" and os.version_id == "12" and self.release == (11, 8):
            cmds: list[Shell] = []
            if not facts.nonfree_sources:
                content = nonfree_sources(facts.debian_mirror or DEBIAN_MIRROR)
                cmds.append(Shell(f"printf %s {shlex.quote(content)} > {NONFREE_SOURCES}", sudo=True))
            cmds += [
                Shell("apt-get update -qq", sudo=True),
                Shell(f"{APT_ENV} apt-get install -y -qq --no-install-recommends nvidia-cuda-toolkit", sudo=True),
            ]
            enabled = "enabled" if facts.nonfree_sources else "to be enabled"
            return Decision.act(f"CUDA {rel} missing; Debian 12 non-free {enabled}", *cmds)
        if os.id == "ubuntu" and os.version_id in ("20.04", "22.04"):
            distro = "ubuntu" + os.version_id.replace(".", "")
            url = NVIDIA_REPO.format(distro=distro)
            pkg = f"cuda-toolkit-{self.release[0]}-{self.release[1]}"
            return Decision.act(
                f"CUDA {rel} missing; NVIDIA's {distro} repository provides {pkg}",
                Shell(f"curl -fsSL -o /tmp/cuda-keyring.deb {shlex.quote(url)}", sudo=True),
                Shell("dpkg -i /tmp/cuda-keyring.deb", sudo=True),
                Shell("apt-get update -qq", sudo=True),
                Shell(f"{APT_ENV} apt-get install -y -qq {pkg}", sudo=True),
            )
        raise OperationError(
            f"no automatic install of CUDA {rel} for {os.pretty_name or 'this OS'}; "
            "supported: Debian 12 (11.8) and Ubuntu 20.04/22.04 - install it by hand, then re-run"
        )

    def apply(self, host: Host, decision: Decision) -> None:
        added = any(isinstance(c, Shell) and NONFREE_SOURCES in c.command for c in decision.commands)
        try:
            for cmd in decision.commands:
                run_command(host, cmd)
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


#: what building llama.cpp and its bindings, and the venv, need from the distribution: the
#: compilers and cmake for the build, ccache so a rebuild of the same tree takes seconds,
#: python3-venv for the toolchain venv (Debian splits it out), curl for the health checks
BUILD_PACKAGES = ("build-essential", "cmake", "ccache", "python3-venv", "curl")
_PACKAGE_NAME = re.compile(r"^[a-z0-9][a-z0-9+.-]+$")


class EnsureSystemPackages(Operation):
    """Debian/Ubuntu packages are installed (apt, with sudo), only those missing."""

    def __init__(self, packages: tuple[str, ...], why: str):
        bad = [p for p in packages if not _PACKAGE_NAME.match(p)]
        if bad:
            raise ValueError(f"not a Debian package name: {bad[0]!r}")
        self.packages, self.why = packages, why
        self.name = f"Ensure {', '.join(packages)} are installed ({why})"

    def read(self, host: Host) -> tuple[set[str], system.OsRelease]:
        installed = apt.parse_installed(read_fact(host, apt.installed_command(self.packages)))
        return installed, system.parse_os_release(read_fact(host, system.OS_RELEASE_COMMAND))

    def decide(self, facts: tuple[set[str], system.OsRelease]) -> Decision:
        installed, os = facts
        missing = [p for p in self.packages if p not in installed]
        if not missing:
            return Decision.ok(f"all {len(self.packages)} installed")
        if os.id not in ("debian", "ubuntu") and "debian" not in os.id_like:
            raise OperationError(
                f"{', '.join(missing)} missing and {os.pretty_name or 'this OS'} has no apt: "
                "install the equivalents by hand, then re-run"
            )
        return Decision.act(
            f"{', '.join(missing)} missing",
            Shell("apt-get update -qq", sudo=True),
            Shell(f"{APT_ENV} apt-get install -y -qq --no-install-recommends {' '.join(missing)}", sudo=True),
        )

    def apply(self, host: Host, decision: Decision) -> None:
        try:
            super().apply(host, decision)
        except HostError as exc:
            text = str(exc)
            if "Unable to locate package" in text or "Temporary failure resolving" in text or "Could not" in text:
                raise HostError(
                    f"{host.name}: apt could not install {', '.join(self.packages)}: its mirror cannot be reached "
                    "or lacks them; install them from a local mirror or by hand, then re-run"
                ) from None
            raise


class EnsureVenv(Operation):
    """Ensure the project venv exists (stdlib venv, the host's python3)."""

    def __init__(self, venv: str):
        self.venv = venv
        self.name = f"Ensure the venv {venv} exists"

    def read(self, host: Host) -> bool:
        return files.parse_stat(read_fact(host, files.stat_command(f"{self.venv}/bin/python"))) is not None

    def decide(self, facts: bool) -> Decision:
        if facts:
            return Decision.ok("venv already exists")
        return Decision.act("venv is missing", Shell(f"python3 -m venv {shlex.quote(self.venv)}"))


#: with a local wheel directory for the pin, an index is asked once, briefly: pip's default is
#: five retries with back-off, 130 "Retrying ... NewConnectionError" lines measured on an
#: offline host whose torch came from the local directory all along (issue 22)
ONE_TRY = ("--retries", "0", "--timeout", "10")


def _sources(tc: Toolchain, index_flag: str, local_wheels: bool = False) -> list[str]:
    """``local_wheels``: the host's pip has find-links of its own (PIP_FIND_LINKS, pip.conf)."""
    args = [index_flag, tc.torch_index] if tc.torch_index else []
    if tc.torch_find_links:
        args += ["--find-links", tc.torch_find_links]
    if tc.torch_find_links or local_wheels:
        args += ONE_TRY
    return args


def torch_install_command(venv: str, tc: Toolchain, local_wheels: bool = False) -> str:
    args = [f"{venv}/bin/pip", "install", "--disable-pip-version-check", "-q"]
    args += [*_sources(tc, "--index-url", local_wheels), f"torch=={tc.torch}"]
    return " ".join(shlex.quote(a) for a in args)


def pip_install_keeping_torch(venv: str, tc: Toolchain, *requirements: str, local_wheels: bool = False) -> str:
    """A pip install into the venv that cannot move the pinned torch: torch is named with its
    exact pin (so the resolver keeps the installed one), its index reachable only as extra."""
    args = [f"{venv}/bin/pip", "install", "--disable-pip-version-check", *requirements, f"torch=={tc.torch}"]
    return " ".join(shlex.quote(a) for a in args + _sources(tc, "--extra-index-url", local_wheels))


@dataclass(frozen=True)
class TorchFacts:
    version: str | None  # torch in the venv
    local_wheels: bool = False  # the host's pip has find-links of its own


def read_local_wheels(host: Host) -> bool:
    return python.parse_pip_find_links(read_fact(host, python.PIP_FIND_LINKS_COMMAND))


def index_named(gone: Unreachable, index: str | None) -> str:
    """Which index pip could not reach, from what it named: PyTorch's (its URL's path, e.g.
    /whl/cu118/torch/) or the package index the host's pip uses for the rest."""
    if index:
        url = urlparse(index)
        path = url.path.rstrip("/") + "/"
        if any(w.startswith((path, index.rstrip("/") + "/")) or w == url.hostname for w in gone.where):
            return f"PyTorch's index {index}"
    named = f" ({gone.where[0]})" if gone.where else ""
    return f"the package index{named}"


def stage_hint(tc: Toolchain, *requirements: str) -> str:
    """How to install without the index: the wheels downloaded elsewhere, into torch_find_links
    (every pip install of the toolchain looks there)."""
    wanted = " ".join(shlex.quote(r) for r in (*requirements, f"torch=={tc.torch}"))
    index = f" --extra-index-url {tc.torch_index}" if tc.torch_index else ""
    return (
        f"give the host access to it, or stage the wheels: on a machine with access and the host's Python, run "
        f"`pip download {wanted}{index} -d wheels`, copy wheels/ to the host and set "
        "toolchain.torch_find_links to that directory and toolchain.torch_index to ''"
    )


def run_pip(host: Host, command: str, tc: Toolchain, *requirements: str) -> None:
    """Run a pip install of the toolchain (``requirements`` beside the pinned torch) on the
    host. When it failed because an index could not be reached (pip retries five times, then
    says "No matching distribution found"), the error is one line naming the index and how to
    stage the wheels instead."""
    result = host.run(command, check=False)
    if result.ok:
        return
    gone = pip_unreachable(result.stderr)
    if gone is None:
        raise host.failure(command, result)
    raise OperationError(
        f"pip cannot reach {index_named(gone, tc.torch_index)} ({gone.cause}): {stage_hint(tc, *requirements)}"
    )


class EnsureTorch(Operation):
    """Ensure the venv holds exactly the pinned torch build."""

    def __init__(self, venv: str, tc: Toolchain):
        self.venv, self.tc = venv, tc
        self.name = f"Ensure torch {tc.torch} is installed in the venv"

    def read(self, host: Host) -> TorchFacts:
        version = python.read_package_version(host, self.venv, "torch")
        return TorchFacts(version, read_local_wheels(host))

    def decide(self, facts: TorchFacts) -> Decision:
        if facts.version == self.tc.torch:
            return Decision.ok(f"torch {facts.version} already installed")
        return Decision.act(
            f"torch is {facts.version or 'not installed'}, want {self.tc.torch}",
            Shell(torch_install_command(self.venv, self.tc, facts.local_wheels)),
        )

    def apply(self, host: Host, decision: Decision) -> None:
        for cmd in decision.commands:
            assert isinstance(cmd, Shell)  # decide() makes only the pip install
            run_pip(host, cmd.command, self.tc)


@dataclass(frozen=True)
class LockFacts:
    toolkits: tuple[cuda.Toolkit, ...]
    torch: str | None
    file: FileFacts


class EnsureToolchainLock(Operation):
    """Ensure <prefix>/toolchain.lock records what the toolchain resolved to."""

    def __init__(self, prefix: str, venv: str, tc: Toolchain):
        self.path, self.venv, self.tc = f"{prefix}/toolchain.lock", venv, tc
        self.name = f"Ensure {self.path} records the toolchain"

    def read(self, host: Host) -> LockFacts:
        return LockFacts(
            toolkits=tuple(cuda.parse_toolkits(read_fact(host, cuda.TOOLKITS_COMMAND))),
            torch=python.read_package_version(host, self.venv, "torch"),
            file=read_file_facts(host, self.path, sudo=False),
        )

    def content(self, facts: LockFacts) -> bytes:
        rel = tuple(int(x) for x in self.tc.cuda.split("."))
        nvcc = next((t for t in facts.toolkits if t.kind == "nvcc" and t.release == rel), None)
        lock = {
            "cuda": {
                "release": self.tc.cuda,
                "nvcc": nvcc.path if nvcc else None,
                "version": nvcc.version if nvcc else None,
            },
            "torch": {"version": facts.torch, "index": self.tc.torch_index, "find_links": self.tc.torch_find_links},
            "venv": self.venv,
        }
        return (json.dumps(lock, indent=2, sort_keys=True) + "\n").encode()

    def decide(self, facts: LockFacts) -> Decision:
        # the content depends on what the host resolved to; the comparison is a file's
        return decide_file(Upload(self.path, self.content(facts), 0o644), facts.file)


def venv_path(prefix: str) -> str:
    """The toolchain venv: torch, and the bindings and converters the later steps run."""
    return f"{prefix}/venv"


def toolchain_ops(
    prefix: str, tc: Toolchain, owner: str | None, needs_cuda: bool, prefix_sudo: bool
) -> list[Operation]:
    venv = venv_path(prefix)
    ops: list[Operation] = [
        EnsureDirectory(prefix, 0o755, owner=owner if prefix_sudo else None, sudo=prefix_sudo),
        EnsureSystemPackages(BUILD_PACKAGES, "to build llama.cpp and make the venv"),
    ]
    if needs_cuda:
        ops.append(EnsureCudaToolkit(tc.cuda))
    ops += [EnsureVenv(venv), EnsureTorch(venv, tc), EnsureToolchainLock(prefix, venv, tc)]
    return ops
