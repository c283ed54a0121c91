"""A wheelhouse: TabbyAPI's Python dependencies as binary wheels, made on the controller for
one Python version, so a host without a package index installs them offline.

TabbyAPI is a git tree, not a package; its dependencies are its pyproject's (the extras, which
pin torch and exllamav2 builds for other CUDAs, are never installed: ExLlamaV2 is built for the
host by ``steps/build/exllamav2.py``). ``pip install`` of the tree builds it through setuptools,
so the wheelhouse holds setuptools, wheel and packaging as well.

    invoke wheelhouse --python 3.11     # on a controller with an index; then provision as usual

The wheels land in ``~/.cache/voltaforge/wheels/tabbyAPI-<ref>-cp311/`` and are packed into one
tar beside them (sorted names, zeroed times: the same wheels make the same bytes), which the
tabbyapi step pushes checksummed when the host's Python is that version. Measured sizes (pip
download for manylinux x86_64, 2026-12): one Python version 49 MB; with ExLlamaV2's own
dependencies (the device check's payload) 66-67 MB, 216 MB for 3.10-3.13 together.
"""

from __future__ import annotations

import io
import re
import subprocess
import sys
import tarfile
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the controller's Python 3.10
    import tomli as tomllib  # type: ignore[import-not-found]

from playbooks.errors import VoltaforgeError
from playbooks.steps.build.llamacpp_source import source_cache_dir

#: what ``pip install <tree>`` needs beside the dependencies (TabbyAPI's build-system)
BUILD_REQUIRES = ("setuptools", "wheel", "packaging")
#: the platforms a manylinux x86_64 host installs (glibc 2.17 .. 2.28 tags pip meets on the index)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64")
PYTHON = re.compile(r"^3\.(1[0-9])$")


def python_tag(version: str) -> str:
    """'3.11' -> 'cp311'; anything else is refused (the value reaches pip's command line)."""
    m = PYTHON.match(version.strip())
    if not m:
        raise VoltaforgeError(f"--python {version!r}: give the Python version as 3.10, 3.11, 3.12 or 3.13")
    return f"cp3{m.group(1)}"


def wheels_dir(ref: str, tag: str, cache: Path | None = None) -> Path:
    base = (cache or source_cache_dir()).parent / "wheels"
    return base / f"tabbyAPI-{ref}-{tag}"


def packed(ref: str, tag: str, cache: Path | None = None) -> Path:
    """The one file the step pushes: the wheelhouse as a tar."""
    d = wheels_dir(ref, tag, cache)
    return d.with_name(d.name + ".tar")


def requirements(archive: Path) -> list[str]:
    """TabbyAPI's dependencies as its pyproject at the staged commit lists them (no extras)."""
    with tarfile.open(archive) as tar:
        member = next((m for m in tar.getmembers() if m.name.lstrip("./") == "pyproject.toml"), None)
        f = tar.extractfile(member) if member else None
        if f is None:
            raise VoltaforgeError(f"{archive}: no pyproject.toml at its top (not a git archive of TabbyAPI?)")
        project = tomllib.load(f).get("project", {})
    return [str(r) for r in project.get("dependencies", [])]


def download_argv(reqs: list[str], version: str, dest: Path, *extra: str, build: bool = True) -> list[str]:
    """pip download of binary wheels for that Python on manylinux x86_64 (no sdists: a host
    without an index may have no compiler either)."""
    argv = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--only-binary=:all:"]
    argv += ["--python-version", version, "--implementation", "cp", "-d", str(dest)]
    for p in PLATFORMS:
        argv += ["--platform", p]
    return argv + [*extra, *reqs, *(BUILD_REQUIRES if build else ())]


def pack(src: Path, out: Path) -> Path:
    """The wheels as one tar, the same bytes for the same wheels (sorted, times and owners zeroed)."""
    tmp = out.with_name(out.name + ".part")
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
        for wheel in sorted(src.glob("*.whl")):
            info = tarfile.TarInfo(wheel.name)
            info.size, info.mode, info.mtime = wheel.stat().st_size, 0o644, 0
            tar.addfile(info, io.BytesIO(wheel.read_bytes()))
    tmp.replace(out)
    return out


def build(archive: Path, version: str, cache: Path | None = None, *extra: str) -> Path:
    """Download TabbyAPI's dependencies for ``version`` into the controller's cache and pack
    them; returns the tar. Reuses what is already downloaded (pip skips files it has)."""
    tag = python_tag(version)
    ref = archive.name.removeprefix("tabbyAPI-").removesuffix(".tar.gz")
    dest = wheels_dir(ref, tag, cache)
    dest.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(download_argv(requirements(archive), version, dest, *extra), capture_output=True, text=True)
    if r.returncode != 0:
        last = [ln for ln in r.stderr.splitlines() if ln.startswith("ERROR")] or r.stderr.splitlines()[-1:]
        raise VoltaforgeError(f"wheelhouse for Python {version}: pip download failed: {' '.join(last)[-300:]}")
    return pack(dest, packed(ref, tag, cache))
