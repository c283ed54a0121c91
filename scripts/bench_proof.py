"""The method, for real (issue 34, item 8): prints figures, asserts nothing.

On this machine, as a user would run them (the `voltaforge` CLI, one `local: true` inventory
entry `stab` serving the 8-layer generated model of scripts/bench_stability.py):

1. `voltaforge bench --noise 4` on the unchanged server (the host's own run-to-run noise, from
   its history), then `voltaforge bench --compare` four times: how many of the pairs each compare
   makes call a change "outside the noise" (stated: none, at most 5% of families);
2. the server redeployed with `threads: 1` (was 2), then `bench --compare`: is the change called
   (a real one, of the size the roofline of one core against two predicts);
3. `voltaforge tune` of one space twice, each from its own empty measurement store (a separate
   VOLTAFORGE_CACHE): the same winner, or each other's winner among the tied.

The last bench's and the second tune's terminal output are kept as the README's samples
(reports/local/bench-sample.json, reports/local/tune-sample.json); the verdicts go to
reports/bench/proof.json. Unless --no-report.

Usage: .venv/bin/python scripts/bench_proof.py
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_served import ROOT, served  # noqa: E402

from playbooks.results import write_result  # noqa: E402

#: what each file's figures are of (results.py, ``measures``)
BENCH_CODE = [
    "playbooks/cli/bench.py",
    "playbooks/conduct/bench.py",
    "playbooks/steps/measure/bench.py",
    "playbooks/steps/measure/bench_run.py",
    "playbooks/steps/measure/bench_report.py",
    "playbooks/steps/measure/bench_stats.py",
    "playbooks/steps/measure/bench_noise.py",
    "playbooks/steps/measure/roofline.py",
]
TUNE_CODE = [
    "playbooks/cli/tune.py",
    "playbooks/conduct/tune.py",
    "playbooks/conduct/tune_candidates.py",
    "playbooks/steps/measure/tune_search.py",
    "playbooks/steps/measure/tune_space.py",
    "playbooks/steps/measure/tune_report.py",
    "playbooks/steps/measure/tune_cost.py",
]
VERDICT = re.compile(
    r"concurrency (\d+): per-stream decode ([+-][\d.]+)% against the (last|best) run, (outside|within)"
)


def cli(args: list[str], env: dict[str, str], cwd: Path) -> tuple[int, str, float]:
    t0 = time.monotonic()
    out = subprocess.run(
        [str(ROOT / ".venv" / "bin" / "voltaforge"), *args], capture_output=True, text=True, env=env, cwd=cwd
    )
    return out.returncode, out.stdout + out.stderr, time.monotonic() - t0


def verdicts(output: str) -> list[tuple[int, float, str, bool]]:
    text = " ".join(output.split())
    return [(int(c), float(p), ref, v == "outside") for c, p, ref, v in VERDICT.findall(text)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--no-report", action="store_true")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    with served("stab", parallel=4, levels=(1, 2, 4), recipe_name="bench-stability", keep=args.keep) as s:
        work, inventory = s.work, s.inventory
        env = {**os.environ, "COLUMNS": "130", "VOLTAFORGE_CACHE": str(work / "cache")}
        inv = ["--host", "stab", "--inventory", str(inventory)]
        figures: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        # 1. the host's own noise (four runs of the unchanged server), then four more runs, each
        # compared with the history before it
        code, out, took = cli(["bench", *inv, "--noise", "4"], env, work)
        noise_line = out.strip().splitlines()[-1] if out.strip() else ""
        print(f"bench --noise 4: exit {code}, {took:.0f} s: {noise_line}", flush=True)
        extra["noise"] = noise_line
        unchanged: list[tuple[int, float, str, bool]] = []
        last_bench = ""
        for i in range(4):
            code, out, took = cli(["bench", *inv, "--compare"], env, work)
            unchanged += verdicts(out)
            last_bench, bench_took = out, took
            print(f"bench {i + 1}: exit {code}, {took:.0f} s, {len(verdicts(out))} verdicts", flush=True)
        called = [v for v in unchanged if v[3]]
        figures |= {"unchanged_verdicts": len(unchanged), "unchanged_called_changed": len(called)}
        extra["unchanged"] = unchanged
        print(f"unchanged server: {len(called)} of {len(unchanged)} comparisons called changed: {called}")
        # 2. a real change: one thread instead of two
        s.deploy(threads=1)
        code, out, _ = cli(["bench", *inv, "--compare"], env, work)
        changed = verdicts(out)
        level1 = [v for v in changed if v[0] == 1 and v[2] == "last"]
        figures |= {
            "threads1_change_pct": level1[0][1] if level1 else None,
            "threads1_called_changed": int(bool(level1 and level1[0][3])),
        }
        extra["threads1"] = changed
        print(f"threads 1 against 2: {changed}")
        s.deploy()  # threads: 2 again (the change wrote the same file)
        # 3. two tunes from empty stores
        tunes = []
        tune_args = ["tune", *inv, "--slots", "2", "--cache", "f16", "--ubatch", "64,512", "--budget", "15m"]
        tune_args += ["--rungs", "2", "--json"]
        for i in range(2):
            tenv = {**env, "VOLTAFORGE_CACHE": str(work / f"tune-cache-{i}")}
            code, out, took = cli(tune_args, tenv, work)
            res, _ = json.JSONDecoder().raw_decode(out[out.index("{") :])  # stderr's progress follows it
            w = res.get("winner") or {}
            tunes.append({"winner": w.get("label"), "tied_with": w.get("tied_with"), "took_s": round(took, 1)})
            print(f"tune {i + 1}: exit {code}, {took:.0f} s, winner {w.get('label')}, tied with {w.get('tied_with')}")
        a, b = tunes
        agree = (
            a["winner"] == b["winner"] or a["winner"] in (b["tied_with"] or []) or b["winner"] in (a["tied_with"] or [])
        )
        figures |= {"tunes_agree_or_tie": int(agree), "tune_first_s": a["took_s"]}
        extra["tunes"] = tunes
        # the README's tune sample: the second tune again, every measurement kept
        tenv = {**env, "VOLTAFORGE_CACHE": str(work / "tune-cache-1")}
        _, tune_out, again = cli(tune_args[:-1], tenv, work)
    print(json.dumps(figures))
    if not args.no_report:
        write_result(
            ROOT / "reports" / "bench" / "proof.json",
            "the method for real: an unchanged server's compares, a real change, two tunes from empty stores",
            figures,
            {k: "s" if k.endswith("_s") else "%" if k.endswith("_pct") else "count" for k in figures},
            ".venv/bin/python scripts/bench_proof.py",
            notes="8-layer hidden-1024 Llama, random weights, Q8_0, llama-server (4 slots) as a managed process "
            "on this machine (the `stab` entry); `voltaforge bench --noise 4` (the host's own noise), four "
            "`voltaforge bench --compare`, then the recipe with threads: 1 "
            "and one more; two `voltaforge tune --slots 2 --cache f16 --ubatch 64,512 --rungs 2`, each from its own "
            "empty store",
            extra=extra,
            measures=BENCH_CODE + TUNE_CODE,
        )
        write_result(
            ROOT / "reports" / "local" / "bench-sample.json",
            "a bare `voltaforge bench --compare` of the 8-layer generated model (Q8_0) on this machine, "
            "the fourth of four after `bench --noise 4`",
            {"command_wall_s": round(bench_took, 1)},
            {"command_wall_s": "s"},
            "voltaforge bench --host stab --inventory .../inventory.yaml --compare (scripts/bench_proof.py)",
            notes="the `stab` entry of scripts/bench_proof.py; extra.output is the whole terminal output",
            extra={"output": last_bench},
            measures=BENCH_CODE,
        )
        write_result(
            ROOT / "reports" / "local" / "tune-sample.json",
            "`voltaforge tune` of the same host and model, again with every measurement kept",
            {"first_run_s": b["took_s"], "again_s": round(again, 1)},
            {"first_run_s": "s", "again_s": "s"},
            "voltaforge tune --host stab --inventory .../inventory.yaml --slots 2 --cache f16 --ubatch 64,512 "
            "--budget 15m --rungs 2 (scripts/bench_proof.py: the second tune, then again)",
            notes="extra.output is the whole terminal output of the run that kept every measurement",
            extra={"output": tune_out},
            measures=TUNE_CODE,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
