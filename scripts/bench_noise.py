"""Run-to-run noise of one unchanged server (issue 34): the data set behind bench_stats.RUN_NOISE.

Prints figures, asserts nothing. One server, never changed, measured again and again: a
generated Llama large enough to be memory-bound (8 layers, hidden 1024, random weights, Q8_0,
about 100 MB), deployed by `invoke deploy` as a managed process on a `local: true` inventory
entry. Each run is the bench's own sweep (bench_run.sweep_level: a warm-up round, then rounds
until the 95% half-width is within 2% or the cap) at concurrency 1 and 2, `--gap` seconds
apart; first `--runs` runs with the machine otherwise idle, then `--busy-runs` with a spinning
process at the lowest priority (nice 19: a batch job on a shared lab box).

Every request is kept (its round, the client's and the server's decode rate, its TTFT), so the
method can be re-derived from the file. From it, per set and level:

- within a run: each run's mean and standard error over its rounds;
- between runs: sigma_run^2 = var(run means) - mean(squared standard errors) (one-way random
  effects, method of moments), as a share of the grand mean: the run effect bench_stats adds
  to every comparison of two runs;
- every pair of runs compared by the old rule (|d| > hypot of the half-widths) and by
  bench_stats.difference with RUN_NOISE: the share of pairs each calls changed, though nothing
  changed. The new rule's RUN_NOISE comes from this same data (the larger set's figure), so
  the busy set judged with the idle figure, and the reverse, is the held-out check.

Writes reports/bench/noise.json (playbooks/results.py) unless --no-report.

Usage: .venv/bin/python scripts/bench_noise.py [--runs 8] [--gap 10]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_served import ROOT, served  # noqa: E402

from playbooks.config.recipe import load_recipe  # noqa: E402
from playbooks.results import write_result  # noqa: E402
from playbooks.steps.measure import bench_stats  # noqa: E402
from playbooks.steps.measure.bench_run import prompt_words, sweep_level, workload_text  # noqa: E402

LEVELS = (1, 2)


def one_run(url: str, recipe: Path, words: int) -> dict[str, Any]:
    g = load_recipe(recipe).recipe.gate
    text = workload_text(g.workload)
    levels = {}
    for c in LEVELS:
        summary, samples = sweep_level(url, text, words, c, g, "llama-server")
        levels[str(c)] = {
            "decode": summary["decode"],
            "aggregate": summary.get("aggregate"),
            "requests": [
                {
                    "round": i // c,
                    "client_tok_s": None if s.decode_tok_s is None else round(s.decode_tok_s, 3),
                    "server_tok_s": s.timings.get("predicted_per_second"),
                    "ttft_s": None if s.ttft is None else round(s.ttft, 5),
                    "error": s.error,
                }
                for i, s in enumerate(samples)
            ],
        }
    return {"at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "levels": levels}


def run_noise(runs: list[dict[str, Any]], level: str) -> dict[str, float]:
    """Within- and between-run spread of the judged decode at one level (method of moments)."""
    decodes = [r["levels"][level]["decode"] for r in runs]
    means = [d["mean"] for d in decodes]
    se2 = [d["stdev"] ** 2 / d["n"] for d in decodes]
    grand = statistics.fmean(means)
    between = max(0.0, statistics.variance(means) - statistics.fmean(se2))
    return {
        "grand_mean": round(grand, 3),
        "run_means_sd_pct": round(statistics.stdev(means) / grand * 100, 3),
        "within_se_pct": round(math.sqrt(statistics.fmean(se2)) / grand * 100, 3),
        "run_noise_pct": round(math.sqrt(between) / grand * 100, 3),
        "range_pct": round((max(means) - min(means)) / grand * 100, 3),
    }


def changed_pairs(runs: list[dict[str, Any]], level: str, run_noise: float) -> dict[str, Any]:
    """Pairs of runs of the unchanged server each rule calls changed."""
    decodes = [r["levels"][level]["decode"] for r in runs]
    pairs = list(itertools.combinations(decodes, 2))
    old = sum(abs(a["mean"] - b["mean"]) > math.hypot(a["halfwidth"], b["halfwidth"]) for a, b in pairs)
    new = sum(bool(bench_stats.distinct(a, b, run_noise=run_noise)) for a, b in pairs)
    return {"pairs": len(pairs), "old_rule_changed": old, "new_rule_changed": new}


def analyse(sets: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The figures of a data set (``extra.sets``): spread within and between runs per set and
    level, and the pairs each rule calls changed (the new rule with the RUN_NOISE the code has
    now, and held out: with the other set's noise)."""
    figures: dict[str, Any] = {f"{name}_runs": len(runs) for name, runs in sets.items()}
    noise = {(name, lv): run_noise(runs, lv) for name, runs in sets.items() for lv in ("1", "2")}
    for (name, lv), n in noise.items():
        for k, v in n.items():
            figures[f"{name}_c{lv}_{k}"] = v
    for name, other in (("idle", "busy"), ("busy", "idle")):
        for lv in ("1", "2"):
            held = noise[(other, lv)]["run_noise_pct"] / 100
            pairs = changed_pairs(sets[name], lv, held)
            const = changed_pairs(sets[name], lv, bench_stats.RUN_NOISE)
            figures[f"{name}_c{lv}_pairs"] = pairs["pairs"]
            figures[f"{name}_c{lv}_old_rule_changed"] = pairs["old_rule_changed"]
            figures[f"{name}_c{lv}_new_rule_changed_heldout"] = pairs["new_rule_changed"]
            figures[f"{name}_c{lv}_new_rule_changed"] = const["new_rule_changed"]
    return figures


def show(figures: dict[str, Any]) -> None:
    for name in ("idle", "busy"):
        for lv in ("1", "2"):
            f = {k.removeprefix(f"{name}_c{lv}_"): v for k, v in figures.items() if k.startswith(f"{name}_c{lv}_")}
            spread = (
                f"run means spread {f['run_means_sd_pct']:.1f}% (sd), within-run se {f['within_se_pct']:.1f}%, "
                f"run noise {f['run_noise_pct']:.1f}%, range {f['range_pct']:.1f}%"
            )
            calls = (
                f"old rule {f['old_rule_changed']}/{f['pairs']}, new rule {f['new_rule_changed']}/{f['pairs']} "
                f"(with the other set's noise {f['new_rule_changed_heldout']})"
            )
            print(
                f"{name}, concurrency {lv}: mean {f['grand_mean']:.1f} tok/s, {spread}; pairs called changed: {calls}"
            )


def write(figures: dict[str, Any], sets: dict[str, Any], command: str, date: str | None = None) -> Path:
    path = ROOT / "reports" / "bench" / "noise.json"
    write_result(
        path,
        "run-to-run noise of one unchanged server, idle and busy: the data set behind RUN_NOISE",
        figures,
        {k: "%" if k.endswith("_pct") else "tok/s" if k.endswith("grand_mean") else "count" for k in figures},
        command,
        notes="8-layer hidden-1024 Llama, random weights, Q8_0, llama-server (2 slots) as a managed process on "
        "this machine; the bench's own sweep at concurrency 1 and 2, 64 prompt and 64 output tokens; the client "
        "on the same 2 cores; busy: a spinning process at nice 19. range: (largest - smallest run mean) / mean",
        extra={"sets": sets},
        date=date,
    )
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=8, help="runs of the idle set")
    ap.add_argument("--busy-runs", type=int, default=6, help="runs of the busy set")
    ap.add_argument("--gap", type=float, default=10.0, help="seconds between runs")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--no-report", action="store_true", help="do not write reports/bench/noise.json")
    ap.add_argument(
        "--reanalyse",
        action="store_true",
        help="measure nothing: the figures again from the requests reports/bench/noise.json keeps",
    )
    args = ap.parse_args()
    if args.reanalyse:
        stored = json.loads((ROOT / "reports" / "bench" / "noise.json").read_text())
        figures = analyse(stored["extra"]["sets"])
        show(figures)
        print(f"result: {write(figures, stored['extra']['sets'], stored['command'], stored['date'])}")
        return 0

    sets: dict[str, list[dict[str, Any]]] = {"idle": [], "busy": []}
    spinner = None
    with served("noise", parallel=2, levels=LEVELS, recipe_name="bench-noise", keep=args.keep) as s:
        try:
            url = f"http://127.0.0.1:{s.port}"
            words, why = prompt_words(url, workload_text("chat"), "llama-server", 64)
            assert why is None, why
            for name in ("idle", "busy"):
                if name == "busy":
                    # a batch job at the lowest priority, as a shared lab box runs one (at normal
                    # priority a spinner on one of two cores cut the rate 4x: measured, abandoned)
                    spinner = subprocess.Popen(["nice", "-n", "19", sys.executable, "-c", "while True: pass"])
                for i in range(args.runs if name == "idle" else args.busy_runs):
                    if i or name == "busy":
                        time.sleep(args.gap)
                    run = one_run(url, s.recipe, words)
                    sets[name].append(run)
                    d1, d2 = run["levels"]["1"]["decode"], run["levels"]["2"]["decode"]
                    print(
                        f"{name} run {i + 1}: c=1 {d1['mean']:.1f} ± {d1['halfwidth']:.1f} tok/s (n={d1['n']}), "
                        f"c=2 {d2['mean']:.1f} ± {d2['halfwidth']:.1f} (n={d2['n']})",
                        flush=True,
                    )
        finally:
            if spinner is not None:
                spinner.kill()
    figures = analyse(sets)
    show(figures)
    if not args.no_report:
        flags = f"--runs {args.runs} --busy-runs {args.busy_runs} --gap {args.gap:g}"
        command = f".venv/bin/python scripts/bench_noise.py {flags}"
        print(f"result: {write(figures, sets, command)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
