"""Debian packages for a host with no package index, staged on the controller (as TabbyAPI's
wheels and the llama.cpp source are): the controller's own apt resolves what the host lacks
against the host's dpkg database (its /var/lib/dpkg/status, read over SSH, given to apt as
``Dir::State::status``), downloads exactly those .debs into the controller's cache
(``~/.cache/voltaforge/debs/``, reused by the next host), and the step pushes and installs them
with dpkg. The controller must run the host's release (its apt lists are the ones used): another
codename is refused in one line, as is a controller without apt."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from playbooks.errors import VoltaforgeError
from playbooks.facts.system import OS_RELEASE_COMMAND, parse_os_release

#: an apt --print-uris line: 'URL' FILE SIZE HASH
_URI = re.compile(r"^'[^']+' (\S+\.deb) (\d+) ", re.M)
TIMEOUT_S = 600


def debs_cache() -> Path:
    root = Path(os.environ.get("VOLTAFORGE_CACHE") or Path.home() / ".cache" / "voltaforge")
    return root / "debs"


def controller_codename() -> str | None:
    done = subprocess.run(["sh", "-c", OS_RELEASE_COMMAND], capture_output=True, text=True, timeout=30)
    return parse_os_release(done.stdout).codename


def stage_debs(
    packages: Sequence[str], dpkg_status: str, codename: str | None, cache: Path | None = None
) -> list[Path]:
    """The .debs the host needs for ``packages`` (dependencies it lacks included), in the cache."""
    if shutil.which("apt-get") is None:
        raise VoltaforgeError(
            f"the host has no package index for {', '.join(packages)}, and this controller has no apt to stage "
            "them from: give the host a mirror, or run voltaforge from a Debian controller"
        )
    mine = controller_codename()
    if codename and mine != codename:
        raise VoltaforgeError(
            f"the host runs Debian {codename} with no package index; this controller runs {mine or 'another system'}: "
            f"its packages would not fit (stage {', '.join(packages)} from a {codename} controller, or give the host "
            "a mirror)"
        )
    cache = cache or debs_cache()
    (cache / "partial").mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        status = Path(tmp) / "status"
        status.write_text(dpkg_status)
        empty = Path(tmp) / "archives"
        (empty / "partial").mkdir(parents=True)

        def apt(archives: Path) -> list[str]:
            return [
                "apt-get", "-o", f"Dir::State::status={status}", "-o", f"Dir::Cache::archives={archives}",
                "-o", "Debug::NoLocking=1", "-y", "-qq", "--no-install-recommends",
            ]  # fmt: skip

        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        # listed against an empty archive (apt leaves out what its archive already holds), then
        # downloaded into the cache (what it holds already is not fetched again)
        listed = subprocess.run([*apt(empty), "--print-uris", "install", *packages], capture_output=True, text=True,
                                timeout=TIMEOUT_S, env=env)  # fmt: skip
        if listed.returncode != 0:
            raise VoltaforgeError(f"this controller's apt cannot resolve {', '.join(packages)}: "
                                  f"{(listed.stderr or listed.stdout).strip().splitlines()[-1:]}")  # fmt: skip
        names = _URI.findall(listed.stdout)
        got = subprocess.run([*apt(cache), "--download-only", "install", *packages], capture_output=True, text=True,
                             timeout=TIMEOUT_S, env=env)  # fmt: skip
        if got.returncode != 0:
            raise VoltaforgeError(f"this controller could not download {', '.join(packages)}: "
                                  f"{(got.stderr or got.stdout).strip().splitlines()[-1:]}")  # fmt: skip
    debs = [cache / name for name, _ in names]
    missing = [d.name for d in debs if not d.is_file()]
    if missing:
        raise VoltaforgeError(f"apt named {', '.join(missing)} but did not download it into {cache}")
    return debs
