"""Facts about Python environments on a host: the version of a package inside a venv."""

from __future__ import annotations

import shlex


def package_version_command(venv: str, package: str) -> str:
    code = f"import importlib.metadata as m; print(m.version({package!r}))"
    return f"{shlex.quote(venv + '/bin/python')} -c {shlex.quote(code)} 2>/dev/null || true"


def parse_package_version(output: str) -> str | None:
    """The installed version, None when the venv or the package is missing."""
    text = output.strip()
    return text.splitlines()[-1] if text else None
