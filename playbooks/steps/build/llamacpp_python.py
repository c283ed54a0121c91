"""llama-cpp-python in the toolchain venv, on the server build's own libraries: one compile
of llama.cpp per host.

The quantize step loads every GGUF it makes through these bindings before the file counts,
and users get Python bindings whose kernels are the server's. Both come from one compile:

- the bindings are the pinned sdist's Python package built with its own compile of llama.cpp
  switched off (``-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF``, the sdist's CMake options): a wheel of
  about 140 KB, made in seconds, with no native code;
- their library directory, ``llama_cpp/lib`` in the venv, is a link to
  ``<prefix>/llama.cpp/current/bin``, where the server's build keeps ``libllama.so`` and the
  ggml libraries (shared, from the same archive, flags and arch; see ``build.cmake_flags``).

So the bindings load exactly what the server runs, and when ``current`` switches to a new
build they follow it through the link: the next run re-proves them (the import check, about a
second) without pip. Measured on this machine (2 cores): the bindings' own compile of the
same tree took 3-5 minutes before; the wheel now takes about 6 s.

Decisions recorded here:
- A link, not ``LLAMA_CPP_LIB_PATH``: the pinned version's ``llama_cpp.py`` honours that
  variable but its ``_ggml.py`` always loads from the package's ``lib/``, so the variable would
  split one process between two builds' libraries, and every caller would have to set it.
- The proof is the server's: its build already listed real cubins for every planned arch in
  ``libggml-cuda.so``, the very file the bindings load. Here the import must work, say its
  version and report the library it loaded, which must be the current build's (recorded in the
  stamp with the build it was proven against). A CUDA build imports only where the driver is
  (libcuda): on a build box without a GPU the import is recorded, not required, as for the
  server.
- The bindings' Python dependencies (numpy, jinja2, diskcache, typing-extensions) and their
  build backend (scikit-build-core) come from the host's package index, as torch does in
  ``invoke toolchain``; the package comes only from the pushed archive.
- ``--no-cache-dir``: pip would otherwise reuse a wheel it built earlier with other
  ``CMAKE_ARGS`` (its cache key is the archive, not the environment).
"""

from __future__ import annotations

import json
import posixpath
import shlex
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import Any

from playbooks.facts import builds, gpu, python, read_fact
from playbooks.host.base import Host
from playbooks.host.ops import Decision, Operation, OperationError, Record, Shell
from playbooks.steps.build.build import BuildLayout
from playbooks.steps.build.buildenv import SYSTEM_PATH, env_prefix
from playbooks.steps.build.llamacpp_source import Source
from playbooks.steps.build.proven_build import Probe, inputs_id, run_proven
from playbooks.steps.build.toolchain import EnsureVenv

DIST = "llama_cpp_python"
STAMP_NAME = "voltaforge-llama-cpp-python.json"
#: the sdist's own switches: no compile of llama.cpp, no multimodal library
CMAKE_ARGS = ("-DLLAMA_BUILD=OFF", "-DLLAVA_BUILD=OFF")
#: what the proof prints: the version, the backends the library was built with, and the file
#: the bindings really loaded (the link resolved)
IMPORT_CHECK = (
    "import os, llama_cpp; print('version:', llama_cpp.__version__); "
    "print('library:', os.path.realpath(llama_cpp.llama_cpp._lib._name)); "
    "print(llama_cpp.llama_print_system_info().decode())"
)


def package_dirs(venv: str) -> str:
    """The bindings' package directory in the venv, as a shell glob (python3.X)."""
    return f"{shlex.quote(venv)}/lib/python3*/site-packages/llama_cpp"


@dataclass(frozen=True)
class BindingsInputs:
    venv: str
    version: str  # the sdist's: 0.3.36
    ref: str
    source_sha256: str
    cmake_args: tuple[str, ...]
    libs: str  # where the library link points: <prefix>/llama.cpp/current/bin

    @property
    def build_id(self) -> str:
        return inputs_id(self.version, asdict(self))


@dataclass(frozen=True)
class BindingsFacts:
    installed: str | None = None  # the llama_cpp_python version in the venv
    stamp: dict[str, Any] | None = None
    link: str | None = None  # where llama_cpp/lib points (None: no link)
    current: str | None = None  # the server build `current` points at
    gpus: gpu.GpuFacts = gpu.GpuFacts(available=False, reason="not read")


class EnsureLlamaCppPython(Operation):
    """The venv holds llama-cpp-python from the pinned sdist, on the current server build's
    libraries, proven."""

    def __init__(self, layout: BuildLayout, source: Source, venv: str, *, cuda: bool):
        self.layout, self.source, self.venv, self.cuda = layout, source, venv, cuda
        self.version = source.requirement.partition("==")[2]
        self.stamp_path = f"{venv}/{STAMP_NAME}"
        self.libs = f"{layout.current}/bin"
        self.name = f"Ensure llama-cpp-python {self.version} is in the venv, on llama.cpp's current build"

    def read(self, host: Host) -> BindingsFacts:
        link = read_fact(host, f"readlink -- {package_dirs(self.venv)}/lib 2>/dev/null || true")
        return BindingsFacts(
            installed=python.read_package_version(host, self.venv, DIST),
            stamp=builds.parse_stamp(read_fact(host, f"cat -- {shlex.quote(self.stamp_path)} 2>/dev/null || true")),
            link=builds.parse_readlink(link),
            current=builds.parse_readlink(read_fact(host, builds.readlink_command(self.layout.current))),
            gpus=(
                gpu.parse_nvidia_smi_csv(read_fact(host, gpu.NVIDIA_SMI_CSV_COMMAND))
                if self.cuda
                else gpu.GpuFacts(available=False, reason="a CPU build")
            ),
        )

    def inputs(self) -> BindingsInputs:
        return BindingsInputs(self.venv, self.version, self.source.ref, self.source.sha256, CMAKE_ARGS, self.libs)

    def decide(self, facts: BindingsFacts) -> Decision:
        inputs = self.inputs()
        bid = inputs.build_id
        stamp = facts.stamp or {}
        server = posixpath.basename(facts.current) if facts.current else None
        installed = stamp.get("id") == bid and facts.installed == self.version
        if installed and facts.link == self.libs and server and stamp.get("server_build") == server:
            return Decision.ok(f"built {stamp.get('built_at', '?')}, {bid}, on build {server}")
        pkg = package_dirs(self.venv)
        link = Shell(f'for d in {pkg}; do rm -rf -- "$d/lib" && ln -s -- {shlex.quote(self.libs)} "$d/lib"; done')
        # a CUDA build imports only where the driver is (libcuda): recorded, not required, on a
        # build box without a GPU, where the server build's cubins are the proof
        probe = Probe(
            f"{shlex.quote(self.venv + '/bin/python')} -c {shlex.quote(IMPORT_CHECK)} 2>&1",
            key="version",
            may_fail=self.cuda and not facts.gpus.available,
        )
        meta = {"inputs": asdict(inputs), "builds": self.layout.builds, "server": server}
        record = Record(self.stamp_path, "the inputs and the proof", json.dumps(meta, sort_keys=True))
        if installed:
            if not server:
                why = f"{self.layout.current} points at no build yet"
            elif facts.link != self.libs:
                why = f"its library link points at {facts.link or 'nothing'}, want {self.libs}"
            else:
                why = f"the server build switched from {stamp.get('server_build')} to {server}: followed, not rebuilt"
            return Decision.act(why, *([] if facts.link == self.libs else [link]), probe, record)
        if facts.installed is None:
            why = "not installed"
        elif facts.installed != self.version:
            why = f"{facts.installed} installed, want {self.version}"
        elif not stamp:
            why = f"{facts.installed} installed without a proof of how it was built"
        else:
            why = f"built from other inputs ({stamp.get('id')}), want {bid}"
        wheels = f"{self.layout.src}/wheels/{bid}"
        make_dir = Shell(f"rm -rf -- {shlex.quote(wheels)} && mkdir -p -- {shlex.quote(wheels)}")
        # the system PATH only: no toolkit is involved, and a CUDA 13 first on PATH must not be
        env = {"PATH": ":".join(SYSTEM_PATH), "CMAKE_ARGS": " ".join(CMAKE_ARGS)}
        build = [f"{self.venv}/bin/pip", "wheel", "--disable-pip-version-check", "--no-cache-dir", "--no-deps"]
        build += ["-w", wheels, self.layout.archive(self.source)]
        pip = [f"{self.venv}/bin/pip", "install", "--disable-pip-version-check", "--no-cache-dir"]
        if facts.installed:
            pip += ["--force-reinstall", "--no-deps"]  # its dependencies are already there
        install = Shell(
            f"{' '.join(shlex.quote(a) for a in pip)} {shlex.quote(wheels)}/{DIST}-{shlex.quote(self.version)}-*.whl"
        )
        wheel = Shell(f"{env_prefix(env)} {' '.join(shlex.quote(a) for a in build)}")
        return Decision.act(why, make_dir, wheel, install, link, probe, record)

    def apply(self, host: Host, decision: Decision) -> None:
        run_proven(host, decision, bindings_stamp, after="re-run `invoke build` (the server build is not affected)")


def bindings_stamp(record: Record, proof: dict[str, str]) -> bytes:
    """The stamp: the inputs, the server build the bindings were proven on, and what the import
    said. A library loaded from anywhere but that build is refused (the link went astray)."""
    meta = json.loads(record.meta)
    inputs = meta["inputs"]
    fields = BindingsInputs(**{**inputs, "cmake_args": tuple(inputs["cmake_args"])})
    lines = proof.get("version", "").strip().splitlines()

    def said(key: str) -> str | None:
        found = next((x for x in lines if x.startswith(f"{key}:")), None)
        return found.removeprefix(f"{key}:").strip() if found else None

    library = said("library")
    server = meta.get("server")  # what `current` pointed at, where the import could not run
    if library:
        rel = posixpath.relpath(library, meta["builds"])
        server = rel.split("/", 1)[0]
        # the link resolved: <builds>/<id>/bin/libllama.so.0.5.0
        if rel.startswith("..") or not rel.startswith(f"{server}/bin/libllama.so"):
            raise OperationError(
                f"the bindings loaded {library}, not a build under {meta['builds']}: "
                f"{fields.venv}'s llama_cpp/lib must link to {fields.libs}"
            )
    stamp = {
        "id": fields.build_id,
        "built_at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "inputs": inputs,
        "import": said("version") or "\n".join(lines)[-300:],
        "library": library,
        "server_build": server,
        "system_info": next((x for x in lines if "CPU :" in x or "CUDA :" in x), None),
    }
    return (json.dumps(stamp, indent=2, sort_keys=True) + "\n").encode()


def bindings_ops(layout: BuildLayout, source: Source, venv: str, *, cuda: bool) -> list[Operation]:
    """After the server build (which pushed and checked the archive): the venv, the bindings."""
    return [EnsureVenv(venv), EnsureLlamaCppPython(layout, source, venv, cuda=cuda)]
