"""The tiny recipe's steps one at a time on this machine, each timed as a user runs it (issue 51,
item 6): `invoke toolchain`, `invoke build` cold then again, `invoke quantize` of two quants then
again, `invoke artifacts` (the verification figures), `invoke deploy` then again, and the
memory-bandwidth probe with one and two threads; asserts nothing.

Nothing of voltaforge cached: a fresh VOLTAFORGE_CACHE (the pinned sdist downloaded, the model
generated), a fresh install prefix (no build, its ccache empty) and log directory; the machine's
own apt packages, pip's cache and its find-links for torch stay. The README's own server on the
same port is stopped first, and this one at the end.

Usage: .venv/bin/python scripts/bench_steps.py
(writes reports/local/{build,quantize,artifacts,deploy,membw}.json)
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from playbooks.results import checkout_commit, write_result  # noqa: E402

INVOKE = [sys.executable, "-m", "invoke", "-r", str(ROOT)]
RECIPE = ("--host", "local", "--recipe", "tiny-cpu")
QUANTS = "Q4_K_M,Q8_0"
ANSWERING = re.compile(r"answering after ([\d.]+) s")
PREFIX = Path("/opt/vf-steps")
COMMAND = re.compile(r"^\[local\] \$ ")  # a command line deploy prints before running it
PROBE = ROOT / "playbooks" / "facts" / "probes" / "membw_probe.py"
BUILD_MEASURES = ["recipes/tiny-cpu.yaml", "playbooks/conduct/build.py", "playbooks/steps/build"]
QUANTIZE_MEASURES = ["recipes/tiny-cpu.yaml", "playbooks/conduct/quantize.py", "playbooks/steps/weights"]
ARTIFACT_MEASURES = [*QUANTIZE_MEASURES, "playbooks/conduct/artifacts.py", "playbooks/modelgen"]
DEPLOY_MEASURES = ["recipes/tiny-cpu.yaml", "playbooks/conduct/deploy.py", "playbooks/steps/serve"]
MEMBW_MEASURES = ["playbooks/facts/probes/membw_probe.py"]


def run(env: dict[str, str], *args: str) -> tuple[float, str]:
    t0 = time.monotonic()
    r = subprocess.run([*INVOKE, *args], env=env, cwd=ROOT, capture_output=True, text=True)
    took = time.monotonic() - t0
    out = (r.stdout + r.stderr).rstrip("\n")
    print(f"invoke {' '.join(args)}: exit {r.returncode} in {took:.1f} s", flush=True)
    if r.returncode:
        raise SystemExit(f"invoke {' '.join(args)} failed:\n{out[-4000:]}")
    return took, out


def membw(threads: int) -> float:
    r = subprocess.run(["python3", str(PROBE), "--threads", str(threads)], capture_output=True, text=True, check=True)
    return float(json.loads(r.stdout)["copy_gb_s"])


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="vf-steps-"))
    prefix = PREFIX  # a fixed path, as the pages show it; removed before and after
    shutil.rmtree(prefix, ignore_errors=True)
    env = {
        **{k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "VIRTUAL_ENV")},
        "VOLTAFORGE_CACHE": str(work / "cache"),
        "VOLTAFORGE_LOG_DIR": str(work / "logs"),
        "INVOKE_VOLTAFORGE_PREFIX": str(prefix),
        "COLUMNS": "120",
    }
    commit = checkout_commit()
    subprocess.run([*INVOKE, "stop", "--host", "local"], cwd=ROOT, capture_output=True)  # the README's own server
    try:
        toolchain_s, _ = run(env, "toolchain", *RECIPE)
        cold_s, _ = run(env, "build", *RECIPE)
        noop_s, noop_out = run(env, "build", *RECIPE)
        write_result(
            ROOT / "reports" / "local" / "build.json",
            "invoke build of tiny-cpu on this machine: llama.cpp and its bindings cold, then the no-op",
            {"cold_s": round(cold_s, 1), "noop_s": round(noop_s, 2)},
            {"cold_s": "s", "noop_s": "s"},
            "time invoke build --host local --recipe tiny-cpu (twice), after invoke toolchain",
            commit=commit,
            notes=(
                "A fresh install prefix (its ccache empty) and VOLTAFORGE_CACHE (the pinned sdist downloaded); "
                "cold_s is the whole first run: the sdist fetched, llama.cpp compiled and proven, the bindings' "
                "wheel built on its libraries. extra.output is the no-op's output."
            ),
            extra={"output": noop_out, "toolchain_s": round(toolchain_s, 1)},
            measures=BUILD_MEASURES,
        )
        first_s, _ = run(env, "quantize", *RECIPE, "--quant", QUANTS)
        second_s, second_out = run(env, "quantize", *RECIPE, "--quant", QUANTS)
        write_result(
            ROOT / "reports" / "local" / "quantize.json",
            f"invoke quantize of tiny-cpu ({QUANTS.replace(',', ' and ')}) on this machine: the first run, then again",
            {"first_run_s": round(first_s, 1), "second_run_s": round(second_s, 2)},
            {"first_run_s": "s", "second_run_s": "s"},
            f"time invoke quantize --host local --recipe tiny-cpu --quant {QUANTS} (twice), after invoke build",
            commit=commit,
            notes=(
                "first_run_s: the model generated, converted to F16 (its logits checked against the weights), "
                "the imatrix, both quants made and their KL divergence against F16 measured. "
                "extra.output is the second run's output."
            ),
            extra={"output": second_out},
            measures=QUANTIZE_MEASURES,
        )
        _, listed = run(env, "artifacts", "--host", "local", "--json")
        _, table = run(env, "artifacts", "--host", "local")
        by_quant = {a["quant"]: a.get("verification") or {} for a in json.loads(listed)}
        f16 = by_quant["F16"]["compare"]
        figures = {"f16_top1_pct": round(f16["top1_agreement"] * 100, 1), "f16_max_dlogit": f16["max_abs_logit_diff"]}
        for quant in QUANTS.split(","):
            kld = by_quant[quant]["kld"]
            figures[f"{quant.lower()}_kld"] = kld["mean_kld"]
            figures[f"{quant.lower()}_same_top_pct"] = kld["same_top_p"]
        write_result(
            ROOT / "reports" / "local" / "artifacts.json",
            f"invoke artifacts after invoke quantize of tiny-cpu ({QUANTS.replace(',', ', ')}): each file's check",
            {k: round(v, 6) for k, v in figures.items()},
            {k: _artifact_unit(k) for k in figures},
            f"invoke artifacts --host local (after invoke quantize --host local --recipe tiny-cpu --quant {QUANTS})",
            commit=commit,
            notes=(
                "The generated tiny Llama (random weights): the F16 file against the original weights "
                "(transformers), each quant against F16 by llama-perplexity --kl-divergence. "
                "extra.output is the table as printed (COLUMNS=120)."
            ),
            extra={"output": table},
            measures=ARTIFACT_MEASURES,
        )
        deploy_s, deploy_out = run(env, "deploy", *RECIPE)
        again_s, _ = run(env, "deploy", *RECIPE)
        ready = ANSWERING.search(deploy_out)
        write_result(
            ROOT / "reports" / "local" / "deploy.json",
            "invoke deploy of tiny-cpu on this machine as a managed process (no systemd), then again",
            {
                "first_run_s": round(deploy_s, 1),
                "ready_after_s": float(ready.group(1)) if ready else -1.0,
                "again_s": round(again_s, 2),
            },
            {"first_run_s": "s", "ready_after_s": "s", "again_s": "s"},
            "time invoke deploy --host local --recipe tiny-cpu (twice), after invoke quantize",
            commit=commit,
            notes=(
                "ready_after_s: the server's first answer, as deploy prints it. extra.output is the first run's, "
                "the command lines it prints before each command left out."
            ),
            extra={"output": "\n".join(ln for ln in deploy_out.splitlines() if not COMMAND.match(ln))},
            measures=DEPLOY_MEASURES,
        )
        run(env, "stop", *RECIPE)
    finally:
        subprocess.run([*INVOKE, "stop", "--host", "local"], env=env, cwd=ROOT, capture_output=True)
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(prefix, ignore_errors=True)
    one, two = membw(1), membw(2)
    write_result(
        ROOT / "reports" / "local" / "membw.json",
        "the membw probe on this machine: a numpy copy with one thread, then two",
        {"copy_gb_s_one_thread": round(one, 1), "copy_gb_s_two_threads": round(two, 1)},
        {"copy_gb_s_one_thread": "GB/s", "copy_gb_s_two_threads": "GB/s"},
        f"python3 {PROBE.relative_to(ROOT)} --threads 1; python3 {PROBE.relative_to(ROOT)} --threads 2",
        commit=commit,
        notes="Read + write counted, 1e9 bytes per GB; the probe's defaults otherwise; Debian's python3-numpy.",
        measures=MEMBW_MEASURES,
    )
    print(f"membw: {one:.1f} GB/s one thread, {two:.1f} two")
    return 0


def _artifact_unit(key: str) -> str:
    """A share in percent, a KL divergence in nats (llama-perplexity's), a logit difference in logits."""
    return "%" if key.endswith("_pct") else "nats" if key.endswith("_kld") else "logits"


if __name__ == "__main__":
    raise SystemExit(main())
