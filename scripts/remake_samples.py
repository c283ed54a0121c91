"""Re-make the locally measurable samples and figures (issue 35): one command, each result file
written by the script that measures it, with the code paths it measures (``measures``).

    .venv/bin/python scripts/remake_samples.py --list      # each file: held, stale (since which commits) or not held
    .venv/bin/python scripts/remake_samples.py --stale     # re-make what is stale (or not yet held)
    .venv/bin/python scripts/remake_samples.py             # re-make everything listed here
    .venv/bin/python scripts/remake_samples.py --only quickstart
    .venv/bin/python scripts/remake_samples.py --docs      # make nothing: the pages take the files' figures

Each maker runs on this machine and takes minutes (the cold quick start compiles llama.cpp):
run it on an otherwise idle machine, then commit the files. tests/test_samples_current.py fails
when a held file's code changed after the commit it names.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from playbooks.results import ResultError, changed_since, load_result  # noqa: E402
from tests.helpers import doc_pages  # noqa: E402
from tests.test_readme_figures import BLOCK_MARK, FENCE, MARK, _blank_markers, _tokens, shown  # noqa: E402


@dataclass(frozen=True)
class Maker:
    name: str
    files: tuple[str, ...]  # the result files it writes, relative to the checkout
    argv: tuple[str, ...]  # the script and its flags, run with this interpreter
    minutes: int  # about how long it takes on this 2-core machine


MAKERS = (
    Maker(
        "quickstart",
        ("reports/local/quickstart-cold.json", "reports/local/provision-noop.json"),
        ("scripts/bench_quickstart.py",),
        14,
    ),
    Maker(
        "bench-proof",
        (
            "reports/bench/proof.json",
            "reports/bench/process-effect.json",
            "reports/local/bench-sample.json",
            "reports/local/bench-against-sample.json",
            "reports/local/tune-sample.json",
        ),
        ("scripts/bench_proof.py",),
        40,
    ),
    Maker("noop", ("reports/local/bench-noop.json",), ("scripts/bench_noop.py", "--runs", "5", "--fleet", "10"), 6),
    Maker("lb-stream", ("reports/local/lb-stream.json",), ("scripts/bench_lb_stream.py", "--runs", "3"), 4),
    Maker(
        "steps",
        tuple(f"reports/local/{n}.json" for n in ("build", "quantize", "artifacts", "deploy", "membw")),
        ("scripts/bench_steps.py",),
        12,
    ),
    Maker("build-times", ("reports/local/bench-build.json",), ("scripts/bench_build.py", "--cpu"), 12),
    Maker(
        "provision-hosts",
        ("reports/local/bench-provision.json",),
        ("scripts/bench_provision.py", "--hosts", "3"),
        14,
    ),
    Maker("roll", ("reports/local/roll.json",), ("scripts/bench_roll.py",), 5),
    Maker(
        "set",
        ("reports/local/set-plan.json", "reports/local/set-gate.json", "reports/local/set-status.json"),
        ("scripts/sample_set.py",),
        2,
    ),
    Maker(
        "provision-container",
        ("reports/local/provision-from-nothing.json",),
        ("scripts/bench_provision_container.py",),
        8,
    ),
)


def state(path: str) -> str:
    """``held``, ``stale: <commits>`` or ``not held`` (the file names no code paths)."""
    try:
        r = load_result(ROOT / path)
    except ResultError as exc:
        return f"unreadable: {exc}"
    if not r.measures:
        return "not held (names no code paths)"
    try:
        changed = changed_since(r.commit, r.measures, ROOT)
    except ResultError as exc:
        return f"unknown: {exc}"
    return f"stale: changed by {', '.join(changed)}" if changed else f"held (made at {r.commit})"


def _as_shown(value: float, old: str, decimals: int, duration: bool) -> str:
    """The file's figure written the way the page wrote the old one (decimals, thousands
    separators, ``N min S s``)."""
    if duration:
        total = shown(value, decimals)
        minutes, seconds = divmod(total, 60)
        return f"{int(minutes)} min {seconds:.{decimals}f} s"
    text = f"{shown(value, decimals):,.{decimals}f}"
    return text if "," in old else text.replace(",", "")


def pick_up(text: str, root: Path = ROOT) -> str:
    """A page with every marked figure and every sample block set to its result file's (the
    files under ``root``)."""
    edits: list[tuple[int, int, str]] = []
    for m in BLOCK_MARK.finditer(text):
        fence = FENCE.match(text, m.end() + 1)
        output = load_result(root / m["file"]).extra.get("output") if fence else None
        if fence and isinstance(output, str):
            body_start = text.index("\n", fence.start()) + 1
            body_end = text.rindex("\n", 0, fence.end()) + 1
            edits.append((body_start, body_end, output.rstrip("\n") + "\n"))
    blank, previous_end = _blank_markers(text), 0
    for m in MARK.finditer(text):
        keys = m["keys"].split()
        line_start = text.rfind("\n", 0, m.start()) + 1
        found = _tokens(blank, max(line_start, previous_end), m.start())[-len(keys) :]
        previous_end = m.end()
        figures = load_result(root / m["file"]).figures
        for key, tok in zip(keys, found, strict=False):
            if key in figures:
                new = _as_shown(figures[key], tok.text, tok.decimals, tok.duration)
                # a change written with its sign (`+1.0%`) that is now a fall: `-7.3%`, not `+-7.3%`
                start = tok.start - 1 if new.startswith("-") and blank[tok.start - 1 : tok.start] == "+" else tok.start
                edits.append((start, tok.end, new))
    for start, end, new in sorted(edits, reverse=True):
        text = text[:start] + new + text[end:]
    return text


def pick_up_pages() -> list[Path]:
    """Every page rewritten with today's result files; the pages that changed."""
    changed = []
    for page in doc_pages():
        old = page.read_text()
        new = pick_up(old)
        if new != old:
            page.write_text(new)
            changed.append(page)
    return changed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--list", action="store_true", help="say each file's state, make nothing")
    ap.add_argument("--stale", action="store_true", help="only the makers with a file not held or stale")
    ap.add_argument("--only", choices=[m.name for m in MAKERS], action="append", help="this maker (repeatable)")
    ap.add_argument("--docs", action="store_true", help="make nothing: set the pages' figures and samples to the files")
    args = ap.parse_args()
    if args.docs:
        for page in pick_up_pages():
            print(f"updated {page.relative_to(ROOT)}")
        return 0
    chosen = [m for m in MAKERS if not args.only or m.name in args.only]
    if args.list:
        for m in chosen:
            for f in m.files:
                print(f"{m.name:12} {f:40} {state(f)}")
        return 0
    if args.stale:
        chosen = [m for m in chosen if any(not state(f).startswith("held") for f in m.files)]
    print(f"making {len(chosen)}: " + ", ".join(f"{m.name} (about {m.minutes} min)" for m in chosen), flush=True)
    failed = []
    for m in chosen:
        t0 = time.monotonic()
        print(f"--- {m.name}: {' '.join(m.argv)}", flush=True)
        code = subprocess.run([sys.executable, *m.argv], cwd=ROOT).returncode
        print(f"--- {m.name}: exit {code} in {time.monotonic() - t0:.0f} s", flush=True)
        if code:
            failed.append(m.name)
    for m in chosen:
        for f in m.files:
            print(f"{f:40} {state(f)}")
    for page in pick_up_pages():  # the docs pick the new figures up
        print(f"updated {page.relative_to(ROOT)}")
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
