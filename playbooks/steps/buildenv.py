"""The build environment for CUDA code: one toolkit, never whatever PATH says.

Calling CUDA 11.8's nvcc by its full path is not enough: nvcc finds ptxas through PATH
when its own directory has none (Debian's layout: nvcc in /usr/lib/nvidia-cuda-toolkit/bin,
ptxas in /usr/bin), so a CUDA 13 ptxas earlier on PATH fails with
`ptxas fatal : Value 'sm_70' is not defined for option 'gpu-name'`. So every build gets an
explicit PATH that starts with the chosen toolkit and holds no directory with another
release's nvcc or ptxas, plus CUDA_HOME, CUDA_PATH and CUDACXX pointing at the same toolkit.
"""

from __future__ import annotations

import posixpath
import shlex
from collections.abc import Sequence

from playbooks.errors import VoltaforgeError
from playbooks.facts.cuda import Toolkit

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
