"""The pinned llama.cpp source: the tree the pinned ``llama-cpp-python`` sdist vendors, fetched
once on the controller from the package index, checksummed, and cached (hosts get it pushed
over SSH, so they need no internet: the offline source knowledge.md names)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

from playbooks.errors import VoltaforgeError
from playbooks.facts.unreachable import pip_unreachable


@dataclass(frozen=True)
class Source:
    """The pinned llama.cpp source as an archive on the controller."""

    requirement: str  # llama-cpp-python==0.3.36
    ref: str  # the llama.cpp commit it vendors (the recipe's llamacpp_ref)
    archive: Path
    sha256: str
    member: str  # the tree inside the archive: <top>/vendor/llama.cpp

    @property
    def filename(self) -> str:
        return self.archive.name


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def source_cache_dir() -> Path:
    return Path(os.environ.get("VOLTAFORGE_CACHE") or Path.home() / ".cache" / "voltaforge") / "sources"


def fetch_sdist(requirement: str, ref: str, cache: Path | None = None) -> Source:
    """The sdist from the package index into the controller's cache, once (pip checks the
    index's hash on download; the sha256 recorded here is what every host is checked against)."""
    name, _, version = requirement.partition("==")
    if not version or not all(c.isalnum() or c in "._-" for c in name + version):
        raise VoltaforgeError(f"toolchain.llamacpp_sdist {requirement!r}: want NAME==VERSION")
    where = (cache or source_cache_dir()) / requirement.replace("==", "-")
    found = sorted(where.glob("*.tar.gz")) if where.is_dir() else []
    if not found:
        where.mkdir(parents=True, exist_ok=True)
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--no-binary",
                ":all:",
                "-d",
                str(where),
                requirement,
            ],
            capture_output=True,
            text=True,
        )
        if r.returncode != 0:
            gone = pip_unreachable(r.stderr)
            if gone is not None:
                named = f" ({gone.where[0]})" if gone.where else ""
                raise VoltaforgeError(
                    f"cannot reach the package index{named} for {requirement}, the llama.cpp source "
                    f"(toolchain.llamacpp_sdist) ({gone.cause}): give this machine access to it, or stage the file: "
                    f"on a machine with access run `pip download --no-deps --no-binary :all: {requirement}` and "
                    f"copy the .tar.gz into {where}/"
                )
            last = (r.stderr.strip().splitlines() or ["no output"])[-1]
            raise VoltaforgeError(f"cannot fetch {requirement} (the llama.cpp source) from the package index: {last}")
        found = sorted(where.glob("*.tar.gz"))
    archive = found[0]
    top = archive.name.removesuffix(".tar.gz")
    member = f"{top}/vendor/llama.cpp"
    return Source(requirement, ref, archive, _checked_sha256(archive, f"{member}/CMakeLists.txt"), member)


def _checked_sha256(archive: Path, must_hold: str) -> str:
    """The archive's sha256, once it was seen to hold ``must_hold``. Both take seconds on a
    50 MB archive (a gzip tar has no index), so the result is kept beside it and trusted while
    the size and mtime stay the same: a no-op provision reads a few bytes instead."""
    st = archive.stat()
    sidecar = archive.with_name(f".{archive.name}.checked.json")
    key = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "holds": must_hold}
    try:
        known = json.loads(sidecar.read_text())
        if {k: known.get(k) for k in key} == key and len(str(known.get("sha256"))) == 64:
            return str(known["sha256"])
    except (OSError, ValueError, AttributeError):
        pass
    with tarfile.open(archive) as tar:
        try:
            tar.getmember(must_hold)
        except KeyError:
            raise VoltaforgeError(f"{archive}: holds no {must_hold}: not a llama.cpp source") from None
    sha = file_sha256(archive)
    try:
        sidecar.write_text(json.dumps({**key, "sha256": sha}))
    except OSError:
        pass  # a read-only cache: checked again next time
    return sha
