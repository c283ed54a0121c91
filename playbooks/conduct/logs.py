"""Where voltaforge writes its logs on this machine: ``$VOLTAFORGE_LOG_DIR``, else
``~/.cache/voltaforge/logs`` (tracebacks, cut failure output, one directory per provision run)."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path

from playbooks.host.ops import FULL_OUTPUT_NOTE, Change


def log_dir() -> Path:
    return Path(os.environ.get("VOLTAFORGE_LOG_DIR") or Path.home() / ".cache" / "voltaforge" / "logs")


def write_details(changes: Sequence[Change]) -> Path | None:
    """The full text of each failure whose one-line summary left something out (its why ends
    with "(full output in the log)") in one log file beside the tracebacks; None when there is
    none, or when the file cannot be written (the report still has the summaries)."""
    cut = [c for c in changes if c.detail and c.why.endswith(FULL_OUTPUT_NOTE)]
    if not cut:
        return None
    text = "".join(f"== {c.host}: {c.step} ({c.status})\n{c.detail.rstrip()}\n\n" for c in cut)
    path = log_dir() / f"failed-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    except OSError:
        return None
    return path
