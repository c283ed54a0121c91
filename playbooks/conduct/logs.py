"""Where voltaforge writes its logs on this machine: ``$VOLTAFORGE_LOG_DIR``, else
``~/.cache/voltaforge/logs`` (tracebacks, cut failure output, one directory per provision run)."""

from __future__ import annotations

import os
from pathlib import Path


def log_dir() -> Path:
    return Path(os.environ.get("VOLTAFORGE_LOG_DIR") or Path.home() / ".cache" / "voltaforge" / "logs")
