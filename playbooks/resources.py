"""Where the shipped data lives: recipes/, templates/ and the GPU probe.

In a checkout they are the repository's top-level folders (where people edit them); a wheel
carries copies inside the package (pyproject.toml maps them to playbooks/_data/), so an
installed voltaforge works outside any checkout.
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def resource_dir(name: str) -> Path:
    """The directory `name` (recipes, templates) of this checkout, else of the installed wheel."""
    checkout = _PACKAGE.parent / name
    if checkout.is_dir() and (_PACKAGE.parent / "pyproject.toml").is_file():
        return checkout
    return _PACKAGE / "_data" / name
