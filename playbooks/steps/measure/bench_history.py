"""The bench history on the controller: one JSON line per complete run (enough to compare, not
the whole result), appended atomically, read back by host and recipe. An incomplete run never
enters it: a partial sweep would be compared as if it were a run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from playbooks.errors import VoltaforgeError
from playbooks.steps.measure.atomic_files import atomic_write_bytes
from playbooks.steps.measure.bench_figures import TRACKED, per_stream
from playbooks.steps.measure.roofline import finite


class IncompleteResult(VoltaforgeError, ValueError):
    """A partial sweep (interrupted, a level missing) kept out of the history it would skew."""


def history_summary(result: dict[str, Any]) -> dict[str, Any]:
    """The line one run leaves in the history: enough to compare, not the whole result."""
    return {
        "at": result.get("at"),
        "host": result.get("host"),
        "recipe": result.get("recipe"),
        "recipe_sha256": result.get("recipe_sha256"),
        "build": (result.get("server") or {}).get("build"),
        "gate_passed": (result.get("gate") or {}).get("passed"),
        "roofline_tok_s": result.get("roofline_tok_s"),
        "mbu": result.get("mbu"),
        "levels": [
            {
                "concurrency": lv.get("concurrency"),
                **tracked(lv),
                # the interval compare judges a change by (runs before the repeats have none)
                **({"decode": lv["decode"]} if lv.get("decode") else {}),
            }
            for lv in result.get("levels") or []
        ],
    }


def append_history(result: dict[str, Any], history_file: Path) -> None:
    """Add this run's summary as one JSON line. A result not marked complete is refused.

    Atomic: the old lines plus the new one go to a temp file that replaces the history, so a
    reader sees the history before or after, never a torn last line. (Two controllers
    appending at the same instant could lose one line; a bench holds the host's lock.)
    """
    if result.get("complete") is not True:
        raise IncompleteResult(
            f"not added to {history_file}: the result is incomplete (complete={result.get('complete')!r}); "
            "a partial sweep would be compared as if it were a run"
        )
    history_file = Path(history_file)
    history_file.parent.mkdir(parents=True, exist_ok=True)
    old = history_file.read_bytes() if history_file.exists() else b""
    if old and not old.endswith(b"\n"):
        old += b"\n"
    line = json.dumps(history_summary(result), sort_keys=True, separators=(",", ":")) + "\n"
    atomic_write_bytes(history_file, old + line.encode())


def read_history(history_file: Path, host: str | None = None, recipe: str | None = None) -> list[dict[str, Any]]:
    """The history's runs, oldest line first, optionally one host's and/or one recipe's."""
    history_file = Path(history_file)
    if not history_file.exists():
        return []
    runs = []
    for n, line in enumerate(history_file.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            run = json.loads(line)
        except json.JSONDecodeError as e:
            raise VoltaforgeError(f"{history_file}:{n}: not a JSON line ({e.msg}); remove or fix that line") from e
        if (host is None or run.get("host") == host) and (recipe is None or run.get("recipe") == recipe):
            runs.append(run)
    return runs


def _pct(now: Any, then: Any) -> float | None:
    n, t = finite(now), finite(then)
    return (n - t) / t * 100 if n is not None and t else None


def tracked(level: dict[str, Any]) -> dict[str, Any]:
    """The TRACKED figures of a level (a result's or a history line's, old or new): the
    per-stream decode is the judged one (:func:`per_stream`), whatever the old field held."""
    return {k: per_stream(level) if k == "per_stream_decode_tok_s" else level.get(k) for k in TRACKED}
