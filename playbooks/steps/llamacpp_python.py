"""llama-cpp-python in the toolchain venv, built from the same pinned sdist as the server.

The quantize step loads every GGUF it makes through these bindings before the file counts,
and users get Python bindings whose kernels match the server's: so they are compiled from the
very archive the server was built from (the sdist vendors the llama.cpp tree), in the same
build environment (``compile_env``: one toolkit, the host's arch, the same host compiler),
with ``CMAKE_ARGS`` carrying the same CUDA flags and ``FORCE_CMAKE=1``.

The same rules as the server build: a stamp in the venv names a hash of the inputs and holds
the proof (the import works and says its version; a CUDA build's ``libggml-cuda.so`` has real
cubins for every planned arch). Same inputs: ``ok`` without pip. New inputs: pip reinstalls.

Decisions recorded here:
- ``LLAVA_BUILD=OFF``: the multimodal library is not used by voltaforge (it serves text
  models) and is a third of the compile; ``llama_cpp`` imports it lazily, so nothing breaks.
- The bindings' Python dependencies (numpy, jinja2, diskcache, typing-extensions) and their
  build backend (scikit-build-core) come from the host's package index, as torch does in
  ``invoke toolchain``; the native code comes only from the pushed archive.
- ``--no-cache-dir``: pip would otherwise reuse a wheel it built earlier with other
  ``CMAKE_ARGS`` (its cache key is the archive, not the environment).
"""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from playbooks.errors import HostError
from playbooks.facts import builds, cuda, python, read_fact
from playbooks.host.base import Host
from playbooks.host.ops import Decision, Fetch, Operation, PushFile, Record, Shell
from playbooks.steps.build import BuildLayout
from playbooks.steps.buildenv import BuildFacts, env_prefix, llamacpp_compile_env, read_compile_facts
from playbooks.steps.fleet_cache import FleetCache
from playbooks.steps.llamacpp_source import Source, file_sha256
from playbooks.steps.proven_build import Probe, inputs_id, run_proven
from playbooks.steps.toolchain import EnsureVenv

DIST = "llama_cpp_python"
STAMP_NAME = "voltaforge-llama-cpp-python.json"
IMPORT_CHECK = (
    "import llama_cpp; print('version:', llama_cpp.__version__); print(llama_cpp.llama_print_system_info().decode())"
)


def bindings_cmake_args(arch: str | None, host_compiler: str | None) -> tuple[str, ...]:
    """The server's kernels for the bindings: same CUDA switch, arch list and host compiler;
    shared libraries (the bindings load them with ctypes), no multimodal library."""
    args = ["-DGGML_NATIVE=OFF", "-DLLAVA_BUILD=OFF"]
    if arch:
        args += ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={arch}"]
        if host_compiler:
            args.append(f"-DCMAKE_CUDA_HOST_COMPILER={host_compiler}")
    else:
        args.append("-DGGML_CUDA=OFF")
    return tuple(args)


@dataclass(frozen=True)
class BindingsInputs:
    venv: str
    version: str  # the sdist's: 0.3.36
    ref: str
    source_sha256: str
    backend: str
    arch: str | None
    toolkit: str | None
    compiler: str
    cmake_args: tuple[str, ...]

    @property
    def build_id(self) -> str:
        return inputs_id(f"{self.version}-{self.backend}", asdict(self))


@dataclass(frozen=True)
class BindingsFacts:
    compile: BuildFacts = field(default_factory=BuildFacts)
    installed: str | None = None  # the llama_cpp_python version in the venv
    stamp: dict[str, Any] | None = None
    #: what a wheel built here is bound to: "cpython-311 linux-x86_64 glibc-2.36" (None: no venv yet)
    abi: str | None = None


#: the venv's interpreter, platform and C library: a wheel built for one runs on the other
#: exactly when these and the build inputs (less the venv's path) are the same
ABI_CODE = (
    "import platform, sys, sysconfig; "
    "print(sys.implementation.cache_tag, sysconfig.get_platform(), 'glibc-' + platform.libc_ver()[1])"
)


def parse_abi(output: str) -> str | None:
    line = output.strip()
    return line if line.startswith("cpython-") and len(line.split()) == 3 else None


def wheel_key(inputs: BindingsInputs, abi: str) -> str:
    """The fleet cache's name for a wheel: the build inputs without the venv's path (a wheel
    is relocatable) and the ABI it was built for."""
    return inputs_id(f"{inputs.version}-{inputs.backend}", {**asdict(inputs), "venv": None, "abi": abi})


class EnsureLlamaCppPython(Operation):
    """The venv holds llama-cpp-python built from the pinned sdist for this host, proven."""

    def __init__(
        self,
        layout: BuildLayout,
        source: Source,
        venv: str,
        *,
        cuda_release: tuple[int, int] | None,
        recipe_arch: str,
        cache: FleetCache | None = None,
    ):
        self.layout, self.source, self.venv, self.cache = layout, source, venv, cache
        self.cuda_release, self.recipe_arch = cuda_release, recipe_arch
        self.version = source.requirement.partition("==")[2]
        self.stamp_path = f"{venv}/{STAMP_NAME}"
        kind = "CUDA" if cuda_release else "CPU"
        self.name = f"Ensure llama-cpp-python {self.version} ({kind}, llama.cpp {source.ref}) is in the venv"

    def read(self, host: Host) -> BindingsFacts:
        return BindingsFacts(
            compile=read_compile_facts(host, cuda_build=bool(self.cuda_release)),
            installed=python.parse_package_version(read_fact(host, python.package_version_command(self.venv, DIST))),
            stamp=builds.parse_stamp(read_fact(host, f"cat -- {shlex.quote(self.stamp_path)} 2>/dev/null || true")),
            abi=parse_abi(
                read_fact(
                    host, f"{shlex.quote(self.venv + '/bin/python')} -c {shlex.quote(ABI_CODE)} 2>/dev/null || true"
                )
            ),
        )

    def plan(self, facts: BindingsFacts) -> tuple[BindingsInputs, dict[str, str], str | None]:
        ce = llamacpp_compile_env(facts.compile, self.cuda_release, self.recipe_arch, self.source.ref)
        inputs = BindingsInputs(
            self.venv,
            self.version,
            self.source.ref,
            self.source.sha256,
            ce.backend,
            ce.arch,
            ce.toolkit,
            ce.compiler,
            bindings_cmake_args(ce.arch, ce.host_compiler),
        )
        return inputs, ce.env, ce.cuobjdump

    def decide(self, facts: BindingsFacts) -> Decision:
        inputs, env, cuobjdump = self.plan(facts)
        bid = inputs.build_id
        stamp = facts.stamp or {}
        if stamp.get("id") == bid and facts.installed == self.version:
            return Decision.ok(f"built {stamp.get('built_at', '?')}, {bid}")
        if facts.installed is None:
            why = "not installed"
        elif facts.installed != self.version:
            why = f"{facts.installed} installed, want {self.version}"
        elif not stamp:
            why = f"{facts.installed} installed without a proof of how it was built"
        else:
            why = f"built from other inputs ({stamp.get('id')}), want {bid}"
        build_env = {
            **env,
            "CMAKE_ARGS": " ".join(inputs.cmake_args),
            "FORCE_CMAKE": "1",
            "CMAKE_BUILD_PARALLEL_LEVEL": str(facts.compile.nproc or 2),
            **({"CCACHE_DIR": self.layout.ccache_dir} if facts.compile.ccache else {}),
        }
        pip = [f"{self.venv}/bin/pip", "install", "--disable-pip-version-check", "--no-cache-dir"]
        if facts.installed:
            pip += ["--force-reinstall", "--no-deps"]  # its dependencies are already there
        key = wheel_key(inputs, facts.abi) if facts.abi else None
        cached = self.cache.wheel(key) if self.cache and key else None
        wheels = f"{self.layout.src}/wheels/{key or bid}"
        make_dir = Shell(f"rm -rf -- {shlex.quote(wheels)} && mkdir -p -- {shlex.quote(wheels)}")
        steps: list[Shell | PushFile] = [make_dir]
        if cached:
            # a proven wheel of the same inputs and ABI, from another host of the fleet
            why += "; the controller's fleet cache holds this build's wheel: pushed, not compiled"
            steps.append(PushFile(f"{wheels}/{cached.name}", cached, file_sha256(cached)))
        else:
            # built as a wheel first, so that the fleet cache can keep it for the next host
            build = [f"{self.venv}/bin/pip", "wheel", "--disable-pip-version-check", "--no-cache-dir", "--no-deps"]
            build += ["-v", "-w", wheels, self.layout.archive(self.source)]
            steps.append(Shell(f"{env_prefix(build_env)} {' '.join(shlex.quote(a) for a in build)}"))
        install = Shell(
            f"{' '.join(shlex.quote(a) for a in pip)} {shlex.quote(wheels)}/{DIST}-{shlex.quote(self.version)}-*.whl"
        )
        # a CUDA build imports only where the driver is (libcuda): recorded, not required, on a
        # build box without a GPU, where the cubins are the proof (as for the server)
        runnable = not cuobjdump or facts.compile.gpus.available
        proof = [
            Probe(
                f"{shlex.quote(self.venv + '/bin/python')} -c {shlex.quote(IMPORT_CHECK)} 2>&1",
                key="version",
                may_fail=not runnable,
            )
        ]
        if cuobjdump:
            lib = f"{shlex.quote(self.venv)}/lib/python3*/site-packages/llama_cpp/lib/libggml-cuda.so"
            proof.append(
                Probe(
                    f"{env_prefix(env)} {shlex.quote(cuobjdump)} --list-elf {lib}",
                    key="cubins",
                    expect=tuple(f"sm_{a}" for a in (inputs.arch or "").split(";") if a),
                    what="llama-cpp-python's libggml-cuda.so",
                    after="the venv has bindings that would JIT or fail on this GPU: fix the toolkit and re-run",
                )
            )
        record = Record(self.stamp_path, "the inputs and the proof", json.dumps(asdict(inputs), sort_keys=True))
        keep = [Fetch(f"{wheels}/*.whl", self.cache.wheel_dir(key))] if self.cache and key and not cached else []
        return Decision.act(why, *steps, install, *proof, record, *keep)

    def apply(self, host: Host, decision: Decision) -> None:
        fetch = [c for c in decision.commands if isinstance(c, Fetch)]
        rest = Decision(tuple(c for c in decision.commands if not isinstance(c, Fetch)), decision.reason)
        run_proven(host, rest, bindings_stamp, after="re-run `invoke build` (the server build is not affected)")
        for f in fetch:  # proven: the wheel goes into the fleet cache (a failure here costs a compile later)
            keep_wheel(host, f.path.rsplit("/", 1)[0], f.local)


def keep_wheel(host: Host, wheels: str, into: Path) -> None:
    """Copy the proven wheel from the host into the fleet cache, whole or not at all."""
    found = host.run(f"ls -1 -- {shlex.quote(wheels)}/*.whl 2>/dev/null || true", stream=False).stdout.split()
    if len(found) != 1:
        return
    into.mkdir(parents=True, exist_ok=True)
    tmp = into / f".{Path(found[0]).name}.partial"
    try:
        host.get(found[0], tmp)
        tmp.replace(into / Path(found[0]).name)
    except (HostError, OSError) as exc:
        tmp.unlink(missing_ok=True)
        host.printer.line(host.name, f"the wheel was not kept in the fleet cache: {exc}")


def bindings_stamp(record: Record, proof: dict[str, str]) -> bytes:
    inputs = json.loads(record.meta)
    fields = BindingsInputs(**{**inputs, "cmake_args": tuple(inputs["cmake_args"])})
    lines = proof.get("version", "").strip().splitlines()
    version = next((x for x in lines if x.startswith("version:")), "")
    stamp = {
        "id": fields.build_id,
        "built_at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "inputs": inputs,
        "import": version.removeprefix("version:").strip() or "\n".join(lines)[-300:],
        "system_info": next((x for x in lines if "CPU :" in x or "CUDA :" in x), None),
        "cubins": sorted(cuda.parse_cuobjdump_list_elf(proof["cubins"])) if "cubins" in proof else None,
    }
    return (json.dumps(stamp, indent=2, sort_keys=True) + "\n").encode()


def bindings_ops(
    layout: BuildLayout,
    source: Source,
    venv: str,
    *,
    cuda_release: tuple[int, int] | None,
    recipe_arch: str,
    cache: FleetCache | None = None,
) -> list[Operation]:
    """After the server build (which pushed and checked the archive): the venv, the bindings."""
    return [
        EnsureVenv(venv),
        EnsureLlamaCppPython(layout, source, venv, cuda_release=cuda_release, recipe_arch=recipe_arch, cache=cache),
    ]
