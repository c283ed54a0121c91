"""Files written whole or not at all: a temp file beside the target, fsynced, renamed over it.
The bench's reports and its history are written this way, so a reader never sees half a file
and an interrupted run leaves no stray ones."""

from __future__ import annotations

import io
import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def atomic_write(path: Path, write: Callable[[io.BufferedWriter], None]) -> Path:
    """Write through ``write`` into a temp file beside ``path``, fsync, rename over ``path``.

    The temp file is on the same filesystem (rename is atomic) and hidden; it is removed on
    every failure, so nothing but finished files is ever left in the folder.
    """
    path = Path(path)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".vf-tmp")
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; reports are meant to be read and shared
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def atomic_write_bytes(path: Path, data: bytes) -> Path:
    def write(f: io.BufferedWriter) -> None:
        f.write(data)

    return atomic_write(path, write)
