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

import json
import posixpath
import shlex
from dataclasses import asdict, dataclass, replace

from playbooks.facts import builds, read_fact, system
from playbooks.host.base import Host
from playbooks.host.ops import (
    Command,
    Decision,
    EnsureDirectory,
    EnsurePushedFile,
    Fetch,
    Operation,
    OperationError,
    PushFile,
    Record,
    Shell,
)
from playbooks.plan.gpus import size_text
from playbooks.steps.build.buildenv import (
    BuildFacts,
    env_prefix,
    generator_flags,
    llamacpp_compile_env,
    read_compile_facts,
    require_cmake,
)
from playbooks.steps.build.fleet_cache import FleetCache
from playbooks.steps.build.llamacpp_source import Source, file_sha256
from playbooks.steps.build.proven_build import Probe, inputs_id, run_proven, stamp_bytes

#: What the later steps run: serve, quantize (+ imatrix), measure quality and speed.
LLAMACPP_TARGETS = (
    "llama-server",
    "llama-quantize",
    "llama-imatrix",
    "llama-perplexity",
    "llama-bench",
    "llama-batched-bench",
    # an RPC worker (`invoke rpc-worker`): every host builds it, so a worker runs the same
    # build as the server that dials it (the RPC protocol is llama.cpp's own, per version)
    "ggml-rpc-server",
)
KEEP_BUILDS = 2


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
        return inputs_id(f"{self.ref}-{self.backend}", asdict(self))


def cmake_flags(cuda_arch: str | None, host_compiler: str | None = None) -> tuple[str, ...]:
    flags = [
        "-DCMAKE_BUILD_TYPE=Release",
        "-DGGML_NATIVE=OFF",
        "-DLLAMA_OPENSSL=OFF",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        # the server runs with --no-webui: no download of prebuilt web UI assets at build time
        # (offline it printed "UI: download dist.tar.gz.sha256 ... failed" into every build)
        "-DLLAMA_USE_PREBUILT_UI=OFF",
        # llama-server's --rpc and the ggml-rpc-server worker (a split across hosts)
        "-DGGML_RPC=ON",
    ]
    if cuda_arch:
        flags += ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={cuda_arch}"]
        if host_compiler:
            flags.append(f"-DCMAKE_CUDA_HOST_COMPILER={host_compiler}")
    else:
        # shared libraries (llama.cpp's default, as for CUDA): the Python bindings load the
        # server build's libllama.so instead of compiling the tree a second time
        # (llamacpp_python.py); without OpenMP: no libgomp needed where the build runs
        flags += ["-DGGML_CUDA=OFF", "-DGGML_OPENMP=OFF"]
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
        EnsurePushedFile(layout.archive(source), source.archive, source.sha256),
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
