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
from collections.abc import Callable
from pathlib import Path
from typing import Any

from playbooks.conduct.logs import log_dir
from playbooks.errors import VoltaforgeError

BUG_EXIT = 70


def _write_log(exc: BaseException) -> Path:
    d = log_dir()
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"error-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    path.write_text("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
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
