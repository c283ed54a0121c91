"""An offline wheelhouse: every Python package a host installs while `invoke toolchain`,
`invoke build` and `invoke quantize` provision a CPU recipe, for a host without internet.

An air-gapped lab stages a host this way: the Debian packages are in its image
(ci/build-test-rootfs.sh), the Python packages in a directory of wheels that pip is
configured to use and nothing else (``no-index``, ``find-links``). The
``provisionable_nspawn_host`` fixture (tests/testhosts.py) bind-mounts this directory
read-only into the Debian 12 container.

What goes in, and where each requirement comes from (so a pin moved in the code moves the
wheelhouse with it):

- ``torch==TORCH_CPU``: the toolchain's torch, the CPU build fetched once by
  :func:`tests.llamacpp_tools.cpu_torch_wheel`, and its dependencies;
- the bindings (``llama-cpp-python``, built from the pinned sdist on the host): the sdist's
  ``[project] dependencies`` and its ``[build-system] requires`` (scikit-build-core), read from
  the sdist itself, plus ``ninja``: scikit-build-core asks pip for the ninja wheel when no
  ``ninja`` is on the host's PATH (the image has none; make would be its fallback only where
  no ninja wheel exists for the platform);
- the converter's requirements (``playbooks.steps.weights.gguf.CONVERT_REQUIREMENTS``).

They are resolved together by ``pip download`` on the controller for the container's
interpreter (CPython 3.11, glibc 2.36, x86_64: ``--python-version``/``--abi``/``--platform``,
binary wheels only), so every version the separate installs pick is in the one consistent set.
Built once into the test cache (``VOLTAFORGE_CACHE``), named by a hash of the requirement
list and target, into a temporary directory renamed into place (a half-built wheelhouse is
never used), under a lock (parallel sessions wait for the first).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from tests.llamacpp_tools import SDIST, TORCH_CPU, cache_dir, cpu_torch_wheel

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10 (the project's floor): pip's own TOML reader
    from pip._vendor import tomli as tomllib

#: The container's interpreter: Debian 12's python3 (3.11) on glibc 2.36, x86_64.
PYTHON_VERSION = "3.11"
ABI = "cp311"
GLIBC = (2, 36)
#: manylinux tags a glibc-2.36 x86_64 host accepts. pip expands only the legacy
#: manylinux2014/2010 aliases itself, so the PEP 600 ones are listed one by one.
PLATFORMS = tuple(f"manylinux_2_{minor}_x86_64" for minor in range(GLIBC[1], 4, -1)) + (
    "manylinux2014_x86_64",
    "manylinux2010_x86_64",
    "manylinux1_x86_64",
)
#: scikit-build-core's dynamic build requirement where no ninja is on PATH (see the docstring).
BUILD_TOOLS = ("ninja",)


def sdist_requirements() -> tuple[list[str], list[str]]:
    """(``[project] dependencies``, ``[build-system] requires``) of the pinned
    llama-cpp-python sdist, read from its pyproject.toml (the archive `invoke build` pushes)."""
    from playbooks.steps.build.llamacpp_source import fetch_sdist

    source = fetch_sdist(SDIST, "0c1e570")
    top = source.member.split("/", 1)[0]
    with tarfile.open(source.archive) as tar:
        member = tar.extractfile(f"{top}/pyproject.toml")
        assert member is not None, f"{source.archive}: no pyproject.toml"
        data = tomllib.load(member)
    return list(data["project"]["dependencies"]), list(data["build-system"]["requires"])


def requirements() -> list[str]:
    """The top-level requirements, sorted: torch pinned, the bindings' runtime and build
    requirements, the converter's."""
    from playbooks.steps.weights.gguf import CONVERT_REQUIREMENTS

    runtime, build = sdist_requirements()
    return sorted({f"torch=={TORCH_CPU}", *runtime, *build, *BUILD_TOOLS, *CONVERT_REQUIREMENTS})


def wheelhouse_dir(reqs: list[str] | None = None) -> Path:
    reqs = requirements() if reqs is None else reqs
    key = "\n".join([PYTHON_VERSION, ABI, *PLATFORMS, *reqs])
    return cache_dir() / f"wheelhouse-{ABI}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def ensure_wheelhouse(timeout: float = 1800) -> Path:
    """The wheelhouse for the container's Python, built once; returns its directory.

    Holds the wheels and ``requirements.txt`` (the top-level list it was resolved from).
    Raises with pip's output when a requirement cannot be resolved as binary wheels.
    """
    reqs = requirements()
    target = wheelhouse_dir(reqs)
    if (target / "requirements.txt").is_file():
        return target
    torch = cpu_torch_wheel()
    if f"-{ABI}-" not in torch.name:
        raise RuntimeError(
            f"{torch.name} is not a {ABI} wheel (the controller's python is "
            f"{sys.version_info.major}.{sys.version_info.minor}): the container needs CPython {PYTHON_VERSION}'s"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "requirements.txt").is_file():
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            try:
                os.link(torch, tmp / torch.name)  # same file system: no 190 MB copy
            except OSError:
                shutil.copyfile(torch, tmp / torch.name)
            cmd = [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--disable-pip-version-check",
                "--only-binary",
                ":all:",
                "--python-version",
                PYTHON_VERSION,
                "--implementation",
                "cp",
                "--abi",
                ABI,
                *(arg for platform in PLATFORMS for arg in ("--platform", platform)),
                "--find-links",
                str(tmp),  # the CPU torch: its +cpu label is on no index pip can reach here
                "-d",
                str(tmp),
                *reqs,
            ]
            log = target.parent / f"{target.name}.log"
            with open(log, "w") as out:
                r = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=timeout)
            if r.returncode != 0:
                tail = log.read_text()[-3000:]
                raise RuntimeError(f"pip download for the wheelhouse failed ({r.returncode}); log {log}:\n{tail}")
            for wheel in tmp.iterdir():
                os.chmod(wheel, 0o644)  # the container's unprivileged user reads them
            (tmp / "requirements.txt").write_text("\n".join(reqs) + "\n")
            os.chmod(tmp, 0o755)
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def wheel_names(wheelhouse: Path) -> dict[str, str]:
    """{normalized project name: version} of the wheels in a wheelhouse."""
    out = {}
    for wheel in wheelhouse.glob("*.whl"):
        name, version = wheel.name.split("-")[:2]
        out[re.sub(r"[-_.]+", "-", name).lower()] = version
    return out
