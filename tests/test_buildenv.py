"""The mixed-toolkit trap, for real: this machine has CUDA 13 first on PATH and Debian's CUDA
11.8 in /usr/bin. The default PATH cannot build sm_70; voltaforge's build environment can."""

import os
import shutil
import subprocess

import pytest

from playbooks.steps.buildenv import build_env, pick_toolkit
from playbooks.errors import VoltaforgeError
from playbooks.facts.cuda import TOOLKITS_COMMAND, parse_cuobjdump_list_elf, parse_nvcc_error, parse_toolkits

KERNEL = "__global__ void scale(float *x, float a) { x[threadIdx.x] *= a; }\n"

needs_both = pytest.mark.skipif(
    not (os.path.exists("/usr/bin/nvcc") and shutil.which("nvcc") and shutil.which("nvcc") != "/usr/bin/nvcc"),
    reason="needs Debian's CUDA 11.8 (/usr/bin/nvcc) and another nvcc first on PATH (ci/install-system-deps.sh)",
)


@pytest.fixture(scope="module")
def toolkits():
    out = subprocess.run(["sh", "-c", TOOLKITS_COMMAND], capture_output=True, text=True, timeout=120).stdout
    return parse_toolkits(out)


@needs_both
def test_default_path_fails_and_build_env_compiles_sm70(tmp_path, toolkits):
    src = tmp_path / "k.cu"
    src.write_text(KERNEL)
    cmd = ["/usr/bin/nvcc", "-arch=sm_70", "-cubin", "-o", str(tmp_path / "k.cubin"), str(src)]
    # 1. the trap: 11.8's nvcc by full path, but the CUDA 13 ptxas first on PATH
    bad = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0
    err = parse_nvcc_error(bad.stderr + bad.stdout)
    assert "sm_70" in (bad.stderr + bad.stdout) and err is not None
    # 2. voltaforge's environment: same command, one toolkit
    nvcc = pick_toolkit(toolkits, (11, 8))
    env = build_env(nvcc, toolkits)
    assert env["PATH"].split(":")[0].endswith("/bin") and "/usr/local/bin" not in env["PATH"].split(":")
    obj = tmp_path / "k.o"
    good = subprocess.run(
        [env["CUDACXX"], "-arch=sm_70", "-c", "-o", str(obj), str(src)],
        capture_output=True, text=True, timeout=300, env={**env, "HOME": str(tmp_path)},
    )
    assert good.returncode == 0, good.stderr
    listing = subprocess.run(["/usr/bin/cuobjdump", "--list-elf", str(obj)], capture_output=True, text=True, env=env)
    assert parse_cuobjdump_list_elf(listing.stdout) == {"sm_70"}


@needs_both
def test_cuda13_cannot_target_sm70_at_all(tmp_path, toolkits):
    nvcc13 = next(t for t in toolkits if t.kind == "nvcc" and t.release and t.release[0] >= 13)
    assert not nvcc13.sm70_supported
    src = tmp_path / "k.cu"
    src.write_text(KERNEL)
    r = subprocess.run([nvcc13.path, "-arch=sm_70", "-c", "-o", str(tmp_path / "k.o"), str(src)], capture_output=True, text=True)
    assert r.returncode != 0 and "Unsupported gpu architecture" in r.stderr + r.stdout


def test_pick_toolkit_names_what_was_found(toolkits):
    with pytest.raises(VoltaforgeError, match="no CUDA 10.2 nvcc found"):
        pick_toolkit(toolkits, (10, 2))


@needs_both
@pytest.mark.slow
def test_llamacpp_cmake_builds_sm70_objects_only_in_voltaforges_environment(tmp_path, toolkits):
    """llama.cpp's own CMake (the pinned tree): with the caller's PATH (CUDA 13 first) even the
    CUDA compiler check fails, in CUDA 13's ptxas; with voltaforge's environment it configures
    against 11.8 (host compiler g++-11 through Debian's wrapper) and a ggml-cuda object carries
    sm_70 code."""
    from tests import llamacpp_tools

    tree = llamacpp_tools.llamacpp_tree()
    flags = ["-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=70", "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF",
             "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF"]
    caller_env = {k: v for k, v in os.environ.items() if not k.startswith("CUDA")}
    bad = subprocess.run(["cmake", "-S", str(tree), "-B", str(tmp_path / "default"), *flags],
                         capture_output=True, text=True, env=caller_env, timeout=300)
    assert bad.returncode != 0
    # CMake finds Debian's nvcc, which then runs the CUDA 13 ptxas first on PATH: the trap
    assert "ptxas fatal" in bad.stderr and "is not defined for option 'gpu-name'" in bad.stderr

    env = {"HOME": str(tmp_path), **build_env(pick_toolkit(toolkits, (11, 8)), toolkits)}
    build = tmp_path / "voltaforge"
    good = subprocess.run(["cmake", "-S", str(tree), "-B", str(build), *flags],
                          capture_output=True, text=True, env=env, timeout=300)
    assert good.returncode == 0, good.stdout[-2000:] + good.stderr[-2000:]
    assert "The CUDA compiler identification is NVIDIA 11.8" in good.stdout
    obj = subprocess.run(["make", "-C", str(build / "ggml/src/ggml-cuda"), "arange.o"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert obj.returncode == 0, obj.stdout[-2000:] + obj.stderr[-2000:]
    cubin = next(build.rglob("arange.cu.o"))
    listing = subprocess.run(["/usr/bin/cuobjdump", "--list-elf", str(cubin)], capture_output=True, text=True, env=env)
    assert parse_cuobjdump_list_elf(listing.stdout) == {"sm_70"}
