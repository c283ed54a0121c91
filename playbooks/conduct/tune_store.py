"""`invoke tune`'s measurements kept on the controller, one JSON line per measured level, and the
rule for reusing one: the same inputs (its key: build, artifact, command line, workload), made on
the same host facts (kernel, CPU, GPU and driver, the bandwidth fact) and younger than
``max_age_days``. A line cut short by a run killed mid-write is skipped, so a re-run resumes."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from playbooks.facts.membw import age_days
from playbooks.facts.provenance import Provenance
from playbooks.steps.measure.bench_run import bench_dir


def store_path(host_name: str, recipe_name: str, cache_root: Path | None = None) -> Path:
    """Where a host's tune measurements of a recipe are kept on the controller (JSON lines)."""
    return (cache_root or bench_dir().parent / "tune") / host_name / recipe_name / "measurements.jsonl"


def stored_rows(store: Path) -> list[dict[str, Any]]:
    """The measurements kept in ``store`` (none when it does not exist); a line cut short by a
    run killed mid-write is skipped."""
    if not store.exists():
        return []
    return [row for line in store.read_text().splitlines() if (row := _json_row(line)) is not None]


def _json_row(line: str) -> dict[str, Any] | None:
    """One stored line as its object; None for a line cut short (a run killed mid-write)."""
    try:
        row = json.loads(line)
    except ValueError:
        return None
    return row if isinstance(row, dict) else None


def kept_level(
    rows: Sequence[dict[str, Any]], key: str, provenance: Provenance, now: datetime, max_age_days: float
) -> tuple[dict[str, Any] | None, str | None]:
    """The kept level of ``key`` made on the same host facts (``provenance``) and younger than
    ``max_age_days``, or None with why the one kept cannot be reused (None: none was kept)."""
    why = None
    for row in rows:
        if row.get("key") != key or (row.get("level") or {}).get("error"):
            continue
        changed = provenance.changed(row.get("provenance"))
        age = age_days(row.get("at"), now)
        if changed:
            why = "the host changed since (" + "; ".join(changed) + ")"
        elif age is None or age > max_age_days:
            why = f"it is older than {max_age_days:g} days" if age is not None else "it was kept without its time"
        else:
            return dict(row["level"]), None
    return None, why


def keep_row(store: Path, row: dict[str, Any]) -> None:
    """One measurement added to ``store``: appended as one line, so what is kept survives a run
    killed later."""
    store.parent.mkdir(parents=True, exist_ok=True)
    with store.open("a") as f:
        f.write(json.dumps(row, sort_keys=True) + "\n")
