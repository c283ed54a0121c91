"""The exact shell lines voltaforge sends to a host, built from validated values only. Pure.

- Commands run as ``env LC_ALL=C VAR=... bash --noprofile --norc -o pipefail -c '<cmd>'``:
  nothing depends on the remote user's shell rc files, error messages are English (we match
  "No space left on device"), and a failing stage of a pipe fails the command.
- ``sudo`` is always ``sudo -n``: a sudo that wants a password fails at once with a clear
  error instead of prompting (and hanging). No password is ever read, sent or logged.
- Files are written to a temp file in the target directory, chmod-ed, then renamed over the
  target: readers see the old or the new file, never half of one, and a full disk leaves
  the old file untouched (the temp is removed).
"""

from __future__ import annotations

import posixpath
import re
import shlex

_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_OWNER_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*\$?(:[A-Za-z_][A-Za-z0-9_.-]*\$?)?$")
#: `timeout` sends TERM at the limit and KILL this many seconds later if still alive.
KILL_AFTER_S = 5


def validate_env(env: dict[str, str] | None) -> list[str]:
    out = []
    for name, value in (env or {}).items():
        if not _ENV_NAME_RE.match(name):
            raise ValueError(f"invalid environment variable name {name!r}: use letters, digits and _")
        if "\0" in str(value):
            raise ValueError(f"environment variable {name}: value contains a NUL byte")
        out.append(shlex.quote(f"{name}={value}"))
    return out


def build_command(
    cmd: str, *, env: dict[str, str] | None = None, sudo: bool = False, timeout: float | None = None
) -> str:
    """The exact shell line sent to the host for ``cmd``. Pure: tested with plain asserts.

    ``env LC_ALL=C`` comes first so sudo's own messages are English too; under sudo the
    caller's variables are set again *after* sudo (sudo resets the environment);
    ``timeout`` kills the command on the host itself, so a stuck command does not outlive
    our deadline. Variables are on the command line (visible in ``ps`` on the host): pass
    secrets in files (written on stdin: :meth:`Host.write_file`), not in ``env``.
    """
    assigns = validate_env(env)
    limit = []
    if timeout is not None:
        if timeout <= 0:
            raise ValueError("timeout must be positive")
        limit = ["timeout", f"--kill-after={KILL_AFTER_S}", f"{timeout:g}"]
    if sudo:
        parts = ["env", "LC_ALL=C", *limit, "sudo", "-n", "--", "env", "LC_ALL=C", *assigns]
    else:
        parts = ["env", "LC_ALL=C", *assigns, *limit]
    parts += ["bash", "--noprofile", "--norc", "-o", "pipefail", "-c", shlex.quote(cmd)]
    return " ".join(parts)


def check_path(path: str) -> str:
    if not path.startswith("/") or path.endswith("/") or "\0" in path or "\n" in path:
        raise ValueError(f"remote path must be an absolute file path, got {path!r}")
    return posixpath.normpath(path)


def check_owner(owner: str | None) -> None:
    if owner is not None and not _OWNER_RE.match(owner):
        raise ValueError(f"invalid owner {owner!r}: use 'user' or 'user:group'")


def write_file_command(path: str, mode: int, owner: str | None = None) -> str:
    """The shell script that writes its stdin to ``path`` atomically (temp file + rename).

    The temp file sits beside the target (same filesystem: ``mv`` is an atomic rename), is
    created 0600 by ``mktemp``, gets its final mode/owner *before* the rename, and is removed
    by the EXIT trap on any failure (a full disk, a killed command).
    """
    path = check_path(path)
    check_owner(owner)
    d, base = posixpath.split(path)
    tmp = posixpath.join(d, f".{base}.vf-XXXXXX")
    steps = [
        "set -e",
        "umask 077",
        f"tmp=$(mktemp {shlex.quote(tmp)})",
        "trap 'rm -f \"$tmp\"' EXIT",
        'cat > "$tmp"',
        f'chmod {mode:04o} "$tmp"',
    ]
    if owner:
        steps.append(f'chown {shlex.quote(owner)} "$tmp"')
    # -T: if the target is a directory, fail instead of moving the temp into it.
    steps.append(f'mv -fT "$tmp" {shlex.quote(path)}')
    return "; ".join(steps)


def check_mode(mode: int) -> int:
    if not isinstance(mode, int) or not 0 <= mode <= 0o7777:
        raise ValueError(f"mode must be an int between 0 and 0o7777, got {mode!r}")
    return mode
