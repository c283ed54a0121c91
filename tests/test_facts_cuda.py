"""CUDA toolchain facts against real captures (public issues + this machine's two toolkits),
and the fact commands run on real toolkits: Debian's CUDA 11.8 and the CUDA 13.0 nvcc from
PyPI (tests/toolkits.py), never a shell script posing as nvcc."""

import importlib.metadata
import os
import re
import subprocess

import pytest

from playbooks.facts import cuda
from playbooks.facts.cuda import (
    CudaToolVersion,
    Toolkit,
    first_on_path,
    mixed_toolkits_warning,
    parse_cuobjdump_list_elf,
    parse_cuobjdump_list_ptx,
    parse_gcc_version,
    parse_nvcc_error,
    parse_nvcc_version,
    parse_toolkits,
    sm70_supported,
)
from tests.helpers import fixture_body as fixture_text
from tests.toolkits import cuda13_bin, cuda13_root, needs_debian_cuda118

# --------------------------------------------------------------------------- nvcc --version


@pytest.mark.parametrize(
    "name,release,version,vtuple,build,built_on,sm70",
    [
        (
            "nvcc-version-cuda11.3.txt",
            (11, 3),
            "V11.3.109",
            (11, 3, 109),
            "cuda_11.3.r11.3/compiler.29920130_0",
            "Mon_May__3_19:15:13_PDT_2021",
            True,
        ),
        (
            "nvcc-version-cuda12.0-linux.txt",
            (12, 0),
            "V12.0.140",
            (12, 0, 140),
            "cuda_12.0.r12.0/compiler.32267302_0",
            "Fri_Jan__6_16:45:21_PST_2023",
            True,
        ),
        (
            "nvcc-version-cuda12.3-v100-dgxs-host.txt",
            (12, 3),
            "V12.3.107",
            (12, 3, 107),
            "cuda_12.3.r12.3/compiler.33567101_0",
            "Wed_Nov_22_10:17:15_PST_2023",
            True,
        ),
        (
            "nvcc-version-cuda12.8-windows.txt",
            (12, 8),
            "V12.8.93",
            (12, 8, 93),
            "cuda_12.8.r12.8/compiler.35583870_0",
            "Fri_Feb_21_20:42:46_Pacific_Standard_Time_2025",
            True,
        ),
        (
            "thishost-nvcc-version-cuda13.0.txt",
            (13, 0),
            "V13.0.88",
            (13, 0, 88),
            "cuda_13.0.r13.0/compiler.36424714_0",
            "Wed_Aug_20_01:58:59_PM_PDT_2025",
            False,
        ),
        (
            "thishost-nvcc-version-cuda11.8-debian.txt",
            (11, 8),
            "V11.8.89",
            (11, 8, 89),
            "cuda_11.8.r11.8/compiler.31833905_0",
            "Wed_Sep_21_10:33:58_PDT_2022",
            True,
        ),
    ],
)
def test_parse_nvcc_version(name, release, version, vtuple, build, built_on, sm70):
    v = parse_nvcc_version(fixture_text(name))
    assert v == CudaToolVersion(
        available=True,
        tool="nvcc",
        release=release,
        version=version,
        version_tuple=vtuple,
        build=build,
        built_on=built_on,
    )
    assert v.sm70_supported is sm70


def test_parse_nvcc_version_absent_and_garbage():
    assert parse_nvcc_version("").available is False
    assert parse_nvcc_version("voltaforge: nvcc not found\n").reason == "nvcc not found"
    bad = parse_nvcc_version("sh: 1: nvcc: Permission denied")
    assert bad.available is False and "Permission denied" in bad.reason


def test_nvcc_version_command_without_nvcc():
    run = subprocess.run(
        ["/bin/sh", "-c", cuda.NVCC_VERSION_COMMAND],
        env={"PATH": "/nonexistent-voltaforge-bin"},
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0
    assert parse_nvcc_version(run.stdout).reason == "nvcc not found"


@pytest.mark.parametrize(
    "release,ok",
    [
        ((8, 0), False),
        ((9, 0), True),
        ((11, 8), True),
        ((12, 8), True),
        ((12, 9), True),
        ((13, 0), False),
        ((13, 1), False),
        (None, False),
    ],
)
def test_sm70_supported(release, ok):
    assert sm70_supported(release) is ok


# --------------------------------------------------------------------------- toolkits


def test_parse_toolkits_this_machine_cuda13_and_debian_118():
    tks = parse_toolkits(fixture_text("thishost-toolkits-cuda13-and-debian-cuda11.8.txt"))
    got = [(t.kind, t.path, t.on_path_index, t.release, t.version, t.realpath) for t in tks]
    assert got == [
        ("nvcc", "/usr/local/bin/nvcc", 0, (13, 0), "V13.0.88", "/usr/local/bin/nvcc"),
        ("nvcc", "/usr/bin/nvcc", 1, (11, 8), "V11.8.89", "/usr/bin/nvcc"),
        ("nvcc", "/bin/nvcc", 2, (11, 8), "V11.8.89", "/usr/bin/nvcc"),
        ("nvcc", "/usr/local/cuda-13.0/bin/nvcc", None, (13, 0), "V13.0.88", "/usr/local/cuda-13.0/bin/nvcc"),
        ("nvcc", "/usr/local/cuda/bin/nvcc", None, (13, 0), "V13.0.88", "/usr/local/cuda-13.0/bin/nvcc"),
        (
            "nvcc",
            "/usr/lib/nvidia-cuda-toolkit/bin/nvcc",
            None,
            (11, 8),
            "V11.8.89",
            "/usr/lib/nvidia-cuda-toolkit/bin/nvcc",
        ),
        ("ptxas", "/usr/local/bin/ptxas", 0, (13, 0), "V13.0.88", "/usr/local/bin/ptxas"),
        ("ptxas", "/usr/bin/ptxas", 1, (11, 8), "V11.8.89", "/usr/bin/ptxas"),
        ("ptxas", "/bin/ptxas", 2, (11, 8), "V11.8.89", "/usr/bin/ptxas"),
        ("ptxas", "/usr/local/cuda-13.0/bin/ptxas", None, (13, 0), "V13.0.88", "/usr/local/cuda-13.0/bin/ptxas"),
        ("ptxas", "/usr/local/cuda/bin/ptxas", None, (13, 0), "V13.0.88", "/usr/local/cuda-13.0/bin/ptxas"),
    ]
    assert all(t.error is None for t in tks)
    nvcc = first_on_path(tks, "nvcc")
    assert nvcc.path == "/usr/local/bin/nvcc" and nvcc.sm70_supported is False
    assert first_on_path(tks, "ptxas").release == (13, 0)
    assert [t.path for t in tks if t.kind == "nvcc" and t.sm70_supported] == [
        "/usr/bin/nvcc",
        "/bin/nvcc",
        "/usr/lib/nvidia-cuda-toolkit/bin/nvcc",
    ]
    assert mixed_toolkits_warning(tks) == (
        "several CUDA releases installed (11.8, 13.0); the ptxas first on PATH is "
        "/usr/local/bin/ptxas (CUDA 13.0): set PATH, CUDA_HOME and CUDACXX to one toolkit "
        "before building"
    )


def test_parse_toolkits_empty_and_cut_off():
    assert parse_toolkits("") == []
    cut = (
        "### voltaforge-tool kind=nvcc on_path_index=0 path=/opt/x/nvcc\n"
        "### realpath=\n"
        "sh: 1: /opt/x/nvcc: Exec format error\n"
    )
    (t,) = parse_toolkits(cut)
    assert t == Toolkit(
        path="/opt/x/nvcc",
        kind="nvcc",
        on_path_index=0,
        error="no 'release X.Y' line in version output: sh: 1: /opt/x/nvcc: Exec format error",
    )
    assert mixed_toolkits_warning([t]) is None


def _wheel_version(root) -> str:
    """The CUDA 13 nvcc's version as its wheel's metadata states it (not from nvcc)."""
    (dist,) = [
        d for d in importlib.metadata.distributions(path=[str(root)]) if d.metadata["Name"] == "nvidia-cuda-nvcc"
    ]
    return dist.version


def _debian_version() -> str:
    """Debian's CUDA version as dpkg states it: '11.8.89~11.8.0-5~deb12u1' -> '11.8.89'."""
    out = subprocess.run(
        ["dpkg-query", "-W", "-f=${Version}", "nvidia-cuda-toolkit"], capture_output=True, text=True, check=True
    ).stdout
    return re.match(r"(?:\d+:)?(\d+\.\d+\.\d+)", out).group(1)


@needs_debian_cuda118
def test_toolkits_command_finds_the_real_toolkits_in_path_order(tmp_path):
    """TOOLKITS_COMMAND under /bin/sh on real binaries: the CUDA 13.0 nvcc and ptxas from PyPI
    first on PATH, through a directory with a space in its name that PATH lists twice, then
    Debian's CUDA 11.8. Versions are checked against the wheel's metadata and dpkg."""
    cuda13 = cuda13_bin()
    spaced = tmp_path / "bin with space"
    spaced.mkdir()
    for tool in ("nvcc", "ptxas"):
        (spaced / tool).symlink_to(cuda13 / tool)
    dirs = [str(spaced), str(spaced), "/nonexistent", "/usr/bin", "/bin"]
    run = subprocess.run(
        ["/bin/sh", "-c", cuda.TOOLKITS_COMMAND],
        env={"PATH": ":".join(dirs)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    tks = parse_toolkits(run.stdout)
    assert all(t.error is None for t in tks)

    v13, v118 = _wheel_version(cuda13_root()), _debian_version()
    release = {str(spaced): (13, 0), "/usr/bin": (11, 8), "/bin": (11, 8)}
    version = {str(spaced): f"V{v13}", "/usr/bin": f"V{v118}", "/bin": f"V{v118}"}
    for kind in ("nvcc", "ptxas"):
        want, seen = [], set()
        for d in dirs:
            exe = f"{d}/{kind}"
            if exe in seen or not os.path.exists(exe):  # listed twice: reported once
                continue
            seen.add(exe)
            want.append((exe, len(want), release[d], version[d], os.path.realpath(exe)))
        got = [
            (t.path, t.on_path_index, t.release, t.version, t.realpath)
            for t in tks
            if t.kind == kind and t.on_path_index is not None
        ]
        assert got == want
    assert v13.startswith("13.0.") and v118.startswith("11.8.")
    nvcc = first_on_path(tks, "nvcc")
    assert nvcc.path == f"{spaced}/nvcc" and nvcc.sm70_supported is False
    assert [t.path for t in tks if t.kind == "nvcc" and t.on_path_index is not None and t.sm70_supported] == [
        d + "/nvcc" for d in ("/usr/bin", "/bin") if os.path.exists(d + "/nvcc")
    ]
    assert f"the ptxas first on PATH is {spaced}/ptxas (CUDA 13.0)" in mixed_toolkits_warning(tks)


@needs_debian_cuda118
@pytest.mark.parametrize("which", ["cuda13", "debian"])
def test_nvcc_version_command_on_the_real_toolkits(which):
    path = str(cuda13_bin()) if which == "cuda13" else "/usr/bin"
    run = subprocess.run(
        ["/bin/sh", "-c", cuda.NVCC_VERSION_COMMAND], env={"PATH": path}, capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0
    v = parse_nvcc_version(run.stdout)
    want = _wheel_version(cuda13_root()) if which == "cuda13" else _debian_version()
    assert v.available and v.version == f"V{want}"
    assert v.version_tuple == tuple(map(int, want.split(".")))
    assert v.release == v.version_tuple[:2]
    assert v.sm70_supported is (which == "debian")


# --------------------------------------------------------------------------- cuobjdump


def test_cuobjdump_list_elf_ggml_native_sm86_only():
    text = fixture_text("cuobjdump-list-elf-ggml-cuda-sm86.txt")
    assert parse_cuobjdump_list_elf(text) == {"sm_86"}  # no sm_70: would not run on a V100
    assert parse_cuobjdump_list_ptx(text) == set()


def test_cuobjdump_vllm_list_ptx_then_list_elf_with_prompt_lines():
    text = fixture_text("cuobjdump-list-ptx-list-elf-vllm-sm70.txt")
    assert parse_cuobjdump_list_elf(text) == {"sm_70", "sm_75", "sm_80", "sm_86", "sm_89", "sm_90"}
    assert parse_cuobjdump_list_ptx(text) == {"sm_90"}


def test_cuobjdump_this_machine_sm70_75_80_plus_ptx():
    text = fixture_text("thishost-cuobjdump-list-elf-ptx-sm70-75-80.txt")
    assert parse_cuobjdump_list_elf(text) == {"sm_70", "sm_75", "sm_80"}
    assert parse_cuobjdump_list_ptx(text) == {"sm_70"}


def test_cuobjdump_fatbin_header_is_not_list_elf():
    text = fixture_text("cuobjdump-ptx-fatbin-header-sm70.txt")
    assert parse_cuobjdump_list_elf(text) == set()  # `cuobjdump -elf`'s headers: not --list-elf's format


# --------------------------------------------------------------------------- nvcc errors


def test_nvcc_error_cuda13_compute70():
    (err,) = parse_nvcc_error(fixture_text("nvcc-cuda13-unsupported-compute70.txt"))
    assert err.kind == "unsupported_gpu_architecture"
    assert (err.tool, err.arch) == ("nvcc", "compute_70")
    assert err.line == "nvcc fatal   : Unsupported gpu architecture 'compute_70'"
    assert err.is_volta


def test_nvcc_error_cuda13_sm70_this_machine():
    (err,) = parse_nvcc_error(fixture_text("thishost-nvcc13-arch-sm70-unsupported.txt"))
    assert (err.kind, err.arch, err.is_volta) == ("unsupported_gpu_architecture", "sm_70", True)


def test_nvcc_error_in_make_output_dedups_repeats():
    errs = parse_nvcc_error(fixture_text("nvcc-cuda13-unsupported-arch-make-output.txt"))
    assert [(e.kind, e.arch) for e in errs] == [
        ("unsupported_gpu_architecture", "compute_50"),
        ("unsupported_gpu_architecture", "compute_60"),
    ]
    assert not any(e.is_volta for e in errs)


def test_nvcc_error_mixed_path_ptxas_this_machine():
    (err,) = parse_nvcc_error(fixture_text("thishost-nvcc118-mixed-path-ptxas-sm70-fatal.txt"))
    assert err.kind == "ptxas_arch_not_defined"
    assert (err.tool, err.arch) == ("ptxas", "sm_70")
    assert err.line == "ptxas fatal   : Value 'sm_70' is not defined for option 'gpu-name'"
    assert "PATH" in err.hint
    # the single-space spelling quoted in docs parses the same way
    (doc,) = parse_nvcc_error("ptxas fatal : Value 'sm_70' is not defined for option 'gpu-name'")
    assert (doc.kind, doc.arch) == ("ptxas_arch_not_defined", "sm_70")


def test_nvcc_error_host_gcc12_this_machine():
    (err,) = parse_nvcc_error(fixture_text("thishost-nvcc118-host-gcc12-unsupported.txt"))
    assert err.kind == "unsupported_host_compiler"
    assert err.arch is None
    assert err.line.startswith(
        "/usr/include/crt/host_config.h:132:2: error: #error -- unsupported GNU version! gcc versions later than 11"
    )


def test_nvcc_error_none_in_clean_version_output():
    assert parse_nvcc_error(fixture_text("thishost-nvcc-version-cuda11.8-debian.txt")) == []


# --------------------------------------------------------------------------- gcc


def test_gcc_12_version_this_machine():
    v = parse_gcc_version(fixture_text("thishost-gcc-12-version.txt"))
    assert (v.available, v.program, v.package_version, v.version, v.major) == (
        True,
        "gcc",
        "Debian 12.2.0-14+deb12u1",
        (12, 2, 0),
        12,
    )


def test_gxx_11_version_this_machine():
    v = parse_gcc_version(fixture_text("thishost-gxx-11-version.txt"))
    assert (v.program, v.package_version, v.version, v.major) == ("g++-11", "Debian 11.3.0-12", (11, 3, 0), 11)


def test_gcc_dumpfullversion_this_machine():
    v = parse_gcc_version(fixture_text("thishost-gcc-dumpfullversion.txt"))
    assert (v.available, v.program, v.version) == (True, None, (12, 2, 0))
    assert parse_gcc_version("12\n").version == (12,)  # -dumpversion


def test_gcc_command_without_compiler():
    run = subprocess.run(
        ["/bin/sh", "-c", cuda.GXX11_VERSION_COMMAND],
        env={"PATH": "/nonexistent-voltaforge-bin"},
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0
    v = parse_gcc_version(run.stdout)
    assert (v.available, v.reason) == (False, "g++-11 not found")
    assert parse_gcc_version("").available is False
