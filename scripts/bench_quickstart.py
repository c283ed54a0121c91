"""The cold quick start (issue 22): the README's main job, `invoke provision` with no flags, on
this machine with nothing cached, timed, its output counted; asserts nothing.

Nothing cached: a fresh VOLTAFORGE_CACHE (no pinned sdist: downloaded from the package index;
no generated model, no fleet cache) and a fresh install prefix (no venv, no build, no ccache);
only what the machine itself provides stays (apt packages, pip's own find-links for torch).
The run happens on a pseudo-terminal (``script``), as a user at a terminal sees it; the lines
are what the terminal kept (the live progress line redraws itself in place and is not
counted). Then the no-op, piped, for its figure and its line count. A server of the same port
(the README's own quick start) is stopped first, and the benchmark's is stopped at the end.

Usage: .venv/bin/python scripts/bench_quickstart.py   (writes reports/local/quickstart-cold.json)
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from playbooks.results import write_result  # noqa: E402

INVOKE = [sys.executable, "-m", "invoke", "-r", str(ROOT)]
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def visible_lines(raw: bytes) -> list[str]:
    """The lines a terminal keeps: rich redraws its live line with carriage returns and
    cursor-up sequences, so only text that ends in a newline after the last redraw counts."""
    text = raw.decode("utf-8", "replace").replace("\r\n", "\n")
    kept = []
    for line in text.split("\n")[:-1]:
        line = ANSI.sub("", line.rsplit("\r", 1)[-1])
        kept.append(line)
    return [x for x in kept if x.strip()]


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="vf-quickstart-"))
    prefix = Path(f"/opt/vf-quickstart-{time.strftime('%Y%m%d%H%M%S')}")
    env = {
        **{k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"},
        "VOLTAFORGE_CACHE": str(work / "cache"),
        "VOLTAFORGE_LOG_DIR": str(work / "logs"),
        "INVOKE_VOLTAFORGE_PREFIX": str(prefix),
        "COLUMNS": "120",
        "LINES": "40",
    }
    subprocess.run([*INVOKE, "stop", "--host", "local"], cwd=ROOT, capture_output=True)  # the README's own server
    typed = shlex.join([*INVOKE, "provision"])
    raw = work / "terminal.txt"
    t0 = time.monotonic()
    r = subprocess.run(["script", "-q", "-e", "-c", typed, str(raw)], cwd=ROOT, env=env, stdin=subprocess.DEVNULL)
    cold = time.monotonic() - t0
    shown = visible_lines(raw.read_bytes())
    t0 = time.monotonic()
    again = subprocess.run([*INVOKE, "provision"], cwd=ROOT, env=env, capture_output=True, text=True)
    noop = time.monotonic() - t0
    piped = [x for x in (again.stdout + again.stderr).splitlines() if x.strip()]
    subprocess.run([*INVOKE, "stop", "--host", "local"], cwd=ROOT, env=env, capture_output=True)
    logs = sorted((work / "logs").glob("provision-*/local.log"))
    log_lines = len(logs[0].read_text().splitlines()) if logs else 0
    print(f"cold quick start: {cold:.1f} s, exit {r.returncode}, {len(shown)} lines on the terminal")
    print(f"the log: {log_lines} lines ({logs[0] if logs else 'none'})")
    print(f"again (no-op, piped): {noop:.2f} s, exit {again.returncode}, {len(piped)} lines")
    print("--- the terminal ---")
    print("\n".join(shown))
    if r.returncode == 0:
        write_result(
            ROOT / "reports" / "local" / "quickstart-cold.json",
            "scripts/bench_quickstart.py: the README's quick start on this machine with nothing cached",
            {
                "cold_s": round(cold, 1),
                "terminal_lines": len(shown),
                "log_lines": log_lines,
                "noop_s": round(noop, 2),
                "noop_piped_lines": len(piped),
            },
            {
                "cold_s": "s",
                "terminal_lines": "lines",
                "log_lines": "lines",
                "noop_s": "s",
                "noop_piped_lines": "lines",
            },
            ".venv/bin/python scripts/bench_quickstart.py",
            notes=(
                "A fresh VOLTAFORGE_CACHE and install prefix (the sdist downloaded, the model generated, llama.cpp "
                "compiled once, no ccache); torch from this machine's pip find-links (/opt/wheels). On a "
                "pseudo-terminal; the lines are those the terminal kept."
            ),
            extra={"terminal": shown},
        )
    shutil.rmtree(prefix, ignore_errors=True)
    return r.returncode


if __name__ == "__main__":
    raise SystemExit(main())
