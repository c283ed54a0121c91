"""A rolling change under load, and the same load without the drain (issue 51, item 6): the
real output of tests/test_roll_real.py (two managed llama-servers of one model behind HAProxy,
a steady load through the balancer while provision's deploy step changes both servers'
context, then a change whose gate cannot pass), and the same test with the roll's drain and
return made no-ops (scripts/roll_without_drain.py: each server restarted in place, in
rotation), whose own assertions then fail on the requests the restarts cut. Asserts nothing.

Usage: .venv/bin/python scripts/bench_roll.py
(writes reports/local/roll.json: the lines the test prints, and the requests of each run)
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from playbooks.results import write_result  # noqa: E402

TEST = "tests/test_roll_real.py::test_a_rolling_change_under_load_loses_no_request"
COUNTS = re.compile(r"^(rolling|failing) change: (\d+) requests, (\d+) failed$")
MEASURES = ["playbooks/conduct/roll.py", "playbooks/steps/serve/runtime_api.py", "tests/test_roll_real.py"]


def run(*plugin: str) -> tuple[int, list[str]]:
    argv = [sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider", *plugin, "-q", "-s", TEST]
    r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, env=None)
    lines = [ln.strip() for ln in r.stdout.splitlines()]
    said = [ln for ln in lines if COUNTS.match(ln) or ln.startswith("rolled ")]
    print("\n".join(said) or r.stdout[-3000:], f"(pytest exit {r.returncode})", flush=True)
    return r.returncode, said


def counts(lines: list[str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for ln in lines:
        if m := COUNTS.match(ln):
            out[f"{m.group(1)}_requests"], out[f"{m.group(1)}_failed"] = int(m.group(2)), int(m.group(3))
    return out


def main() -> int:
    code, with_drain = run()
    if code:
        return code
    _, without = run("-p", "scripts.roll_without_drain")
    figures = counts(with_drain)
    plain = counts(without)
    if "rolling_requests" not in figures or "rolling_requests" not in plain:
        return 1
    figures |= {"in_place_requests": plain["rolling_requests"], "in_place_failed": plain["rolling_failed"]}
    write_result(
        ROOT / "reports" / "local" / "roll.json",
        "a rolling change of two managed llama-servers behind HAProxy under load, then a failing one; "
        "and the same change with the servers restarted in place (no drain)",
        figures,
        {k: ("failed" if k.endswith("_failed") else "requests") for k in figures},
        f".venv/bin/python -m pytest -s {TEST}; the same with -p scripts.roll_without_drain",
        notes=(
            "extra.output: the lines the test prints, in its order (the rolled lines after each change's count). "
            "in_place_*: the first change's requests with the drain and return made no-ops (the test's own "
            "assertions then fail on the cut requests, as they should)."
        ),
        extra={"output": "\n".join(with_drain), "in_place_output": "\n".join(without)},
        measures=MEASURES,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
