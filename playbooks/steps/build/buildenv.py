"""The compile environment: the host's compilers and tools as facts, and for CUDA code one
toolkit, never whatever PATH says.

Calling CUDA 11.8's nvcc by its full path is not enough: nvcc finds ptxas through PATH
when its own directory has none (Debian's layout: nvcc in /usr/lib/nvidia-cuda-toolkit/bin,
ptxas in /usr/bin), so a CUDA 13 ptxas earlier on PATH fails with
`ptxas fatal : Value 'sm_70' is not defined for option 'gpu-name'`. So every build gets an
explicit PATH that starts with the chosen toolkit and holds no directory with another
release's nvcc or ptxas, plus CUDA_HOME, CUDA_PATH and CUDACXX pointing at the same toolkit.
"""

from __future__ import annotations

import os
import posixpath
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from playbooks.errors import VoltaforgeError
from playbooks.facts import builds, cuda, gpu, read_fact, system
from playbooks.facts.cuda import Toolkit
from playbooks.host.base import Host
from playbooks.host.ops import OperationError

# The directories a build may use besides the toolkit's: the distribution's own, in order.
SYSTEM_PATH = ("/usr/sbin", "/usr/bin", "/sbin", "/bin")
DEBIAN_TOOLKIT_ROOT = "/usr/lib/nvidia-cuda-toolkit"


def pick_toolkit(toolkits: Sequence[Toolkit], release: tuple[int, int]) -> Toolkit:
    """The nvcc of the wanted release (PATH order first, then standard places)."""
    for t in sorted(toolkits, key=lambda t: (t.on_path_index is None, t.on_path_index or 0)):
        if t.kind == "nvcc" and t.release == release:
            return t
    found = sorted({f"{t.release[0]}.{t.release[1]} ({t.path})" for t in toolkits if t.kind == "nvcc" and t.release})
    raise VoltaforgeError(
        f"no CUDA {release[0]}.{release[1]} nvcc found (found: {', '.join(found) or 'none'}); "
        "run `invoke toolchain` to install it"
    )


def _is_debian_layout(nvcc: Toolkit) -> bool:
    real = nvcc.realpath or nvcc.path
    return nvcc.path == "/usr/bin/nvcc" or real.startswith(DEBIAN_TOOLKIT_ROOT + "/")


def toolkit_root(nvcc: Toolkit) -> str:
    """CUDA_HOME for an nvcc: <root> for NVIDIA's <root>/bin/nvcc; /usr for Debian's package.

    Debian spreads the toolkit over /usr (headers in /usr/include, libraries in
    /usr/lib/<triplet>, nvcc's helpers in /usr/lib/nvidia-cuda-toolkit/bin). CMake's
    FindCUDAToolkit needs the root whose include/ holds cuda_runtime.h: /usr, not
    /usr/lib/nvidia-cuda-toolkit ("Could NOT find CUDAToolkit (missing: CUDAToolkit_INCLUDE_DIR)"
    when llama.cpp is configured with the latter).
    """
    if _is_debian_layout(nvcc):
        return "/usr"
    return posixpath.dirname(posixpath.dirname(nvcc.realpath or nvcc.path))


def toolkit_bin(nvcc: Toolkit) -> str:
    """The directory with nvcc's own helpers (cicc, and on Debian the g++-11 wrapper)."""
    if _is_debian_layout(nvcc):
        return f"{DEBIAN_TOOLKIT_ROOT}/bin"
    return posixpath.dirname(nvcc.realpath or nvcc.path)


def build_env(nvcc: Toolkit, toolkits: Sequence[Toolkit], arch: str = "70") -> dict[str, str]:
    """Environment variables for building CUDA code for `arch` with exactly this nvcc."""
    root = toolkit_root(nvcc)
    own_bin = toolkit_bin(nvcc)
    foreign = {posixpath.dirname(t.path) for t in toolkits if t.release is not None and t.release != nvcc.release}
    path = [own_bin] + [d for d in SYSTEM_PATH if d not in foreign and d != own_bin]
    clash = sorted(foreign & set(SYSTEM_PATH))
    if clash:
        assert nvcc.release is not None  # a release differs from this nvcc's only if it has one (pick_toolkit)
        raise VoltaforgeError(
            f"another CUDA release has nvcc/ptxas in {', '.join(clash)}, a system directory a build "
            f"needs; remove it or install CUDA {nvcc.release[0]}.{nvcc.release[1]} elsewhere"
        )
    return {
        "PATH": ":".join(path),
        "CUDA_HOME": root,
        "CUDA_PATH": root,
        "CUDAToolkit_ROOT": root,  # CMake's FindCUDAToolkit
        "CUDACXX": nvcc.path,
        "CUDAARCHS": arch,
        "TORCH_CUDA_ARCH_LIST": torch_arch_list(arch),
    }


def torch_arch_list(arch: str) -> str:
    """CMake's "70;89" as torch's cpp_extension wants it: "7.0;8.9"."""
    return ";".join(f"{a[:-1]}.{a[-1]}" if a.isdigit() and len(a) >= 2 else a for a in arch.split(";"))


def env_prefix(env: dict[str, str]) -> str:
    """`env -i`-free prefix that sets these variables for one command, each value quoted."""
    return "env " + " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())


@dataclass(frozen=True)
class BuildFacts:
    toolkits: tuple[cuda.Toolkit, ...] = ()
    gcc: cuda.GccVersion = cuda.GccVersion(available=False)
    gxx11: cuda.GccVersion = cuda.GccVersion(available=False)
    nproc: int | None = None
    ccache: str | None = None
    gpus: gpu.GpuFacts = gpu.GpuFacts(available=False, reason="not read")
    builds: tuple[str, ...] = ()
    stamps: dict[str, dict[str, Any]] = field(default_factory=dict)
    current: str | None = None
    cached: tuple[str, ...] = ()  # build ids in the controller's fleet cache
    disk_free: int | None = None  # bytes an unprivileged user can write where builds go
    # absolute paths of the build tools on the host's PATH (facts/builds.py BUILD_TOOLS)
    cmake: str | None = "/usr/bin/cmake"
    make: str | None = "/usr/bin/make"
    ninja: str | None = None


def arch_list(gpus: gpu.GpuFacts, fallback: str) -> str:
    """The archs of the GPUs the host reports ("70", or "70;80" for a mixed host); the recipe's
    cuda_arch when none is visible (a build box, a container)."""
    ccs = sorted({g.compute_capability for g in gpus.gpus if g.compute_capability}) if gpus.available else []
    return ";".join(f"{a}{b}" for a, b in ccs) or fallback


def read_compile_facts(host: Host, *, cuda_build: bool) -> BuildFacts:
    """What any compile on this host depends on: compilers, toolkits, GPUs, cores, ccache."""
    tools = builds.parse_build_tools(read_fact(host, builds.BUILD_TOOLS_COMMAND))
    facts = BuildFacts(
        gcc=cuda.parse_gcc_version(read_fact(host, cuda.GCC_VERSION_COMMAND)),
        nproc=system.parse_nproc(read_fact(host, system.NPROC_COMMAND)),
        ccache=builds.parse_ccache(read_fact(host, builds.CCACHE_COMMAND)),
        cmake=tools["cmake"],
        make=tools["make"],
        ninja=tools["ninja"],
    )
    if not cuda_build:
        return facts
    return replace(
        facts,
        toolkits=tuple(cuda.parse_toolkits(read_fact(host, cuda.TOOLKITS_COMMAND))),
        gxx11=cuda.parse_gcc_version(read_fact(host, cuda.GXX11_VERSION_COMMAND)),
        gpus=gpu.parse_nvidia_smi_csv(read_fact(host, gpu.NVIDIA_SMI_CSV_COMMAND)),
    )


@dataclass(frozen=True)
class CompileEnv:
    """How to compile on one host: the toolkit and host compiler chosen, the arch list, and the
    environment every compile command runs in (the server build and the Python bindings share
    it, so both carry the same kernels)."""

    backend: str  # cuda | cpu
    arch: str | None
    release: tuple[int, int] | None  # the chosen nvcc's
    toolkit: str | None  # "11.8 V11.8.89 /usr/bin/nvcc"
    compiler: str  # "gcc 12.2.0" (+ the CUDA host compiler)
    host_compiler: str | None  # /usr/bin/g++-11 where nvcc refuses the default gcc
    env: dict[str, str]
    cuobjdump: str | None


def compile_env(facts: BuildFacts, cuda_release: tuple[int, int] | None, recipe_arch: str) -> CompileEnv:
    """Pick the toolkit, the arch and the host compiler for this host, or refuse. Pure."""
    compiler = f"gcc {'.'.join(map(str, facts.gcc.version or ())) or 'unknown'}"
    if not cuda_release:
        return CompileEnv("cpu", None, None, None, compiler, None, {"PATH": ":".join(SYSTEM_PATH), "LC_ALL": "C"}, None)
    arch = arch_list(facts.gpus, recipe_arch)
    try:
        nvcc = pick_toolkit(facts.toolkits, cuda_release)
    except VoltaforgeError as exc:
        raise OperationError(str(exc)) from None
    if "70" in arch.split(";") and not cuda.sm70_supported(nvcc.release):
        raise OperationError(
            f"CUDA {'.'.join(map(str, nvcc.release or ()))} ({nvcc.path}) cannot target sm_70: "
            "pin toolchain.cuda 11.8 (or 12.x) in the recipe"
        )
    host_compiler = None
    debian = toolkit_root(nvcc) == "/usr"
    if nvcc.release and nvcc.release[0] == 11 and (facts.gcc.major or 0) > 11 and not debian:
        # NVIDIA's CUDA 11.x refuses GCC > 11 (crt/host_config.h); Debian's wrapper routes to g++-11 itself
        if not facts.gxx11.available:
            raise OperationError(
                f"CUDA {nvcc.release[0]}.{nvcc.release[1]} refuses gcc {facts.gcc.major} "
                "as its host compiler and no g++-11 is installed: install g++-11"
            )
        host_compiler = "/usr/bin/g++-11"
        compiler += " + g++-11 for CUDA"
    try:
        env = {**build_env(nvcc, facts.toolkits, arch), "LC_ALL": "C"}
    except VoltaforgeError as exc:
        raise OperationError(str(exc)) from None
    toolkit = f"{nvcc.release[0]}.{nvcc.release[1]} {nvcc.version} {nvcc.path}" if nvcc.release else nvcc.path
    cuobjdump = f"{toolkit_root(nvcc)}/bin/cuobjdump"
    return CompileEnv("cuda", arch, nvcc.release, toolkit, compiler, host_compiler, env, cuobjdump)


def llamacpp_compile_env(
    facts: BuildFacts, cuda_release: tuple[int, int] | None, recipe_arch: str, ref: str
) -> CompileEnv:
    """compile_env, and what the pinned llama.cpp cannot do with the chosen toolkit."""
    ce = compile_env(facts, cuda_release, recipe_arch)
    if ce.release and ce.release < (12, 0) and any(a.startswith("9") for a in (ce.arch or "").split(";")):
        # measured (scripts/bench_build.py): ggml-cuda at 0c1e570 uses Hopper launch intrinsics
        # (cudaGridDependencySynchronize) for sm_90 that CUDA 11.8 does not declare
        raise OperationError(
            f"llama.cpp {ref} does not compile for sm_90 with CUDA "
            f"{ce.release[0]}.{ce.release[1]}: pin toolchain.cuda 12.x for a Hopper GPU"
        )
    return ce


def require_cmake(facts: BuildFacts) -> str:
    if not facts.cmake:
        raise OperationError(
            "cmake is not installed on the host: the toolchain step installs it (`invoke toolchain`), "
            "or put one on the PATH of the login shell"
        )
    return facts.cmake


def generator_flags(facts: BuildFacts) -> tuple[str, ...]:
    """cmake's default generator (Unix Makefiles) runs `make` from the compile's PATH, which
    holds the system directories only; where the system has no make but a ninja is found
    (a CUDA image with pip's cmake and ninja), generate for that ninja by its path."""
    system_make = facts.make and os.path.dirname(facts.make) in SYSTEM_PATH
    if system_make or not facts.ninja:
        return ()
    return ("-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={facts.ninja}")
