"""Facts about apt on Debian-family hosts: is non-free enabled, which mirror is configured."""

from __future__ import annotations

NONFREE_ENABLED_COMMAND = (
    "grep -rlsE '(^Components:.*|^deb .*)non-free' /etc/apt/sources.list /etc/apt/sources.list.d/ || true"
)


def parse_nonfree_enabled(output: str) -> list[str]:
    """The sources files that enable a non-free component (empty: none)."""
    return [line.strip() for line in output.splitlines() if line.strip()]


DEBIAN_MIRROR_COMMAND = "sed -n 's/^URIs: *//p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -n1"
_UNSAFE = set(" '\"$`\\;")


def parse_debian_mirror(output: str) -> str | None:
    """The mirror of debian.sources, when it is a plain http(s) URL that is safe to write back."""
    mirror = output.strip()
    if not mirror.startswith(("http://", "https://")) or any(c in _UNSAFE for c in mirror):
        return None
    return mirror


def installed_command(packages: tuple[str, ...]) -> str:
    """Which of ``packages`` dpkg holds installed (names are checked by the caller)."""
    names = " ".join(packages)
    return f"dpkg-query -W -f='${{Package}} ${{db:Status-Status}}\\n' {names} 2>/dev/null || true"


def parse_installed(output: str) -> set[str]:
    found = set()
    for line in output.splitlines():
        name, _, status = line.strip().partition(" ")
        if status.strip() == "installed":
            found.add(name.split(":")[0])  # dpkg prints foo:amd64 for multi-arch names
    return found
