"""What `invoke preflight` reads of a host: every fact its checks judge, gathered over the host
layer, one command per fact (or one probe), read-only: nothing on the host changes. The judging
is steps/preflight_checks.py and steps/preflight_fit.py; steps/preflight.py puts them together."""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel

from playbooks.config.recipe import LoadedRecipe
from playbooks.facts import cuda, read_fact, system
from playbooks.facts import gpu as gpufacts
from playbooks.facts import rpc as rpcfacts
from playbooks.host.base import Host


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
    nproc: int | None = None
    machine: str | None = None
    # a recipe split across RPC workers: whether this host reaches each endpoint
    rpc: dict[str, str] = {}  # endpoint -> open | refused | timeout
    rpc_connect_ms: dict[str, float] = {}  # endpoint -> the TCP connect time from this host


def _gpu_facts(host: Host) -> gpufacts.GpuFacts:
    """NVML through the probe when the host has Python, nvidia-smi's CSV otherwise."""
    # the probe travels on stdin: one read, no file pushed and removed (three round trips)
    probe = gpufacts.GPU_PROBE_PATH.read_bytes()
    probed = gpufacts.parse_gpu_probe_json(read_fact(host, gpufacts.GPU_PROBE_STDIN_COMMAND, stdin=probe))
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


def rpc_endpoints(loaded: LoadedRecipe | None) -> list[str]:
    """The RPC worker endpoints preflight tries from the host (none without a recipe)."""
    return [w.endpoint for w in loaded.recipe.rpc] if loaded else []


def gather(host: Host, prefix: str, model_dir: str, rpc: Sequence[str] = ()) -> HostFacts:
    """Read every fact preflight judges. Read-only: nothing on the host changes.
    ``rpc``: the recipe's RPC worker endpoints, each tried from this host."""
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
        **_rpc_facts(host, rpc),
    )


def _rpc_facts(host: Host, endpoints: Sequence[str]) -> dict[str, dict]:
    if not endpoints:
        return {}
    timed = rpcfacts.parse_reach_timed(read_fact(host, rpcfacts.reach_command(endpoints)))
    return {
        "rpc": {e: state for e, (state, _) in timed.items()},
        "rpc_connect_ms": {e: ms for e, (state, ms) in timed.items() if state == "open" and ms is not None},
    }
