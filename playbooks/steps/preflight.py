"""`invoke preflight`: read a host's facts, then judge them against a recipe.

Gathering is I/O (one command per fact, over the host layer); judging is pure: `judge()`
takes facts and a recipe and returns checks, each with a verdict and a fix. A check that
fails and is blocking makes preflight exit non-zero.
"""

from __future__ import annotations

import json
import re
import secrets
import sys
from dataclasses import dataclass, field
from typing import Any, Optional

from pydantic import BaseModel
from rich.console import Console
from rich.table import Table

from playbooks.facts import read_fact, cuda, gpu as gpufacts, system
from playbooks.plan.gpus import GIB, Gpu, get_gpu, gpu_from_nvidia_name
from playbooks.plan.planner import make_plan
from playbooks.plan.tensors import parameter_count
from playbooks.cli.render import size_text as _size
from playbooks.config.recipe import LoadedRecipe

# Minimum Linux driver per CUDA major release (NVIDIA's CUDA compatibility table, minor
# version compatibility): 11.x needs >= 450.80.02, 12.x needs >= 525.60.13.
MIN_DRIVER = {11: (450, 80, 2), 12: (525, 60, 13)}
# R580 is the last driver branch that supports Volta (knowledge.md section 3).
LAST_VOLTA_DRIVER_BRANCH = 580
MIN_RAM_BYTES = 16 * GIB  # HF -> GGUF conversion and EXL2 measurement hold a layer plus buffers


class HostFacts(BaseModel):
    host: str
    os: system.OsRelease
    gpus: gpufacts.GpuFacts
    toolkits: list[cuda.Toolkit]
    gcc: cuda.GccVersion
    gxx11: cuda.GccVersion
    python: system.PythonVersion
    disk: dict[str, system.DiskFree]
    memory: system.MemInfo
    systemd: system.SystemdState
    nproc: Optional[int] = None
    machine: Optional[str] = None



def _gpu_facts(host) -> gpufacts.GpuFacts:
    """NVML through the probe when the host has Python, nvidia-smi's CSV otherwise."""
    remote = f"/tmp/voltaforge-gpu-probe-{secrets.token_hex(6)}.py"
    try:
        host.put(str(gpufacts.GPU_PROBE_PATH), remote)
        probed = gpufacts.parse_gpu_probe_json(read_fact(host, gpufacts.gpu_probe_command(remote)))
    finally:
        host.run(f"rm -f {remote}", check=False, stream=False)
    if probed.available:
        return probed
    csv = gpufacts.parse_nvidia_smi_csv(read_fact(host, gpufacts.NVIDIA_SMI_CSV_COMMAND))
    if csv.needs_legacy_query:
        csv = gpufacts.parse_nvidia_smi_csv(
            read_fact(host, gpufacts.NVIDIA_SMI_CSV_LEGACY_COMMAND), gpufacts.QUERY_FIELDS_LEGACY
        )
    if csv.available:
        return csv
    return csv.model_copy(update={"reason": f"{probed.reason}; {csv.reason}"})


def gather(host, prefix: str, model_dir: str) -> HostFacts:
    """Read every fact preflight judges. Read-only: nothing on the host changes."""
    return HostFacts(
        host=host.name,
        os=system.parse_os_release(read_fact(host, system.OS_RELEASE_COMMAND)),
        gpus=_gpu_facts(host),
        toolkits=cuda.parse_toolkits(read_fact(host, cuda.TOOLKITS_COMMAND)),
        gcc=cuda.parse_gcc_version(read_fact(host, cuda.GCC_VERSION_COMMAND)),
        gxx11=cuda.parse_gcc_version(read_fact(host, cuda.GXX11_VERSION_COMMAND)),
        python=system.parse_python_version(read_fact(host, system.PYTHON_VERSION_COMMAND)),
        disk=system.parse_df(read_fact(host, system.disk_free_command([prefix, model_dir]))),
        memory=system.parse_meminfo(read_fact(host, system.MEMINFO_COMMAND)),
        systemd=system.parse_systemd(read_fact(host, system.SYSTEMD_COMMAND)),
        nproc=system.parse_nproc(read_fact(host, system.NPROC_COMMAND)),
        machine=system.parse_uname_machine(read_fact(host, system.UNAME_MACHINE_COMMAND)),
    )


@dataclass
class Check:
    name: str
    status: str            # pass | warn | fail
    detail: str
    fix: str = ""
    blocking: bool = False


@dataclass
class Verdict:
    facts: HostFacts
    checks: list[Check] = field(default_factory=list)
    plan_summary: Optional[str] = None

    @property
    def ok(self) -> bool:
        return not any(c.status == "fail" and c.blocking for c in self.checks)


# The seed report's V100 fell from 42 to 30 tok/s after ten minutes at 85 C.
HOT_C = 85
BUSY_MIB = 1024  # more than a CUDA context's worth held by someone else


def _gpu_health(gpus, add) -> None:
    """Thermal/power throttling, persistence mode and memory already in use, per GPU."""
    hot = [f"GPU{g.index} {g.temperature_c} C" for g in gpus if g.temperature_c is not None and g.temperature_c >= HOT_C]
    throttled = [f"GPU{g.index}: {', '.join(g.throttling)}" for g in gpus if g.throttling]
    if hot or throttled:
        add(Check("thermal", "warn", "; ".join(hot + throttled),
                  "improve cooling or airflow, check `nvidia-smi -q -d PERFORMANCE,TEMPERATURE` (the seed "
                  "report's V100 fell from 42 to 30 tok/s at 85 C)"))
    elif any(g.temperature_c is not None for g in gpus):
        add(Check("thermal", "pass", ", ".join(f"GPU{g.index} {g.temperature_c} C" for g in gpus if g.temperature_c is not None)))
    off = [f"GPU{g.index}" for g in gpus if g.persistence_mode is False]
    if off:
        add(Check("persistence", "warn", f"persistence mode off on {', '.join(off)}",
                  "enable nvidia-persistenced (or `nvidia-smi -pm 1`) so the driver stays loaded between runs"))
    busy = [f"GPU{g.index} {g.memory_used_mib} MiB" for g in gpus if (g.memory_used_mib or 0) > BUSY_MIB]
    if busy:
        add(Check("gpu-memory-in-use", "warn", f"memory already in use: {', '.join(busy)}",
                  "the plan assumes an empty GPU: stop the other processes (`nvidia-smi` lists them)"))


def _version_tuple(v: Optional[str]) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v or ""))


def host_gpu(facts: HostFacts) -> Optional[Gpu]:
    """The catalog entry for the host's first GPU, with the memory the driver reports."""
    if not facts.gpus.available or not facts.gpus.gpus:
        return None
    g = facts.gpus.gpus[0]
    known = gpu_from_nvidia_name(g.name or "", g.memory_total_mib)
    if known is None:
        return None
    if g.memory_total_mib:
        known = known.model_copy(update={"memory_gib": g.memory_total_mib / 1024})
    return known


def judge(facts: HostFacts, loaded: Optional[LoadedRecipe], model_dir: str, prefix: str,
          inventory_gpu: Optional[str] = None) -> Verdict:
    """Pure: turn facts (and the recipe, when given) into checks with fixes.

    The GPU the plan is judged against: the one the host reports; else the inventory's `gpu`;
    else the recipe's. An inventory entry that disagrees with the host is flagged."""
    v = Verdict(facts)
    add = v.checks.append
    recipe = loaded.recipe if loaded else None
    wants_gpu = recipe is None or not get_gpu(recipe.gpu).is_cpu
    cuda_pin = tuple(int(x) for x in (recipe.toolchain.cuda if recipe else "11.8").split("."))

    # --- OS and init
    os_ok = facts.os.id in ("debian", "ubuntu") and facts.os.version_id in ("12", "20.04", "22.04")
    add(Check("os", "pass" if os_ok else "warn",
              facts.os.pretty_name or facts.os.reason or "unknown",
              "" if os_ok else "voltaforge installs CUDA 11.8 on Debian 12 and Ubuntu 20.04/22.04; others need it preinstalled"))
    add(Check("systemd", "pass" if facts.systemd.systemd_running else "fail",
              f"state {facts.systemd.state or 'absent'}",
              "" if facts.systemd.systemd_running else "services are systemd units: use a host booted with systemd",
              blocking=True))
    py = facts.python
    py_ok = bool(py.available and py.version and py.version >= (3, 9))
    add(Check("python", "pass" if py_ok else "fail",
              ".".join(map(str, py.version)) if py.version else py.reason,
              "" if py_ok else "install python3 (>= 3.9) and python3-venv", blocking=True))

    # --- GPU, driver
    g = host_gpu(facts)
    # same kind = same compute capability and nominal memory (SXM2 and PCIe V100s are alike)
    if g is not None and inventory_gpu and (
        (get_gpu(inventory_gpu).compute_capability, get_gpu(inventory_gpu).memory_gib)
        != (g.compute_capability, get_gpu(g.key).memory_gib)
    ):
        add(Check("gpu-kind", "warn", f"inventory.yaml says {inventory_gpu}, the host has {g.name}",
                  "correct the host's gpu in inventory.yaml (the plan uses the GPU the host reports)"))
    if not facts.gpus.available:
        add(Check("gpu", "fail" if wants_gpu else "pass",
                  f"no NVIDIA GPU visible: {facts.gpus.reason}" + ("" if wants_gpu else " (not needed: CPU recipe)"),
                  "install the NVIDIA driver (R580 is the last branch for Volta) and check `nvidia-smi`" if wants_gpu else "",
                  blocking=wants_gpu))
    else:
        first = facts.gpus.gpus[0]
        cc = first.compute_capability
        detail = f"{facts.gpus.gpu_count} x {first.name}, {first.memory_total_mib} MiB, cc {cc[0]}.{cc[1]}" if cc else first.name
        add(Check("gpu", "pass", detail))
        if cc and cc < (8, 0):
            add(Check("bf16", "warn", f"compute capability {cc[0]}.{cc[1]} has no BF16",
                      "BF16 weights are converted to FP16 (FP16-only paths can overflow for some models: the smoke gate checks text)"))
        drv = _version_tuple(facts.gpus.driver_version)
        need = MIN_DRIVER.get(cuda_pin[0])
        if drv and need and drv < need:
            add(Check("driver", "fail", f"driver {facts.gpus.driver_version} is older than CUDA {recipe.toolchain.cuda if recipe else '11.8'} needs ({'.'.join(map(str, need))})",
                      "upgrade the driver (any branch up to R580 runs CUDA 11.8 binaries)", blocking=True))
        elif drv and cc and cc == (7, 0) and drv[0] > LAST_VOLTA_DRIVER_BRANCH:
            add(Check("driver", "fail", f"driver {facts.gpus.driver_version} is past R580, the last branch that supports Volta",
                      "install an R580 (or older) driver", blocking=True))
        else:
            add(Check("driver", "pass", f"driver {facts.gpus.driver_version or 'unknown'}"))
        _gpu_health(facts.gpus.gpus, add)

    # --- CUDA toolkits
    if cuda_pin[0] >= 13 and wants_gpu:
        add(Check("cuda-pin", "fail", f"recipe pins CUDA {recipe.toolchain.cuda}: CUDA 13 cannot target sm_70",
                  "set toolchain.cuda to 11.8 (or 12.x)", blocking=True))
    nvccs = [t for t in facts.toolkits if t.kind == "nvcc"]
    pinned = [t for t in nvccs if t.release == cuda_pin[:2]]
    if wants_gpu:
        if pinned:
            add(Check("cuda-toolkit", "pass", f"CUDA {cuda_pin[0]}.{cuda_pin[1]} at {pinned[0].path}"))
        else:
            found = ", ".join(f"{t.release[0]}.{t.release[1]} ({t.path})" for t in nvccs if t.release) or "none"
            add(Check("cuda-toolkit", "warn", f"CUDA {cuda_pin[0]}.{cuda_pin[1]} not installed (found: {found})",
                      "`invoke toolchain --host H` installs it (Debian 12: non-free nvidia-cuda-toolkit)"))
        first_nvcc = cuda.first_on_path(facts.toolkits, "nvcc")
        if first_nvcc and first_nvcc.release and not first_nvcc.sm70_supported:
            add(Check("cuda-on-path", "warn",
                      f"the nvcc first on PATH ({first_nvcc.path}) is CUDA {first_nvcc.release[0]}.{first_nvcc.release[1]}, which cannot target sm_70",
                      "voltaforge builds with PATH/CUDA_HOME/CUDACXX pinned to the recipe's toolkit; do the same for manual builds"))
        mixed = cuda.mixed_toolkits_warning(facts.toolkits)
        if mixed:
            add(Check("mixed-toolkits", "warn", mixed,
                      "voltaforge's build environment pins one toolkit (playbooks/steps/buildenv.py); by hand: "
                      "PATH=<toolkit>/bin:/usr/sbin:/usr/bin:/sbin:/bin CUDA_HOME=<root> CUDAToolkit_ROOT=<root> CUDACXX=<nvcc> (root /usr for Debian's package)"))
        # nvcc 11.x refuses GCC > 11 (crt/host_config.h) unless a g++-11 is used
        if cuda_pin[0] == 11 and facts.gcc.major and facts.gcc.major > 11:
            ok = facts.gxx11.available
            add(Check("host-compiler", "pass" if ok else "warn",
                      f"gcc {'.'.join(map(str, facts.gcc.version or ()))}; g++-11 {'present' if ok else 'missing'}",
                      "" if ok else "install g++-11 (Debian's nvidia-cuda-toolkit depends on it and routes nvcc to it)"))

    # --- disk and memory
    if loaded:
        plan = make_plan(loaded.shape, g or get_gpu(inventory_gpu or recipe.gpu), _serving(loaded), quant=recipe.quant_name,
                         min_bpw=recipe.planner.min_bpw)
        chosen = plan.chosen
        params = parameter_count(loaded.shape)
        # download (BF16, 2 bytes/param) + FP16 intermediate (2 bytes/param) + the quantized file
        need_disk = 4 * params + chosen.weights_bytes
        d = facts.disk.get(model_dir)
        if d and d.available_bytes is not None:
            ok = d.available_bytes >= need_disk
            add(Check("disk", "pass" if ok else "fail",
                      f"{_size(d.available_bytes)} free at {d.existing_path}, need {_size(need_disk)} "
                      "(download + FP16 + quantized file)",
                      "" if ok else f"free {max(0, need_disk - d.available_bytes) / 1e9:.1f} GB or point the model dir elsewhere",
                      blocking=True))
        mem = facts.memory.mem_total_bytes
        if mem:
            ok = mem >= MIN_RAM_BYTES or params < 2e9
            add(Check("ram", "pass" if ok else "warn", f"{mem / GIB:.1f} GiB RAM",
                      "" if ok else "conversion of 14-32B models wants >= 16 GiB RAM; add swap or convert elsewhere"))
        verdict = (f"{chosen.quant} fits with {chosen.headroom_bytes / 2**20:,.0f} MiB left"
                   if chosen.fits else f"{chosen.quant} does not fit by {-chosen.headroom_bytes / 2**20:,.0f} MiB")
        source = "the inventory's" if inventory_gpu else "the recipe's"
        target = plan.gpu.name + (f" ({source} GPU: none seen on the host)" if g is None and wants_gpu else "")
        v.plan_summary = f"{verdict} on {target}; {plan.reason}"
        add(Check("fit", "pass" if chosen.fits else "fail", f"{verdict} on {target}",
                  "" if chosen.fits else f"choose {plan.recommendation.quant if plan.recommendation else 'a smaller model'}, or a shorter context",
                  blocking=True))
    return v


def _serving(loaded: LoadedRecipe):
    from playbooks.config.planning import serving_from_recipe

    return serving_from_recipe(loaded)


def verdict_json(v: Verdict) -> dict[str, Any]:
    return {
        "host": v.facts.host,
        "ok": v.ok,
        "facts": json.loads(v.facts.model_dump_json()),
        "checks": [c.__dict__ for c in v.checks],
        "plan": v.plan_summary,
    }


def render(v: Verdict, console: Console) -> None:
    f = v.facts
    console.print(f"[bold]{f.host}[/]: {f.os.pretty_name or 'unknown OS'}, {f.machine or '?'}, "
                  f"{f.nproc or '?'} CPUs, {(f.memory.mem_total_bytes or 0) / GIB:.1f} GiB RAM")
    table = Table(title=f"preflight {f.host}")
    for col in ("check", "status", "detail", "fix"):
        table.add_column(col, overflow="fold")
    colours = {"pass": "green", "warn": "yellow", "fail": "red"}
    for c in v.checks:
        table.add_row(c.name, f"[{colours[c.status]}]{c.status}{' (blocking)' if c.status == 'fail' and c.blocking else ''}[/]",
                      c.detail, c.fix)
    console.print(table)
    console.print("[green]ready[/]" if v.ok else "[red]not ready: fix the blocking checks above[/]")


def run_preflight(host_name: str, recipe: Optional[str] = None, as_json: bool = False,
                  inventory: str = "inventory.yaml", out=None) -> int:
    from playbooks.host.hosts import connect
    from playbooks.config.inventory import resolve_host
    from playbooks.config.recipe import load_recipe

    out = out or sys.stdout
    spec = resolve_host(host_name, inventory)
    loaded = load_recipe(recipe or spec.recipe) if (recipe or spec.recipe) else None
    model_dir = f"{spec.prefix}/models"
    host = connect(spec)
    try:
        facts = gather(host, spec.prefix, model_dir)
    finally:
        close = getattr(host, "close", None)
        if close:
            close()
    v = judge(facts, loaded, model_dir, spec.prefix, inventory_gpu=spec.gpu)
    if as_json:
        out.write(json.dumps(verdict_json(v), indent=2) + "\n")
    else:
        render(v, Console(file=out, width=140))
    return 0 if v.ok else 1
