"""How a secret is named in recipes and the inventory: a file under /etc/voltaforge/secrets/."""

from __future__ import annotations

import re

#: a secret's file name (service.api_key_ref, lb.api_key_ref)
SECRET_REF_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")


def check_secret_ref(v: str | None) -> str | None:
    """A secret's name reaches a unit's LoadCredential= line: no path, no space, no specifier,
    nothing a unit file would read as syntax."""
    if v is not None and not SECRET_REF_RE.fullmatch(v):
        raise ValueError("must be a secret's file name: letters, digits, _ and - (no path)")
    return v
