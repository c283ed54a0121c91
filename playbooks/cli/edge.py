"""The one place where commands meet people: errors become one line and an exit code.

- A VoltaforgeError (bad flag, bad recipe, unreachable host, ...) prints ``error: <message>``
  on stderr and exits with its code (2), never a traceback.
- Anything unexpected prints one line naming the exception and a log file that holds the
  traceback (``$VOLTAFORGE_LOG_DIR`` or ``~/.cache/voltaforge/logs``), and exits 70
  (EX_SOFTWARE): a bug of ours, reported without drowning the user.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from playbooks.conduct.logs import log_dir
from playbooks.errors import VoltaforgeError

if TYPE_CHECKING:
    from playbooks.host.ops import Change

BUG_EXIT = 70


def _write_log(exc: BaseException) -> Path:
    d = log_dir()
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"error-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    path.write_text("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
    return path


def write_details(changes: Sequence[Change]) -> Path | None:
    """The full text of each failure whose one-line summary left something out (its why ends
    with "(full output in the log)") in one log file beside the tracebacks; None when there is
    none, or when the file cannot be written (the report still has the summaries)."""
    from playbooks.host.ops import FULL_OUTPUT_NOTE

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


def run_command(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """Run a command function; exit with its return code (0 when it returns None)."""
    try:
        code = fn(*args, **kwargs)
    except VoltaforgeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as exc:  # noqa: BLE001 - the edge: every other error is a bug to report
        try:
            where = f"the traceback is in {_write_log(exc)}"
        except OSError as log_exc:
            where = f"and the log could not be written ({log_exc})"
        print(f"error: unexpected {type(exc).__name__}: {exc}; {where}", file=sys.stderr)
        sys.exit(BUG_EXIT)
    if code:
        sys.exit(code)
