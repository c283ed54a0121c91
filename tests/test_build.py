"""`invoke build`'s decisions, table-driven on real captured facts (this machine's CUDA 13 +
Debian 11.8 toolkit scan, its gcc, a Titan V + Ada nvidia-smi CSV, real cuobjdump listings),
and the build for real over SSH (slow): the CPU build from the sdist, a no-op second run, a
changed input building beside the old one, an interrupted build leaving `current` alone."""

from __future__ import annotations

import pytest

from playbooks.facts import builds, cuda, gpu
from playbooks.host.ops import OperationError, Record
from playbooks.steps.build.build import BuildLayout, EnsureLlamacppBuild
from playbooks.steps.build.buildenv import BuildFacts
from playbooks.steps.build.llamacpp_source import Source
from playbooks.steps.build.proven_build import Probe, check_cubins
from tests.helpers import ROOT, fixture_body

SOURCE = Source("llama-cpp-python==0.3.36", "0c1e570", ROOT / "x.tar.gz", "ab" * 32, "x/vendor/llama.cpp")
LAYOUT = BuildLayout("/opt/vf")
TOOLKITS = tuple(cuda.parse_toolkits(fixture_body("thishost-toolkits-cuda13-and-debian-cuda11.8.txt")))
GCC12 = cuda.parse_gcc_version(fixture_body("thishost-gcc-12-version.txt"))
NO_GPU = gpu.GpuFacts(available=False, reason="nvidia-smi not found")
TITAN_ADA = gpu.parse_nvidia_smi_csv(fixture_body("nvidia-smi-csv-compute-cap-titanv-volta-driver570.txt"), fields=None)


def op(cuda_release=(11, 8), **kw):
    return EnsureLlamacppBuild(LAYOUT, SOURCE, cuda_release=cuda_release, recipe_arch="70", **kw)


def facts(**kw):
    base = dict(toolkits=TOOLKITS, gcc=GCC12, nproc=16, gpus=NO_GPU)
    return BuildFacts(**{**base, **kw})


def shown(decision):
    return [c.show() for c in decision.commands]


def test_cuda_build_for_sm70_in_one_toolkit_only():
    d = op().decide(facts())
    configure, build, version, cubins, record, switch = d.commands
    # the environment: Debian's 11.8, and no directory of the CUDA 13 that is first on PATH here
    assert "CUDACXX=/usr/bin/nvcc" in configure.show() and "CUDA_HOME=/usr" in configure.show()
    assert "PATH=/usr/lib/nvidia-cuda-toolkit/bin:/usr/sbin:/usr/bin:/sbin:/bin" in configure.show()
    assert "/usr/local" not in configure.show() and "cuda-13" not in configure.show()
    assert "-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=70" in configure.show()
    assert "-DGGML_NATIVE=OFF" in configure.show() and "-DCMAKE_BUILD_TYPE=Release" in configure.show()
    assert build.show().endswith(
        "-j 16 --target llama-server llama-quantize llama-imatrix llama-perplexity llama-bench llama-batched-bench "
        "ggml-rpc-server"
    )
    assert isinstance(cubins, Probe) and cubins.expect == ("sm_70",)
    assert "/usr/bin/cuobjdump --list-elf" in cubins.command and cubins.command.endswith("/bin/libggml-cuda.so")
    assert isinstance(record, Record) and record.path.endswith("/voltaforge-stamp.json")
    assert switch.show().startswith("ln -sfn -- /opt/vf/llama.cpp/builds/0c1e570-cuda-")
    assert d.reason.startswith("no build of these inputs (0c1e570-cuda-")


def test_arch_comes_from_the_hosts_gpus():
    """Titan V (7.0) + RTX 5880 Ada (8.9) in one host: both archs, both proven."""
    d = op().decide(facts(gpus=TITAN_ADA))
    assert "-DCMAKE_CUDA_ARCHITECTURES=70;89" in shown(d)[0] or "'-DCMAKE_CUDA_ARCHITECTURES=70;89'" in shown(d)[0]
    assert next(c for c in d.commands if isinstance(c, Probe) and c.expect).expect == ("sm_70", "sm_89")


def test_the_same_inputs_name_the_same_build_and_a_flag_another():
    a = op().plan(facts())[0]
    assert a.build_id == op().plan(facts(nproc=2))[0].build_id  # -j is not an input of the result
    assert a.build_id != op(extra_flags=("-DGGML_CUDA_F16=ON",)).plan(facts())[0].build_id
    assert a.build_id != op().plan(facts(gpus=TITAN_ADA))[0].build_id
    assert a.build_id.startswith("0c1e570-cuda-")


def test_no_pinned_toolkit_is_a_clear_failure():
    only13 = tuple(t for t in TOOLKITS if t.release and t.release[0] == 13)
    with pytest.raises(OperationError, match=r"no CUDA 11\.8 nvcc found \(found: 13\.0"):
        op().decide(facts(toolkits=only13))


def test_cuda13_pinned_for_sm70_is_refused():
    with pytest.raises(OperationError, match="cannot target sm_70"):
        op(cuda_release=(13, 0)).decide(facts())


def test_proven_and_current_is_ok_in_one_decision():
    bid = op().plan(facts())[0].build_id
    stamp = {"id": bid, "built_at": "2026-11-30T12:00:00Z"}
    d = op().decide(facts(builds=(bid,), stamps={bid: stamp}, current=LAYOUT.build_dir(bid)))
    assert d.commands == () and d.reason == f"built 2026-11-30T12:00:00Z, {bid}"


def test_proven_but_not_current_switches_and_prunes_to_two():
    bid = op().plan(facts())[0].build_id
    old, older = "0c1e570-cuda-000000000001", "0c1e570-cuda-000000000002"
    d = op().decide(facts(builds=(older, old, bid), stamps={bid: {"id": bid}}, current=LAYOUT.build_dir(old)))
    assert shown(d)[0].startswith(f"ln -sfn -- {LAYOUT.build_dir(bid)} ")
    assert shown(d)[1] == f"rm -rf -- {LAYOUT.build_dir(older)}"  # keeps the new and the one in use


def test_an_interrupted_build_is_resumed_in_its_directory():
    bid = op().plan(facts())[0].build_id
    d = op().decide(facts(builds=(bid,), current="/opt/vf/llama.cpp/builds/0c1e570-cuda-000000000001"))
    assert d.reason == "an interrupted build of these inputs is resumed"
    assert f"-B {LAYOUT.build_dir(bid)} " in shown(d)[0]


def test_cpu_build_has_shared_libraries_for_the_bindings_and_needs_no_toolkit():
    d = op(cuda_release=None).decide(facts(toolkits=()))
    assert " && env PATH=/usr/sbin:/usr/bin:/sbin:/bin LC_ALL=C flock -w 900 " in shown(d)[0]
    assert ".lock /usr/bin/cmake -S /opt/vf/src/llama.cpp-0c1e570-" in shown(d)[0]
    # shared (llama.cpp's default): the Python bindings load this build's libllama.so
    assert "-DGGML_CUDA=OFF -DGGML_OPENMP=OFF" in shown(d)[0] and "BUILD_SHARED_LIBS" not in shown(d)[0]
    assert not any(isinstance(c, Probe) and c.expect for c in d.commands)


def test_ccache_when_present_keeps_its_cache_in_the_prefix():
    d = op(cuda_release=None).decide(facts(ccache="/usr/bin/ccache"))
    assert "CCACHE_DIR=/opt/vf/llama.cpp/ccache CCACHE_BASEDIR=/opt/vf" in shown(d)[0]


def test_cubin_proof_on_real_listings():
    check_cubins(fixture_body("thishost-cuobjdump-list-elf-ptx-sm70-75-80.txt"), ("sm_70",))
    # a native build on an Ampere box: sm_86 only, no sm_70 -> the step fails, nothing switched
    with pytest.raises(OperationError, match=r"no sm_70 cubins \(found: sm_86\)"):
        check_cubins(fixture_body("cuobjdump-list-elf-ggml-cuda-sm86.txt"), ("sm_70",))


# ------------------------------------------------------------------------------------------
# for real
# ------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(1800)  # a cold compile, then four more builds, on 2 cores
@pytest.mark.usefixtures("cpu_alone")  # tests/helpers.cpu_alone
def test_cpu_build_over_ssh_then_noop_then_new_input_then_interrupted(sshd_host, tmp_path, capsys, monkeypatch):
    """The CPU build from the pinned sdist on a real SSH host, through `run_build` (the task's
    own code). One target (llama-server) keeps it to one compile; ccache (from ci/) makes the
    rebuilds with other inputs cheap, as it does on a real host, and its cache is shared with
    test_quantize_real's host (CCACHE_BASEDIR makes paths under the prefix relative). The
    bindings (llama-cpp-python) are built and checked by test_quantize_real, which needs them."""
    import pwd
    import subprocess
    import threading
    import time
    from pathlib import Path

    from playbooks.cli.build import run_build
    from playbooks.host import connect
    from playbooks.steps.build.fleet_cache import FleetCache
    from tests.helpers import inventory_for, shared_ccache, spec_for

    monkeypatch.setattr(FleetCache, "default", classmethod(lambda cls: cls(tmp_path / "fleet")))
    prefix = sshd_host.prefix / "vf"
    inv = inventory_for(tmp_path, "box", sshd_host, prefix=str(prefix))
    layout = BuildLayout(str(prefix))
    server = ("llama-server",)

    def build(*flags, dry_run=False):
        code = run_build(
            "box", "tiny-cpu", dry_run=dry_run, inventory=inv, targets=server, extra_flags=flags, bindings=False
        )
        return code, capsys.readouterr().out

    def builds():
        return sorted(p.name for p in (prefix / "llama.cpp" / "builds").iterdir())

    # dry run: the exact commands, nothing on the host
    code, out = build(dry_run=True)
    assert code == 0 and "would run: env PATH=/usr/sbin:/usr/bin:/sbin:/bin" in out and "cmake --build" in out
    assert not prefix.exists()
    shared_ccache(prefix, sshd_host.user)
    # first run: builds and proves
    code, out = build()
    assert code == 0, out[-3000:]
    assert "UI: download" not in out and "UI:" in out  # the UI step ran, and fetched nothing
    first = builds()
    assert len(first) == 1 and (prefix / "llama.cpp" / "current").resolve().name == first[0]
    with connect(spec_for(sshd_host)) as host:
        version = host.run(f"{layout.llama_server} --version 2>&1", stream=False).stdout
    assert "version:" in version
    stamp = (prefix / "llama.cpp" / "builds" / first[0] / "voltaforge-stamp.json").read_text()
    assert first[0] in stamp and "built_at" in stamp
    # second run: nothing to do, no cmake, seconds
    t0 = time.monotonic()
    code, out = build()
    elapsed = time.monotonic() - t0
    assert code == 0 and "cmake" not in out and "built " in out and "6 ok" in out
    assert elapsed < 10, elapsed
    # a changed input: a second build beside the first, current switched to it
    code, out = build("-DLLAMA_BUILD_COMMON=ON")
    assert code == 0, out[-3000:]
    second = [b for b in builds() if b not in first]
    assert len(second) == 1 and (prefix / "llama.cpp" / "current").resolve().name == second[0]
    # an interrupted build: current keeps pointing at the second build
    third_flag = "-DLLAMA_BUILD_TOOLS=ON"
    result = {}
    runner = threading.Thread(target=lambda: result.update(code=build(third_flag)[0]))
    runner.start()
    # kill it once it is compiling (not while cmake configures): the build process is on the host
    deadline = time.monotonic() + 300
    building = ["pgrep", "-u", sshd_host.user, "-f", "cmake --build"]
    while time.monotonic() < deadline and subprocess.run(building, capture_output=True).returncode != 0:
        time.sleep(0.2)
    time.sleep(2)
    subprocess.run(["pkill", "-u", sshd_host.user, "-f", "cmake --build"], check=False)
    runner.join(600)
    assert result["code"] == 1
    assert (prefix / "llama.cpp" / "current").resolve().name == second[0]
    third = [b for b in builds() if b not in first + second]
    assert len(third) == 1 and not (prefix / "llama.cpp" / "builds" / third[0] / "voltaforge-stamp.json").exists()
    # the re-run resumes it, switches, and keeps two builds (the new one and the one in use)
    code, out = build(third_flag)
    assert code == 0 and "an interrupted build of these inputs is resumed" in out
    assert builds() == sorted(second + third)
    assert (prefix / "llama.cpp" / "current").resolve().name == third[0]
    # the fleet cache: every proven build was kept on the controller; a host that lost its
    # build (or a new host with the same inputs) gets the archive and proves it, no compile
    assert {p.name for p in (tmp_path / "fleet").iterdir()} == {f"{b}.tar.gz" for b in first + second + third}
    subprocess.run(["rm", "-rf", str(prefix / "llama.cpp" / "builds" / third[0])], check=True)
    code, out = build(third_flag)
    assert code == 0 and "proven in the controller's fleet cache" in out and "cmake" not in out
    assert (prefix / "llama.cpp" / "current").resolve().name == third[0]
    assert (prefix / "llama.cpp" / "builds" / third[0] / "voltaforge-stamp.json").exists()
    # the connection dropped mid-build (this connection's sshd processes killed, the compile
    # left running on the host, as after a network cut): one line, current untouched, and the
    # re-run waits for the orphaned compile (its lock) and resumes
    from testhosts import _descendants

    drop_flag = "-DLLAMA_BUILD_SERVER=ON"
    runner = threading.Thread(target=lambda: result.update(dropped=build(drop_flag)))
    runner.start()
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and subprocess.run(building, capture_output=True).returncode != 0:
        time.sleep(0.2)
    time.sleep(1)
    for pid in _descendants(sshd_host.pid):
        try:
            comm = Path(f"/proc/{pid}/comm").read_text(errors="replace").strip()
        except OSError:
            continue  # gone meanwhile (a short fact command)
        if comm == "sshd":
            subprocess.run(["kill", "-9", str(pid)], check=False)
    runner.join(600)
    code, out = result["dropped"]
    assert code == 1 and f"connection to box (127.0.0.1:{sshd_host.port}) lost while running" in out, out[-2000:]
    assert "re-run to resume it; current is unchanged" in out
    assert (prefix / "llama.cpp" / "current").resolve().name == third[0]
    code, out = build(drop_flag)
    assert code == 0 and "an interrupted build of these inputs is resumed" in out, out[-3000:]
    fourth = [b for b in builds() if b not in third]
    assert len(fourth) == 1 and (prefix / "llama.cpp" / "current").resolve().name == fourth[0]
    # the disk filled up mid-build (a small tmpfs mounted where the next build goes): the
    # compiler's own line in one message, current untouched
    full_flag = "-DLLAMA_FATAL_WARNINGS=OFF"  # the default: another input, the same compile
    code, out = build(full_flag, dry_run=True)
    bid = out.split("no build of these inputs (", 1)[1].split(")", 1)[0]
    small = prefix / "llama.cpp" / "builds" / bid
    small.mkdir()
    user = pwd.getpwnam(sshd_host.user)
    opts = f"size=8m,mode=0755,uid={user.pw_uid},gid={user.pw_gid}"
    subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "vf-full", str(small)], check=True)
    try:
        code, out = build(full_flag)
    finally:
        subprocess.run(["umount", str(small)], check=True)
        small.rmdir()
    failed = [line for line in out.splitlines() if "disk full during the build (" in line]
    assert code == 1 and failed and "No space left on device" in failed[0], out[-3000:]
    assert failed[0].rstrip().endswith("free space and re-run to resume it; current is unchanged")
    assert (prefix / "llama.cpp" / "current").resolve().name == fourth[0]


@pytest.mark.slow
def test_a_build_here_and_a_build_over_ssh_share_one_ccache(sshd_host, tmp_path, monkeypatch):
    """The run's one full compile is the tests' tools build (llamacpp_tools.build_tools: the
    build step on this machine, in this process's environment); the SSH builds after it reuse
    its objects only if ccache finds them from a login session: another prefix (the build
    step's CCACHE_BASEDIR), another user, another LANG (the shared directory's ccache.conf,
    tests/helpers.share_ccache_dir). One small target (ggml-base) compiled here with
    LANG=C.UTF-8, then over SSH in a session without it: every object a hit, none compiled.
    Without the conf's `sloppiness = locale`, measured: none of them hit."""
    import shutil
    import subprocess

    from playbooks.host import connect
    from playbooks.host.local import LocalHost
    from playbooks.host.ops import run_ops
    from playbooks.host.output import Printer
    from playbooks.steps.build.build import build_ops
    from playbooks.steps.build.llamacpp_source import fetch_sdist
    from tests.helpers import share_ccache_dir, spec_for

    cache = share_ccache_dir(sshd_host.prefix / "ccache")  # where the test user reaches it
    source = fetch_sdist("llama-cpp-python==0.3.36", "0c1e570")

    def compile_on(host, prefix) -> None:
        ops = build_ops(BuildLayout(str(prefix)), source, cuda_release=None, recipe_arch="70", targets=("ggml-base",))
        assert all(c.status != "failed" for c in run_ops(host, ops[:-1]))  # directories, archive, tree
        # the build step's own configure and compile (its proof wants llama-server, not built here)
        configure, build = ops[-1].check(host).commands[:2]
        for command in (configure, build):
            host.run(command.command, stream=False)

    def stats() -> dict[str, int]:
        out = subprocess.run(
            ["ccache", "--print-stats"], env={"CCACHE_DIR": str(cache)}, capture_output=True, text=True
        )
        return {k: int(v) for k, v in (line.split("\t") for line in out.stdout.splitlines())}

    here = tmp_path / "here"
    (here / "llama.cpp").mkdir(parents=True)
    (here / "llama.cpp" / "ccache").symlink_to(cache)
    monkeypatch.setenv("LANG", "C.UTF-8")
    compile_on(LocalHost("here", Printer(quiet=True)), here)
    assert stats()["cache_miss"] >= 9  # compiled here, into the shared cache
    there = sshd_host.prefix / "vf"
    (there / "llama.cpp").mkdir(parents=True)
    (there / "llama.cpp" / "ccache").symlink_to(cache)
    shutil.chown(there, sshd_host.user)
    shutil.chown(there / "llama.cpp", sshd_host.user)
    subprocess.run(["ccache", "-z"], env={"CCACHE_DIR": str(cache)}, check=True, capture_output=True)
    with connect(spec_for(sshd_host), Printer(quiet=True)) as host:
        assert host.run("echo ${LANG-none}", stream=False).stdout.strip() != "C.UTF-8"  # the case at hand
        compile_on(host, there)
    after = stats()
    assert after["cache_miss"] == 0 and after["direct_cache_hit"] >= 9, after


@pytest.mark.slow
def test_cuda_path_compiles_sm70_through_the_build_steps_own_commands(tmp_path):
    """The CUDA path on this machine's real toolkits, through EnsureLlamacppBuild: its facts are
    read from this machine (CUDA 13 first on PATH where the image has it, Debian's 11.8), its
    configure command runs for real, one ggml-cuda object is compiled in the same environment,
    and the step's own proof finds sm_70 cubins in it. The whole ggml-cuda (about 50 minutes on
    2 cores, docs/knowledge.md section 3) is not built here."""
    import shlex
    import subprocess

    from playbooks.host import LocalHost
    from playbooks.steps.build.llamacpp_source import fetch_sdist

    source = fetch_sdist("llama-cpp-python==0.3.36", "0c1e570")
    layout = BuildLayout(str(tmp_path / "vf"))
    host = LocalHost()
    src = layout.tree(source)
    subprocess.run(["mkdir", "-p", src], check=True)
    strip = source.member.count("/") + 1
    subprocess.run(
        ["tar", "-xzf", str(source.archive), "-C", src, f"--strip-components={strip}", source.member], check=True
    )
    op = EnsureLlamacppBuild(layout, source, cuda_release=(11, 8), recipe_arch="70")
    decision = op.decide(op.read(host))
    configure = decision.commands[0].show()
    assert "/usr/local/cuda" not in configure and "cuda-13" not in configure
    run = host.run(configure.replace("cmake -S", "cmake -DLLAMA_BUILD_SERVER=OFF -S", 1), stream=False, check=False)
    assert run.ok, run.stdout[-2000:] + run.stderr[-2000:]
    assert "The CUDA compiler identification is NVIDIA 11.8" in run.stdout
    env_part = configure.split("cmake -S", 1)[0].rsplit(" ", 1)[0]  # up to the cmake path
    build_dir = configure.split(" -B ", 1)[1].split(" ", 1)[0]
    obj = host.run(f"{env_part} make -C {build_dir}/ggml/src/ggml-cuda arange.cu.o", stream=False, check=False)
    assert obj.ok, obj.stdout[-2000:] + obj.stderr[-2000:]
    probe = next(c for c in decision.commands if isinstance(c, Probe) and c.expect)
    listing = host.run(
        probe.command.replace(
            f"{build_dir}/bin/libggml-cuda.so",
            shlex.quote(f"{build_dir}/ggml/src/ggml-cuda/CMakeFiles/ggml-cuda.dir/arange.cu.o"),
        ),
        stream=False,
    ).stdout
    check_cubins(listing, probe.expect)
    assert cuda.parse_cuobjdump_list_elf(listing) == {"sm_70"}


def test_fleet_cache_copies_a_proven_build_instead_of_compiling(tmp_path):
    from playbooks.host.ops import Fetch, PushFile
    from playbooks.steps.build.fleet_cache import FleetCache

    cache = FleetCache(tmp_path)
    with_cache = op(cache=cache)
    bid = with_cache.plan(facts())[0].build_id
    # not in the cache: compile, then keep the proven build in the cache
    d = with_cache.decide(facts())
    fetch = next(c for c in d.commands if isinstance(c, Fetch))
    assert fetch.local == tmp_path / f"{bid}.tar.gz" and "cmake --build" in shown(d)[1]
    # in the cache: pushed, unpacked and proven again here; no cmake
    (tmp_path / f"{bid}.tar.gz").write_bytes(b"archive")
    d = with_cache.decide(facts(cached=(bid,)))
    assert isinstance(d.commands[0], PushFile) and not any("cmake" in s for s in shown(d))
    assert [c.key for c in d.commands if isinstance(c, Probe)] == ["version", "cubins"]
    assert d.reason.startswith(f"build {bid} is proven in the controller's fleet cache")
    # --no-cache: the same facts compile
    assert "cmake --build" in shown(op().decide(facts(cached=(bid,))))[1]


def test_a_build_for_another_prefix_is_another_build():
    other = EnsureLlamacppBuild(BuildLayout("/srv/vf"), SOURCE, cuda_release=(11, 8), recipe_arch="70")
    assert other.plan(facts())[0].build_id != op().plan(facts())[0].build_id


NVIDIA_118 = cuda.Toolkit(path="/usr/local/cuda-11.8/bin/nvcc", kind="nvcc", release=(11, 8), version="V11.8.89")


def test_nvidias_cuda_11_8_with_gcc_12_needs_g_plus_plus_11():
    """NVIDIA's 11.8 refuses GCC > 11 (crt/host_config.h; tests/fixtures/thishost-nvcc118-host-gcc12-unsupported.txt);
    Debian's package routes nvcc to g++-11 itself, NVIDIA's does not."""
    with pytest.raises(OperationError, match="refuses gcc 12 as its host compiler and no g\\+\\+-11 is installed"):
        op().decide(facts(toolkits=(NVIDIA_118,)))
    gxx11 = cuda.parse_gcc_version(fixture_body("thishost-gxx-11-version.txt"))
    d = op().decide(facts(toolkits=(NVIDIA_118,), gxx11=gxx11))
    assert "-DCMAKE_CUDA_HOST_COMPILER=/usr/bin/g++-11" in shown(d)[0]
    assert "CUDA_HOME=/usr/local/cuda-11.8" in shown(d)[0] and "/usr/local/cuda-11.8/bin/cuobjdump" in shown(d)[3]


@pytest.mark.slow
def test_an_unknown_source_is_one_line(tmp_path):
    """A pinned sdist the package index does not have: one line, exit 2, nothing on the host."""
    import subprocess
    import sys

    from tests.helpers import recipe_with

    recipe = recipe_with(tmp_path, "tiny-cpu", "toolchain:\n  llamacpp_sdist: llama-cpp-python==0.0.0\n")
    r = subprocess.run(
        [sys.executable, "-m", "invoke", "build", "--host", "local", "--recipe", str(recipe), "--dry-run"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**__import__("os").environ, "VOLTAFORGE_CACHE": str(tmp_path / "cache")},
    )
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith(
        "error: cannot fetch llama-cpp-python==0.0.0 (the llama.cpp source) from the package index"
    )


def test_the_version_proof_is_required_where_the_binary_can_start():
    """A CUDA llama-server needs the NVIDIA driver to start: on a build box with no GPU its
    --version is recorded, not required (the cubins prove the build); elsewhere it must run."""

    def version_probe(d):
        return next(c for c in d.commands if isinstance(c, Probe) and c.key == "version")

    assert version_probe(op().decide(facts())).may_fail is True
    assert version_probe(op().decide(facts(gpus=TITAN_ADA))).may_fail is False
    assert version_probe(op(cuda_release=None).decide(facts())).may_fail is False


def test_hopper_with_cuda_11_8_is_refused_before_compiling():
    """Measured with scripts/bench_build.py: at 0c1e570 ggml-cuda does not compile for sm_90
    with CUDA 11.8 (`cudaGridDependencySynchronize` is undefined), so say so before an hour."""
    h200 = gpu.GpuFacts(available=True, gpus=(gpu.GpuInfo(index=0, name="NVIDIA H200", compute_capability=(9, 0)),))
    with pytest.raises(OperationError, match="does not compile for sm_90 with CUDA 11.8"):
        op().decide(facts(gpus=h200))


def test_a_build_is_refused_before_compiling_when_the_disk_cannot_hold_it():
    """Compute first: 300 MB free where a CPU build needs 512 MiB is refused with both numbers;
    a proven build that only needs switching is not held up by a full disk."""
    with pytest.raises(
        OperationError,
        match=r"^0.30 GB free under /opt/vf/llama.cpp/builds, a cpu build needs about 0.54 GB: free space",
    ):
        op(cuda_release=None).decide(facts(disk_free=300_000_000))
    with pytest.raises(OperationError, match="a cuda build needs about 2.15 GB"):
        op().decide(facts(gpus=TITAN_ADA, disk_free=2_000_000_000))  # two archs
    assert op().decide(facts(disk_free=1_200_000_000)).commands  # one arch fits in 1.2 GB
    bid = op().plan(facts())[0].build_id
    stamped = facts(disk_free=0, builds=(bid,), stamps={bid: {"id": bid}})
    assert shown(op().decide(stamped))[0].startswith("ln -sfn")


def test_compiles_of_one_build_directory_never_overlap():
    """After a dropped connection the old compile may still be running on the host: configure
    and build hold a lock per build directory, so a re-run waits instead of racing it."""
    d = op().decide(facts())
    bid = op().plan(facts())[0].build_id
    lock = f"flock -w 900 /opt/vf/llama.cpp/builds/{bid}/.voltaforge-build.lock /usr/bin/cmake"
    assert lock + " -S" in shown(d)[0] and lock + " --build" in shown(d)[1]
    assert shown(d)[0].startswith(f"mkdir -p -- /opt/vf/llama.cpp/builds/{bid} && env ")


def test_the_two_outside_deaths_of_a_build_are_one_line_each():
    """Real messages: a compiler's (tests/fixtures/thishost-gcc-no-space-left.txt is what g++ said
    on a full tmpfs here) inside the host layer's failure, and the host layer's lost connection."""
    from playbooks.errors import HostError
    from playbooks.steps.build.proven_build import build_failure

    tail = fixture_body("thishost-gcc-no-space-left.txt")
    failed = HostError(f"box: command failed (exit 2): env PATH=/usr/sbin:/usr/bin LC_ALL=C flock -w 900\n{tail}")
    msg = str(build_failure(failed, "re-run to resume it; current is unchanged"))
    assert len(msg.splitlines()) == 1 and msg.startswith("disk full during the build (")
    assert "No space left on device" in msg and msg.endswith("free space and re-run to resume it; current is unchanged")
    lost = HostError("connection to box (127.0.0.1:2222) lost while running: env PATH=/usr/sbin")
    assert str(build_failure(lost, "re-run")) == (
        "connection to box (127.0.0.1:2222) lost while running: env PATH=/usr/sbin: re-run"
    )
    compile_error = HostError("box: command failed (exit 2): cmake --build\nerror: 'x' was not declared")
    assert build_failure(compile_error, "re-run") is compile_error


def test_build_tools_are_run_by_the_path_the_host_found_them_at():
    # a CUDA image: cmake and ninja from pip in /usr/local/bin, no make; the compile's PATH
    # holds the system directories only, so a bare `cmake` would not be found there
    tools = builds.parse_build_tools("cmake=/usr/local/bin/cmake\nmake=\nninja=/usr/local/bin/ninja\n")
    assert tools == {"cmake": "/usr/local/bin/cmake", "make": None, "ninja": "/usr/local/bin/ninja"}
    d = op(cuda_release=None).decide(facts(toolkits=(), **tools))
    configure, build = shown(d)[:2]
    assert ".lock /usr/local/bin/cmake -S " in configure and ".lock /usr/local/bin/cmake --build " in build
    assert "-G Ninja -DCMAKE_MAKE_PROGRAM=/usr/local/bin/ninja" in configure
    # with the system's make, cmake's default generator (and no flag that changes the build id)
    plain = shown(op(cuda_release=None).decide(facts(toolkits=(), cmake="/usr/local/bin/cmake", ninja="/x/ninja")))[0]
    assert "-G Ninja" not in plain


def test_a_host_without_cmake_gets_one_line_naming_the_fix():
    with pytest.raises(OperationError, match="cmake is not installed on the host: the toolchain step installs it"):
        op(cuda_release=None).decide(facts(toolkits=(), cmake=None))


def test_a_toolchain_error_buried_under_make_is_the_failures_one_line(tmp_path):
    """Real make output of CUDA 13 refusing an old arch (tests/fixtures/nvcc-cuda13-unsupported-
    arch-make-output.txt, from cuda-samples issue 382), then make's follow-up errors: the host
    layer keeps the nvcc line under the last five, and the build's failure is one line with its
    fix (facts/cuda.parse_nvcc_error), where it used to end in make's 'Error 2'."""
    from playbooks.errors import HostError
    from playbooks.host import LocalHost
    from playbooks.steps.build.proven_build import build_failure

    out = tmp_path / "make.txt"
    out.write_text(
        fixture_body("nvcc-cuda13-unsupported-arch-make-output.txt")
        + "".join(f"make[1]: *** [CMakeFiles/Makefile2:{i}: all] Error 2\n" for i in range(6))
    )
    with pytest.raises(HostError) as info:
        LocalHost().run(f"cat {out} >&2; exit 2", stream=False)
    assert "nvcc fatal   : Unsupported gpu architecture 'compute_50'" in str(info.value)
    msg = str(build_failure(info.value, "re-run"))
    assert len(msg.splitlines()) == 1, msg
    assert msg.startswith("the build stopped at a toolchain error (nvcc fatal   : Unsupported gpu architecture")
    assert "sm_70 needs CUDA 9.0-12.x, not 13+" in msg and msg.endswith("; then re-run")
