"""The GPU path in one short run, for a GPU machine that is lent for minutes and has no network.

    python3 scripts/device_check.py PHASE --out DIR [--src TARBALL] [--prefix /opt/voltaforge]

Each phase writes DIR/<phase>.json (and its logs) and never needs the network; run them in
order from a driver (scripts/device_check.sh) so a failed phase does not stop the next:

  facts  the GPU (nvidia-smi, read by facts/gpu.py) and the host's copy rate (facts/membw.py)
  build  the build step's own operations (steps/build/build.py) on this machine for its GPU's arch:
         compiled, proven by cuobjdump, then run again (the no-op). If they fail, a plain
         cmake build of the same tree keeps the later phases going, and the failure is kept.
  gate   the v100-16gb recipe's model (Qwen2.5-14B, Q4_K_M) as a shaped GGUF (the planner's own
         tensors and types, zero weights: weights/shaped_gguf.py), served by llama-server with
         the recipe's own command line (steps/serve/units.py), its load log judged against the plan
         (facts/server_log.py), then the gate itself (steps/bench_run.gate_run: the bench
         client's sweep, GPU telemetry, llama-bench, the JSON/Markdown/PNG report)
  moe    Qwen3-30B-A3B Q4_K_M, shaped: llama-bench decode at --n-cpu-moe 0..48 (the two-sided
         roofline, measured), llama-fit-params with a V100-16GB-sized budget (what llama.cpp's
         own fit picks), and llama-server with --n-cpu-moe: its load log
  exporter  our GPU exporter (steps/monitor/gpu_exporter.py) scraped between two
         `nvidia-smi --query-gpu` reads, five rounds: scripts/exporter_vs_smi.py says what agrees

Zero weights make the tokens meaningless and the speed and memory real (shaped_gguf.py says
where that differs). The recipe's GPU is replaced by the lent one (`--gpu`, default h200).

Each phase also writes its figures as result files (playbooks/results.py: the figures, the
command, the commit, the machine, the date; "measured here") under --reports, by default
DIR/../reports/<gpu>: facts -> membw.json and gpu-copy.json, build -> build.json, gate -> gate.json and
gate-load.json, moe -> moe-sweep.json and moe-load.json, exporter -> gpu-exporter.json. The session copies them into the
repository (`cp -r $OUT/reports/. reports/`), where tests/test_readme_figures.py holds the
README's figures to them; the names and keys are the ones the README's markers already use.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass
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
from playbooks.modelgen.shaped_gguf import write_shaped_gguf  # noqa: E402
from playbooks.plan.gpus import get_gpu, gpu_from_nvidia_name  # noqa: E402
from playbooks.plan.model_config import load_config_file  # noqa: E402
from playbooks.plan.moe import expert_layout  # noqa: E402
from playbooks.results import checkout_commit, describe_machine, write_result  # noqa: E402
from playbooks.steps.build.build import BuildLayout, build_ops, cmake_flags  # noqa: E402
from playbooks.steps.build.buildenv import read_compile_facts  # noqa: E402
from playbooks.steps.build.llamacpp_source import Source, file_sha256  # noqa: E402
from playbooks.steps.measure import roofline  # noqa: E402
from playbooks.steps.measure.bench import decode_figure  # noqa: E402
from playbooks.steps.serve.engine_llamacpp import llama_server_argv  # noqa: E402
from playbooks.steps.serve.units import ServerLayout  # noqa: E402

TARGETS = ("llama-server", "llama-bench", "llama-fit-params", "llama-quantize")
MODELS = Path("/tmp/vf-device/models")


def _save(out: Path, name: str, data: dict[str, Any]) -> None:
    (out / f"{name}.json").write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


def _sh(cmd: str, timeout: float = 600) -> tuple[int, str]:
    r = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=timeout)
    return r.returncode, r.stdout + r.stderr


def load_log_dict(text: str) -> dict[str, Any]:
    """What a llama-server load log says about memory (facts/server_log.py), as JSON."""
    loadlog = parse_load_log(text)
    return {
        "offloaded": loadlog.offloaded,
        "kv_mib": loadlog.kv_mib,
        "compute_mib": loadlog.compute_mib,
        "model_mib": loadlog.model_mib,
        "build": loadlog.build,
    }


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
    # the GPU's own device-to-device copy, reported beside its datasheet figure (which stays the
    # roofline's ceiling): the probe with the first python that has torch
    d2d = membw.Membw(copy_gb_s=None, error="no python with torch", kind="no-torch")
    for python in (sys.executable, "/opt/torch/.venv/bin/python", "python3"):
        cmd = f"{shlex.quote(python)} {shlex.quote(str(membw.MEMBW_PROBE_PATH))} --mib 1024 --device cuda"
        d2d = membw.read_membw(read_fact(host, f"{cmd} 2>&1 || true"))
        if d2d.kind not in ("no-torch", "no-output"):  # no-output: that python is not there
            break
    known = gpu_from_nvidia_name(g.gpus[0].name or "", g.gpus[0].memory_total_mib) if g.available and g.gpus else None
    datasheet = known.bandwidth_gb_s if known else None  # a GPU the catalog does not know: no datasheet figure
    return {
        "gpus": [x.model_dump() for x in g.gpus] if g.available else g.reason,
        "membw": bw.__dict__,
        "device_copy": d2d.__dict__,
        "datasheet_gb_s": datasheet,
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
    from playbooks.steps.measure.bench_run import gate_run
    from playbooks.steps.serve.deploy_record import DeployLayout, write_record

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
        result["load_log"] = load_log_dict(text)
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

    layout = expert_layout(shape, "Q4_K_M")
    result: dict[str, Any] = {
        "file_bytes": gguf.stat().st_size,
        "config": config.name,
        # the file's own layout, so a later planner can be compared on exactly this file
        "types": {t.name: ttype.name for t, ttype in assign_types(shape, "Q4_K_M")},
        # the plan's bytes per token at each N (GPU, host RAM) and the GPU's datasheet bandwidth:
        # what the two-sided roofline is made of, for the figures derived from the sweep
        "per_token_bytes": {n: list(layout.per_token(int(n))) for n in args.sweep.split(",")},
        "gpu_gb_s": get_gpu(args.gpu).bandwidth_gb_s,
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
        found["load_log"] = load_log_dict((out / "moe-server.log").read_text(errors="replace"))
        found["n_cpu_moe"] = shape.num_hidden_layers // 2
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


# -- result files -----------------------------------------------------------------------------
# Each phase's figures from its own JSON (what the phase returned), written as result files.
# Pure apart from the writing: tests/test_device_check.py feeds them captured phase output.


# -- exporter -------------------------------------------------------------------------------------

EXPORTER = ROOT / "playbooks" / "steps" / "monitor" / "gpu_exporter.py"
PROBE = ROOT / "playbooks" / "facts" / "probes" / "telemetry_probe.py"


def smi_fields_known() -> list[str]:
    """Each field exporter_vs_smi may ask, asked alone: one this driver does not know fails the
    whole query ('is not a valid field to query')."""
    import exporter_vs_smi as evs

    return [f for f in evs.WANTED if _sh(f"nvidia-smi --query-gpu={f} --format=csv,noheader,nounits", 30)[0] == 0]


def phase_exporter(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Our GPU exporter, run as a host runs it (its file and the probe beside it; pynvml and
    prometheus_client from this python's packages), scraped between two nvidia-smi reads, five
    rounds a second apart; each round's rows saved (scripts/exporter_vs_smi.py says what agrees)."""
    import urllib.request

    import exporter_vs_smi as evs

    where = out / "exporter"
    where.mkdir(exist_ok=True)
    for src in (EXPORTER, PROBE):
        (where / src.name).write_bytes(src.read_bytes())
    known = smi_fields_known()
    fields = evs.query_fields(known)
    result: dict[str, Any] = {"fields_known": known, "fields_asked": fields, "rounds": []}
    if "index" not in fields:
        raise RuntimeError("nvidia-smi answers no --query-gpu=index: no card to compare with")
    port = 19835
    log = out / "exporter.log"
    proc = subprocess.Popen(
        [sys.executable, str(where / EXPORTER.name), f"--listen=127.0.0.1:{port}"],
        stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    query = f"nvidia-smi --query-gpu={','.join(fields)} --format=csv,noheader,nounits"
    try:
        text = ""
        for _ in range(40):  # its first answer: up to 20 s
            try:
                text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
                break
            except OSError:
                if proc.poll() is not None:
                    raise RuntimeError(f"the exporter exited {proc.returncode}: {log.read_text()[-2000:]}") from None
                time.sleep(0.5)
        (out / "exporter-first.txt").write_text(text)
        sys.path.insert(0, str(where))
        from telemetry_probe import CLOCKS_EVENT_REASON_BITS

        rounds = []
        for i in range(5):
            rc_b, before = _sh(query, 30)
            scraped = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
            rc_a, after = _sh(query, 30)
            if rc_b or rc_a:
                raise RuntimeError(f"{query} failed: {before if rc_b else after}")
            rows = evs.compare(
                evs.parse_smi(before, fields), scraped, evs.parse_smi(after, fields), CLOCKS_EVENT_REASON_BITS
            )
            rounds.append(rows)
            result["rounds"].append({"before": before, "after": after, "rows": [asdict(r) for r in rows]})
            (out / f"exporter-scrape-{i}.txt").write_text(scraped)
            time.sleep(1)
        result["summary"] = evs.summary([r for rows in rounds for r in rows])
        result["per_round"] = [evs.summary(rows) for rows in rounds]
    finally:
        _stop(proc)
    return result


@dataclass(frozen=True)
class Run:
    """What every result file of this run shares."""

    reports: Path  # the folder the files go to (DIR/../reports/<gpu>)
    commit: str
    machine: str
    command: str  # this phase's command line


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _write(
    run: Run, name: str, title: str, figures: dict[str, Any], units: dict[str, str], command: str = "", **kw: Any
) -> Path | None:
    """One result file of the figures that were measured (a missing or failed one is left out);
    none at all: no file."""
    kept = {k: v for k, v in figures.items() if _number(v)}
    if not kept:
        return None
    path = run.reports / f"{name}.json"
    write_result(
        path,
        title,
        kept,
        {k: units[k] for k in kept},
        command or run.command,
        machine=run.machine,
        commit=run.commit,
        **kw,
    )
    return path


def _on_gpu(mib: dict[str, float] | None) -> float | None:
    """A load log's MiB on the GPUs (CUDA0, CUDA1, ...; not CUDA_Host)."""
    found = [v for k, v in (mib or {}).items() if re.fullmatch(r"CUDA\d+", k)]
    return round(sum(found), 2) if found else None


def _load_figures(load_log: dict[str, Any] | None) -> dict[str, Any]:
    log = load_log or {}
    offloaded = log.get("offloaded")
    return {
        "offloaded_layers": offloaded[0] if offloaded else None,
        "kv_mib": _on_gpu(log.get("kv_mib")),
        "compute_mib": _on_gpu(log.get("compute_mib")),
        "gpu_weights_mib": _on_gpu(log.get("model_mib")),
    }


LOAD_UNITS = {"offloaded_layers": "layers", "kv_mib": "MiB", "compute_mib": "MiB", "gpu_weights_mib": "MiB"}


def facts_results(data: dict[str, Any], run: Run) -> list[Path | None]:
    bw = data.get("membw") or {}
    d2d = data.get("device_copy") or {}
    return [
        _write(
            run,
            "membw",
            "the membw probe on the lent GPU machine's host (facts/membw.py's command)",
            {"copy_gb_s": bw.get("copy_gb_s"), "threads": bw.get("threads")},
            {"copy_gb_s": "GB/s", "threads": "threads"},
            notes="A numpy copy (read + write counted, 1e9 bytes per GB), the best of its trials.",
            extra={"membw": bw, "gpus": data.get("gpus")},
        ),
        _write(
            run,
            "gpu-copy",
            "the GPU's own device-to-device copy beside its datasheet bandwidth (the roofline keeps the datasheet)",
            {"d2d_copy_gb_s": d2d.get("copy_gb_s"), "datasheet_gb_s": data.get("datasheet_gb_s")},
            {"d2d_copy_gb_s": "GB/s", "datasheet_gb_s": "GB/s"},
            notes="torch on GPU 0, a 1 GiB buffer copied, timed with CUDA events, the best of 10 (read + write "
            "counted); the datasheet figure from playbooks/plan/gpus.py.",
            extra={"device_copy": d2d},
        ),
    ]


def build_results(data: dict[str, Any], run: Run) -> list[Path | None]:
    def count(which: str, status: str) -> int | None:
        changes = (data.get(which) or {}).get("changes")
        return None if changes is None else sum(c.get("status") == status for c in changes)

    return [
        _write(
            run,
            "build",
            f"invoke build's operations for sm_{data.get('arch')} on the lent GPU machine, run twice",
            {
                "first_run_s": (data.get("first") or {}).get("seconds"),
                "first_run_changed": count("first", "changed"),
                "second_run_s": (data.get("again") or {}).get("seconds"),
                "second_run_ok": count("again", "ok"),
                "fallback_build_s": (data.get("fallback") or {}).get("seconds"),
            },
            {
                "first_run_s": "s",
                "first_run_changed": "operations",
                "second_run_s": "s",
                "second_run_ok": "operations",
                "fallback_build_s": "s",
            },
            notes=f"CUDA {data.get('release')}; fallback_build_s only when the build step failed (a plain cmake).",
            extra={k: data.get(k) for k in ("release", "arch", "toolkits", "stamp")},
        )
    ]


def gate_results(data: dict[str, Any], run: Run) -> list[Path | None]:
    bench = data.get("gate") or {}
    levels = bench.get("levels") or []
    first = levels[0] if levels else {}
    telemetry = (bench.get("telemetry") or {}).get("summary") or {}
    work = bench.get("workload") or {}
    lb = bench.get("llama_bench") or {}
    mbu = bench.get("mbu")
    tg, pp = f"llama_bench_tg{work.get('max_tokens')}_tok_s", f"llama_bench_pp{work.get('prompt_tokens')}_tok_s"
    figures: dict[str, Any] = {
        "single_stream_tok_s": decode_figure(first) if first else None,
        # the bench's repeats: the 95% half-width of that mean, and how many requests made it
        "single_stream_halfwidth_tok_s": (first.get("decode") or {}).get("halfwidth"),
        "single_stream_n": (first.get("decode") or {}).get("n"),
        "server_tok_s": first.get("server_predicted_per_second"),
        # a share of the roofline only where it bounds: none above it (roofline.ABOVE_CEILING,
        # said in extra) nor where no roofline binds (cache-resident)
        "roofline_pct": round(mbu * 100, 2) if _number(mbu) and not roofline.above(mbu) else None,
        "ttft_p50_ms": round(first["ttft_p50_s"] * 1000, 1) if _number(first.get("ttft_p50_s")) else None,
        tg: lb.get("tg_tok_s"),
        pp: lb.get("pp_tok_s"),
        "min_sm_clock_mhz": telemetry.get("min_sm_clock_mhz"),
        "max_sm_clock_mhz": telemetry.get("max_sm_clock_mhz"),
        "max_temperature_c": telemetry.get("max_temperature_c"),
        "mean_power_w": telemetry.get("mean_power_w"),
    }
    units = {k: "tok/s" for k in ("single_stream_tok_s", "single_stream_halfwidth_tok_s", "server_tok_s", tg, pp)}
    units["single_stream_n"] = "count"
    units |= {"roofline_pct": "%", "ttft_p50_ms": "ms", "min_sm_clock_mhz": "MHz", "max_sm_clock_mhz": "MHz"}
    units |= {"max_temperature_c": "°C", "mean_power_w": "W"}
    for level in levels:
        key = f"aggregate_{level.get('concurrency')}_tok_s"
        figures[key], units[key] = level.get("aggregate_tok_s"), "tok/s"
    verdict = bench.get("gate") or {}
    return [
        _write(
            run,
            "gate",
            f"the gate of {bench.get('recipe')} (a shaped GGUF, the recipe's command line) on the lent GPU",
            figures,
            units,
            notes=(
                "steps/bench_run.gate_run: single_stream_tok_s is the figure the gate judges "
                "(steps/bench.decode_figure), roofline_pct the same over the computed roofline (extra.roofline_tok_s)."
            ),
            extra={
                "gate_passed": verdict.get("passed"),
                "reasons": verdict.get("reasons"),
                "roofline_tok_s": bench.get("roofline_tok_s"),
                "roofline_basis": bench.get("roofline_basis"),
                # a ceiling or measurement error (MBU above 1), or a roofline that does not bind
                "mbu_note": roofline.mbu_note(bench),
                "workload": work,
                "llama_bench_command": lb.get("command"),
                "throttled": telemetry.get("throttled"),
            },
        ),
        _write(
            run,
            "gate-load",
            "llama-server loading the gate recipe's shaped model with the recipe's command line on the lent GPU",
            _load_figures(data.get("load_log")),
            LOAD_UNITS,
            " ".join(data.get("argv") or []),
            notes="The load log's lines at -lv 4 (facts/server_log.py), the GPU's buffers; the plan's in extra.",
            extra={"planned": data.get("planned"), "judge_load": data.get("judge_load")},
        ),
    ]


def moe_results(data: dict[str, Any], run: Run) -> list[Path | None]:
    sweep = data.get("sweep") or {}
    per_token = data.get("per_token_bytes") or {}
    gpu_gb_s = data.get("gpu_gb_s")
    figures: dict[str, Any] = {}
    units: dict[str, str] = {}
    for row in sweep.get("rows") or []:
        n, tok_s = row.get("n_cpu_moe"), row.get("tg_tok_s")
        if not _number(n) or not _number(tok_s) or tok_s <= 0:
            continue
        figures[f"tg_tok_s_n{n}"], units[f"tg_tok_s_n{n}"] = round(tok_s, 2), "tok/s"
        gpu, host = per_token.get(str(n)) or per_token.get(n) or (None, None)
        if not _number(gpu_gb_s) or gpu is None:
            continue
        figures[f"gpu_roofline_pct_n{n}"] = round(tok_s / (gpu_gb_s * 1e9 / gpu) * 100, 2)
        units[f"gpu_roofline_pct_n{n}"] = "%"
        rest = 1 / tok_s - gpu / (gpu_gb_s * 1e9)  # the seconds per token the GPU's bytes do not explain
        if host and rest > 0:
            figures[f"host_gb_s_n{n}"], units[f"host_gb_s_n{n}"] = round(host / rest / 1e9, 2), "GB/s"
    server = data.get("server") or {}
    return [
        _write(
            run,
            "moe-sweep",
            f"llama-bench decode of the shaped {data.get('config')} Q4_K_M against --n-cpu-moe N",
            figures,
            units,
            sweep.get("command") or "",
            notes=(
                "tg_tok_s_nN is measured. Derived with the plan's bytes per token (extra.per_token_bytes: GPU, host) "
                f"and the GPU's datasheet {gpu_gb_s} GB/s: host_gb_s_nN = host bytes / (1 / tok/s - GPU bytes / GPU "
                "bandwidth), gpu_roofline_pct_nN = tok/s over GPU bandwidth / GPU bytes."
            ),
            extra={"per_token_bytes": per_token, "gpu_gb_s": gpu_gb_s, "rows": sweep.get("rows")},
        ),
        _write(
            run,
            "moe-load",
            f"llama-server loading the shaped {data.get('config')} Q4_K_M with --n-cpu-moe {server.get('n_cpu_moe')}",
            _load_figures(server.get("load_log")),
            LOAD_UNITS,
            " ".join(server.get("argv") or []),
            notes="The load log's lines at -lv 4 (facts/server_log.py), the GPU's buffers.",
        ),
    ]


def exporter_results(data: dict[str, Any], run: Run) -> list[Path | None]:
    total = data.get("summary") or {}
    return [
        _write(
            run,
            "gpu-exporter",
            "our GPU exporter's series against nvidia-smi --query-gpu, read around each scrape",
            {
                "compared": total.get("compared"),
                "agree": total.get("agree"),
                "differ": total.get("differ"),
                "rounds": len(data.get("rounds") or []) or None,
            },
            {"compared": "values", "agree": "values", "differ": "values", "rounds": "rounds"},
            notes="scripts/exporter_vs_smi.py: a value that does not move must be equal, one that moves must lie "
            "between nvidia-smi's reads before and after the scrape (widened by its display rounding); a field "
            "neither answers agrees. The card as the phases before it left it (idle when the phase runs alone).",
            extra={
                "differing": total.get("differing"),
                "fields_asked": data.get("fields_asked"),
                "per_round": data.get("per_round"),
            },
        )  # fmt: skip
    ]


RESULTS = {
    "facts": facts_results,
    "build": build_results,
    "gate": gate_results,
    "moe": moe_results,
    "exporter": exporter_results,
}


def run_commit() -> str:
    """This checkout's commit, else the one the session wrote into .device/commit (the copy on a
    lent machine has no .git)."""
    found = checkout_commit(ROOT)
    if found:
        return found
    stamp = ROOT / ".device" / "commit"
    sha = stamp.read_text().strip().lower()[:12] if stamp.exists() else ""
    if not re.fullmatch(r"[0-9a-f]{7,12}", sha):
        raise RuntimeError("no commit: not a git checkout and no .device/commit")
    return sha


def machine_line() -> str:
    """The GPUs (nvidia-smi) and the host (results.describe_machine)."""
    rc, text = _sh("nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader", timeout=30)
    gpus = [" ".join(x.strip() for x in ln.split(",")[:2]) for ln in text.splitlines() if ln.count(",") >= 2]
    driver = text.splitlines()[0].split(",")[-1].strip() if gpus else ""
    what = f"{', '.join(gpus)} (driver {driver}); " if rc == 0 and gpus else "no GPU seen by nvidia-smi; "
    return what + describe_machine()


PHASES = {
    "facts": phase_facts,
    "build": phase_build,
    "gate": phase_gate,
    "moe": phase_moe,
    "exporter": phase_exporter,
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("phase", choices=sorted(PHASES))
    p.add_argument("--out", required=True)
    p.add_argument("--reports", help="where the result files go (default: OUT/../reports/GPU)")
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
    try:  # the figures as result files; a failure here is recorded, the phase's JSON still saved
        run = Run(
            Path(args.reports) if args.reports else out.parent / "reports" / args.gpu,
            run_commit(),
            machine_line(),
            shlex.join(["python3", "scripts/device_check.py", *sys.argv[1:]]),
        )
        data["result_files"] = [str(p) for p in RESULTS[args.phase](data, run) if p is not None]
    except Exception as exc:
        data["result_files_error"] = f"{type(exc).__name__}: {exc}"
    _save(out, args.phase, data)
    print(f"{args.phase}: {'ok' if rc == 0 else data['error']} ({data['phase_seconds']} s)", flush=True)
    os.sync()
    return rc


if __name__ == "__main__":
    sys.exit(main())
