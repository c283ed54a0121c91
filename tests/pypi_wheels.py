"""Pinned wheels from the package index, fetched once into the test cache and unpacked there:
sources the tests read (exllamav2's Python, torch's headers) without installing them."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from tests.llamacpp_tools import _cache_lock, cache_dir, convert_python


def pypi_wheel(requirement: str, name_glob: str) -> Path:
    """A wheel from the package index into the test cache, once (the pinned versions)."""
    where = cache_dir() / "wheels"
    found = sorted(where.glob(name_glob))
    if not found:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:", "--python-version",
             "3.11", "--platform", "manylinux_2_28_x86_64", "-d", str(where), requirement],
            check=True,
            timeout=900,
        )  # fmt: skip
        found = sorted(where.glob(name_glob))
    return found[0]


def unpacked(wheel: Path, member_prefix: str) -> Path:
    """The wheel's members under member_prefix, extracted once into the test cache."""
    out = cache_dir() / "unpacked" / wheel.stem
    if not (out / ".done").exists():
        with zipfile.ZipFile(wheel) as z:
            z.extractall(out, [n for n in z.namelist() if n.startswith(member_prefix)])
        (out / ".done").write_text("")
    return out


def exllamav2_source() -> Path:
    """The directory holding the pinned exllamav2 package (0.3.2, pure Python: its CUDA
    extension is compiled on first import, so importing it needs a stand-in for that)."""
    return unpacked(pypi_wheel("exllamav2==0.3.2", "exllamav2-0.3.2-*.whl"), "exllamav2/")


#: what exllamav2's package imports besides torch and what the converter's venv has: rich
#: (util.py's progress bars) and pillow (vlm/, imported by __init__)
EXLLAMAV2_IMPORTS = ["rich>=13,<15", "pillow>=10,<13"]


def exllamav2_python() -> Path:
    """A Python that imports the pinned exllamav2 (with exllamav2_source() on its path): the
    converter's venv (CPU torch), plus EXLLAMAV2_IMPORTS, installed once."""
    python = convert_python()
    marker = python.parent.parent / ".exllamav2-imports"
    with _cache_lock("convert-venv"):
        if marker.exists() and marker.read_text() == repr(EXLLAMAV2_IMPORTS):
            return python
        subprocess.run(
            [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *EXLLAMAV2_IMPORTS],
            check=True,
            timeout=900,
        )
        marker.write_text(repr(EXLLAMAV2_IMPORTS))
    return python
