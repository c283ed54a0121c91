"""Bench stability benchmark (issue 20): prints figures, asserts nothing.

Five back-to-back `invoke bench` runs (the real run_bench, as the CLI calls it) of one unchanged
server on this machine: a generated Llama large enough to be memory-bound (8 layers, hidden
1024, random weights, Q8_0, about 100 MB), deployed by `invoke deploy` as a managed process
on a `local: true` inventory entry with its own prefix. For each run: the ceiling (the host's
stored memory bandwidth over the bytes a token streams), the single-stream decode as mean ±
95% half-width, the server's own rate, client/server, MBU. Beside it, side by side in the same
run, the MBU each run would have had with a bandwidth measured afresh (the old behaviour: the
probe run again before each bench), so the two spreads can be compared.

Writes reports/bench/stability.json (playbooks/results.py) unless --no-report.

Usage: .venv/bin/python scripts/bench_stability.py [--runs 5] [--keep]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_served import DESCRIPTION, ROOT, served  # noqa: E402

from playbooks.cli.bench import run_bench  # noqa: E402
from playbooks.host.local import LocalHost  # noqa: E402
from playbooks.results import write_result  # noqa: E402
from playbooks.steps.measure.bench_ceilings import host_membw  # noqa: E402


def spread(values: list[float]) -> float:
    return max(values) - min(values) if values else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--no-report", action="store_true", help="do not write reports/bench/stability.json")
    args = ap.parse_args()

    rows = []
    with served("stab", parallel=4, levels=(1, 2, 4), recipe_name="bench-stability", keep=args.keep) as s:
        recipe, settings, prefix = s.recipe, s.settings, s.prefix
        for i in range(args.runs):
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                code = run_bench("stab", str(recipe), as_json=True, settings=settings)
            r = json.loads(out.getvalue())
            with LocalHost() as host:  # the old way: a fresh probe run, not used by the bench
                fresh = host_membw(host, prefix + "/fresh", sys.executable, remeasure=True)["gb_s"]
            one = r["levels"][0]
            d = one["decode"]
            bytes_per_token = r["membw_gb_s"] * 1e9 / r["roofline_tok_s"]
            rows.append(
                {
                    "run": i + 1,
                    "exit": code,
                    "membw_gb_s": r["membw_gb_s"],
                    "membw_source": r["membw"]["source"].split(",")[0].split(" (")[0],
                    "roofline_tok_s": r["roofline_tok_s"],
                    "decode_mean": d["mean"],
                    "decode_halfwidth": d["halfwidth"],
                    "decode_n": d["n"],
                    "decode_source": d["source"],
                    "server_tok_s": one["server_predicted_per_second"],
                    "crosscheck_ratio": one["crosscheck_ratio"],
                    "mbu": r["mbu"],
                    "fresh_membw_gb_s": fresh,
                    "mbu_if_fresh": round(d["mean"] / (fresh * 1e9 / bytes_per_token), 4),
                    "client_cores": r["client_cpu"]["cores"],
                    "sweep_s": r["sweep_s"],
                }
            )
            row = rows[-1]
            print(
                f"run {row['run']}: ceiling {row['roofline_tok_s']:.1f} tok/s ({row['membw_gb_s']:.1f} GB/s, "
                f"{row['membw_source']}); level 1 {row['decode_mean']:.1f} ± {row['decode_halfwidth']:.1f} tok/s "
                f"(n={row['decode_n']}, {row['decode_source']}), server {row['server_tok_s']:.1f}, "
                f"client/server {row['crosscheck_ratio']}, MBU {row['mbu']:.3f}; fresh probe "
                f"{fresh:.1f} GB/s -> MBU {row['mbu_if_fresh']:.3f}; sweep {row['sweep_s']:.0f} s",
                flush=True,
            )
    mbu = [r["mbu"] for r in rows]
    fresh_mbu = [r["mbu_if_fresh"] for r in rows]
    decode = [r["decode_mean"] for r in rows]
    ratios = [r["crosscheck_ratio"] for r in rows if r["crosscheck_ratio"] is not None]
    figures = {
        "runs": len(rows),
        "mbu_spread": round(spread(mbu), 4),
        "mbu_min": min(mbu),
        "mbu_max": max(mbu),
        "mbu_spread_if_fresh_membw": round(spread(fresh_mbu), 4),
        "decode_spread_pct": round(spread(decode) / min(decode) * 100, 2),
        "fresh_membw_spread_pct": round(
            spread([r["fresh_membw_gb_s"] for r in rows]) / min(r["fresh_membw_gb_s"] for r in rows) * 100, 2
        ),  # fmt: skip
        "crosschecked_runs": len(ratios),
    }
    if ratios:
        figures["worst_crosscheck_pct"] = round(max(abs(x - 1) for x in ratios) * 100, 2)
    print(
        f"MBU over {len(rows)} runs: {min(mbu):.3f}-{max(mbu):.3f}, spread {figures['mbu_spread']:.3f} with the stored "
        f"ceiling; {figures['mbu_spread_if_fresh_membw']:.3f} with a fresh probe each run "
        f"(fresh bandwidth moved {figures['fresh_membw_spread_pct']:.1f}%); single-stream decode moved "
        f"{figures['decode_spread_pct']:.1f}%; level 1 cross-checked in {len(ratios)} of {len(rows)} runs, "
        f"worst {figures['worst_crosscheck_pct']}% apart"
    )
    if not args.no_report:
        write_result(
            ROOT / "reports" / "bench" / "stability.json",
            "five back-to-back benches of one unchanged server: MBU spread with the stored ceiling",
            figures,
            {
                k: "%" if k.endswith("_pct") else "count" if k in ("runs", "crosschecked_runs") else "MBU"
                for k in figures
            },
            f".venv/bin/python scripts/bench_stability.py --runs {args.runs}",
            notes=f"{DESCRIPTION}, levels 1/2/4, 64 prompt and 64 output tokens; the client on the same 2 cores",
            extra={"rows": rows},
        )
        print(f"result: {ROOT / 'reports' / 'bench' / 'stability.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
