"""A CI run's cost as a result file (reports/ci/), from what the run left: its log and its start
and end stamps (``date +%s`` before and after ``bash .ci/run``).

    .venv/bin/python scripts/ci_cost.py --log /tmp/cold.log --start 1733350000 --end 1733352400 \\
        --commit 5640972 --title "..." --notes "..." reports/ci/cold-stop61.json

Figures: the wall time (s and min), pytest's own time, the tests passed and failed. ``extra``
holds the slowest tests as pytest's ``--durations`` printed them (the ten first), so
docs/tests.md can quote them from the file.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from playbooks.results import write_result  # noqa: E402

SUMMARY = re.compile(r"^(?:(\d+) failed, )?(\d+) passed.* in ([\d.]+)s", re.M)
DURATION = re.compile(r"^([\d.]+)s (call|setup|teardown)\s+(\S+)$", re.M)


def read_log(text: str) -> tuple[dict[str, float], list[dict[str, object]]]:
    """(passed, failed, pytest_s) and the slowest tests (seconds, phase, test) from a log."""
    summary = SUMMARY.findall(text)
    if not summary:
        raise SystemExit("no pytest summary line ('N passed ... in S s') in the log")
    failed, passed, seconds = summary[-1]
    slowest = [{"s": float(s), "phase": phase, "test": test} for s, phase, test in DURATION.findall(text)]
    return {"passed": int(passed), "failed": int(failed or 0), "pytest_s": float(seconds)}, slowest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--log", type=Path, required=True)
    ap.add_argument("--start", type=int, required=True)
    ap.add_argument("--end", type=int, required=True)
    ap.add_argument("--commit", required=True)
    ap.add_argument("--title", required=True)
    ap.add_argument("--notes", default="")
    ap.add_argument("--command", default="git clone /work/main /work/ci-clone && cd /work/ci-clone && bash .ci/run")
    args = ap.parse_args()
    counts, slowest = read_log(args.log.read_text(errors="replace"))
    wall = args.end - args.start
    figures = {"wall_s": wall, "wall_min": round(wall / 60, 1), **counts}
    units = {"wall_s": "s", "wall_min": "min", "pytest_s": "s", "passed": "tests", "failed": "tests"}
    write_result(
        args.out,
        args.title,
        figures,
        units,
        args.command + " (start and end taken with date +%s around it)",
        notes=args.notes,
        extra={"slowest": slowest[:10]},
        commit=args.commit,
    )
    print(f"{args.out}: {figures}")


if __name__ == "__main__":
    main()
