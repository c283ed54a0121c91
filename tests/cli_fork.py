"""The CLI run as ``python -m invoke ARGS`` runs it, in a fresh process, without paying for a
fresh interpreter each time.

The walks over every flag and every configuration key (tests/test_flags_all.py) run the CLI
some thousand times. A new interpreter spends about 0.45 s of its 0.8 s importing invoke and
voltaforge before the task starts, which was most of those walks' cost. Here each run is a
process forked by multiprocessing's fork server, which imported those modules once (and
nothing else: it is started clean, single-threaded, before any test state exists), so each
run starts with them in ``sys.modules`` and with no state a run before it left: its own
process, its own cwd and environment (replaced whole), its stdout and stderr files, its exit
status. From there the code path is ``invoke.main.program.run()`` on ``sys.argv``, what
``python -m invoke`` runs, or the installed ``voltaforge`` command's ``program.run()``.

What a forked run cannot show is what happens before that: the interpreter's start and the
imports themselves. tests/test_cli.py runs the CLI in real subprocesses (``invoke``, the
installed command, the import cost) for that.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import tempfile
from pathlib import Path

#: imported once in the fork server: what every run would import first
PRELOAD = ["invoke", "invoke.main", "playbooks.cli.main", "playbooks.cli.tasks"]

_context = multiprocessing.get_context("forkserver")
_context.set_forkserver_preload(PRELOAD)


def _child(argv: list[str], cwd: str, env: dict[str, str], out: str, err: str, program: str) -> None:
    """In the forked process: become the run (fds, cwd, environment, argv), run, exit with its
    status. Never returns."""
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(target, fd)
        os.close(target)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = argv
    code: object = 0
    try:
        if program == "invoke":
            from invoke.main import program as cli
        else:
            from playbooks.cli.main import program as cli
        cli.run()
    except SystemExit as e:
        code = e.code
    if code is None:
        code = 0
    elif not isinstance(code, int):  # sys.exit("message"): printed, status 1, as the interpreter does
        print(code, file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_cli(
    args: list[str], *, cwd: Path, env: dict[str, str], program: str = "invoke", timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """``python -m invoke ARGS`` (program="invoke") or the ``voltaforge`` command's
    ``program.run()`` (program="voltaforge") in cwd with exactly env: its exit status, stdout
    and stderr. A run still going after ``timeout`` seconds is killed (status -9)."""
    with tempfile.TemporaryDirectory(prefix="vf-cli-") as tmp:
        out, err = f"{tmp}/stdout", f"{tmp}/stderr"
        argv = [program, *args]
        proc = _context.Process(target=_child, args=(argv, str(cwd), dict(env), out, err, program))
        proc.start()
        proc.join(timeout)
        if proc.exitcode is None:
            proc.kill()
            proc.join()
        code = proc.exitcode if proc.exitcode is not None else -9
        read = lambda p: Path(p).read_text(errors="replace") if Path(p).exists() else ""  # noqa: E731
        return subprocess.CompletedProcess(argv, code, read(out), read(err))
