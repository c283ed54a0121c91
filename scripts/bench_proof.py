"""The method, for real (issue 34, item 8; issue 53): prints figures, asserts nothing.

On this machine, as a user would run them (the `voltaforge` CLI, one `local: true` inventory
entry `stab` serving the 8-layer generated model of scripts/bench_stability.py, memory-bound:
its bytes per token set its speed), three proof runs, each with its own bench history (a
separate VOLTAFORGE_CACHE), each:

1. `voltaforge bench --noise 6` on the unchanged Q8_0 server (the host's own run-to-run noise,
   from its history), then one `voltaforge bench --compare`: how many of its verdicts (three
   levels, against the last configuration and the best run) call a change (stated: at most 5%);
2. in one run each, interleaved (`voltaforge bench --against RECIPE`: the deployed Q8_0 recipe
   and RECIPE, each block on a fresh process, beside the deployed server): the same Q8_0
   recipe twice (how many of its verdicts, three levels a run, call a
   change: stated at most 5% a run), then Q6_K (about 0.77x the bytes per token), Q4_K_M
   (about 0.57x) and the model 6 layers deep instead of 8 (0.75x the bytes and the work): is the
   change called, at every level where it is 30% or more;
3. the recipe at Q6_K, Q8_0 again, then Q4_K_M, each deployed and compared across runs
   (`--compare`): the same question for the comparison of separate runs.

Then `voltaforge tune` of one space twice, each from its own empty measurement store: the same
winner, or each other's winner among the tied.

The last proof run's Q6_K compare and the second tune's terminal output are kept as the
README's samples (reports/local/bench-sample.json, reports/local/tune-sample.json); the verdicts
go to reports/bench/proof.json. Unless --no-report.

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
from process_effect import BENCH_CODE, report  # noqa: E402
from tiny_served import ROOT, served  # noqa: E402

from playbooks.results import write_result  # noqa: E402

#: what each file's figures are of (results.py, ``measures``)
TUNE_CODE = [
    "playbooks/cli/tune.py",
    "playbooks/conduct/tune.py",
    "playbooks/conduct/tune_candidates.py",
    "playbooks/conduct/tune_store.py",
    "playbooks/steps/measure/tune_search.py",
    "playbooks/steps/measure/tune_space.py",
    "playbooks/steps/measure/tune_report.py",
    "playbooks/steps/measure/tune_cost.py",
]
VERDICT = re.compile(
    r"concurrency (\d+): per-stream decode ([+-][\d.]+)% against the (last|best)(?: \d+)? runs?, (outside|within)"
)
#: the proof runs, each from an empty history
PROOF_RUNS = 3
#: the unchanged server's runs that give the host its noise (bench_noise.NOISE_RUNS)
NOISE_RUNS = 6
#: the changes, in turn after the unchanged compare: the bytes per token fix their size
CHANGES = ("Q6_K", "Q8_0", "Q4_K_M")
#: `bench --against` each, beside the deployed Q8_0 server: the unchanged pair twice, then the
#: changes: two of quant (sized by the CPU) and one of depth (6 of 8 layers at Q8_0: a token's
#: bytes and work both 0.75x, about +33% on any machine)
AGAINST = ("Q8_0", "Q8_0", "Q6_K", "Q4_K_M", "6 layers")
SHALLOW_LAYERS = 6
AGAINST_VERDICT = re.compile(
    r"concurrency (\d+): per-stream decode ([+-][\d.]+)% \(95%.*?\) against the deployed recipe, (outside|within)"
)


def cli(args: list[str], env: dict[str, str], cwd: Path) -> tuple[int, str, float]:
    t0 = time.monotonic()
    out = subprocess.run(
        [str(ROOT / ".venv" / "bin" / "voltaforge"), *args], capture_output=True, text=True, env=env, cwd=cwd
    )
    return out.returncode, out.stdout + out.stderr, time.monotonic() - t0


def against_verdicts(output: str) -> list[tuple[int, float, bool]]:
    text = " ".join(output.split())
    return [(int(c), float(p), v == "outside") for c, p, v in AGAINST_VERDICT.findall(text)]


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
        inv = ["--host", "stab", "--inventory", str(inventory)]
        sizes = {q: round(s.stage(q), 1) for q in ("Q8_0", *CHANGES)}
        print(f"models: {sizes} MB", flush=True)
        unchanged: list[tuple[int, float, str, bool]] = []
        proofs: list[dict[str, Any]] = []
        sample, sample_took = "", 0.0
        against_sample, against_took = "", 0.0
        for p in range(PROOF_RUNS):
            env = {**os.environ, "COLUMNS": "130", "VOLTAFORGE_CACHE": str(work / f"proof-{p}")}
            s.deploy()  # Q8_0 (the last proof run ended at Q4_K_M)
            code, out, took = cli(["bench", *inv, "--noise", str(NOISE_RUNS)], env, work)
            flat = " ".join(out.split())  # the figure's line, wrapped by the terminal's width
            noise = flat[flat.rfind("stab: ") :] if "stab: " in flat else flat[-300:]
            print(f"proof {p + 1}: bench --noise {NOISE_RUNS}: exit {code}, {took:.0f} s: {noise}", flush=True)
            code, out, took = cli(["bench", *inv, "--compare"], env, work)
            seen = verdicts(out)
            unchanged += seen
            print(f"proof {p + 1}: unchanged: exit {code}, {took:.0f} s, {seen}", flush=True)
            against: list[dict[str, Any]] = []
            for quant in AGAINST:
                other = s.shallower(SHALLOW_LAYERS) if quant == "6 layers" else s.other(quant)
                code, out, took = cli(["bench", *inv, "--against", str(other)], env, work)
                seen_b = against_verdicts(out)
                against.append({"quant": quant, "verdicts": seen_b, "took_s": round(took, 1), "exit": code})
                print(f"proof {p + 1}: --against {quant}: exit {code}, {took:.0f} s, {seen_b}", flush=True)
                if quant == "Q6_K":
                    against_sample, against_took = out, took
            changes: dict[str, list[tuple[int, float, str, bool]]] = {}
            for quant in CHANGES:
                s.deploy(quant=quant)
                code, out, took = cli(["bench", *inv, "--compare"], env, work)
                changes[quant] = verdicts(out)
                print(f"proof {p + 1}: {quant}: exit {code}, {took:.0f} s, {changes[quant]}", flush=True)
                if quant == "Q6_K":
                    sample, sample_took = out, took
            proofs.append({"noise": noise, "unchanged": seen, "changes": changes, "against": against})
        called = [v for v in unchanged if v[3]]
        figures: dict[str, Any] = {
            "proof_runs": PROOF_RUNS,
            "unchanged_verdicts": len(unchanged),
            "unchanged_called_changed": len(called),
        }
        for quant in ("Q6_K", "Q4_K_M"):
            single = [v for p in proofs for v in p["changes"][quant] if v[0] == 1 and v[2] == "last"]
            key = quant.lower()
            figures[f"{key}_c1_called_changed"] = sum(v[3] for v in single)
            figures[f"{key}_c1_change_min_pct"] = min((v[1] for v in single), default=None)
            figures[f"{key}_c1_change_max_pct"] = max((v[1] for v in single), default=None)
        # the host's own noise each proof run measured: overall and at one stream
        overall = [float(m[1]) for p in proofs if (m := re.search(r"stab: ([\d.]+)% between runs", p["noise"]))]
        single_noise = [float(m[1]) for p in proofs if (m := re.search(r"by concurrency: 1: ([\d.]+)%", p["noise"]))]
        figures |= {
            "noise_min_pct": min(overall, default=None),
            "noise_max_pct": max(overall, default=None),
            "noise_c1_min_pct": min(single_noise, default=None),
            "noise_c1_max_pct": max(single_noise, default=None),
        }
        # every level, every change, against the last configuration: a change of 30% or more
        big = [v for p in proofs for q in CHANGES for v in p["changes"][q] if v[2] == "last" and abs(v[1]) >= 30]
        figures |= {"levels_30pct_or_more": len(big), "levels_30pct_or_more_called": sum(v[3] for v in big)}
        print(f"unchanged server: {len(called)} of {len(unchanged)} comparisons called changed: {called}")
        # in one run, interleaved: the unchanged pair's verdicts, the changes at one stream and at
        # every level where they are 30% or more
        runs = [a for p in proofs for a in p["against"]]
        same = [v for a in runs if a["quant"] == "Q8_0" for v in a["verdicts"]]
        figures |= {
            "against_unchanged_verdicts": len(same),
            "against_unchanged_called_changed": sum(v[2] for v in same),
            "against_unchanged_runs_with_a_call": sum(
                any(v[2] for v in a["verdicts"]) for a in runs if a["quant"] == "Q8_0"
            ),
            "against_run_max_s": max(a["took_s"] for a in runs),
        }
        for quant in ("Q6_K", "Q4_K_M", "6 layers"):
            single = [v for a in runs if a["quant"] == quant for v in a["verdicts"] if v[0] == 1]
            key = f"against_{quant.lower().replace(' ', '_')}"
            figures[f"{key}_c1_called_changed"] = sum(v[2] for v in single)
            figures[f"{key}_c1_runs"] = len(single)
            figures[f"{key}_c1_change_min_pct"] = min((v[1] for v in single), default=None)
            figures[f"{key}_c1_change_max_pct"] = max((v[1] for v in single), default=None)
            every = [v for a in runs if a["quant"] == quant for v in a["verdicts"]]
            figures[f"{key}_levels_called"] = sum(v[2] for v in every)
            figures[f"{key}_levels"] = len(every)
        big = [v for a in runs if a["quant"] != "Q8_0" for v in a["verdicts"] if abs(v[1]) >= 30]
        figures |= {
            "against_levels_30pct_or_more": len(big),
            "against_levels_30pct_or_more_called": sum(v[2] for v in big),
        }
        # two tunes from empty stores, of the Q8_0 server
        s.deploy()
        env = {**os.environ, "COLUMNS": "130", "VOLTAFORGE_CACHE": str(work / "proof-0")}
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
        extra: dict[str, Any] = {"model_mb": sizes, "proofs": proofs, "tunes": tunes}
        # the README's tune sample: the second tune again, every measurement kept
        tenv = {**env, "VOLTAFORGE_CACHE": str(work / "tune-cache-1")}
        _, tune_out, again = cli(tune_args[:-1], tenv, work)
        # each deployed process's own speed, from the proof runs' histories (reports/bench/process-effect.json)
        report(work, write=not args.no_report)
    print(json.dumps(figures))
    if not args.no_report:
        write_result(
            ROOT / "reports" / "bench" / "proof.json",
            "the method for real: an unchanged server's compares, changes the bytes per token size, "
            "two tunes from empty stores",
            figures,
            {k: "s" if k.endswith("_s") else "%" if k.endswith("_pct") else "count" for k in figures},
            ".venv/bin/python scripts/bench_proof.py",
            notes="8-layer hidden-1024 Llama, random weights, llama-server (4 slots) as a managed process on "
            f"this machine (the `stab` entry); {PROOF_RUNS} proof runs, each with its own history: "
            f"`voltaforge bench --noise {NOISE_RUNS}` at Q8_0, one `voltaforge bench --compare`, then "
            f"`voltaforge bench --against` a recipe at {', '.join(AGAINST)} in turn (the deployed Q8_0 recipe and "
            "it, each block on a fresh process, beside the Q8_0 server), then the "
            f"recipe at {', '.join(CHANGES)} in turn, each deployed and compared; then two `voltaforge tune "
            "--slots 2 --cache f16 --ubatch 64,512 --rungs 2`, each from its own empty store",
            extra=extra,
            measures=BENCH_CODE + TUNE_CODE,
        )
        write_result(
            ROOT / "reports" / "local" / "bench-sample.json",
            "a bare `voltaforge bench --compare` of the 8-layer generated model on this machine, the recipe "
            f"changed from Q8_0 to Q6_K after `bench --noise {NOISE_RUNS}` and one unchanged compare",
            {"command_wall_s": round(sample_took, 1)},
            {"command_wall_s": "s"},
            "voltaforge bench --host stab --inventory .../inventory.yaml --compare (scripts/bench_proof.py)",
            notes="the `stab` entry of scripts/bench_proof.py, its last proof run; extra.output is the whole "
            "terminal output",
            extra={"output": sample},
            measures=BENCH_CODE,
        )
        write_result(
            ROOT / "reports" / "local" / "bench-against-sample.json",
            "`voltaforge bench --against` a Q6_K recipe beside the deployed Q8_0 server of the 8-layer generated "
            "model on this machine",
            {"command_wall_s": round(against_took, 1)},
            {"command_wall_s": "s"},
            "voltaforge bench --host stab --inventory .../inventory.yaml --against .../bench-stability-q6_k.yaml "
            "(scripts/bench_proof.py)",
            notes="the `stab` entry of scripts/bench_proof.py, its last proof run; extra.output is the whole "
            "terminal output",
            extra={"output": against_sample},
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
