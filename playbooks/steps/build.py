"""`invoke build`: llama.cpp from the pinned source, for the host's arch, proven, stamped.

The seed's first pitfall is a llama.cpp built without sm_70 ("no kernel image is available",
or PTX JIT and slow generic kernels). So a build here:

- compiles the pinned source: the llama.cpp tree the pinned ``llama-cpp-python`` sdist vendors,
  fetched once on the controller from the package index (checksummed) and pushed over SSH, so
  hosts need no internet (the offline source knowledge.md names);
- configures in ``buildenv``'s environment only (one toolkit, never the caller's PATH), for the
  arch the host's GPUs report (the recipe's ``cuda_arch`` when none is visible), Release,
  ``GGML_NATIVE=OFF``, only the targets the later steps use;
- proves itself: after a CUDA build ``cuobjdump --list-elf`` on ``libggml-cuda.so`` must list
  real ``sm_XX`` cubins for every planned arch, or the step fails and nothing is switched;
- lands in its own directory named by a hash of its inputs (source ref and sha256, flags,
  toolkit, compiler, arch, targets) with a stamp holding the proof; the same inputs again are
  ``ok`` in seconds, new inputs build beside the old one and switch the ``current`` symlink
  atomically only once proven, so a running service keeps its binary through a failed or
  interrupted build. The last two builds are kept.

Decision (pure) and facts are separate, as everywhere: ``EnsureLlamacppBuild.decide`` takes
what the host reported and returns the exact commands, tested table-driven without a host.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import shlex
import subprocess
import sys
import tarfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from playbooks.errors import HostError, VoltaforgeError
from playbooks.facts import builds, cuda, gpu, read_fact, system
from playbooks.facts.unreachable import pip_unreachable
from playbooks.host.base import Host
from playbooks.host.ops import (
    Command,
    Decision,
    EnsureDirectory,
    EnsureFile,
    Fetch,
    Operation,
    OperationError,
    PushFile,
    Record,
    Shell,
    run_command,
)
from playbooks.plan.gpus import size_text
from playbooks.steps.buildenv import SYSTEM_PATH, build_env, env_prefix, pick_toolkit, toolkit_root

#: What the later steps run: serve, quantize (+ imatrix), measure quality and speed.
LLAMACPP_TARGETS = (
    "llama-server",
    "llama-quantize",
    "llama-imatrix",
    "llama-perplexity",
    "llama-bench",
    "llama-batched-bench",
)
KEEP_BUILDS = 2


# ------------------------------------------------------------------------------------------
# the source, on the controller
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Source:
    """The pinned llama.cpp source as an archive on the controller."""

    requirement: str  # llama-cpp-python==0.3.36
    ref: str  # the llama.cpp commit it vendors (the recipe's llamacpp_ref)
    archive: Path
    sha256: str
    member: str  # the tree inside the archive: <top>/vendor/llama.cpp

    @property
    def filename(self) -> str:
        return self.archive.name


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def source_cache_dir() -> Path:
    return Path(os.environ.get("VOLTAFORGE_CACHE") or Path.home() / ".cache" / "voltaforge") / "sources"


def fetch_sdist(requirement: str, ref: str, cache: Path | None = None) -> Source:
    """The sdist from the package index into the controller's cache, once (pip checks the
    index's hash on download; the sha256 recorded here is what every host is checked against)."""
    name, _, version = requirement.partition("==")
    if not version or not all(c.isalnum() or c in "._-" for c in name + version):
        raise VoltaforgeError(f"toolchain.llamacpp_sdist {requirement!r}: want NAME==VERSION")
    where = (cache or source_cache_dir()) / requirement.replace("==", "-")
    found = sorted(where.glob("*.tar.gz")) if where.is_dir() else []
    if not found:
        where.mkdir(parents=True, exist_ok=True)
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--no-binary",
                ":all:",
                "-d",
                str(where),
                requirement,
            ],
            capture_output=True,
            text=True,
        )
        if r.returncode != 0:
            gone = pip_unreachable(r.stderr)
            if gone is not None:
                named = f" ({gone.where[0]})" if gone.where else ""
                raise VoltaforgeError(
                    f"cannot reach the package index{named} for {requirement}, the llama.cpp source "
                    f"(toolchain.llamacpp_sdist) ({gone.cause}): give this machine access to it, or stage the file: "
                    f"on a machine with access run `pip download --no-deps --no-binary :all: {requirement}` and "
                    f"copy the .tar.gz into {where}/"
                )
            last = (r.stderr.strip().splitlines() or ["no output"])[-1]
            raise VoltaforgeError(f"cannot fetch {requirement} (the llama.cpp source) from the package index: {last}")
        found = sorted(where.glob("*.tar.gz"))
    archive = found[0]
    top = archive.name.removesuffix(".tar.gz")
    member = f"{top}/vendor/llama.cpp"
    return Source(requirement, ref, archive, _checked_sha256(archive, f"{member}/CMakeLists.txt"), member)


def _checked_sha256(archive: Path, must_hold: str) -> str:
    """The archive's sha256, once it was seen to hold ``must_hold``. Both take seconds on a
    50 MB archive (a gzip tar has no index), so the result is kept beside it and trusted while
    the size and mtime stay the same: a no-op provision reads a few bytes instead."""
    st = archive.stat()
    sidecar = archive.with_name(f".{archive.name}.checked.json")
    key = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "holds": must_hold}
    try:
        known = json.loads(sidecar.read_text())
        if {k: known.get(k) for k in key} == key and len(str(known.get("sha256"))) == 64:
            return str(known["sha256"])
    except (OSError, ValueError, AttributeError):
        pass
    with tarfile.open(archive) as tar:
        try:
            tar.getmember(must_hold)
        except KeyError:
            raise VoltaforgeError(f"{archive}: holds no {must_hold}: not a llama.cpp source") from None
    sha = file_sha256(archive)
    try:
        sidecar.write_text(json.dumps({**key, "sha256": sha}))
    except OSError:
        pass  # a read-only cache: checked again next time
    return sha


# ------------------------------------------------------------------------------------------
# where things go on the host
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BuildLayout:
    prefix: str

    @property
    def src(self) -> str:
        return f"{self.prefix}/src"

    def archive(self, source: Source) -> str:
        return f"{self.src}/{source.filename}"

    def tree(self, source: Source) -> str:
        return f"{self.src}/llama.cpp-{source.ref}-{source.sha256[:12]}"

    @property
    def builds(self) -> str:
        return f"{self.prefix}/llama.cpp/builds"

    @property
    def current(self) -> str:
        return f"{self.prefix}/llama.cpp/current"

    @property
    def ccache_dir(self) -> str:
        return f"{self.prefix}/llama.cpp/ccache"

    def build_dir(self, build_id: str) -> str:
        return f"{self.builds}/{build_id}"

    @property
    def llama_server(self) -> str:
        """What a service runs: through `current`, so a switch-over needs only a restart."""
        return f"{self.current}/bin/llama-server"


# ------------------------------------------------------------------------------------------
# the fleet cache, on the controller
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FleetCache:
    """Proven builds kept on the controller by their input hash: a fleet of ten V100s with the
    same arch, toolkit, compiler, ref, flags and prefix compiles once, the other nine get the
    archive copied and re-proven."""

    root: Path

    @classmethod
    def default(cls) -> FleetCache:
        return cls(source_cache_dir().parent / "builds")

    def archive(self, build_id: str) -> Path:
        return self.root / f"{build_id}.tar.gz"

    def wheel_dir(self, key: str) -> Path:
        """Proven llama-cpp-python wheels (one per directory), by build inputs and ABI."""
        return self.root / "wheels" / key

    def wheel(self, key: str) -> Path | None:
        found = sorted(self.wheel_dir(key).glob("*.whl"))
        return found[0] if len(found) == 1 else None

    def ids(self) -> tuple[str, ...]:
        if not self.root.is_dir():
            return ()
        return tuple(sorted(p.name.removesuffix(".tar.gz") for p in self.root.glob("*.tar.gz")))


# ------------------------------------------------------------------------------------------
# the source on the host
# ------------------------------------------------------------------------------------------

SOURCE_MARKER = ".voltaforge-source"


class EnsureSourceTree(Operation):
    """The pinned tree unpacked from the pushed archive, once (a marker holds its sha256)."""

    def __init__(self, layout: BuildLayout, source: Source):
        self.layout, self.source = layout, source
        self.tree = layout.tree(source)
        self.name = f"Ensure the llama.cpp {source.ref} tree is unpacked"

    def read(self, host: Host) -> str:
        return read_fact(host, f"cat -- {shlex.quote(self.tree + '/' + SOURCE_MARKER)} 2>/dev/null || true").strip()

    def decide(self, facts: str) -> Decision:
        sha = self.source.sha256
        if facts == sha:
            return Decision.ok(f"already unpacked at {self.tree} (sha256 {sha[:12]})")
        tmp = f"{self.tree}.vf-unpack"
        q, qt = shlex.quote(self.tree), shlex.quote(tmp)
        strip = self.source.member.count("/") + 1
        script = (
            f"set -e; rm -rf -- {qt}; mkdir -p -- {qt}; "
            f"tar -xzf {shlex.quote(self.layout.archive(self.source))} -C {qt} "
            f"--strip-components={strip} {shlex.quote(self.source.member)}; "
            f"echo {sha} > {qt}/{SOURCE_MARKER}; rm -rf -- {q}; mv -T -- {qt} {q}"
        )
        return Decision.act("tree is missing" if not facts else "tree is from another archive", Shell(script))


# ------------------------------------------------------------------------------------------
# the build
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BuildInputs:
    """Everything a build's result depends on; its hash names the build directory."""

    prefix: str  # absolute paths are baked in (RPATH, the stamp): a copy needs the same prefix
    ref: str
    source_sha256: str
    backend: str  # cuda | cpu
    arch: str | None  # "70", "70;80" (CUDA), None (CPU)
    toolkit: str | None  # "11.8 V11.8.89 /usr/bin/nvcc"
    compiler: str  # "gcc 12.2.0" (+ the CUDA host compiler)
    flags: tuple[str, ...]
    targets: tuple[str, ...]

    @property
    def build_id(self) -> str:
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return f"{self.ref}-{self.backend}-{hashlib.sha256(blob).hexdigest()[:12]}"


@dataclass(frozen=True)
class Probe(Shell):
    """A read-only command whose output the operation checks and records (the proof);
    ``expect``: for the cubin listing, the archs that must have real cubins."""

    key: str = ""
    expect: tuple[str, ...] = ()
    may_fail: bool = False  # recorded either way (a CUDA build on a box without the driver)
    # for the cubin listing: what was listed, and what a failed proof leaves behind
    what: str = "libggml-cuda.so"
    after: str = "the build is kept for inspection and current is unchanged"


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


def cmake_flags(cuda_arch: str | None, host_compiler: str | None = None) -> tuple[str, ...]:
    flags = [
        "-DCMAKE_BUILD_TYPE=Release",
        "-DGGML_NATIVE=OFF",
        "-DLLAMA_OPENSSL=OFF",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
    ]
    if cuda_arch:
        flags += ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={cuda_arch}"]
        if host_compiler:
            flags.append(f"-DCMAKE_CUDA_HOST_COMPILER={host_compiler}")
    else:
        # static, without OpenMP: the binaries run anywhere this libc does (a test container too)
        flags += ["-DGGML_CUDA=OFF", "-DBUILD_SHARED_LIBS=OFF", "-DGGML_OPENMP=OFF"]
    return tuple(flags)


class EnsureLlamacppBuild(Operation):
    """A proven llama.cpp build of these inputs exists and `current` points at it."""

    def __init__(
        self,
        layout: BuildLayout,
        source: Source,
        *,
        cuda_release: tuple[int, int] | None,
        recipe_arch: str,
        targets: tuple[str, ...] = LLAMACPP_TARGETS,
        extra_flags: tuple[str, ...] = (),
        cache: FleetCache | None = None,
    ):
        self.layout, self.source, self.cache = layout, source, cache
        self.cuda_release, self.recipe_arch = cuda_release, recipe_arch
        self.targets, self.extra_flags = tuple(targets), tuple(extra_flags)
        kind = "CUDA" if cuda_release else "CPU"
        self.name = f"Ensure llama.cpp {source.ref} is built ({kind}) and current"

    # -- facts ---------------------------------------------------------------------------

    def read(self, host: Host) -> BuildFacts:
        listed = builds.parse_list_dir(read_fact(host, builds.list_dir_command(self.layout.builds)))
        names = tuple(n for n in listed if not n.startswith("."))  # .<id>.tar.gz in transit
        disk = system.parse_df(read_fact(host, system.disk_free_command([self.layout.builds]))).get(self.layout.builds)
        stamps = {}
        for name in names:
            stamp = builds.parse_stamp(read_fact(host, builds.stamp_command(self.layout.build_dir(name))))
            if stamp:
                stamps[name] = stamp
        return replace(
            read_compile_facts(host, cuda_build=bool(self.cuda_release)),
            builds=names,
            stamps=stamps,
            current=builds.parse_readlink(read_fact(host, builds.readlink_command(self.layout.current))),
            cached=self.cache.ids() if self.cache else (),  # the controller's state is a fact too
            disk_free=disk.available_bytes if disk else None,
        )

    # -- decision --------------------------------------------------------------------------

    def plan(self, facts: BuildFacts) -> tuple[BuildInputs, dict[str, str], str | None]:
        """(inputs, build environment, cuobjdump path) for this host. Pure."""
        ce = llamacpp_compile_env(facts, self.cuda_release, self.recipe_arch, self.source.ref)
        flags = generator_flags(facts) + cmake_flags(ce.arch, ce.host_compiler) + self.extra_flags
        inputs = BuildInputs(
            self.layout.prefix,
            self.source.ref,
            self.source.sha256,
            ce.backend,
            ce.arch,
            ce.toolkit,
            ce.compiler,
            flags,
            self.targets,
        )
        return inputs, ce.env, ce.cuobjdump

    def decide(self, facts: BuildFacts) -> Decision:
        inputs, env, cuobjdump = self.plan(facts)
        bid = inputs.build_id
        target = self.layout.build_dir(bid)
        stamp = facts.stamps.get(bid)
        switch = Shell(
            f"ln -sfn -- {shlex.quote(target)} {shlex.quote(self.layout.current + '.vf-new')} && "
            f"mv -fT -- {shlex.quote(self.layout.current + '.vf-new')} {shlex.quote(self.layout.current)}"
        )
        prune = self._prune(facts, bid)
        if stamp and facts.current == target:
            return Decision.ok(f"built {stamp.get('built_at', '?')}, {bid}")
        if stamp:
            return Decision.act(
                f"build {bid} is proven; switching current from {facts.current or 'nothing'}", switch, *prune
            )
        jobs = facts.nproc or 2
        if facts.ccache:
            # CCACHE_BASEDIR: paths under the prefix are hashed relative, so a build with other
            # inputs (another build directory) or under another prefix still hits the cache
            env = {**env, "CCACHE_DIR": self.layout.ccache_dir, "CCACHE_BASEDIR": self.layout.prefix}
        run = env_prefix(env)
        src, q = shlex.quote(self.layout.tree(self.source)), shlex.quote(target)
        proof = self._proof(q, run, cuobjdump, inputs, runnable=not cuobjdump or facts.gpus.available)
        packed = shlex.quote(f"{self.layout.builds}/.{bid}.tar.gz")
        if self.cache and bid in facts.cached:
            archive = self.cache.archive(bid)
            return Decision.act(
                f"build {bid} is proven in the controller's fleet cache: copied and re-proven, not compiled",
                PushFile(f"{self.layout.builds}/.{bid}.tar.gz", archive, file_sha256(archive)),
                Shell(f"rm -rf -- {q} && tar -xzf {packed} -C {shlex.quote(self.layout.builds)} && rm -f -- {packed}"),
                *proof,
                switch,
                *prune,
            )
        need = build_space(inputs)
        if facts.disk_free is not None and facts.disk_free < need:
            raise OperationError(
                f"{size_text(facts.disk_free)} free under {self.layout.builds}, a {inputs.backend} build "
                f"needs about {size_text(need)}: free space there or use another prefix"
            )
        # one compile per build directory at a time: after a dropped connection the old compile
        # may still be finishing on the host; a re-run waits for it instead of racing it
        lock = shlex.quote(f"{target}/.voltaforge-build.lock")  # goes with the build directory
        cmake = shlex.quote(require_cmake(facts))
        configure = Shell(
            f"mkdir -p -- {q} && {run} flock -w 900 {lock} {cmake} -S {src} -B {q} "
            f"{' '.join(shlex.quote(f) for f in inputs.flags)}"
        )
        build = Shell(
            f"{run} flock -w 900 {lock} {cmake} --build {q} --config Release -j {jobs} --target "
            f"{' '.join(shlex.quote(t) for t in inputs.targets)}"
        )
        why = (
            "an interrupted build of these inputs is resumed"
            if bid in facts.builds
            else f"no build of these inputs ({bid})"
        )
        record = Record(
            f"{target}/{builds.STAMP_NAME}", "the inputs and the proof", json.dumps(asdict(inputs), sort_keys=True)
        )
        keep: list[Command] = []
        if self.cache:
            keep = [
                # what a host runs (bin/: binaries and, for CUDA, the shared libraries) and the
                # stamp with the proof; not the objects, which are most of a build directory
                Shell(
                    f"tar -C {shlex.quote(self.layout.builds)} -czf {packed} "
                    f"{shlex.quote(bid + '/bin')} {shlex.quote(bid + '/' + builds.STAMP_NAME)}"
                ),
                Fetch(f"{self.layout.builds}/.{bid}.tar.gz", self.cache.archive(bid)),
                Shell(f"rm -f -- {packed}"),
            ]
        return Decision.act(why, configure, build, *proof, record, *keep, switch, *prune)

    def _proof(self, q: str, run: str, cuobjdump: str | None, inputs: BuildInputs, runnable: bool) -> list[Probe]:
        """The server runs and says its version; a CUDA build has real cubins for every arch."""
        # a CUDA llama-server needs the NVIDIA driver (libcuda) to start at all: on a build box
        # without a GPU its --version is recorded, not required; the cubins are the proof there
        proof = [Probe(f"{q}/bin/llama-server --version 2>&1", key="version", may_fail=not runnable)]
        if cuobjdump:
            wanted = tuple(f"sm_{a}" for a in (inputs.arch or "").split(";") if a)
            proof.append(
                Probe(f"{run} {shlex.quote(cuobjdump)} --list-elf {q}/bin/libggml-cuda.so", key="cubins", expect=wanted)
            )
        return proof

    def _prune(self, facts: BuildFacts, keep: str) -> list[Shell]:
        """Keep the new build and the one `current` points at now; remove the rest."""
        current = posixpath.basename(facts.current) if facts.current else None
        stale = [b for b in facts.builds if b not in (keep, current)]
        if not stale:
            return []
        paths = " ".join(shlex.quote(self.layout.build_dir(b)) for b in stale)
        return [Shell(f"rm -rf -- {paths}")]

    # -- acting ------------------------------------------------------------------------------

    def apply(self, host: Host, decision: Decision) -> None:
        run_proven(host, decision, stamp_bytes, after="re-run to resume it; current is unchanged")


def build_space(inputs: BuildInputs) -> int:
    """Free space a build directory needs, in bytes. Measured: the CPU build of every target is
    144 MiB; the sm_70 CUDA build's libggml-cuda.so alone is 195 MB, about as much again in
    objects (docs/knowledge.md, section 3). Twice that, and once more per extra arch."""
    if inputs.backend == "cpu":
        return 512 << 20
    return (1 << 30) * len((inputs.arch or "70").split(";"))


def build_failure(exc: HostError, after: str, during: str = "the build") -> HostError:
    """One line for the two ways a long build dies from outside: a full disk (the compiler's
    line names the file), a dropped connection. Anything else keeps its own message (a
    compile error's tail is what the user needs)."""
    text = str(exc)
    full = next((line for line in text.splitlines() if "No space left on device" in line), None)
    if full:
        return OperationError(f"disk full during {during} ({full.strip()[-160:]}): free space and {after}")
    if "lost while running" in text:
        return OperationError(f"{text.splitlines()[0]}: {after}")
    return exc


def run_proven(
    host: Host,
    decision: Decision,
    stamp: Callable[[Record, dict[str, str]], bytes],
    after: str | None = None,
) -> None:
    """Run a build's commands; the probes' outputs are checked and go into the stamp, which is
    written only after every probe passed (a build without a stamp does not count). ``after``:
    what to do once a full disk or a dropped connection killed a command (``build_failure``)."""
    try:
        _run_proven(host, decision, stamp)
    except OperationError:
        raise
    except HostError as exc:
        if after is None:
            raise
        raise build_failure(exc, after) from None


def _run_proven(host: Host, decision: Decision, stamp: Callable[[Record, dict[str, str]], bytes]) -> None:
    proof: dict[str, str] = {}
    for cmd in decision.commands:
        if isinstance(cmd, Probe):
            result = host.run(cmd.command, stream=False, check=not cmd.may_fail)
            proof[cmd.key] = result.stdout if result.ok else f"(exit {result.exited}) {result.stdout.strip()[-300:]}"
            if cmd.expect:
                check_cubins(proof[cmd.key], cmd.expect, cmd.what, cmd.after)
        elif isinstance(cmd, Record):
            host.write_file(cmd.path, stamp(cmd, proof), 0o644)
        else:
            run_command(host, cmd)


def check_cubins(
    listing: str,
    wanted: tuple[str, ...],
    what: str = "libggml-cuda.so",
    after: str = "the build is kept for inspection and current is unchanged",
) -> None:
    """Real cubins for every planned arch, not only PTX (PTX alone means a JIT at first start,
    or "no kernel image is available" when the PTX is newer than the driver)."""
    archs = cuda.parse_cuobjdump_list_elf(listing)
    missing = sorted(set(wanted) - archs)
    if missing:
        raise OperationError(
            f"{what} has no {', '.join(missing)} cubins (found: {', '.join(sorted(archs)) or 'none'}): {after}"
        )


def stamp_bytes(record: Record, proof: dict[str, str]) -> bytes:
    version = proof.get("version", "")
    line = next((x for x in version.splitlines() if x.startswith("version:")), version.strip())
    stamp = {
        "id": posixpath.basename(posixpath.dirname(record.path)),
        "built_at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "inputs": json.loads(record.meta) if record.meta else None,
        "llama_server_version": line.removeprefix("version:").strip(),
        "cubins": sorted(cuda.parse_cuobjdump_list_elf(proof["cubins"])) if "cubins" in proof else None,
    }
    return (json.dumps(stamp, indent=2, sort_keys=True) + "\n").encode()


def build_ops(
    layout: BuildLayout,
    source: Source,
    *,
    cuda_release: tuple[int, int] | None,
    recipe_arch: str,
    targets: tuple[str, ...] = LLAMACPP_TARGETS,
    extra_flags: tuple[str, ...] = (),
    owner: str | None = None,
    sudo: bool = False,
    cache: FleetCache | None = None,
) -> list[Operation]:
    """The build step as operations: directories, the archive pushed (checksummed), the tree
    unpacked, the proven build switched in."""
    return [
        EnsureDirectory(layout.prefix, 0o755, owner=owner if sudo else None, sudo=sudo),
        EnsureDirectory(layout.src, 0o755),
        EnsureDirectory(layout.builds, 0o755),
        EnsureFile(layout.archive(source), source.archive.read_bytes(), 0o644),
        EnsureSourceTree(layout, source),
        EnsureLlamacppBuild(
            layout,
            source,
            cuda_release=cuda_release,
            recipe_arch=recipe_arch,
            targets=targets,
            extra_flags=extra_flags,
            cache=cache,
        ),
    ]
