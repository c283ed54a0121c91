"""Every program started while something runs, with its whole argv: does any hold a secret?

strace records each ``execve`` as the kernel sees it, so nothing is missed by being quick. (The
sampler this replaced read ``/proc/*/cmdline`` every 10 ms and caught the pre-issue-31 key check
in 12 of 200 runs when issue 51 was filed: a ``grep`` lives a millisecond.) Two ways in, both
from outside the code under test:

- **under** (:meth:`ExecTrace.under`, :meth:`ExecTrace.wrap`): a command started under ``strace
  -f``, which records it and everything it ever starts: the CLI runs of the controller, with
  every process they start on this machine (``--seccomp-bpf``: the filter is inherited, so only
  execve stops them), and a private sshd (each SSH session forks from it: every command the
  host runs, a managed server included; without the filter, which would keep sudo from
  gaining root, so each of their system calls stops them: slower, still correct).
- **attached** (``pids``): ``strace -f -p PID ...`` to running processes and every child they
  start from then on: the booted container's PID 1 and every process already in it (its sshd
  among them), so whatever the container runs, a unit's start included, is seen.
  ``--seccomp-bpf`` does not apply to attached processes: they stop on every system call while
  traced, slower, still correct.

Every trace goes to a file in ``out``; :meth:`ExecTrace.holding` searches them all. The argv is
written with ``-s`` wide enough for any command line the host layer sends, and strace escapes
only quotes, backslashes and unprintable bytes, so a key of URL-safe characters appears as it is.
Environments are not printed (strace shows their count): the check is about argv, which any
local user can read in ``/proc``.
"""

from __future__ import annotations

import itertools
import re
import signal
import subprocess
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

#: every string whole: the longest command line the host layer sends is a few KiB
STRING_LIMIT = 1 << 20
_EXECVE = re.compile(r'^(\d+) +execve\("([^"]*)", \[(.*)\], ')


def strace_argv(out: Path, *, attach: Iterable[int] = (), seccomp: bool = False) -> list[str]:
    argv = ["strace", "-f", "-qq", "-e", "trace=execve", "-e", "signal=none", "-s", str(STRING_LIMIT)]
    if seccomp:
        argv.append("--seccomp-bpf")  # the filter is installed in what strace starts itself
    argv += ["-o", str(out)]
    for pid in attach:
        argv += ["-p", str(pid)]
    return argv


def tracer_of(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("TracerPid:"):
                return int(line.split()[1]) or None
    except OSError:
        return None
    return None


class ExecTrace:
    """The execs of ``pids`` (attached, with every child started from then on) and of each
    command :meth:`wrap` returns, in trace files under ``out``."""

    def __init__(self, out: Path, pids: Sequence[int] = ()):
        self.out = out
        self.pids = tuple(pids)
        self._proc: subprocess.Popen | None = None
        self._n = itertools.count()
        out.mkdir(parents=True, exist_ok=True)

    def __enter__(self) -> ExecTrace:
        if self.pids:
            self._proc = subprocess.Popen(
                strace_argv(self.out / "attached.trace", attach=self.pids),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=open(self.out / "attached.err", "wb"),  # noqa: SIM115 (lives as long as strace)
            )
            # traced only once every process has strace as its tracer: what starts before is not seen
            deadline = time.monotonic() + 30
            while any(tracer_of(p) != self._proc.pid for p in self.pids if Path(f"/proc/{p}").exists()):
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"strace did not attach to {self.pids}: {self.errors()}")
                time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is not None:
            self._proc.send_signal(signal.SIGINT)  # detaches from every tracee and exits
            try:
                self._proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()

    def wrap(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run under strace, writing to a trace file of its own in ``out``."""
        return [*self.under(), *argv]

    def under(self, *, sudo: bool = False) -> list[str]:
        """The command line to put before a command so that it, and everything it ever starts,
        runs under strace, into its own file: with ``--seccomp-bpf`` (only execve stops them),
        unless something under it runs ``sudo``: strace sets no_new_privs for the filter, and
        setuid programs then gain nothing (seen: sudo failing under a traced sshd)."""
        return [*strace_argv(self.out / f"wrapped-{next(self._n)}.trace", seccomp=not sudo), "--"]

    def errors(self) -> str:
        path = self.out / "attached.err"
        return path.read_text(errors="replace")[-2000:] if path.exists() else ""

    def execs(self) -> list[str]:
        """Every execve recorded, one line each: failed ones too (a path search tries each PATH
        entry with the whole argv), and a call another process interrupted (``<unfinished
        ...>``) still carries its argv."""
        lines = []
        for trace in sorted(self.out.glob("*.trace")):
            lines += [ln for ln in trace.read_text(errors="replace").splitlines() if _EXECVE.match(ln)]
        return lines

    def programs(self) -> list[str]:
        """The path each execve ran (the first argument), in order."""
        return [m.group(2) for ln in self.execs() if (m := _EXECVE.match(ln))]

    def holding(self, needle: str, program: str | None = None) -> list[str]:
        """The execs whose line holds ``needle``; of the program named ``program`` only, if given."""
        return [
            ln
            for ln in self.execs()
            if needle in ln and (program is None or ((m := _EXECVE.match(ln)) and Path(m.group(2)).name == program))
        ]
