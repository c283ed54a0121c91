"""Each process's own speed, from a proof's kept files (issue 53): prints figures, asserts nothing.

`scripts/bench_proof.py --keep` leaves each proof run's bench history and every `bench --against`
result under its work directory. Per proof run this reads the deployed Q8_0 server's
single-stream decode over its bench runs (one process, deployed once per proof run: `--noise`,
the unchanged `--compare`) and, in each unchanged `--against`, the two sides' means at one stream
and every fresh process's own figure (each block is one: A, B, B, A a cycle). Where the same
configuration runs at several speeds in several processes for their whole life, the process, not
the run, is what a comparison of configurations must replicate; the spread of the processes'
speeds (a block's own noise and the machine's modes in it: a process serves one block) bounds
the size of that effect.

Usage: .venv/bin/python scripts/process_effect.py WORK_DIR   (the proof's work directory)
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from playbooks.results import write_result  # noqa: E402

#: what the figures are of (bench_proof.BENCH_CODE: imported there, so kept here)
BENCH_CODE = [
    "playbooks/cli/bench.py",
    "playbooks/conduct/bench.py",
    "playbooks/steps/measure/bench.py",
    "playbooks/steps/measure/bench_run.py",
    "playbooks/steps/measure/bench_ceilings.py",
    "playbooks/steps/measure/atomic_files.py",
    "playbooks/steps/measure/bench_figures.py",
    "playbooks/steps/measure/bench_render.py",
    "playbooks/steps/measure/bench_history.py",
    "playbooks/steps/measure/bench_compare.py",
    "playbooks/steps/measure/bench_stats.py",
    "playbooks/steps/measure/bench_noise.py",
    "playbooks/steps/measure/roofline.py",
    "playbooks/steps/measure/bench_against.py",
    "playbooks/steps/measure/paired.py",
    "playbooks/conduct/bench_against.py",
    "playbooks/conduct/scratch.py",
]


def single(levels: list[dict[str, Any]]) -> float | None:
    one = next((lv for lv in levels if lv.get("concurrency") == 1), None)
    return ((one or {}).get("decode") or {}).get("mean")


def per_process(blocks: list[dict[str, Any]]) -> list[float]:
    """An unchanged --against level's processes (each block its own), each one's figure."""
    return [v for block in blocks if (v := block["decode"])]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("work", type=Path)
    ap.add_argument("--no-report", action="store_true")
    args = ap.parse_args()
    how = f".venv/bin/python scripts/process_effect.py {args.work} (the files of a scripts/bench_proof.py run)"
    report(args.work, write=not args.no_report, command=how)
    return 0


def report(
    work: Path,
    write: bool = True,
    command: str = ".venv/bin/python scripts/bench_proof.py (its kept files, read by scripts/process_effect.py)",
) -> dict[str, Any]:
    """The figures of the proof kept under ``work`` (written to reports/ unless ``write`` is false)."""
    runs = []
    all_processes: list[float] = []
    for proof in sorted(work.glob("proof-*")):
        history = [json.loads(line) for line in (proof / "bench" / "history.jsonl").read_text().splitlines()]
        # the deployed Q8_0 process's runs: the first eight (six --noise runs, the unchanged compare and its
        # history entry); the deploys after them are other processes
        served = [round(v, 1) for h in history[:7] if (v := single(h.get("levels") or []))]
        pairs = []
        for f in sorted(proof.glob("bench/*/*/against-*/against.json")):
            got = json.loads(f.read_text())
            if not got["b"]["recipe"].endswith("-q8_0"):
                continue  # a change, not the unchanged pair
            one = next(lv for lv in got["levels"] if lv["concurrency"] == 1)
            all_processes.extend(per_process(one["blocks"]))
            pairs.append(
                {
                    "a": one["a"]["decode"],
                    "b": one["b"]["decode"],
                    "change_pct": round(one["change"]["change"] * 100, 1),
                }
            )
        runs.append({"proof": proof.name, "deployed_c1": served, "unchanged_pairs_c1": pairs})
        print(proof.name, served, pairs)
    means = [statistics.fmean(r["deployed_c1"]) for r in runs if r["deployed_c1"]]
    # the fresh processes' single-stream figures spread: a process's own speed, a block's own
    # noise and the window's mode together (one block a process: they cannot be told apart here)
    total = statistics.variance([math.log(v) for v in all_processes]) if len(all_processes) > 2 else 0.0
    spreads = [(max(r["deployed_c1"]) - min(r["deployed_c1"])) / statistics.fmean(r["deployed_c1"]) for r in runs]
    figures = {
        "deployed_c1_mean_min": round(min(means), 1),
        "deployed_c1_mean_max": round(max(means), 1),
        "between_processes_pct": round((max(means) / min(means) - 1) * 100, 1),
        "within_process_range_max_pct": round(max(spreads) * 100, 1),
        "unchanged_pair_c1_change_max_pct": max(abs(p["change_pct"]) for r in runs for p in r["unchanged_pairs_c1"]),
        "fresh_processes": len(all_processes),
        "process_sd_pct": round(math.sqrt(total) * 100, 1),
    }
    print(json.dumps(figures))
    if write:
        write_result(
            ROOT / "reports" / "bench" / "process-effect.json",
            "one configuration, several processes: each deployed server's single stream over its bench runs, "
            "and the unchanged pairs of bench --against",
            figures,
            {k: "%" if k.endswith("_pct") else "tok/s" for k in figures},
            command,
            notes="the proof's three runs, each with its own deployment of the Q8_0 server (a fresh process); "
            "deployed_c1: its single-stream decode in the first seven bench runs of that process (six --noise runs "
            "and the unchanged --compare); fresh_processes, process_sd_pct: every process of the unchanged "
            "--against runs (each block one: A, B, B, A a cycle), the spread of their single-stream speeds, a "
            "block's own noise and the machine's modes in it",
            extra={"runs": runs},
            measures=BENCH_CODE,
        )
    return figures


if __name__ == "__main__":
    sys.exit(main())
