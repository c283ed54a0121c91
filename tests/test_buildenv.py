"""sm_70 builds on real toolkits, the same on every image.

1. The positive proof needs only what ci/install-system-deps.sh installs (Debian's CUDA 11.8,
   cmake, g++): voltaforge's build environment compiles real sm_70 cubins, for a kernel and
   for an object of llama.cpp's own CMake build.
2. The mixed-toolkit trap needs a second toolkit that cannot target sm_70: the CUDA 13.0 nvcc
   from PyPI (ci/install-cuda13-nvcc.sh, tests/toolkits.py). Each test puts it first on PATH
   itself (an explicit env for the subprocess), so nothing depends on the image's own nvcc.
"""

import subprocess

import pytest

from playbooks.errors import VoltaforgeError
from playbooks.facts.cuda import TOOLKITS_COMMAND, parse_cuobjdump_list_elf, parse_nvcc_error, parse_toolkits
from playbooks.steps.build.buildenv import build_env, pick_toolkit
from tests.toolkits import DEBIAN_CUOBJDUMP, DEBIAN_NVCC, cuda13_first_path, needs_debian_cuda118, system_path

KERNEL = "__global__ void scale(float *x, float a) { x[threadIdx.x] *= a; }\n"
CMAKE_FLAGS = [
    "-DGGML_CUDA=ON",
    "-DCMAKE_CUDA_ARCHITECTURES=70",
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
]


def toolkits_on(path: str):
    """TOOLKITS_COMMAND run for real with this PATH (plus the standard places it looks in)."""
    out = subprocess.run(
        ["sh", "-c", TOOLKITS_COMMAND], capture_output=True, text=True, timeout=120, env={"PATH": path}
    ).stdout
    return parse_toolkits(out)


def elf_archs(obj, env) -> set[str]:
    listing = subprocess.run(
        [DEBIAN_CUOBJDUMP, "--list-elf", str(obj)], capture_output=True, text=True, env=env, timeout=60
    )
    assert listing.returncode == 0, listing.stderr
    return parse_cuobjdump_list_elf(listing.stdout)


@pytest.fixture
def kernel(tmp_path):
    src = tmp_path / "k.cu"
    src.write_text(KERNEL)
    return src


@pytest.fixture(scope="module")
def mixed():
    """PATH with CUDA 13 (from PyPI) first and Debian's CUDA 11.8 after it, and what
    voltaforge's toolkit scan finds on it."""
    path = cuda13_first_path()
    return path, toolkits_on(path)


# --------------------------------------------------------------------------- 1. positive proof


@needs_debian_cuda118
def test_build_env_compiles_sm70_cubins_with_debian_cuda118(tmp_path, kernel):
    toolkits = toolkits_on(system_path())
    nvcc = pick_toolkit(toolkits, (11, 8))
    env = build_env(nvcc, toolkits)
    assert env["CUDACXX"] == DEBIAN_NVCC and env["CUDA_HOME"] == "/usr"
    obj = tmp_path / "k.o"
    good = subprocess.run(
        [env["CUDACXX"], "-arch=sm_70", "-c", "-o", str(obj), str(kernel)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**env, "HOME": str(tmp_path)},
    )
    assert good.returncode == 0, good.stderr
    assert elf_archs(obj, env) == {"sm_70"}


@needs_debian_cuda118
@pytest.mark.slow
def test_llamacpp_cmake_builds_sm70_objects_in_voltaforges_environment(tmp_path):
    """llama.cpp's own CMake (the pinned tree) configures against 11.8 (host compiler g++-11
    through Debian's wrapper) in voltaforge's environment, and a ggml-cuda object carries
    sm_70 code."""
    from tests import llamacpp_tools

    toolkits = toolkits_on(system_path())
    env = {"HOME": str(tmp_path), **build_env(pick_toolkit(toolkits, (11, 8)), toolkits)}
    build = tmp_path / "voltaforge"
    good = subprocess.run(
        ["cmake", "-S", str(llamacpp_tools.llamacpp_tree()), "-B", str(build), *CMAKE_FLAGS],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert good.returncode == 0, good.stdout[-2000:] + good.stderr[-2000:]
    assert "The CUDA compiler identification is NVIDIA 11.8" in good.stdout
    obj = subprocess.run(
        ["make", "-C", str(build / "ggml/src/ggml-cuda"), "arange.o"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert obj.returncode == 0, obj.stdout[-2000:] + obj.stderr[-2000:]
    assert elf_archs(next(build.rglob("arange.cu.o")), env) == {"sm_70"}


def test_pick_toolkit_names_what_was_found():
    with pytest.raises(VoltaforgeError, match="no CUDA 10.2 nvcc found"):
        pick_toolkit(toolkits_on(system_path()), (10, 2))


# --------------------------------------------------------------------------- 2. the trap


def test_cuda13_nvcc_cannot_target_sm70_but_is_a_working_toolkit(tmp_path, kernel, mixed):
    path, toolkits = mixed
    nvcc13 = next(t for t in toolkits if t.kind == "nvcc" and t.on_path_index == 0)
    assert nvcc13.release == (13, 0) and not nvcc13.sm70_supported
    env = {"PATH": path, "HOME": str(tmp_path)}
    # a complete toolkit: it builds for a newer GPU...
    ok = subprocess.run(
        [nvcc13.path, "-arch=sm_80", "-c", "-o", str(tmp_path / "k80.o"), str(kernel)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert ok.returncode == 0, ok.stderr
    # ...and refuses Volta
    r = subprocess.run(
        [nvcc13.path, "-arch=sm_70", "-c", "-o", str(tmp_path / "k.o"), str(kernel)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert r.returncode != 0
    (err,) = parse_nvcc_error(r.stderr + r.stdout)
    assert (err.kind, err.arch) == ("unsupported_gpu_architecture", "sm_70")


@needs_debian_cuda118
def test_mixed_path_fails_and_build_env_compiles_sm70(tmp_path, kernel, mixed):
    path, toolkits = mixed
    cmd = [DEBIAN_NVCC, "-arch=sm_70", "-cubin", "-o", str(tmp_path / "k.cubin"), str(kernel)]
    # the trap: 11.8's nvcc by full path, but the CUDA 13 ptxas first on PATH
    bad = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={"PATH": path, "HOME": str(tmp_path)})
    assert bad.returncode != 0
    (err,) = parse_nvcc_error(bad.stderr + bad.stdout)
    assert (err.kind, err.tool, err.arch) == ("ptxas_arch_not_defined", "ptxas", "sm_70")
    # voltaforge's environment, from the same scan: one toolkit, the CUDA 13 bin/ left out
    nvcc = pick_toolkit(toolkits, (11, 8))
    env = build_env(nvcc, toolkits)
    cuda13_dir = path.split(":")[0]
    assert cuda13_dir not in env["PATH"].split(":")
    obj = tmp_path / "k.o"
    good = subprocess.run(
        [env["CUDACXX"], "-arch=sm_70", "-c", "-o", str(obj), str(kernel)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**env, "HOME": str(tmp_path)},
    )
    assert good.returncode == 0, good.stderr
    assert elf_archs(obj, env) == {"sm_70"}


@needs_debian_cuda118
@pytest.mark.slow
def test_llamacpp_cmake_with_cuda13_first_on_path_fails_in_ptxas(tmp_path, mixed):
    """llama.cpp's CMake told to use 11.8's nvcc (CUDACXX) while CUDA 13 comes first on PATH:
    even CMake's CUDA compiler check fails, in CUDA 13's ptxas."""
    from tests import llamacpp_tools

    path, _ = mixed
    env = {"PATH": path, "HOME": str(tmp_path), "CUDACXX": DEBIAN_NVCC}
    bad = subprocess.run(
        ["cmake", "-S", str(llamacpp_tools.llamacpp_tree()), "-B", str(tmp_path / "b"), *CMAKE_FLAGS],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert bad.returncode != 0
    assert "ptxas fatal" in bad.stderr and "is not defined for option 'gpu-name'" in bad.stderr
