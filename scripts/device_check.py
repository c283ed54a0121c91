"""The GPU path in one short run, for a GPU machine that is lent for minutes and has no network.

    python3 scripts/device_check.py PHASE --out DIR [--src TARBALL] [--prefix /opt/voltaforge]

Each phase writes DIR/<phase>.json (and its logs) and never needs the network; run them in
order from a driver (scripts/device_check.sh) so a failed phase does not stop the next:

  facts  the GPU (nvidia-smi, read by facts/gpu.py) and the host's copy rate (facts/membw.py)
  build  the build step's own operations (steps/build.py) on this machine for its GPU's arch:
         compiled, proven by cuobjdump, then run again (the no-op). If they fail, a plain
         cmake build of the same tree keeps the later phases going, and the failure is kept.
  gate   the v100-16gb recipe's model (Qwen2.5-14B, Q4_K_M) as a shaped GGUF (the planner's own
         tensors and types, zero weights: weights/shaped_gguf.py), served by llama-server with
         the recipe's own command line (steps/units.py), its load log judged against the plan
         (facts/server_log.py), then the gate itself (steps/bench_run.gate_run: the bench
         client's sweep, GPU telemetry, llama-bench, the JSON/Markdown/PNG report)
  moe    Qwen3-30B-A3B Q4_K_M, shaped: llama-bench decode at --n-cpu-moe 0..48 (the two-sided
         roofline, measured), llama-fit-params with a V100-16GB-sized budget (what llama.cpp's
         own fit picks), and llama-server with --n-cpu-moe: its load log

Zero weights make the tokens meaningless and the speed and memory real (shaped_gguf.py says
where that differs). The recipe's GPU is replaced by the lent one (`--gpu`, default h200).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from playbooks.config.planning import plan_recipe  # noqa: E402
from playbooks.config.recipe import load_recipe  # noqa: E402
from playbooks.facts import builds, cuda, gpu, membw, read_fact  # noqa: E402
from playbooks.facts.server_log import judge_load, parse_load_log  # noqa: E402
from playbooks.host.local import LocalHost  # noqa: E402
from playbooks.host.ops import run_ops  # noqa: E402
from playbooks.plan.model_config import load_config_file  # noqa: E402
from playbooks.steps.build import (  # noqa: E402
    BuildLayout,
    Source,
    build_ops,
    cmake_flags,
    file_sha256,
    read_compile_facts,
)
from playbooks.steps.units import ServerLayout, llama_server_argv  # noqa: E402
from playbooks.weights.shaped_gguf import write_shaped_gguf  # noqa: E402

TARGETS = ("llama-server", "llama-bench", "llama-fit-params", "llama-quantize")
MODELS = Path("/tmp/vf-device/models")


def _save(out: Path, name: str, data: dict[str, Any]) -> None:
    (out / f"{name}.json").write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


def _sh(cmd: str, timeout: float = 600) -> tuple[int, str]:
    r = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=timeout)
    return r.returncode, r.stdout + r.stderr


def bin_dir(args: argparse.Namespace) -> Path:
    if args.bin:
        return Path(args.bin)
    ours = Path(args.prefix) / "llama.cpp" / "current" / "bin"
    return ours if (ours / "llama-server").exists() else Path("/tmp/vf-device/fallback-build/bin")


# -- facts ------------------------------------------------------------------------------------


def phase_facts(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    host = LocalHost()
    g = gpu.parse_nvidia_smi_csv(read_fact(host, gpu.NVIDIA_SMI_CSV_COMMAND))
    bw = membw.read_membw(read_fact(host, membw.membw_command(sys.executable, str(membw.MEMBW_PROBE_PATH), 1024)))
    toolkits = cuda.parse_toolkits(read_fact(host, cuda.TOOLKITS_COMMAND))
    _, smi = _sh("nvidia-smi; nproc; free -g; cat /proc/cpuinfo | grep -m1 'model name'")
    (out / "nvidia-smi.txt").write_text(smi)
    return {
        "gpus": [x.model_dump() for x in g.gpus] if g.available else g.reason,
        "membw": bw.__dict__,
        "toolkits": [t.model_dump() for t in toolkits],
    }


# -- build ------------------------------------------------------------------------------------


def phase_build(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    host = LocalHost()
    src = Path(args.src)
    top = src.name.removesuffix(".tar.gz")
    source = Source(
        "llama-cpp-python==0.3.36 (vendor/llama.cpp; models, docs, tests and benches left out)",
        "0c1e570",
        src,
        file_sha256(src),
        f"{top}/vendor/llama.cpp",
    )
    facts = read_compile_facts(host, cuda_build=True)
    nvccs = sorted({t.release for t in facts.toolkits if t.kind == "nvcc" and t.release})
    release = nvccs[-1] if nvccs else None
    arch = args.arch
    result: dict[str, Any] = {"toolkits": [str(t.path) for t in facts.toolkits], "release": release, "arch": arch}
    layout = BuildLayout(args.prefix)
    ops = build_ops(layout, source, cuda_release=release, recipe_arch=arch, targets=TARGETS)
    for run in ("first", "again"):
        t0 = time.monotonic()
        changes = run_ops(host, ops)
        result[run] = {
            "seconds": round(time.monotonic() - t0, 1),
            "changes": [{"step": c.step, "status": c.status, "why": c.why} for c in changes],
        }
        if any(c.status == "failed" for c in changes):
            result[run]["detail"] = next((c.detail for c in changes if c.status == "failed"), "")
            break
    stamp = Path(layout.current) / builds.STAMP_NAME
    if stamp.exists():
        result["stamp"] = json.loads(stamp.read_text())
    if not (Path(layout.current) / "bin" / "llama-server").exists():
        # keep the later phases going with the same flags, outside our operations
        fb = Path("/tmp/vf-device/fallback-build")
        tree = Path("/tmp/vf-device/fallback-src")
        tree.mkdir(parents=True, exist_ok=True)
        nvcc = shlex.quote(next((t.path for t in facts.toolkits if t.kind == "nvcc" and t.release == release), "nvcc"))
        flags = " ".join(shlex.quote(f) for f in cmake_flags(arch))
        cmd = (
            f"tar -xzf {shlex.quote(str(src))} -C {tree} && cd {tree}/{top}/vendor/llama.cpp && "
            f"CUDACXX={nvcc} cmake -S . -B {fb} $(command -v make >/dev/null || echo -G Ninja) {flags} "
            f"> {fb}.configure.log 2>&1 && "
            f"cmake --build {fb} -j$(nproc) --target {' '.join(TARGETS)} > {fb}.build.log 2>&1"
        )
        t0 = time.monotonic()
        rc, text = _sh(cmd, timeout=900)
        result["fallback"] = {"rc": rc, "seconds": round(time.monotonic() - t0, 1), "tail": text[-2000:]}
    return result


# -- gate -------------------------------------------------------------------------------------


def device_recipe(base: str, gpu_key: str, tmp: Path, config: Path | None = None, **over: Any) -> Path:
    """The shipped recipe with the lent GPU (and `config` for its model), its model config
    copied beside it."""
    import yaml

    from playbooks.config.recipe import RECIPES_DIR

    data = yaml.safe_load((RECIPES_DIR / f"{base}.yaml").read_text())
    cfg = data["model"]["config"]
    tmp.mkdir(parents=True, exist_ok=True)
    if isinstance(cfg, str):  # a file beside the recipe (else the JSON inline)
        (tmp / Path(cfg).name).write_text((RECIPES_DIR / cfg).read_text())
        data["model"]["config"] = Path(cfg).name
    if config is not None:
        (tmp / config.name).write_text(config.read_text())
        data["model"] = {"config": config.name, "repo": "voltaforge/shaped", "revision": "0" * 40}
    data["gpu"] = gpu_key
    data.setdefault("toolchain", {})["cuda_arch"] = "90"
    data |= over
    (tmp / "defaults.yaml").write_text((RECIPES_DIR / "defaults.yaml").read_text())
    path = tmp / f"{base}-on-{gpu_key}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _serve(argv: list[str], log: Path, port: int, timeout: float = 300) -> tuple[subprocess.Popen, int, float]:
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    code = 0
    host = LocalHost()
    from playbooks.facts.service import health_command, parse_health

    while time.monotonic() - t0 < timeout and proc.poll() is None:
        code = parse_health(read_fact(host, health_command(port)))
        if code == 200:
            break
        time.sleep(0.5)
    return proc, code, round(time.monotonic() - t0, 1)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()


def phase_gate(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    from playbooks.steps.bench_run import gate_run
    from playbooks.steps.deploy import DeployLayout, write_record

    path = device_recipe(args.gate_recipe, args.gpu, Path("/tmp/vf-device/recipes"))
    loaded = load_recipe(path)
    r = loaded.recipe
    gguf = write_shaped_gguf(MODELS / f"{args.gate_recipe}-{r.quant_name}.gguf", loaded.shape, r.quant_name)
    plan = plan_recipe(loaded)
    option = next(o for o in plan.options if o.quant == r.quant_name)
    argv, _ = llama_server_argv(r, ServerLayout(args.prefix))
    argv[0] = str(bin_dir(args) / "llama-server")
    argv[argv.index("--model") + 1] = str(gguf)
    log = out / "gate-server.log"
    proc, code, load_s = _serve(argv, log, r.service.port)
    result: dict[str, Any] = {
        "argv": argv,
        "health": code,
        "load_s": load_s,
        "file_bytes": gguf.stat().st_size,
        "planned": {
            "file_bytes": option.weights_bytes,
            "kv_mib": option.kv_bytes / 2**20,
            "compute_mib": option.compute_bytes / 2**20,
            "vram_gib": option.vram_bytes / 2**30,
            "streamed_bytes": option.streamed_bytes,
        },
    }
    try:
        text = log.read_text(errors="replace")
        loadlog = parse_load_log(text)
        result["load_log"] = {
            "offloaded": loadlog.offloaded,
            "kv_mib": loadlog.kv_mib,
            "compute_mib": loadlog.compute_mib,
            "model_mib": loadlog.model_mib,
            "build": loadlog.build,
        }
        result["judge_load"] = judge_load(
            loadlog,
            expect_layers=None if args.gpu == "cpu" else loaded.shape.num_hidden_layers + 1,
            planned_kv_mib=option.kv_bytes / 2**20,
            planned_compute_mib=option.compute_bytes / 2**20,
        )
        if code != 200:
            result["error"] = f"llama-server did not answer /health (last {code})"
            return result
        layout = DeployLayout(args.prefix, "voltaforge-device-gate")
        Path(layout.state_dir).mkdir(parents=True, exist_ok=True)
        write_record(
            LocalHost(),
            layout,
            {
                "port": r.service.port,
                "artifact": {"path": str(gguf)},
                "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "buffers": {"offloaded": list(loadlog.offloaded) if loadlog.offloaded else None},
            },
        )
        gated, files, _ = gate_run(loaded, LocalHost(), args.prefix, layout, out_dir=out / "gate-report")
        result["gate"] = gated
    finally:
        _stop(proc)
    return result


# -- moe --------------------------------------------------------------------------------------


def _part(result: dict[str, Any], key: str, fn: Any) -> None:
    """One measurement of a phase: its failure is recorded and the next one still runs."""
    try:
        result[key] = fn()
    except Exception as exc:
        result[key] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-2000:]}


def phase_moe(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    config = Path(args.moe_config)
    shape = load_config_file(config)
    gguf = write_shaped_gguf(MODELS / f"{config.stem}-Q4_K_M.gguf", shape, "Q4_K_M")
    b = bin_dir(args)
    from playbooks.plan.gguf_size import assign_types

    result: dict[str, Any] = {
        "file_bytes": gguf.stat().st_size,
        "config": config.name,
        # the file's own layout, so a later planner can be compared on exactly this file
        "types": {t.name: ttype.name for t, ttype in assign_types(shape, "Q4_K_M")},
    }

    def fit() -> dict[str, Any]:
        # what llama.cpp's own fit picks when the GPU leaves a V100-sized budget free
        rc, free = _sh("nvidia-smi --query-gpu=memory.free --format=csv,noheader,nounits")
        if rc:
            return {"error": "no nvidia-smi"}
        free_mib = int(free.split()[0])
        found = {}
        for name, budget_mib in (("v100-16gb", 16384 - 400 - 256), ("v100-32gb", 32768 - 400 - 256)):
            cmd = f"{b}/llama-fit-params -m {gguf} -c 4096 -fa on -fitt {max(free_mib - budget_mib, 0)}"
            rc, text = _sh(cmd, timeout=180)
            found[name] = {
                "command": cmd,
                "rc": rc,
                "free_mib": free_mib,
                "budget_mib": budget_mib,
                "out": text[-6000:],
            }
        return found

    def sweep() -> dict[str, Any]:
        # decode speed against the experts kept in host RAM, one llama-bench process
        cmd = f"{b}/llama-bench -m {gguf} -p 0 -n 64 -r 2 -fa 1 -ncmoe {args.sweep} -o json"
        rc, text = _sh(cmd + " 2>/dev/null", timeout=400)
        rows = json.loads(text)
        return {
            "command": cmd,
            "rc": rc,
            "rows": [
                {"n_cpu_moe": r.get("n_cpu_moe"), "tg_tok_s": r.get("avg_ts"), "stddev": r.get("stddev_ts")}
                for r in rows
            ],
        }

    def server() -> dict[str, Any]:
        # llama-server with experts on the CPU: the load log deploy must accept
        path = device_recipe(
            args.gate_recipe, args.gpu, Path("/tmp/vf-device/recipes-moe"), config, context=4096, parallel=1
        )
        loaded = load_recipe(path)
        argv, _ = llama_server_argv(loaded.recipe, ServerLayout(args.prefix))
        argv[0] = str(b / "llama-server")
        argv[argv.index("--model") + 1] = str(gguf)
        argv += ["--n-cpu-moe", str(shape.num_hidden_layers // 2)]
        port = loaded.recipe.service.port
        proc, code, load_s = _serve(argv, out / "moe-server.log", port)
        found: dict[str, Any] = {"argv": argv, "health": code, "load_s": load_s}
        try:
            if code == 200:
                _, text = _sh(
                    f'curl -s -m 60 http://127.0.0.1:{port}/completion -d \'{{"prompt": "Hello", "n_predict": 64}}\''
                )
                found["timings"] = json.loads(text).get("timings")
        finally:
            _stop(proc)
        return found

    _part(result, "fit", fit)
    _part(result, "sweep", sweep)
    _part(result, "server", server)
    return result


PHASES = {"facts": phase_facts, "build": phase_build, "gate": phase_gate, "moe": phase_moe}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("phase", choices=sorted(PHASES))
    p.add_argument("--out", required=True)
    p.add_argument("--src", default=str(ROOT / ".device" / "llama_cpp_python-0.3.36.tar.gz"))
    p.add_argument("--prefix", default="/opt/voltaforge")
    p.add_argument("--gpu", default="h200")
    p.add_argument("--arch", default="90")
    p.add_argument("--bin", help="llama.cpp binaries to use instead of the build's (a local trial)")
    p.add_argument("--gate-recipe", default="qwen2.5-14b-v100-16gb")
    p.add_argument("--moe-config", default=str(ROOT / "recipes" / "models" / "qwen3-30b-a3b.config.json"))
    p.add_argument("--sweep", default="0,12,24,36,48", help="the --n-cpu-moe values llama-bench runs")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    try:
        data = PHASES[args.phase](args, out)
        rc = 0
    except Exception as exc:  # a phase's failure is its result: the driver goes on
        data = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        rc = 1
    data["phase_seconds"] = round(time.monotonic() - t0, 1)
    data["commit"] = _sh(f"git -C {ROOT} rev-parse HEAD 2>/dev/null || cat {ROOT}/.device/commit")[1].strip()
    _save(out, args.phase, data)
    print(f"{args.phase}: {'ok' if rc == 0 else data['error']} ({data['phase_seconds']} s)", flush=True)
    os.sync()
    return rc


if __name__ == "__main__":
    sys.exit(main())
