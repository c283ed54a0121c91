"""The comparison method's false-change rate and power (issue 34), by simulation: prints figures,
asserts nothing.

The machine is simulated from the measured data set (reports/bench/noise.json, made by
scripts/bench_noise.py): its run-to-run noise, within-run round spread and drift at concurrency
1, once for the idle set (where RUN_NOISE comes from) and once for the busy one. On it, side by side in one run, the old
rule (|a - b| > hypot of the half-widths, each pair alone) and the new one (bench_stats: Welch's t
with the between-run term, Bonferroni over the pairs compared together):

- compare: four runs of an unchanged server, is any pair called changed (family-wise
  false-change rate); two runs with a real change of the stated size, is it flagged (power);
- tune: four equal candidates, is a needless winner named; one of them better by the stated
  size, is it named or tied with the winner;
- the compare as scripts/bench_proof.py makes it (issue 53), through the product's own
  host_noise and compare: `bench --noise 6`, one unchanged compare (a false change: either of
  its verdicts), then a 30% change against the last configuration (pooled) and against the
  last run alone, on a machine whose runs move by PROOF_RUN_SD.

Writes reports/bench/method.json (playbooks/results.py) unless --no-report.

Usage: .venv/bin/python scripts/bench_method.py [--trials 2000]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from playbooks.results import write_result  # noqa: E402
from playbooks.steps.measure import bench_stats  # noqa: E402
from tests.noise_sim import Machine, compare_rates, compare_verdicts, machine_from_noise, tune_rates  # noqa: E402

#: the proof's machine: this VM's own noise as `bench --noise 4` measured it on 2026-12-05
#: (3.6%, reports/bench/proof.json before issue 53's proof), rounds scattered by 10%
PROOF_RUN_SD, PROOF_ROUND_SD = 0.036, 0.10


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=2000)
    ap.add_argument("--no-report", action="store_true", help="do not write reports/bench/method.json")
    args = ap.parse_args()
    noise = json.loads((ROOT / "reports" / "bench" / "noise.json").read_text())
    figures: dict[str, float] = {"trials": args.trials}
    machines = {}
    for which in ("idle", "busy"):
        m = machine_from_noise(noise, which)
        machines[which] = m.__dict__
        change = bench_stats.detectable_change({"mean": 100.0, "stdev": m.round_sd * 100, "n": 16})
        assert change is not None
        change = round(change + 0.005, 2)  # the stated size: the detectable change, rounded up
        print(
            f"{which} machine (reports/bench/noise.json, concurrency 1): run noise {m.run_sd:.1%}, round sd "
            f"{m.round_sd:.1%}, drift {m.drift:+.2%} per run; RUN_NOISE {bench_stats.RUN_NOISE:.0%}; detectable "
            f"change {change:.0%}; {args.trials} trials each",
            flush=True,
        )
        null = compare_rates(m, args.trials)
        power = compare_rates(m, args.trials, runs=2, change=change)
        tune_null = tune_rates(m, args.trials)
        tune_real = tune_rates(m, args.trials, better=change)
        figures |= {
            f"{which}_detectable_change_pct": round(change * 100, 1),
            f"{which}_compare_false_change_old_pct": round(null["old"] * 100, 1),
            f"{which}_compare_false_change_new_pct": round(null["new"] * 100, 1),
            f"{which}_compare_power_old_pct": round(power["old"] * 100, 1),
            f"{which}_compare_power_new_pct": round(power["new"] * 100, 1),
            f"{which}_tune_needless_winner_old_pct": round(tune_null["old"] * 100, 1),
            f"{which}_tune_needless_winner_new_pct": round(tune_null["new"] * 100, 1),
            f"{which}_tune_missed_better_old_pct": round(tune_real["old"] * 100, 1),
            f"{which}_tune_missed_better_new_pct": round(tune_real["new"] * 100, 1),
        }
        print(
            f"  compare, 4 runs of an unchanged server, any pair called changed: old {null['old']:.1%}, "
            f"new {null['new']:.1%} (stated: at most {bench_stats.ALPHA:.0%})"
        )
        print(
            f"  compare, a real change of {change:.0%}, flagged: old {power['old']:.1%}, new {power['new']:.1%} "
            f"(stated: at least {bench_stats.POWER:.0%})"
        )
        print(
            f"  tune, 4 equal candidates, a needless winner named: old {tune_null['old']:.1%}, "
            f"new {tune_null['new']:.1%}"
        )
        print(
            f"  tune, one candidate {change:.0%} better, neither named nor tied: old {tune_real['old']:.1%}, "
            f"new {tune_real['new']:.1%}"
        )
    proof = Machine(run_sd=PROOF_RUN_SD, round_sd=PROOF_ROUND_SD)
    pooled = compare_verdicts(proof, args.trials, noise_runs=6)
    alone = compare_verdicts(proof, args.trials, noise_runs=6, pool_runs=1)
    four = compare_verdicts(proof, args.trials, noise_runs=4)
    figures |= {
        "proof_false_change_pct": round(pooled["false"] * 100, 1),
        "proof_power_pooled_pct": round(pooled["power"] * 100, 1),
        "proof_power_last_run_pct": round(alone["power"] * 100, 1),
        "proof_power_noise4_pct": round(four["power"] * 100, 1),
    }
    machines["proof"] = proof.__dict__
    print(
        f"proof machine (run noise {PROOF_RUN_SD:.1%}, round sd {PROOF_ROUND_SD:.0%}), bench --noise 6 then "
        f"--compare: an unchanged run called changed {pooled['false']:.1%} (stated: at most 5%); a 30% change "
        f"called {pooled['power']:.1%} against the last configuration, {alone['power']:.1%} against the last run "
        f"alone, {four['power']:.1%} after --noise 4"
    )
    if not args.no_report:
        path = ROOT / "reports" / "bench" / "method.json"
        write_result(
            path,
            "the comparison rules on a simulated drifting, noisy machine: false-change rate and power",
            figures,
            {k: "%" if k.endswith("_pct") else "count" for k in figures},
            f".venv/bin/python scripts/bench_method.py --trials {args.trials}",
            notes="two machines from reports/bench/noise.json (the idle and the busy set at concurrency 1: run "
            "noise, round spread, drift); the bench's own stopping rule; old rule: |a-b| > hypot(half-widths); "
            "new: bench_stats.difference with RUN_NOISE and Bonferroni. RUN_NOISE is the idle set's: the busy "
            "set's run noise is four times it, and there the stated rates do not hold. proof_*: the procedure "
            "of scripts/bench_proof.py through bench_noise.host_noise and bench_compare.compare "
            "(tests/noise_sim.compare_verdicts)",
            extra={"machines": machines},
        )
        print(f"result: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
