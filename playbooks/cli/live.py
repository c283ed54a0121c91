"""What a long run shows while it runs: quiet by default, everything with ``-v``.

Every line a run prints goes to the host's log file whatever is shown (host/output.py's
HostPrinter, which conduct/provision gives each host, writes it there first); this decides
what reaches the terminal:

- ``-v``: every line, as it comes (the commands, the compiler's and pip's output), prefixed
  with its host: the old behaviour;
- quiet, on a terminal: a line per step as it starts, and one live line per host below them
  (rich) with what runs now: the compile as ``[73/140] llama-server`` (``[ 45%] ggml.c.o``
  with make), pip's download or build, the quantizer's tensor ``[12/29]``, the operation;
- quiet, piped: the same lines per step, no live line.

Both quiet forms print what a dry run would run (that is its purpose), every failure, and
before a failure the failing command's last lines, so the cause is on screen without the log.
"""

from __future__ import annotations

import re
import threading
from collections import deque
from types import TracebackType
from typing import TextIO, cast

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TaskID, TextColumn, TimeElapsedColumn

from playbooks.conduct.view import Printer

#: lines of the failing command shown before its failure
TAIL_LINES = 12
#: what a live line shows of a command or an output line
WIDTH = 70

_STEP = re.compile(r"^== (\S+) ==$")
_WHAT = r"(?:(?:Building|Linking) \S+ (?:object|\S+ library|executable) |Built target )?(\S+)"
# [73/140] Building CXX object ... (ninja); [ 12/ 29] blk.0.attn_q.weight ... (llama-quantize)
_COUNTED = re.compile(r"^\[\s*(\d+)\s*/\s*(\d+)\s*\]\s+" + _WHAT)
# [ 45%] Building CXX object ggml/src/CMakeFiles/ggml-base.dir/ggml.c.o (make)
_PERCENT = re.compile(r"^\[\s*(\d+)%\]\s+" + _WHAT)


def _short(text: str, width: int = WIDTH) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def _name(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


class LiveView(Printer):
    """The terminal side of a run's output (see the module doc); a context manager around the
    run, so the live lines end before the summary is printed."""

    def __init__(self, console: Console, verbose: bool = False):
        super().__init__(cast(TextIO, console.file))
        self.console, self.verbose = console, verbose
        self.live = console.is_terminal and not verbose
        self._progress: Progress | None = None
        self._tasks: dict[str, TaskID] = {}
        self._step: dict[str, str] = {}
        self._tails: dict[str, deque[str]] = {}
        self._mutex = threading.Lock()

    def __enter__(self) -> LiveView:
        if self.live:
            self._progress = Progress(
                SpinnerColumn(),
                TextColumn("{task.description}", markup=False),
                BarColumn(bar_width=20),
                TimeElapsedColumn(),
                console=self.console,
                transient=True,
            )
            self._progress.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    # -- the lines ---------------------------------------------------------------------------

    def line(self, host: str, text: str) -> None:
        if self.verbose:
            super().line(host, text)
            return
        with self._mutex:
            self._quiet(host, text)

    def _print(self, host: str, text: str) -> None:
        if self._progress is not None:
            self._progress.console.print(f"[{host}] {text}", markup=False, highlight=False, soft_wrap=True)
        else:
            print(f"[{host}] {text}", file=self.console.file, flush=True)

    def _quiet(self, host: str, text: str) -> None:
        tail = self._tails.setdefault(host, deque(maxlen=TAIL_LINES))
        step = _STEP.match(text)
        if step:
            self._step[host] = step.group(1)
            tail.clear()
            self._print(host, step.group(1))
            self._show(host, "")
            return
        if text.startswith("failed: "):
            for before in tail:
                self._print(host, f"  | {before}")
            self._print(host, f"{text} (every line: the host's log)")
            tail.clear()
            return
        if text.startswith("would run: "):
            self._print(host, text)
            return
        if text.startswith(("ok: ", "changed: ")):
            self._show(host, _short(text.split(" - ", 1)[0]))
            return
        if text.startswith("$ "):
            tail.clear()
            tail.append(text)
            self._show(host, _short(text))
            return
        tail.append(text)
        self._activity(host, text)

    def _activity(self, host: str, text: str) -> None:
        counted = _COUNTED.match(text)
        if counted:
            done, total, what = int(counted.group(1)), int(counted.group(2)), _name(counted.group(3))
            self._show(host, f"[{done}/{total}] {_short(what, 40)}", done, total)
            return
        percent = _PERCENT.match(text)
        if percent:
            self._show(host, f"[{percent.group(1)}%] {_short(_name(percent.group(2)), 40)}", int(percent.group(1)), 100)
            return
        if text.strip():
            # pip's download or build, the sweep's level, a warning: the latest line, shortened
            self._show(host, _short(text.strip()))

    def _show(self, host: str, activity: str, done: int | None = None, total: int | None = None) -> None:
        if self._progress is None:
            return
        description = f"[{host}] {self._step.get(host, '')}" + (f": {activity}" if activity else "")
        task = self._tasks.get(host)
        if task is None:
            self._tasks[host] = self._progress.add_task(description, total=total, completed=done or 0)
        else:
            self._progress.update(task, description=description, total=total, completed=done or 0)
