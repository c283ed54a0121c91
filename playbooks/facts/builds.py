"""Facts about builds on a host: a build's stamp, where `current` points, which builds exist,
and whether ccache is there. Each a command and a pure parser."""

from __future__ import annotations

import json
import shlex
from typing import Any

STAMP_NAME = "voltaforge-stamp.json"


def stamp_command(build_dir: str) -> str:
    return f"cat -- {shlex.quote(build_dir + '/' + STAMP_NAME)} 2>/dev/null || true"


def parse_stamp(output: str) -> dict[str, Any] | None:
    """The stamp a finished, proven build wrote; None when absent or unreadable (a build that
    was interrupted never wrote one, so it does not count)."""
    try:
        data = json.loads(output)
    except ValueError:
        return None
    return data if isinstance(data, dict) and data.get("id") else None


def readlink_command(path: str) -> str:
    return f"readlink -- {shlex.quote(path)} 2>/dev/null || true"


def parse_readlink(output: str) -> str | None:
    text = output.strip()
    return text or None


def list_dir_command(path: str) -> str:
    q = shlex.quote(path)
    return f"if [ -d {q} ]; then ls -1A -- {q}; fi"


def parse_list_dir(output: str) -> tuple[str, ...]:
    return tuple(sorted(line for line in output.splitlines() if line.strip()))


CCACHE_COMMAND = "command -v ccache 2>/dev/null || true"

# The build tools on the host's own PATH, found once and then run by absolute path: a compile
# runs with a PATH of the system directories and the chosen CUDA only (steps/build/buildenv.py), so a
# cmake in /usr/local/bin or a venv (pip's cmake, Kitware's installer) is not on it.
BUILD_TOOLS = ("cmake", "make", "ninja")
BUILD_TOOLS_COMMAND = "; ".join(f'echo "{t}=$(command -v {t} 2>/dev/null)"' for t in BUILD_TOOLS)


def parse_build_tools(output: str) -> dict[str, str | None]:
    """tool -> absolute path, None where the host has none."""
    found: dict[str, str | None] = dict.fromkeys(BUILD_TOOLS)
    for line in output.splitlines():
        name, _, path = line.strip().partition("=")
        if name in found and path.startswith("/"):
            found[name] = path
    return found


def parse_ccache(output: str) -> str | None:
    path = output.strip()
    return path if path.startswith("/") else None
