"""Run the real command line many times without paying for its imports each time.

`python -m invoke TASK ...` spends about 0.4 s of its 0.45 s importing Invoke and voltaforge's
collection (measured here: `python -c "import playbooks.cli.tasks"` 0.37 s). The flag walk
(tests/test_flags_all.py) runs it about 1,500 times. This server imports both once, then for
each request forks a child that does exactly what `python -m invoke` does after its imports
(``invoke.main.program.run()`` on ``sys.argv``), in the request's working directory, with the
request's whole environment and its own stdout and stderr: a fresh process per case, as before,
whose exit status and output are what the test judges.

What the fork does not redo: reading the environment at import time (voltaforge reads none
there: every HOME, VOLTAFORGE_* and INVOKE_* read happens when a task runs) and Python's own
start (PYTHONPATH is the server's, started with the walk's).

Protocol, one JSON object per line on stdin: ``{"argv": [...], "cwd": ..., "env": {...},
"timeout": s}``; one per line on stdout: ``{"rc": n, "stdout": ..., "stderr": ...}``.
The server handles one request at a time; callers that want several at once start several.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def serve() -> None:
    import invoke.main  # noqa: F401  the imports every case would pay for

    import playbooks.cli.tasks  # noqa: F401

    out = sys.stdout
    for line in sys.stdin:
        request = json.loads(line)
        with tempfile.TemporaryFile() as o, tempfile.TemporaryFile() as e:
            pid = os.fork()
            if pid == 0:  # the child: the case
                code = 70
                try:
                    os.dup2(o.fileno(), 1)
                    os.dup2(e.fileno(), 2)
                    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
                    sys.stdin = open(os.devnull)  # noqa: SIM115
                    os.chdir(request["cwd"])
                    os.environ.clear()
                    os.environ.update(request["env"])
                    signal.alarm(int(request.get("timeout", 120)))
                    sys.argv = ["invoke", *request["argv"]]
                    from invoke.main import program

                    try:
                        program.run()
                        code = 0
                    except SystemExit as exc:
                        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(code)
            _, status = os.waitpid(pid, 0)
            rc = os.waitstatus_to_exitcode(status)
            o.seek(0)
            e.seek(0)
            text = {"stdout": o.read().decode(errors="replace"), "stderr": e.read().decode(errors="replace")}
            answer = {"rc": rc, **text}
        out.write(json.dumps(answer) + "\n")
        out.flush()


class CliFork:
    """A client of one server; ``run`` answers as subprocess.run(capture_output=True, text=True)."""

    def __init__(self, env: dict[str, str]):
        self.proc = subprocess.Popen(
            [sys.executable, __file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            cwd=ROOT,
            text=True,
        )

    def run(self, argv: list[str], cwd: Path, env: dict[str, str], timeout: int = 120) -> Any:
        assert self.proc.stdin and self.proc.stdout
        request = {"argv": argv, "cwd": str(cwd), "env": env, "timeout": timeout}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the CLI fork server ended (exit {self.proc.wait()})")
        a = json.loads(line)
        return subprocess.CompletedProcess(["invoke", *argv], a["rc"], a["stdout"], a["stderr"])

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait(timeout=30)


if __name__ == "__main__":
    serve()
