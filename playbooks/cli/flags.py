"""Every command-line value, typed and checked in one place.

Invoke hands task functions strings (or the default); each task turns them into typed values
here, so a bad value anywhere ends in one line, ``error: --ctx 'abc' is not a number of
tokens``, and exit 2, never a traceback or a silently wrong plan ("-3 slot(s)").
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, cast

from invoke import Task

from playbooks.config.inventory import is_host_address
from playbooks.errors import UsageError


def _is(path: Path, test: Callable[[Path], bool]) -> bool:
    """``path.is_dir()`` and co., False where the name itself is impossible (too long, ...)."""
    try:
        return test(path)
    except OSError:
        return False


def positive_int(flag: str, value: object, what: str, maximum: int | None = None) -> int | None:
    """``--ctx 4096`` -> 4096; None stays None; anything else but a whole number > 0 (and at
    most ``maximum``) is refused."""
    if value is None:
        return None
    text = str(value).strip()
    try:
        number = int(text)
    except ValueError:
        raise UsageError(f"{flag} {text!r} is not a number of {what}") from None
    if number <= 0:
        raise UsageError(f"{flag} must be a positive number of {what}, got {number}")
    if maximum is not None and number > maximum:
        raise UsageError(f"{flag} must be at most {maximum} {what}, got {_short(text)}")
    return number


def shares(flag: str, value: object) -> tuple[float, ...] | None:
    """``--tensor-split 3,1`` -> (3.0, 1.0): non-negative numbers, at least one above 0."""
    if value is None:
        return None
    text = str(value).strip()
    try:
        parts = tuple(float(p) for p in text.split(","))
    except ValueError:
        raise UsageError(f"{flag} {_short(text)!r}: want shares separated by commas, e.g. 1,1") from None
    if any(not math.isfinite(p) or p < 0 for p in parts) or not any(parts):
        raise UsageError(f"{flag} {_short(text)!r}: want non-negative shares, at least one above 0")
    return parts


def split_mode(flag: str, value: object) -> str | None:
    """``--split-mode layer``; another mode: one line saying why it is not planned (plan/split.py)."""
    if value is None:
        return None
    from playbooks.plan.split import split_mode_refusal

    text = str(value).strip()
    why = split_mode_refusal(text)
    if why:
        raise UsageError(f"{flag} {_short(text)!r} {why.removeprefix(f'--split-mode {text} ')}")
    return text


def _short(text: str, limit: int = 40) -> str:
    """A value as a message quotes it: a 400-digit number is not read, it is recognised."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def word(flag: str, value: object, what: str) -> str | None:
    """A name such as a GPU or a quant type: None stays None; given, it is a non-empty single line."""
    if value is None:
        return None
    text = str(value).strip()
    if not text or "\n" in text or "\0" in text:
        raise UsageError(f"{flag} {str(value)!r}: give {what}")
    return text


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
    if not _is(path, Path.is_file):
        raise UsageError(f"{flag} {str(value)!r}: no such file")
    return path


def _comma_list(flag: str, value: object, least: int, what: str) -> list[str]:
    """``a,b,c``: at least ``least`` non-empty names separated by commas, or one line saying so."""
    text = str(value or "").strip()
    names = [n.strip() for n in text.split(",")]
    if not text or len(names) < least or any(not n for n in names):
        raise UsageError(f"{flag} {_short(text)!r}: give {what} separated by commas")
    return names


def host_names(flag: str, value: object) -> list[str]:
    """``--host v100-01,v100-02``: inventory names, ~/.ssh/config aliases, addresses or ``local``."""
    names = _comma_list(flag, value, 1, "one or more host names")
    for n in names:
        if n != "local" and not is_host_address(n):
            raise UsageError(f"{flag} {n!r} is not a valid host name (letters, digits, '-', '_', dot-separated)")
    return names


def recipe_names(flag: str, value: object) -> list[str]:
    """``--models a,b,c``: two or more recipe names or paths, separated by commas (a set: one
    model is a plain server)."""
    return _comma_list(flag, value, 2, "two or more recipe names or paths")


def ip_address(flag: str, value: object) -> str:
    """``--bind 127.0.0.1``: one IP address (what a listener binds to)."""
    import ipaddress

    text = str(value).strip()
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        raise UsageError(f"{flag} {_short(text)!r} is not an IP address, e.g. 127.0.0.1") from None


def one_host(flag: str, value: object) -> str:
    names = host_names(flag, value)
    if len(names) != 1:
        raise UsageError(f"{flag}: this command takes one host, got {len(names)}")
    return names[0]


def positive_float(flag: str, value: object, what: str, maximum: float | None = None) -> float:
    text = str(value).strip()
    try:
        number = float(text)
    except ValueError:
        raise UsageError(f"{flag} {text!r} is not a number of {what}") from None
    if not number > 0:
        raise UsageError(f"{flag} must be a positive number of {what}, got {text}")
    if not math.isfinite(number) or (maximum is not None and number > maximum):
        most = f"at most {maximum:g}" if maximum is not None else "a finite number of"
        raise UsageError(f"{flag} must be {most} {what}, got {_short(text)}")
    return number


def inventory_file(flag: str, value: object, default: object) -> Path:
    """The inventory: the default name may be absent (an empty inventory, hosts from
    ~/.ssh/config); any other file named must exist, or a typo would silently mean "no inventory"."""
    text = name_or_path(flag, value) or str(default)
    path = Path(text)
    if text != str(default) and not _is(path, Path.is_file):
        raise UsageError(f"{flag} {text!r}: no such file")
    return path


def config_section(section: object, known: Mapping[str, object]) -> Mapping[str, object]:
    """The ``voltaforge:`` section of Invoke's configuration: a mapping of the keys voltaforge
    knows; a misspelt key would otherwise be ignored without a word."""
    if section is None:
        return {}
    if not hasattr(section, "keys") or not hasattr(section, "get"):
        raise UsageError(f"voltaforge: in the configuration must be a mapping of settings, got {section!r}")
    unknown = sorted(str(k) for k in section.keys() if k not in known)
    if unknown:
        raise UsageError(
            f"voltaforge.{unknown[0]} in the configuration is not a setting; known: {', '.join(sorted(known))}"
        )
    return cast(Mapping[str, object], section)


def directory(flag: str, value: object) -> Path | None:
    if value is None:
        return None
    path = Path(str(value))
    if not str(value).strip() or not _is(path, Path.is_dir):  # Path("") is ".": not what "" meant
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


#: --n-cpu-moe: more layers than any model has (the plan then says how many the model has)
MAX_LAYERS = 10000


def n_cpu_moe(flag: str, value: object) -> int | str | None:
    """``--n-cpu-moe 12`` -> 12, ``auto`` -> "auto"; None stays None; 0 is a number (no
    offload); anything else is refused."""
    if value is None:
        return None
    text = str(value).strip()
    if text == "auto":
        return text
    try:
        number = int(text)
    except ValueError:
        raise UsageError(f"{flag} {_short(text)!r}: want a number of layers or auto") from None
    if number < 0 or number > MAX_LAYERS:
        raise UsageError(f"{flag} must be a number of layers from 0 to {MAX_LAYERS} or auto, got {_short(text)}")
    return number


#: --min-tok-s: more tok/s than any roofline reaches is no floor but a typo
MAX_TOK_S = 1e9


def speed_floor(flag: str, value: object) -> float | str | None:
    """``--min-tok-s 30`` -> 30.0, ``none`` -> "none" (no speed floor); None stays None."""
    if value is None:
        return None
    text = str(value).strip()
    if text == "none":
        return text
    try:
        number = float(text)
    except ValueError:
        raise UsageError(f"{flag} {_short(text)!r}: want a decode speed in tok/s, or none") from None
    if not (number > 0 and math.isfinite(number) and number <= MAX_TOK_S):
        raise UsageError(f"{flag} must be a positive number of tok/s up to {MAX_TOK_S:g}, or none; got {_short(text)}")
    return number


def choice(flag: str, value: object, allowed: tuple[str, ...]) -> str:
    text = str(value).strip()
    if text not in allowed:
        raise UsageError(f"{flag} {text!r}: want one of {', '.join(allowed)}")
    return text


def gpu_indexes(value: object) -> tuple[int, ...] | None:
    """``--gpus 0,1`` -> (0, 1); None stays None (the recipe's default GPUs)."""
    if value is None:
        return None
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
    _check_writable(flag, text, path)
    if _is(path, Path.exists) and not _is(path, Path.is_dir):
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
    if _is(path, Path.is_dir):
        raise UsageError(f"{flag} {text!r} is a directory, not a file")
    _check_writable(flag, text, path)
    return path


NAME_MAX = 255  # bytes in one path component: ext4, xfs, btrfs, tmpfs


def _check_writable(flag: str, text: str, path: Path) -> None:
    """Refused now what a write at the end of a long run would fail on: a component longer
    than a file name can be, or a nearest existing directory this user cannot write (or a
    file where a directory must be)."""
    if any(len(part.encode()) > NAME_MAX for part in path.parts):
        raise UsageError(f"{flag} {_short(text)!r}: a name in it is longer than {NAME_MAX} bytes")
    above = path.absolute()
    while not _is(above, Path.exists) and above != above.parent:
        above = above.parent
    if above != path.absolute() and not _is(above, Path.is_dir):
        raise UsageError(f"{flag} {_short(text)!r}: {above} is not a directory")
    if above != path.absolute() and not os.access(above, os.W_OK):
        raise UsageError(f"{flag} {_short(text)!r}: cannot write in {above}")


class ShortFlagTask(Task):
    """Invoke's Task with the one short flag the long runs share, ``-v`` for ``--verbose``
    (the tasks turn auto_shortflags off: ``--host`` would otherwise claim ``-h``)."""

    SHORT = {"verbose": "v"}

    def arg_opts(self, name: str, default: str, taken_names: set[str]) -> dict[str, Any]:
        opts = super().arg_opts(name, default, taken_names)
        short = self.SHORT.get(name)
        if short and short not in taken_names:
            opts["names"].append(short)
        return opts
