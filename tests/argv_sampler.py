"""Every process's command line, sampled while something runs: does any argv hold a secret?

``/proc`` of this machine lists the processes of the test hosts too (a private sshd runs here;
a booted container's PID namespace is a child of this one), so one sampler watches the
controller and the host side at once. A sampler that finds nothing proves something only
beside a positive control that it does find: :func:`hold_in_argv` puts the needle in a real
process's argv for a while (tests call it, or today's offending command, and expect a hit).
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path


class ArgvSampler:
    """Reads /proc/*/cmdline every ``interval`` seconds in a thread; keeps the command lines
    that hold ``needle`` (with the pid) and counts its rounds."""

    def __init__(self, needle: str, interval: float = 0.01):
        self.needle = needle.encode()
        self.interval = interval
        self.hits: list[tuple[int, str]] = []
        self.rounds = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._me = os.getpid()

    def _loop(self) -> None:
        while not self._stop.is_set():
            for entry in os.scandir("/proc"):
                if not entry.name.isdigit() or int(entry.name) == self._me:
                    continue
                try:
                    argv = Path(entry.path, "cmdline").read_bytes()
                except OSError:
                    continue
                if self.needle in argv:
                    self.hits.append((int(entry.name), argv.replace(b"\0", b" ").decode("utf-8", "replace")))
            self.rounds += 1
            self._stop.wait(self.interval)

    def __enter__(self) -> ArgvSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def hold_in_argv(command: str, seconds: float = 0.5) -> None:
    """Run ``command`` (a bash line whose argv will hold the needle) with a FIFO on its stdin
    that stays open ``seconds``: the process lives long enough for any sampler to see it."""
    subprocess.run(["bash", "-c", f"{{ sleep {seconds}; }} | {{ {command}; }}"], check=False, timeout=30)
    time.sleep(0.05)
