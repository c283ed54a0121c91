"""Every command-line value, typed and checked in one place.

Invoke hands task functions strings (or the default); each task turns them into typed values
here, so a bad value anywhere ends in one line, ``error: --ctx 'abc' is not a number of
tokens``, and exit 2, never a traceback or a silently wrong plan ("-3 slot(s)").
"""

from __future__ import annotations

from pathlib import Path

from playbooks.config.inventory import is_host_address
from playbooks.errors import VoltaforgeError


class UsageError(VoltaforgeError):
    """A flag has a value the command cannot use."""


def positive_int(flag: str, value: object, what: str) -> int | None:
    """``--ctx 4096`` -> 4096; None stays None; anything else but a whole number > 0 is refused."""
    if value is None:
        return None
    text = str(value).strip()
    try:
        number = int(text)
    except ValueError:
        raise UsageError(f"{flag} {text!r} is not a number of {what}") from None
    if number <= 0:
        raise UsageError(f"{flag} must be a positive number of {what}, got {number}")
    return number


def name_or_path(flag: str, value: object) -> str | None:
    """A recipe or inventory given by name or path: a non-empty single line."""
    if value is None:
        return None
    text = str(value)
    if not text.strip() or "\n" in text or "\0" in text:
        raise UsageError(f"{flag} {text!r} is not a name or a path")
    return text


def existing_file(flag: str, value: object) -> Path | None:
    if value is None:
        return None
    path = Path(str(value))
    if not path.is_file():
        raise UsageError(f"{flag} {str(value)!r}: no such file")
    return path


def host_names(flag: str, value: object) -> list[str]:
    """``--host v100-01,v100-02``: inventory names, ~/.ssh/config aliases, addresses or ``local``."""
    text = str(value or "").strip()
    names = [n.strip() for n in text.split(",")]
    if not text or any(not n for n in names):
        raise UsageError(f"{flag} {text!r}: give one or more host names separated by commas")
    for n in names:
        if n != "local" and not is_host_address(n):
            raise UsageError(f"{flag} {n!r} is not a valid host name (letters, digits, '-', '_', dot-separated)")
    return names


def one_host(flag: str, value: object) -> str:
    names = host_names(flag, value)
    if len(names) != 1:
        raise UsageError(f"{flag}: this command takes one host, got {len(names)}")
    return names[0]


def positive_float(flag: str, value: object, what: str) -> float:
    text = str(value).strip()
    try:
        number = float(text)
    except ValueError:
        raise UsageError(f"{flag} {text!r} is not a number of {what}") from None
    if not number > 0:
        raise UsageError(f"{flag} must be a positive number of {what}, got {text}")
    return number


def directory(flag: str, value: object) -> Path | None:
    if value is None:
        return None
    path = Path(str(value))
    if not path.is_dir():
        raise UsageError(f"{flag} {str(value)!r}: no such directory")
    return path


def install_prefix(flag: str, value: object) -> str | None:
    if value is None:
        return None
    text = str(value)
    if not text.startswith("/") or any(c not in _PREFIX_CHARS for c in text) or "/../" in text + "/":
        raise UsageError(f"{flag} {text!r}: want an absolute path of letters, digits and . _ / -")
    return text.rstrip("/") or "/"


_PREFIX_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._/-")


def choice(flag: str, value: object, allowed: tuple[str, ...]) -> str:
    text = str(value).strip()
    if text not in allowed:
        raise UsageError(f"{flag} {text!r}: want one of {', '.join(allowed)}")
    return text


def gpu_indexes(value: object) -> tuple[int, ...]:
    """``--gpus 0,1`` -> (0, 1): one llama-server instance per GPU."""
    text = str(value).strip()
    try:
        indexes = tuple(int(p) for p in text.split(","))
    except ValueError:
        raise UsageError(f"--gpus {text!r}: give GPU indexes separated by commas, e.g. 0,1") from None
    if any(i < 0 or i > 63 for i in indexes) or len(set(indexes)) != len(indexes):
        raise UsageError(f"--gpus {text!r}: distinct GPU indexes 0-63")
    return indexes


def output_dir(flag: str, value: object) -> Path:
    """A directory to write into: made when missing, refused when a file is there."""
    text = str(value or "")
    if not text.strip() or "\n" in text or "\0" in text:
        raise UsageError(f"{flag} {text!r} is not a directory path")
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise UsageError(f"{flag} {text!r} exists and is not a directory")
    return path


def output_file(flag: str, value: object) -> Path | None:
    """A file to write: its directory is made when missing; a directory there is refused."""
    if value is None:
        return None
    text = str(value)
    if not text.strip() or "\n" in text or "\0" in text:
        raise UsageError(f"{flag} {text!r} is not a file path")
    path = Path(text)
    if path.is_dir():
        raise UsageError(f"{flag} {text!r} is a directory, not a file")
    return path
