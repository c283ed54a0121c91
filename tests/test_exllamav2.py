"""ExLlamaV2 and TabbyAPI for EXL2 recipes.

Decisions on real captured facts (this machine's CUDA 13 + Debian 11.8 toolkits, its gcc, a
Titan V + Ada nvidia-smi CSV). For real, on this machine: the EXL2 kernels of the pinned
exllamav2 (its GEMM compilation unit and RMS norm) compile for sm_70 in the step's own
environment against the pinned torch's headers, and the step's own cubin proof finds sm_70
in them; TabbyAPI's step over real SSH on a host that cannot reach GitHub fails in one line
saying what to stage, leaving nothing behind. The whole extension needs torch +cu118 from
PyTorch's index (unreachable here); scripts/prove_exllamav2.py runs the whole step's JIT path
for another arch where a CUDA torch is reachable (docs/knowledge.md, section 9)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from playbooks.config.recipe import Toolchain
from playbooks.facts import cuda, gpu
from playbooks.host.ops import OperationError, PushFile, Record
from playbooks.steps.build.buildenv import BuildFacts
from playbooks.steps.build.exllamav2 import EnsureExllamav2, ExtFacts, cubin_archs, ext_stamp
from playbooks.steps.build.proven_build import Probe, check_cubins
from playbooks.steps.build.tabbyapi import EnsureTabbyAPI, TabbyFacts
from tests.helpers import fixture_body
from tests.pypi_wheels import exllamav2_source, pypi_wheel, unpacked

TOOLKITS = tuple(cuda.parse_toolkits(fixture_body("thishost-toolkits-cuda13-and-debian-cuda11.8.txt")))
GCC12 = cuda.parse_gcc_version(fixture_body("thishost-gcc-12-version.txt"))
NO_GPU = gpu.GpuFacts(available=False, reason="nvidia-smi not found")
TITAN_ADA = gpu.parse_nvidia_smi_csv(fixture_body("nvidia-smi-csv-compute-cap-titanv-volta-driver570.txt"), fields=None)
COMPILE = BuildFacts(toolkits=TOOLKITS, gcc=GCC12, nproc=16, gpus=NO_GPU)
TC = Toolchain()  # the pinned defaults: CUDA 11.8, torch 2.7.1+cu118, exllamav2 0.3.2


def op(tc=TC):
    return EnsureExllamav2("/opt/vf", "/opt/vf/venv", tc)


def facts(**kw):
    return ExtFacts(**{"compile": COMPILE, "torch": "2.7.1+cu118", "torch_cuda": (11, 8), **kw})


def test_torch_cuda_is_torchs_own_word():
    from playbooks.facts.python import parse_torch_cuda

    assert parse_torch_cuda("11.8\n") == (11, 8) and parse_torch_cuda("13.0") == (13, 0)
    assert parse_torch_cuda("none\n") is None and parse_torch_cuda("") is None


def test_the_extension_is_built_ahead_of_time_for_sm70_with_the_pinned_toolkit():
    d = op().decide(facts())
    pip, clear, jit, install, version, cubins, record = d.commands
    assert d.reason == "exllamav2 is not installed, want 0.3.2"
    # the pinned exllamav2 beside the pinned torch, which the resolver may not move
    assert pip.show() == (
        "/opt/vf/venv/bin/pip install --disable-pip-version-check exllamav2==0.3.2 tokenizers ninja torch==2.7.1+cu118 "
        "--extra-index-url https://download.pytorch.org/whl/cu118"
    )
    assert "exllamav2_ext*.so" in clear.show() and clear.show().startswith("site=$(")
    # the JIT build, once, here: Debian's 11.8 only, sm_70, all cores, a directory per inputs
    bid = op().plan(facts())[0].build_id
    j = jit.show()
    assert "CUDACXX=/usr/bin/nvcc" in j and "CUDA_HOME=/usr" in j and "cuda-13" not in j
    assert "TORCH_CUDA_ARCH_LIST=7.0" in j and "MAX_JOBS=16" in j
    # torch's cpp_extension runs ninja from PATH: the venv's (pip's wheel), right after the
    # toolkit's own directory and before the system's, where apt's may be or may not
    assert "PATH=/usr/lib/nvidia-cuda-toolkit/bin:/opt/vf/venv/bin:/usr/sbin:/usr/bin:/sbin:/bin " in j
    assert f"TORCH_EXTENSIONS_DIR=/opt/vf/exllamav2/ext/{bid}" in j and j.endswith("-c 'import exllamav2.ext'")
    assert f"/opt/vf/exllamav2/ext/{bid}/exllamav2_ext/exllamav2_ext.so" in install.show()
    assert install.show().endswith('mv -f -- "$site"/.exllamav2_ext.so.new "$site"/exllamav2_ext.so')
    # proof: it imports as a ready module (no JIT at serve time) and carries sm_70 cubins
    assert isinstance(version, Probe) and "import torch, exllamav2_ext, exllamav2" in version.command
    assert isinstance(cubins, Probe) and cubins.expect == ("sm_70",)
    assert "/usr/bin/cuobjdump --list-elf /opt/vf/venv/lib/python3*/site-packages/exllamav2_ext.so" in cubins.command
    assert isinstance(record, Record) and record.path == "/opt/vf/venv/voltaforge-exllamav2.json"


def test_a_mixed_host_builds_every_arch_in_torchs_spelling():
    inputs, env, _ = op().plan(facts(compile=BuildFacts(toolkits=TOOLKITS, gcc=GCC12, gpus=TITAN_ADA)))
    assert inputs.arch == env["TORCH_CUDA_ARCH_LIST"] == "7.0;8.9"
    assert cubin_archs(inputs.arch) == ["70", "89"]


def test_proven_is_ok_and_other_inputs_rebuild_without_reinstalling():
    d = op().decide(facts())
    record = next(c for c in d.commands if isinstance(c, Record))
    listing = fixture_body("thishost-cuobjdump-list-elf-ptx-sm70-75-80.txt")
    proof = {"version": "version: 0.3.2\next: /x/exllamav2_ext.so\ntorch: 2.7.1+cu118 11.8", "cubins": listing}
    stamp = json.loads(ext_stamp(record, proof))
    assert stamp["exllamav2"] == "0.3.2" and stamp["torch"] == "2.7.1+cu118 11.8" and "sm_70" in stamp["cubins"]
    ok = op().decide(facts(installed="0.3.2", stamp=stamp))
    assert ok.commands == () and ok.reason.startswith(f"built {stamp['built_at']}, {stamp['id']} (7.0)")
    # the GPU changed (a Titan V and an Ada card now): the extension is rebuilt, pip is not run
    mixed = facts(installed="0.3.2", stamp=stamp, compile=BuildFacts(toolkits=TOOLKITS, gcc=GCC12, gpus=TITAN_ADA))
    d = op().decide(mixed)
    assert d.reason.startswith("built from other inputs") and "pip install" not in d.commands[0].show()


@pytest.mark.parametrize(
    ("torch", "error"),
    [
        (None, "no torch in /opt/vf/venv: run `invoke toolchain` first"),
        ("2.7.0+cu118", "torch 2.7.0+cu118 is in /opt/vf/venv, the recipe pins 2.7.1+cu118"),
        ("2.6.0", "torch 2.6.0 is in /opt/vf/venv, the recipe pins 2.7.1+cu118"),
    ],
)
def test_torch_must_be_the_pinned_one(torch, error):
    with pytest.raises(OperationError, match=error.replace("+", r"\+")):
        op().decide(facts(torch=torch))


def test_the_pin_is_compared_as_pip_compares_versions():
    """A lent H200's torch: torch.__version__ 2.11.0+cu130 (the pin), pip's 2.11.0. The public
    versions are compared; which CUDA it was built with is torch.version.cuda's word against the
    toolkit's major, checked apart (the next test)."""
    from playbooks.steps.build.exllamav2 import same_release

    assert same_release("2.11.0", "2.11.0+cu130") and same_release("2.7.1+cu118", "2.7.1+cu118")
    assert not same_release("2.10.0", "2.11.0+cu130")
    h200 = Toolchain(cuda="13.0", torch="2.11.0+cu130", cuda_arch="90")
    cuda13 = tuple(t for t in TOOLKITS if t.release == (13, 0))
    inputs, _, _ = op(h200).plan(
        facts(torch="2.11.0", torch_cuda=(13, 0), compile=BuildFacts(toolkits=cuda13, gcc=GCC12, gpus=NO_GPU))
    )
    assert inputs.torch == "2.11.0" and inputs.arch == "9.0"
    # a +cu126 torch under a +cu118 pin has the same public version: its CUDA major refuses it
    with pytest.raises(OperationError, match=r"built with CUDA 12.6, the toolkit is 11.8"):
        op().decide(facts(torch="2.7.1+cu126", torch_cuda=(12, 6)))


def test_a_venv_without_ninja_gets_it_before_the_build():
    """exllamav2 at the pin but no ninja in the venv (installed --no-deps): pip installs ninja
    first, since the JIT build runs the venv's (a lent H200 had no other: "Ninja is required")."""
    d = op().decide(facts(installed="0.3.2", ninja=False))
    assert d.reason == "no ninja in /opt/vf/venv/bin (the extension's build runs it from there)"
    assert " ninja torch==2.7.1+cu118" in d.commands[0].show()
    assert "pip install" not in op().decide(facts(installed="0.3.2")).commands[0].show()


def test_torch_of_another_cuda_major_or_without_cuda_is_refused_before_compiling():
    """torch's cpp_extension refuses an nvcc of another CUDA major than torch's (knowledge.md 3)."""
    cu126 = Toolchain(torch="2.7.1+cu126")
    with pytest.raises(OperationError, match=r"built with CUDA 12.6, the toolkit is 11.8: .* pin a \+cu11x torch"):
        op(cu126).decide(facts(torch="2.7.1+cu126", torch_cuda=(12, 6)))
    cpu = Toolchain(torch="2.7.1+cpu")
    with pytest.raises(OperationError, match="has no CUDA"):
        op(cpu).decide(facts(torch="2.7.1+cpu", torch_cuda=None))


def test_cuda_13_cannot_build_the_extension_for_sm70():
    cuda13 = tuple(t for t in TOOLKITS if t.release == (13, 0))
    tc = Toolchain(cuda="13.0", torch="2.14.1+cu130")
    with pytest.raises(OperationError, match="cannot target sm_70"):
        op(tc).decide(
            facts(torch="2.14.1+cu130", torch_cuda=(13, 0), compile=BuildFacts(toolkits=cuda13, gcc=GCC12, gpus=NO_GPU))
        )


# ------------------------------------------------------------------------------------------
# TabbyAPI
# ------------------------------------------------------------------------------------------

REF = TC.tabbyapi_ref


def tabby(tmp_path):
    return EnsureTabbyAPI("/opt/vf", "/opt/vf/venv", TC, cache=tmp_path)


def test_tabbyapi_at_its_sha_is_ok(tmp_path):
    d = tabby(tmp_path).decide(TabbyFacts(marker=REF, git=True, reachable=False))
    assert d.commands == () and d.reason == f"TabbyAPI {REF[:12]} at /opt/vf/tabbyAPI"


def test_tabbyapi_is_fetched_by_sha_where_the_host_reaches_the_repository(tmp_path):
    d = tabby(tmp_path).decide(TabbyFacts(marker="0" * 40, git=True, reachable=True, python="3.11"))
    fetch, pip, push_proof, proof, switch = (c.show() for c in d.commands)
    assert d.reason.startswith(f"TabbyAPI {REF[:12]} is at 000000000000; fetched from https://github.com/theroyallab")
    assert f"fetch -q --depth 1 https://github.com/theroyallab/tabbyAPI {REF} &&" in fetch
    assert "checkout -q FETCH_HEAD" in fetch
    assert pip.startswith("/opt/vf/venv/bin/pip install --disable-pip-version-check /opt/vf/tabbyAPI.vf-new torch==")
    assert "its dependencies from the host's index (no wheelhouse for Python 3.11 on the controller)" in d.reason
    # the proof travels into the new tree and runs there: the server, not the backend
    assert push_proof.endswith("to /opt/vf/tabbyAPI.vf-new/.voltaforge-proof.py")
    assert proof == "/opt/vf/venv/bin/python /opt/vf/tabbyAPI.vf-new/.voltaforge-proof.py /opt/vf/tabbyAPI.vf-new 2>&1"
    # the marker is written and the tree switched only after the proof
    assert switch == (
        f"rm -f -- /opt/vf/tabbyAPI.vf-new/.voltaforge-proof.py && echo {REF} > /opt/vf/tabbyAPI.vf-new/.voltaforge-ref"
        " && rm -rf -- /opt/vf/tabbyAPI && mv -T -- /opt/vf/tabbyAPI.vf-new /opt/vf/tabbyAPI"
    )


def test_a_copy_staged_on_the_controller_is_pushed_checksummed(tmp_path):
    staged = tmp_path / f"tabbyAPI-{REF}.tar.gz"
    staged.write_bytes(b"archive")
    d = tabby(tmp_path).decide(TabbyFacts(marker=None, git=False, reachable=False, staged=True, python="3.11"))
    push = next(c for c in d.commands if isinstance(c, PushFile))
    assert push.local == staged and push.path == f"/opt/vf/src/tabbyAPI-{REF}.tar.gz"
    assert "from the copy staged on the controller" in d.reason


@pytest.mark.slow
def test_tabbyapi_on_a_host_without_github_is_one_line_saying_what_to_stage(sshd_host, tmp_path):
    """This machine cannot reach GitHub: the step, over real SSH, fails in one line naming the
    exact commands (`invoke stage-tabbyapi` with or without a carried archive), and leaves
    nothing on the host."""
    from playbooks.host import connect
    from playbooks.host.ops import run_ops
    from tests.helpers import spec_for

    prefix = sshd_host.prefix / "vf"
    step = EnsureTabbyAPI(str(prefix), str(prefix / "venv"), TC, cache=tmp_path)
    with connect(spec_for(sshd_host)) as host:
        (change,) = run_ops(host, [step])
    assert change.status == "failed" and len(change.why.splitlines()) == 1
    assert change.why.startswith(f"TabbyAPI {REF[:12]} is not on the host, it cannot reach https://github.com/")
    assert f"git -C tabbyAPI archive --format=tar.gz -o tabbyAPI-{REF}.tar.gz {REF}" in change.why
    assert f"then here `invoke stage-tabbyapi --archive tabbyAPI-{REF}.tar.gz`" in change.why
    assert not prefix.exists()


# ------------------------------------------------------------------------------------------
# the EXL2 kernels for sm_70, for real
# ------------------------------------------------------------------------------------------

# what torch's cpp_extension adds to every nvcc command (torch/utils/cpp_extension.py,
# COMMON_NVCC_FLAGS and _get_cuda_arch_flags for TORCH_CUDA_ARCH_LIST) and what exllamav2's
# ext.py adds (extra_cuda_cflags)
TORCH_NVCC_FLAGS = (
    "-D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__ "
    "-D__CUDA_NO_HALF2_OPERATORS__ --expt-relaxed-constexpr -DTORCH_EXTENSION_NAME=exllamav2_ext "
    "-D_GLIBCXX_USE_CXX11_ABI=1 --compiler-options -fPIC -std=c++17 -lineinfo -O3"
)


@pytest.mark.slow
def test_exl2_kernels_compile_for_sm70_in_the_steps_environment(tmp_path):
    """The step's plan on this machine's real facts (CUDA 13 first on PATH where the image has
    it, Debian's 11.8): the EXL2 GEMM unit and RMS norm of exllamav2 0.3.2 compile in that
    environment against torch 2.7.1's headers (the pinned torch; its headers are the same in
    every CUDA variant) with torch's own nvcc flags, and the step's cubin proof passes."""
    from playbooks.host import LocalHost
    from playbooks.steps.build.buildenv import env_prefix, read_compile_facts

    ext = exllamav2_source() / "exllamav2"
    torch_inc = unpacked(pypi_wheel("torch==2.7.1", "torch-2.7.1-cp311-*.whl"), "torch/include/") / "torch/include"
    host = LocalHost()
    step = op()
    inputs, env, cuobjdump = step.plan(facts(compile=read_compile_facts(host, cuda_build=True)))
    assert "cuda-13" not in env["PATH"] and env["CUDACXX"] == "/usr/bin/nvcc" and inputs.arch == "7.0"
    gencode = " ".join(f"-gencode=arch=compute_{a},code=sm_{a}" for a in cubin_archs(inputs.arch))
    src = ext / "exllamav2_ext"
    objects = []
    for unit in ("cuda/comp_units/unit_exl2_1a.cu", "cuda/rms_norm.cu"):
        obj = tmp_path / (Path(unit).stem + ".o")
        r = host.run(
            f"{env_prefix(env)} nvcc {TORCH_NVCC_FLAGS} {gencode} -I{src} -I{torch_inc} "
            f"-I{torch_inc}/torch/csrc/api/include -c {src / unit} -o {obj}",
            stream=False,
            check=False,
        )
        assert r.ok, r.stdout[-2000:] + r.stderr[-3000:]
        objects.append(obj)
    d = step.decide(facts(compile=read_compile_facts(host, cuda_build=True)))
    probe = next(c for c in d.commands if isinstance(c, Probe) and c.expect)
    for obj in objects:
        lib = probe.command.split(" --list-elf ", 1)[1]
        listing = host.run(probe.command.replace(lib, str(obj)), stream=False).stdout
        check_cubins(listing, probe.expect, probe.what, probe.after)
        assert cuda.parse_cuobjdump_list_elf(listing) == {"sm_70"}
    assert cuobjdump == "/usr/bin/cuobjdump"
