"""The cold quick start (issues 22, 35): the README's two commands, `bash scripts/install.sh`
and `.venv/bin/invoke provision`, in a fresh clone of this checkout's HEAD on this machine with
nothing of voltaforge cached, timed, its output counted; then the no-op the README shows;
asserts nothing.

Nothing cached: a fresh clone (no venv), a fresh VOLTAFORGE_CACHE (no pinned sdist: downloaded
from the package index; no generated model, no fleet cache) and a fresh install prefix (no
build venv, no build, no ccache); only what the machine itself provides stays (apt packages,
pip's own cache and find-links for torch). The provision runs on a pseudo-terminal (``script``),
as a user at a terminal sees it; the lines are what the terminal kept (the live progress line
redraws itself in place and is not counted). Then the no-op, piped, as the README's sample. A
server on the same port (the README's own quick start) is stopped first, and the benchmark's
is stopped at the end.

Usage: .venv/bin/python scripts/bench_quickstart.py
(writes reports/local/quickstart-cold.json and reports/local/provision-noop.json)
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from playbooks.results import write_result  # noqa: E402
from scripts.bench_provision import PROVISION_MEASURES  # noqa: E402

INVOKE = [sys.executable, "-m", "invoke", "-r", str(ROOT)]
#: what the two result files measure (results.py, ``measures``): the cold run's time is the
#: install and the steps' (the compile most of it); the no-op's is the read pass and the summary
#: (its gate line is gate.py's figures_line)
COLD_MEASURES = ["scripts/install.sh", "pyproject.toml", *PROVISION_MEASURES]
NOOP_MEASURES = [
    "tasks.py",
    "playbooks/conduct/provision.py",
    "playbooks/conduct/read_pass.py",
    "playbooks/conduct/known_reads.py",
    "playbooks/host/prefetch.py",
    "playbooks/cli/provision.py",
    "playbooks/steps/measure/gate.py",
]
REMOTE_CALLS = re.compile(r", (\d+) remote calls?\b")
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
    clone = work / "voltaforge"
    prefix = Path(f"/opt/vf-quickstart-{time.strftime('%Y%m%d%H%M%S')}")
    env = {
        **{k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "VIRTUAL_ENV")},
        "VOLTAFORGE_CACHE": str(work / "cache"),
        "VOLTAFORGE_LOG_DIR": str(work / "logs"),
        "INVOKE_VOLTAFORGE_PREFIX": str(prefix),
        "COLUMNS": "120",
        "LINES": "40",
    }
    subprocess.run([*INVOKE, "stop", "--host", "local"], cwd=ROOT, capture_output=True)  # the README's own server
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    commit = subprocess.run(
        ["git", "-C", str(clone), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    # 1. the set-up command, as typed
    t0 = time.monotonic()
    inst = subprocess.run(["bash", "scripts/install.sh"], cwd=clone, env=env, capture_output=True, text=True)
    install = time.monotonic() - t0
    install_lines = [x for x in (inst.stdout + inst.stderr).splitlines() if x.strip()]
    print(f"install: {install:.1f} s, exit {inst.returncode}, {len(install_lines)} lines", flush=True)
    if inst.returncode:
        print(inst.stdout + inst.stderr)
        return inst.returncode
    # 2. the main job on a terminal
    typed = ".venv/bin/invoke provision"
    raw = work / "terminal.txt"
    t0 = time.monotonic()
    r = subprocess.run(["script", "-q", "-e", "-c", typed, str(raw)], cwd=clone, env=env, stdin=subprocess.DEVNULL)
    cold = time.monotonic() - t0
    shown = visible_lines(raw.read_bytes())
    # 3. again: the no-op, piped, as the README shows it
    t0 = time.monotonic()
    again = subprocess.run(typed.split(), cwd=clone, env=env, capture_output=True, text=True)
    noop = time.monotonic() - t0
    piped = (again.stdout + again.stderr).rstrip("\n")
    calls = REMOTE_CALLS.search(piped)
    subprocess.run(
        [str(clone / ".venv/bin/invoke"), "stop", "--host", "local"], cwd=clone, env=env, capture_output=True
    )
    logs = sorted((work / "logs").glob("provision-*/local.log"))
    log_lines = len(logs[0].read_text().splitlines()) if logs else 0
    print(f"cold quick start: {cold:.1f} s, exit {r.returncode}, {len(shown)} lines on the terminal")
    print(f"the log: {log_lines} lines ({logs[0] if logs else 'none'})")
    print(f"again (no-op, piped): {noop:.2f} s, exit {again.returncode}, {len(piped.splitlines())} lines")
    print("--- the terminal ---")
    print("\n".join(shown))
    if r.returncode == 0:
        write_result(
            ROOT / "reports" / "local" / "quickstart-cold.json",
            "the README's two commands on this machine with nothing cached: install, then the main job",
            {
                "install_s": round(install, 1),
                "install_lines": len(install_lines),
                "cold_s": round(cold, 1),
                "total_s": round(install + cold, 1),
                "terminal_lines": len(shown),
                "log_lines": log_lines,
                "noop_s": round(noop, 2),
                "noop_piped_lines": len(piped.splitlines()),
            },
            {
                "install_s": "s",
                "install_lines": "lines",
                "cold_s": "s",
                "total_s": "s",
                "terminal_lines": "lines",
                "log_lines": "lines",
                "noop_s": "s",
                "noop_piped_lines": "lines",
            },
            ".venv/bin/python scripts/bench_quickstart.py",
            commit=commit,
            notes=(
                "A fresh clone, VOLTAFORGE_CACHE and install prefix (the sdist downloaded, the model generated, "
                "llama.cpp compiled once, no ccache); pip's own cache and this machine's find-links for torch "
                "(/opt/wheels) stay. `bash scripts/install.sh` timed alone, then `.venv/bin/invoke provision` on a "
                "pseudo-terminal; the lines are those the terminal kept."
            ),
            extra={"install": install_lines, "terminal": shown},
            measures=COLD_MEASURES,
        )
    if r.returncode == 0 and again.returncode == 0 and calls:
        write_result(
            ROOT / "reports" / "local" / "provision-noop.json",
            "invoke provision of tiny-cpu on this machine, again: the no-op",
            {"wall_s": round(noop, 2), "remote_calls": int(calls.group(1))},
            {"wall_s": "s", "remote_calls": "calls"},
            typed,
            commit=commit,
            notes="wall_s is the whole invoke process (the output's last line, added by the script that ran it); "
            "piped, bytecode written; right after the cold run of scripts/bench_quickstart.py",
            extra={"output": f"{piped}\n{noop:.2f} s wall"},
            measures=NOOP_MEASURES,
        )
    shutil.rmtree(prefix, ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)
    return r.returncode


if __name__ == "__main__":
    raise SystemExit(main())
