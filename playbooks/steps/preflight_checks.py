"""`invoke preflight`'s checks of a host's facts, one area at a time (OS, systemd, Python, GPU
and its health, the GPUs a layout names, CUDA and the compilers, RPC workers): pure, each takes
the facts and the recipe (a :class:`Context`) and returns checks, each with a verdict and, when
it does not pass, a fix. The plan's fit on the host is steps/preflight_fit.py."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from playbooks.config.recipe import LoadedRecipe, Recipe
from playbooks.facts import cuda
from playbooks.facts import gpu as gpufacts
from playbooks.plan.gpus import Gpu, get_gpu, gpu_from_nvidia_name
from playbooks.steps.preflight_facts import HostFacts
from playbooks.steps.serve.service_manager import systemd_only

# Minimum Linux driver per CUDA major release (NVIDIA's CUDA compatibility table, minor
# version compatibility): 11.x needs >= 450.80.02, 12.x needs >= 525.60.13.
MIN_DRIVER = {11: (450, 80, 2), 12: (525, 60, 13)}
# R580 is the last driver branch that supports Volta (docs/knowledge.md section 3).
LAST_VOLTA_DRIVER_BRANCH = 580


@dataclass
class Check:
    name: str
    status: str  # pass | warn | fail
    detail: str
    fix: str = ""
    blocking: bool = False


@dataclass
class Verdict:
    facts: HostFacts
    checks: list[Check] = field(default_factory=list)
    plan_summary: str | None = None

    @property
    def ok(self) -> bool:
        return not any(c.status == "fail" and c.blocking for c in self.checks)


# The seed report's V100 fell from 42 to 30 tok/s after ten minutes at 85 C.
HOT_C = 85
BUSY_MIB = 1024  # more than a CUDA context's worth held by someone else


def _gpu_health(gpus: Sequence[gpufacts.GpuInfo]) -> list[Check]:
    """Thermal/power throttling, persistence mode and memory already in use, per GPU."""
    out: list[Check] = []
    add = out.append
    hot = [
        f"GPU{g.index} {g.temperature_c} C" for g in gpus if g.temperature_c is not None and g.temperature_c >= HOT_C
    ]
    throttled = [f"GPU{g.index}: {', '.join(g.throttling)}" for g in gpus if g.throttling]
    if hot or throttled:
        add(
            Check(
                "thermal",
                "warn",
                "; ".join(hot + throttled),
                "improve cooling or airflow, check `nvidia-smi -q -d PERFORMANCE,TEMPERATURE` (the seed "
                "report's V100 fell from 42 to 30 tok/s at 85 C)",
            )
        )
    elif any(g.temperature_c is not None for g in gpus):
        add(
            Check(
                "thermal",
                "pass",
                ", ".join(f"GPU{g.index} {g.temperature_c} C" for g in gpus if g.temperature_c is not None),
            )
        )
    off = [f"GPU{g.index}" for g in gpus if g.persistence_mode is False]
    if off:
        add(
            Check(
                "persistence",
                "warn",
                f"persistence mode off on {', '.join(off)}",
                "enable nvidia-persistenced (or `nvidia-smi -pm 1`) so the driver stays loaded between runs",
            )
        )
    busy = [f"GPU{g.index} {g.memory_used_mib} MiB" for g in gpus if (g.memory_used_mib or 0) > BUSY_MIB]
    if busy:
        add(
            Check(
                "gpu-memory-in-use",
                "warn",
                f"memory already in use: {', '.join(busy)}",
                "the plan assumes an empty GPU: stop the other processes (`nvidia-smi` lists them)",
            )
        )
    return out


def _version_tuple(v: str | None) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v or ""))


def host_gpu(facts: HostFacts) -> Gpu | None:
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


@dataclass(frozen=True)
class Context:
    """What every check may look at: the facts, the recipe (if any) and where things go."""

    facts: HostFacts
    loaded: LoadedRecipe | None
    model_dir: str
    prefix: str
    inventory_gpu: str | None
    gpu_indexes: tuple[int, ...] | None = None  # the GPUs a layout gives the recipe

    @property
    def recipe(self) -> Recipe | None:
        return self.loaded.recipe if self.loaded else None

    @property
    def wants_gpu(self) -> bool:
        return self.recipe is None or not get_gpu(self.recipe.gpu).is_cpu

    @property
    def cuda_pin(self) -> tuple[int, ...]:
        return tuple(int(x) for x in (self.recipe.toolchain.cuda if self.recipe else "11.8").split("."))


def check_os(cx: Context) -> list[Check]:
    os = cx.facts.os
    ok = os.id in ("debian", "ubuntu") and os.version_id in ("12", "20.04", "22.04")
    return [
        Check(
            "os",
            "pass" if ok else "warn",
            os.pretty_name or os.reason or "unknown",
            ""
            if ok
            else "voltaforge installs CUDA 11.8 on Debian 12 and Ubuntu 20.04/22.04; others need it preinstalled",
        )
    ]


def check_systemd(cx: Context) -> list[Check]:
    """systemd runs the server as a unit that starts at boot. Without it deploy runs the recipe's
    same command line (llama-server's or TabbyAPI's) as a managed process, not restarted at
    boot: a warning. What only a unit can do (one server per GPU) blocks."""
    sd = cx.facts.systemd
    state = f"state {sd.state or 'absent'}"
    if sd.systemd_running:
        return [Check("systemd", "pass", state)]
    if sd.booted:
        # deploy would choose systemd here (it is PID 1), and units cannot start in this state
        return [
            Check(
                "systemd",
                "fail",
                f"{state}: systemd is PID 1 but cannot start units",
                "bring it to running or degraded (`systemctl is-system-running`, `systemctl --failed`)",
                blocking=True,
            )
        ]
    boot = "boot the host with systemd for a service that survives reboots"
    if cx.recipe is None:
        return [
            Check(
                "systemd",
                "warn",
                f"{state} (not booted with systemd): a recipe would run as a managed process, "
                "not restarted at boot; one server per GPU needs systemd",
                boot,
            )
        ]
    why = systemd_only(cx.recipe)
    if why:
        return [
            Check(
                "systemd",
                "fail",
                f"{state} (not booted with systemd): recipe {cx.recipe.name}: {why}",
                "use a host booted with systemd",
                blocking=True,
            )
        ]
    several = "" if get_gpu(cx.recipe.gpu).is_cpu else "; one server per GPU (`--gpus 0,1`) would need it"
    return [
        Check(
            "systemd",
            "warn",
            f"{state} (not booted with systemd): the server will run as a managed process, not restarted "
            f"at boot{several}",
            boot,
        )
    ]


def check_python(cx: Context) -> list[Check]:
    py = cx.facts.python
    ok = bool(py.available and py.version and py.version >= (3, 9))
    return [
        Check(
            "python",
            "pass" if ok else "fail",
            ".".join(map(str, py.version)) if py.version else (py.reason or "unknown"),
            "" if ok else "install python3 (>= 3.9) and python3-venv",
            blocking=True,
        )
    ]


def check_gpu(cx: Context) -> list[Check]:
    """GPU kind against the inventory, presence, BF16, driver, and health."""
    facts, out = cx.facts, []
    g = host_gpu(facts)
    # same kind = same compute capability and nominal memory (SXM2 and PCIe V100s are alike)
    if g is not None and cx.inventory_gpu:
        listed = get_gpu(cx.inventory_gpu)
        if (listed.compute_capability, listed.memory_gib) != (g.compute_capability, get_gpu(g.key).memory_gib):
            out.append(
                Check(
                    "gpu-kind",
                    "warn",
                    f"inventory.yaml says {cx.inventory_gpu}, the host has {g.name}",
                    "correct the host's gpu in inventory.yaml (the plan uses the GPU the host reports)",
                )
            )
    if not facts.gpus.available:
        wants = cx.wants_gpu
        out.append(
            Check(
                "gpu",
                "fail" if wants else "pass",
                f"no NVIDIA GPU visible: {facts.gpus.reason}" + ("" if wants else " (not needed: CPU recipe)"),
                "install the NVIDIA driver (R580 is the last branch for Volta) and check `nvidia-smi`" if wants else "",
                blocking=wants,
            )
        )
        return out
    first = facts.gpus.gpus[0]
    cc = first.compute_capability
    detail = (
        f"{facts.gpus.gpu_count} x {first.name}, {first.memory_total_mib} MiB, cc {cc[0]}.{cc[1]}"
        if cc
        else (first.name or "?")
    )
    out.append(Check("gpu", "pass", detail))
    if cc and cc < (8, 0):
        out.append(
            Check(
                "bf16",
                "warn",
                f"compute capability {cc[0]}.{cc[1]} has no BF16",
                "BF16 weights are converted to FP16 "
                "(FP16-only paths can overflow for some models: the smoke gate checks text)",
            )
        )
    out.append(_driver_check(cx, cc))
    out += _gpu_health(facts.gpus.gpus)
    return out


def _driver_check(cx: Context, cc: tuple[int, int] | None) -> Check:
    drv_text = cx.facts.gpus.driver_version
    drv = _version_tuple(drv_text)
    need = MIN_DRIVER.get(cx.cuda_pin[0])
    pin = ".".join(map(str, cx.cuda_pin))
    if drv and need and drv < need:
        return Check(
            "driver",
            "fail",
            f"driver {drv_text} is older than CUDA {pin} needs ({'.'.join(map(str, need))})",
            "upgrade the driver (any branch up to R580 runs CUDA 11.8 binaries)",
            blocking=True,
        )
    if drv and cc and cc == (7, 0) and drv[0] > LAST_VOLTA_DRIVER_BRANCH:
        return Check(
            "driver",
            "fail",
            f"driver {drv_text} is past R580, the last branch that supports Volta",
            "install an R580 (or older) driver",
            blocking=True,
        )
    return Check("driver", "pass", f"driver {drv_text or 'unknown'}")


def check_cuda(cx: Context) -> list[Check]:
    """The pinned toolkit, what is first on PATH, mixed toolkits and the host compiler."""
    facts, pin, out = cx.facts, cx.cuda_pin, []
    if pin[0] >= 13 and cx.wants_gpu:
        out.append(
            Check(
                "cuda-pin",
                "fail",
                f"recipe pins CUDA {'.'.join(map(str, pin))}: CUDA 13 cannot target sm_70",
                "set toolchain.cuda to 11.8 (or 12.x)",
                blocking=True,
            )
        )
    if not cx.wants_gpu:
        return out
    nvccs = [t for t in facts.toolkits if t.kind == "nvcc"]
    pinned = [t for t in nvccs if t.release == pin[:2]]
    if pinned:
        out.append(Check("cuda-toolkit", "pass", f"CUDA {pin[0]}.{pin[1]} at {pinned[0].path}"))
    else:
        found = ", ".join(f"{t.release[0]}.{t.release[1]} ({t.path})" for t in nvccs if t.release) or "none"
        out.append(
            Check(
                "cuda-toolkit",
                "warn",
                f"CUDA {pin[0]}.{pin[1]} not installed (found: {found})",
                "`invoke toolchain --host H` installs it (Debian 12: non-free nvidia-cuda-toolkit)",
            )
        )
    first_nvcc = cuda.first_on_path(facts.toolkits, "nvcc")
    if first_nvcc and first_nvcc.release and not first_nvcc.sm70_supported:
        out.append(
            Check(
                "cuda-on-path",
                "warn",
                f"the nvcc first on PATH ({first_nvcc.path}) is CUDA "
                f"{first_nvcc.release[0]}.{first_nvcc.release[1]}, which cannot target sm_70",
                "voltaforge builds with PATH/CUDA_HOME/CUDACXX pinned to the recipe's toolkit; "
                "do the same for manual builds",
            )
        )
    mixed = cuda.mixed_toolkits_warning(facts.toolkits)
    if mixed:
        out.append(
            Check(
                "mixed-toolkits",
                "warn",
                mixed,
                "voltaforge's build environment pins one toolkit (playbooks/steps/build/buildenv.py); by hand: "
                "PATH=<toolkit>/bin:/usr/sbin:/usr/bin:/sbin:/bin CUDA_HOME=<root> CUDAToolkit_ROOT=<root> "
                "CUDACXX=<nvcc> (root /usr for Debian's package)",
            )
        )
    # nvcc 11.x refuses GCC > 11 (crt/host_config.h) unless a g++-11 is used
    if pin[0] == 11 and facts.gcc.major and facts.gcc.major > 11:
        ok = facts.gxx11.available
        out.append(
            Check(
                "host-compiler",
                "pass" if ok else "warn",
                f"gcc {'.'.join(map(str, facts.gcc.version or ()))}; g++-11 {'present' if ok else 'missing'}",
                "" if ok else "install g++-11 (Debian's nvidia-cuda-toolkit depends on it and routes nvcc to it)",
            )
        )
    return out


def check_rpc(cx: Context) -> list[Check]:
    """Every RPC worker of the recipe accepts a connection from this host (llama-server would
    otherwise fail to load, after the deploy step already replaced the running server)."""
    r = cx.recipe
    if r is None or not r.rpc:
        return []
    out = []
    for w in r.rpc:
        state = cx.facts.rpc.get(w.endpoint, "refused")
        if state == "open":
            ms = cx.facts.rpc_connect_ms.get(w.endpoint)
            took = f" (connected in {ms:.1f} ms, the plan's network hop)" if ms is not None else ""
            out.append(Check("rpc-worker", "pass", f"{w.endpoint} accepts connections{took}"))
            continue
        if state == "timeout":
            # an RPC worker serves one client at a time: a running server holds it
            out.append(
                Check(
                    "rpc-worker",
                    "warn",
                    f"the RPC worker {w.endpoint} does not answer within 3 s: busy with a server (a worker serves "
                    "one at a time) or filtered",
                    "if no server of this recipe runs, check the network path and the worker's allow_from",
                )
            )
            continue
        start = (
            f"invoke rpc-worker --host {w.worker} --recipe {r.name}"
            if w.worker
            else f"ggml-rpc-server --host {w.address} --port {w.port} on that host"
        )
        out.append(
            Check(
                "rpc-worker",
                "fail",
                f"the RPC worker {w.endpoint} refuses connections from {cx.facts.host}: nothing listens there",
                f"start it ({start})",
                blocking=True,
            )
        )
    return out


def check_gpu_indexes(cx: Context) -> list[Check]:
    """The GPUs a host's layout gives the recipe are on the host (nvidia-smi's numbering)."""
    gpus = cx.facts.gpus
    if cx.gpu_indexes is None or not cx.wants_gpu or not gpus.available:
        return []
    missing = [i for i in cx.gpu_indexes if i >= gpus.gpu_count]
    if not missing:
        return [Check("gpu-indexes", "pass", f"GPU {', '.join(map(str, cx.gpu_indexes))} of {gpus.gpu_count}")]
    return [
        Check(
            "gpu-indexes",
            "fail",
            f"the layout gives GPU {', '.join(map(str, missing))}; the host has {gpus.gpu_count} "
            f"(0-{gpus.gpu_count - 1})",
            "place the recipe on GPUs the host has (serve: in inventory.yaml)",
            blocking=True,
        )
    ]
