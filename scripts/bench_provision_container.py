"""`invoke provision` from nothing to a passing gate in a booted Debian 12 container over SSH, and
again, timed by tests/test_provision_real.py's end-to-end test (it prints both); asserts
nothing itself: the test's own assertions hold the run.

The test runs as the suite runs it (one process, this checkout's venv); its line
``provision from nothing: <s> s; again (no-op): <s> s`` becomes the result file.

Usage: .venv/bin/python scripts/bench_provision_container.py   (as root: it boots a container)
(writes reports/local/provision-from-nothing.json)
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from playbooks.results import write_result  # noqa: E402
from scripts.bench_provision import PROVISION_MEASURES  # noqa: E402

TEST = "tests/test_provision_real.py::test_provision_a_systemd_host_end_to_end"
LINE = re.compile(r"provision from nothing: ([\d.]+) s; again \(no-op\): ([\d.]+) s")
MEASURES = [*PROVISION_MEASURES, "playbooks/steps/serve", "tests/test_provision_real.py"]


def main() -> int:
    argv = [sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider", "-q", "-s", TEST]
    r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    out = r.stdout + r.stderr
    m = LINE.search(out)
    print(m.group(0) if m else out[-3000:], f"(pytest exit {r.returncode})")
    if r.returncode or not m:
        return 1
    write_result(
        ROOT / "reports" / "local" / "provision-from-nothing.json",
        "invoke provision of tiny-cpu from nothing to a passing gate, a booted Debian 12 container over SSH",
        {"wall_s": float(m.group(1)), "noop_s": float(m.group(2))},
        {"wall_s": "s", "noop_s": "s"},
        f".venv/bin/python -m pytest -s {TEST} (it prints 'provision from nothing: <s> s; again (no-op): <s> s')",
        notes=(
            "The test's first provision: toolchain (pip offline from a wheelhouse), the server from the controller's "
            "fleet cache when the run holds one, else compiled (the run's shared ccache), the bindings on its "
            "libraries, quantize, a systemd unit, the gate; then the same command again."
        ),
        measures=MEASURES,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
