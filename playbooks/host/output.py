"""Output of commands on hosts: the finished Result, and the Printer that shows lines as they come."""

from __future__ import annotations

import codecs
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO


@dataclass(frozen=True)
class Result:
    """What a finished command printed and how it exited."""

    stdout: str
    stderr: str
    exited: int

    @property
    def ok(self) -> bool:
        return self.exited == 0


class Printer:
    """Prints remote output line by line, each line prefixed with its host: ``[v100-01] ...``.

    Plain ``print`` on purpose: remote output may contain ``[brackets]`` that rich would take
    for markup. One lock for all hosts, so lines of parallel hosts never interleave mid-line.
    ``quiet=True`` silences it; ``out`` defaults to the *current* ``sys.stdout``.
    """

    _lock = threading.Lock()

    def __init__(self, out: TextIO | None = None, quiet: bool = False):
        self.out = out
        self.quiet = quiet

    def line(self, host: str, text: str) -> None:
        if self.quiet:
            return
        with self._lock:
            print(f"[{host}] {text}", file=self.out or sys.stdout, flush=True)


class LineSplitter:
    """Turns a stream of byte chunks into whole decoded lines for the printer."""

    def __init__(self, emit: Callable[[str], None]):
        self._emit = emit
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._buf = ""

    def feed(self, data: bytes) -> None:
        self._buf += self._decoder.decode(data)
        *lines, self._buf = self._buf.split("\n")
        for line in lines:
            self._emit(line.rstrip("\r"))

    def flush(self) -> None:
        self._buf += self._decoder.decode(b"", final=True)
        if self._buf:
            self._emit(self._buf)
        self._buf = ""


class BufferedPrinter(Printer):
    """Keeps the lines instead of printing them, for :meth:`replay` once it is known that they
    are the ones to show (a reads pass whose result may be thrown away)."""

    def __init__(self) -> None:
        super().__init__(quiet=True)
        self.lines: list[tuple[str, str]] = []

    def line(self, host: str, text: str) -> None:
        self.lines.append((host, text))

    def replay(self, to: Printer) -> None:
        for host, text in self.lines:
            to.line(host, text)


class HostPrinter(Printer):
    """Every line to the host's log file, then to the console, which decides what it shows
    (all of it by default; cli/live.py's view shows a line per step and a live line)."""

    def __init__(self, log: TextIO, console: Printer):
        super().__init__()
        self.log, self.console = log, console

    def line(self, host: str, text: str) -> None:
        with self._lock:
            self.log.write(f"{time.strftime('%H:%M:%S')} {text}\n")
            self.log.flush()
        self.console.line(host, text)
