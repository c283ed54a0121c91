"""Facts about paths on a host: what is there (stat), what it holds (sha256), who may write."""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class FileStat:
    kind: str  # stat's %F: "directory", "regular file", "regular empty file", ...
    mode: int
    owner: str
    group: str

    @property
    def is_file(self) -> bool:
        return self.kind in ("regular file", "regular empty file")


def path_word(path: str) -> str:
    """A host path as one shell word: quoted, except that a leading ``~/`` becomes the SSH
    user's ``"$HOME"/`` (a quoted ``~`` is not expanded by the shell)."""
    if path.startswith("~/"):
        return '"$HOME"/' + shlex.quote(path[2:])
    return shlex.quote(path)


def stat_command(path: str) -> str:
    # -L: follow symlinks (a prefix that is a symlink to a big disk is normal).
    q = path_word(path)
    return f"if [ -e {q} ]; then stat -L -c '%F|%a|%U|%G' -- {q}; else echo missing; fi"


def parse_stat(output: str) -> FileStat | None:
    """Parse ``stat_command`` output: None when the path does not exist, or when the output is
    not stat's line (empty: the read failed, or a reads pass has not fetched it yet). Like every
    parser here it never raises: the operation that then makes the path meets the real cause."""
    parts = output.strip().rsplit("|", 3)
    if len(parts) != 4 or not parts[1].isdigit() or any(c not in "01234567" for c in parts[1]):
        return None
    kind, mode, owner, group = parts
    return FileStat(kind, int(mode, 8), owner, group)


def sha256_command(path: str) -> str:
    q = shlex.quote(path)
    return f"if [ -f {q} ]; then sha256sum < {q}; else echo missing; fi"


def parse_sha256(output: str) -> str | None:
    """Hex SHA-256 of a regular file, None when there is none (or the output is not a hash)."""
    word = (output.split() or [""])[0]
    return word if len(word) == 64 and all(c in "0123456789abcdef" for c in word) else None


def writable_command(path: str) -> str:
    """Prints 'yes' when the login user can write ``path`` or, if it is missing, its parent."""
    parent = path.rsplit("/", 1)[0] or "/"
    return (
        f"if test -w {shlex.quote(path)} || {{ ! test -e {shlex.quote(path)} && test -w {shlex.quote(parent)}; }}; "
        "then echo yes; else echo no; fi"
    )


def parse_writable(output: str) -> bool:
    return output.strip() == "yes"


def cat_command(path: str) -> str:
    """A small file's content; nothing when it is absent or unreadable."""
    return f"cat -- {shlex.quote(path)} 2>/dev/null || true"


def parse_json_object(output: str) -> dict[str, Any] | None:
    """A JSON object (a manifest, a stamp, a record); None when empty, garbage or not an object."""
    try:
        data = json.loads(output) if output.strip() else None
    except ValueError:
        return None
    return data if isinstance(data, dict) else None
