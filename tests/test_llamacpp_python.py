"""llama-cpp-python's decisions on real captured facts (this machine's CUDA 13 + Debian 11.8
toolkits, its gcc, a Titan V + Ada nvidia-smi CSV, real cuobjdump listings). The real build
into a venv over SSH is in test_build.py's SSH test, beside the server build it must match."""

from __future__ import annotations

import json

import pytest

from playbooks.facts import cuda, gpu
from playbooks.host.ops import OperationError, Record
from playbooks.steps.build import BuildLayout, EnsureLlamacppBuild
from playbooks.steps.buildenv import BuildFacts
from playbooks.steps.llamacpp_python import BindingsFacts, EnsureLlamaCppPython, bindings_stamp
from playbooks.steps.llamacpp_source import Source
from playbooks.steps.proven_build import Probe
from tests.helpers import ROOT, fixture_body

SOURCE = Source("llama-cpp-python==0.3.36", "0c1e570", ROOT / "x.tar.gz", "ab" * 32, "x/vendor/llama.cpp")
LAYOUT = BuildLayout("/opt/vf")
VENV = "/opt/vf/venv"
TOOLKITS = tuple(cuda.parse_toolkits(fixture_body("thishost-toolkits-cuda13-and-debian-cuda11.8.txt")))
GCC12 = cuda.parse_gcc_version(fixture_body("thishost-gcc-12-version.txt"))
NO_GPU = gpu.GpuFacts(available=False, reason="nvidia-smi not found")
TITAN_ADA = gpu.parse_nvidia_smi_csv(fixture_body("nvidia-smi-csv-compute-cap-titanv-volta-driver570.txt"), fields=None)
COMPILE = BuildFacts(toolkits=TOOLKITS, gcc=GCC12, nproc=16, gpus=NO_GPU, ccache="/usr/bin/ccache")


def op(cuda_release=(11, 8)):
    return EnsureLlamaCppPython(LAYOUT, SOURCE, VENV, cuda_release=cuda_release, recipe_arch="70")


def facts(compile=COMPILE, **kw):
    return BindingsFacts(compile=compile, **kw)


def proven(o, f):
    """The stamp the operation writes after a successful install on these facts."""
    d = o.decide(f)
    record = next(c for c in d.commands if isinstance(c, Record))
    return json.loads(bindings_stamp(record, {"version": "version: 0.3.36\nCPU : SSE3 = 1 |"}))


def test_cuda_bindings_build_in_the_servers_environment_for_sm70():
    d = op().decide(facts())
    mkdir, build, install, version, cubins, record = d.commands
    cmd = build.show()
    assert d.reason == "not installed"
    # one toolkit (Debian's 11.8), none of the CUDA 13 that is first on PATH here
    assert (
        "CUDACXX=/usr/bin/nvcc" in cmd and "PATH=/usr/lib/nvidia-cuda-toolkit/bin:/usr/sbin:/usr/bin:/sbin:/bin" in cmd
    )
    assert "cuda-13" not in cmd and "/usr/local" not in cmd
    assert "CMAKE_ARGS='-DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=70'" in cmd
    assert (
        "FORCE_CMAKE=1" in cmd
        and "CMAKE_BUILD_PARALLEL_LEVEL=16" in cmd
        and "CCACHE_DIR=/opt/vf/llama.cpp/ccache" in cmd
    )
    # the very archive the server was built from, as a wheel (pip's cache off: it would reuse a
    # wheel built with other flags), then installed from that wheel
    wheels = mkdir.show().rsplit(" ", 1)[1]
    assert wheels.startswith("/opt/vf/src/wheels/0.3.36-cuda-")
    assert cmd.endswith(
        f"/opt/vf/venv/bin/pip wheel --disable-pip-version-check --no-cache-dir --no-deps -v -w {wheels} "
        "/opt/vf/src/x.tar.gz"
    )
    pip = "/opt/vf/venv/bin/pip install --disable-pip-version-check --no-cache-dir"
    assert install.show() == f"{pip} {wheels}/llama_cpp_python-0.3.36-*.whl"
    assert "CMAKE_ARGS" not in install.show()
    # proof: cubins for sm_70 in the venv's libggml-cuda.so; the import needs the driver (no GPU here)
    assert isinstance(cubins, Probe) and cubins.expect == ("sm_70",)
    assert "/usr/bin/cuobjdump --list-elf /opt/vf/venv/lib/python3*/site-packages/llama_cpp/lib/libggml-cuda.so" in (
        cubins.command
    )
    assert isinstance(version, Probe) and version.may_fail and "import llama_cpp" in version.command
    assert isinstance(record, Record) and record.path == "/opt/vf/venv/voltaforge-llama-cpp-python.json"


def test_the_bindings_match_the_servers_build():
    """Same archive, toolkit, compiler and arch list as the server build on the same facts."""
    server, _, _ = EnsureLlamacppBuild(LAYOUT, SOURCE, cuda_release=(11, 8), recipe_arch="70").plan(COMPILE)
    mine, _, _ = op().plan(facts())
    assert (mine.source_sha256, mine.ref, mine.toolkit, mine.compiler, mine.arch) == (
        server.source_sha256,
        server.ref,
        server.toolkit,
        server.compiler,
        server.arch,
    )
    # a host with a Titan V and an Ada card: both archs, in both builds
    server, _, _ = EnsureLlamacppBuild(LAYOUT, SOURCE, cuda_release=(11, 8), recipe_arch="70").plan(
        BuildFacts(toolkits=TOOLKITS, gcc=GCC12, gpus=TITAN_ADA)
    )
    mine, _, _ = op().plan(facts(BuildFacts(toolkits=TOOLKITS, gcc=GCC12, gpus=TITAN_ADA)))
    assert mine.arch == server.arch == "70;89"


def test_proven_with_the_same_inputs_is_ok_without_pip():
    stamp = proven(op(), facts())
    d = op().decide(facts(installed="0.3.36", stamp=stamp))
    assert d.commands == () and d.reason.startswith(f"built {stamp['built_at']}, 0.3.36-cuda-")


@pytest.mark.parametrize(
    ("installed", "stamp_from", "reason"),
    [
        ("0.3.20", None, "0.3.20 installed, want 0.3.36"),
        ("0.3.36", None, "0.3.36 installed without a proof of how it was built"),
        ("0.3.36", "cpu", "built from other inputs (0.3.36-cpu-"),
    ],
)
def test_other_bindings_are_reinstalled_without_touching_their_dependencies(installed, stamp_from, reason):
    stamp = proven(op(cuda_release=None), facts()) if stamp_from == "cpu" else None
    d = op().decide(facts(installed=installed, stamp=stamp))
    assert d.reason.startswith(reason)
    assert "--force-reinstall --no-deps" in d.commands[2].show()


def test_a_cpu_build_has_no_cuda_and_its_import_is_the_proof():
    d = op(cuda_release=None).decide(facts())
    _, build, install, version, record = d.commands
    assert "CMAKE_ARGS='-DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF -DGGML_CUDA=OFF'" in build.show()
    assert "CUDACXX" not in build.show() and "PATH=/usr/sbin:/usr/bin:/sbin:/bin" in build.show()
    assert isinstance(version, Probe) and not version.may_fail


def test_cuda_13_for_sm70_is_refused_as_for_the_server():
    cuda13 = tuple(t for t in TOOLKITS if t.release == (13, 0))
    assert cuda13, "the fixture holds this machine's CUDA 13"
    with pytest.raises(OperationError, match="cannot target sm_70"):
        op(cuda_release=(13, 0)).decide(facts(BuildFacts(toolkits=cuda13, gcc=GCC12, gpus=NO_GPU)))


def test_the_stamp_holds_the_proof_from_real_output():
    listing = fixture_body("thishost-cuobjdump-list-elf-ptx-sm70-75-80.txt")
    d = op().decide(facts())
    record = next(c for c in d.commands if isinstance(c, Record))
    stamp = json.loads(
        bindings_stamp(record, {"version": "version: 0.3.36\nCPU : SSE3 = 1 | AVX = 1 |", "cubins": listing})
    )
    assert stamp["import"] == "0.3.36" and stamp["system_info"].startswith("CPU : SSE3")
    assert stamp["cubins"] == sorted(cuda.parse_cuobjdump_list_elf(listing)) and "sm_70" in stamp["cubins"]
    assert stamp["id"] == op().plan(facts())[0].build_id and stamp["inputs"]["arch"] == "70"


ABI = "cpython-311 linux-x86_64 glibc-2.36"


def test_a_wheel_in_the_fleet_cache_is_pushed_not_compiled(tmp_path):
    from playbooks.host.ops import Fetch, PushFile
    from playbooks.steps.fleet_cache import FleetCache
    from playbooks.steps.llamacpp_python import parse_abi, wheel_key

    cache = FleetCache(tmp_path)
    cpu = EnsureLlamaCppPython(LAYOUT, SOURCE, VENV, cuda_release=None, recipe_arch="70", cache=cache)
    # no wheel yet: compiled, and the proven wheel is fetched into the cache afterwards
    d = cpu.decide(facts(abi=ABI))
    assert "pip wheel" in d.commands[1].show() and isinstance(d.commands[-1], Fetch)
    key = wheel_key(cpu.plan(facts(abi=ABI))[0], ABI)
    assert d.commands[-1].local == tmp_path / "wheels" / key
    # another host of the fleet, same inputs and ABI, another prefix: the wheel is pushed
    whl = cache.wheel_dir(key) / "llama_cpp_python-0.3.36-cp311-cp311-linux_x86_64.whl"
    whl.parent.mkdir(parents=True)
    whl.write_bytes(b"wheel")
    other = EnsureLlamaCppPython(BuildLayout("/srv/vf"), SOURCE, "/srv/vf/venv", cuda_release=None, recipe_arch="70",
                                 cache=cache)  # fmt: skip
    d = other.decide(facts(abi=ABI))
    assert d.reason == "not installed; the controller's fleet cache holds this build's wheel: pushed, not compiled"
    push = next(c for c in d.commands if isinstance(c, PushFile))
    assert push.path == f"/srv/vf/src/wheels/{key}/{whl.name}" and push.local == whl
    assert not any("pip wheel" in c.show() or isinstance(c, Fetch) for c in d.commands)
    # the stamp still names this venv's inputs, and the import proves it here
    assert any(isinstance(c, Probe) and "import llama_cpp" in c.command for c in d.commands)
    # another Python (or no venv yet, so no ABI known): compiled
    assert "pip wheel" in other.decide(facts(abi="cpython-312 linux-x86_64 glibc-2.36")).commands[1].show()
    assert "pip wheel" in other.decide(facts(abi=None)).commands[1].show()
    assert parse_abi(ABI + "\n") == ABI and parse_abi("Traceback ...") is None
