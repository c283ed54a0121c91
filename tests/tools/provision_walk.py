"""The walk of `invoke provision --dry-run` (issue 59): which of our modules run, in order, and how
often the walk goes back to a module it had left.

Two runs on this machine, each a `local: true` inventory entry over a fresh prefix (a dry run
only reads, so nothing changes): the built-in default recipe (tiny-cpu) on one host, and a
layout host serving two recipes (inventory ``serve:``). Every Python call is seen
(sys.setprofile); a call's module is its function's ``__name__``; consecutive calls in one
module are one visit. A *return* is a visit to a module the walk had already left. Counted
twice: over every module of playbooks/, and over the assembling layers alone (playbooks.conduct
and playbooks.steps: where a step is put together, the walk the issue traces), where helpers
called from everywhere (host, facts, plan) do not count.

    python -m tests.tools.provision_walk          # prints both runs' counts as JSON
    python -m tests.tools.provision_walk --against REV --out reports/local/provision-walk.json

``--against REV``: the same walk of the commit REV too (a temporary git worktree, the walk run
there by that commit's own copy of this tool), both written side by side as a result file.
It asserts nothing: a figure to compare before and after a change (docs/layout.md).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ("playbooks.conduct.", "playbooks.steps.")


@contextlib.contextmanager
def walked() -> Iterator[list[str]]:
    """The modules of playbooks/ whose functions are called meanwhile, one entry per visit."""
    seen: list[str] = []

    def profile(frame: Any, event: str, _arg: Any) -> None:
        if event != "call":
            return
        name = frame.f_globals.get("__name__", "")
        if name.startswith("playbooks.") and (not seen or seen[-1] != name):
            seen.append(name)

    sys.setprofile(profile)
    try:
        yield seen
    finally:
        sys.setprofile(None)


def returns(visits: list[str], keep: Callable[[str], bool] = lambda _: True) -> dict[str, int]:
    """Visits, distinct modules and returns (a visit to a module already left) of the walk
    narrowed to the modules ``keep`` admits (consecutive visits to one module merged again)."""
    narrowed: list[str] = []
    for m in visits:
        if keep(m) and (not narrowed or narrowed[-1] != m):
            narrowed.append(m)
    left: set[str] = set()
    back = 0
    for before, now in zip(narrowed, narrowed[1:], strict=False):
        left.add(before)
        back += now in left
    return {"visits": len(narrowed), "modules": len(set(narrowed)), "returns": back}


def _walk(inventory: dict[str, Any], host: str) -> dict[str, Any]:
    from playbooks.cli.provision import run_provision
    from playbooks.conduct.provision import Options
    from playbooks.conduct.settings import Settings

    with tempfile.TemporaryDirectory(prefix="vf-walk-") as tmp:
        inventory["hosts"][host]["prefix"] = f"{tmp}/vf"
        path = Path(tmp) / "inventory.yaml"
        path.write_text(yaml.safe_dump(inventory))
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out), walked() as visits:
            code = run_provision([host], options=Options(dry_run=True), settings=Settings(inventory=path))
    return {
        "exit": code,
        "all": returns(visits),
        "assembling": returns(visits, lambda m: m.startswith(LAYERS)),
    }


def walks() -> dict[str, Any]:
    local = {"host": "127.0.0.1", "local": True}
    layout = {
        **local,
        "serve": [
            {"recipe": "tiny-cpu", "port": 18180},
            {"recipe": "tiny-moe-cpu", "port": 18190},
        ],
    }
    return {
        "default": _walk({"hosts": {"walk": dict(local)}}, "walk"),
        "layout": _walk({"hosts": {"walk-layout": layout}}, "walk-layout"),
    }


def walks_at(rev: str) -> tuple[str, dict[str, Any]]:
    """The walk of commit ``rev`` (its short sha, the counts), run in a worktree of it."""
    git = ["git", "-C", str(ROOT)]
    sha = subprocess.run([*git, "rev-parse", "--short", rev], capture_output=True, text=True, check=True).stdout
    with tempfile.TemporaryDirectory(prefix="vf-walk-rev-") as tmp:
        tree = f"{tmp}/tree"
        subprocess.run([*git, "worktree", "add", "--detach", "-q", tree, rev], check=True)
        try:
            # cwd first on sys.path: that commit's playbooks/, not this checkout's
            walk = [sys.executable, "-m", "tests.tools.provision_walk"]
            out = subprocess.run(walk, cwd=tree, capture_output=True, text=True, check=True).stdout
        finally:
            subprocess.run([*git, "worktree", "remove", "--force", tree], check=True)
    return sha.strip(), json.loads(out)


def write_compared(out: Path, rev: str, before: dict[str, Any], now: dict[str, Any]) -> None:
    from playbooks.results import write_result

    figures: dict[str, float] = {}
    for when, got in (("before", before), ("after", now)):
        for run in ("default", "layout"):
            for scope in ("assembling", "all"):
                figures[f"{run}_{scope}_returns_{when}"] = got[run][scope]["returns"]
    write_result(
        out,
        "returns to a module already left during `invoke provision --dry-run`, before and after",
        figures,
        dict.fromkeys(figures, "count"),
        f"python -m tests.tools.provision_walk --against {rev} --out {out}",
        notes=f"before: commit {rev}, run in a worktree of it; after: this checkout. assembling: "
        "playbooks.conduct and playbooks.steps only; all: every module of playbooks/",
        extra={"before": before, "after": now},
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", help="a commit to walk too, for comparison")
    ap.add_argument("--out", type=Path, help="with --against: the result file to write")
    args = ap.parse_args()
    got = walks()
    if args.against:
        rev, before = walks_at(args.against)
        if args.out:
            write_compared(args.out, rev, before, got)
        got = {"before": before, "after": got}
    print(json.dumps(got, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
