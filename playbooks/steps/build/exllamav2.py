"""ExLlamaV2 in the toolchain venv, its CUDA extension compiled ahead of time for the host's arch.

exllamav2 0.3.2 is on the package index only as a pure-Python wheel: its extension
(``exllamav2_ext``) is compiled by torch's ``cpp_extension.load`` at the first import, for
minutes (9 min 8 s measured for one arch on 2 cores, docs/knowledge.md section 3), and for
whatever arch torch guesses. A server must not do that. So this step:

1. installs the pinned exllamav2 (and ``tokenizers``, which its import needs but its metadata
   omits) beside the pinned torch, which it must not move;
2. runs that same JIT build once, here, in ``buildenv``'s environment (one toolkit: the
   pinned nvcc, never PATH's), with ``TORCH_CUDA_ARCH_LIST`` from the host's GPUs (the
   recipe's cuda_arch when none is visible) and ``MAX_JOBS`` = the host's cores, into a build
   directory named by the inputs (an interrupted build resumes through ninja);
3. installs the result as a top-level module in the venv: exllamav2's ``ext.py`` imports a
   ready ``exllamav2_ext`` before it considers compiling, so the server never JITs;
4. proves it: ``import torch, exllamav2_ext, exllamav2`` in the venv, and real cubins for
   every planned arch in the module (``cuobjdump --list-elf``), recorded in a stamp.

torch's cpp_extension refuses an nvcc of another CUDA major than torch's own, so the pinned
torch's CUDA (``+cu118``) must match the pinned toolkit (11.8): checked before anything runs.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any

from packaging.version import InvalidVersion, Version

from playbooks.config.recipe import Toolchain
from playbooks.facts import builds, cuda, python, read_fact
from playbooks.host.base import Host
from playbooks.host.ops import Decision, Operation, OperationError, Record, Shell
from playbooks.steps.build.buildenv import BuildFacts, compile_env, env_prefix, read_compile_facts, torch_arch_list
from playbooks.steps.build.proven_build import Probe, inputs_id, run_proven
from playbooks.steps.build.toolchain import pip_install_keeping_torch

EXT = "exllamav2_ext"
#: torch's cpp_extension builds with ninja; pip's wheel puts it in the venv's bin/
NINJA = "ninja"
STAMP_NAME = "voltaforge-exllamav2.json"
PROOF = (
    "import torch, exllamav2_ext, exllamav2; print('version:', exllamav2.__version__); "
    "print('ext:', exllamav2_ext.__file__); print('torch:', torch.__version__, torch.version.cuda)"
)


@dataclass(frozen=True)
class ExtInputs:
    venv: str
    exllamav2: str
    torch: str
    arch: str  # TORCH_CUDA_ARCH_LIST: "7.0"
    toolkit: str | None
    compiler: str

    @property
    def build_id(self) -> str:
        return inputs_id(self.exllamav2, asdict(self))


@dataclass(frozen=True)
class ExtFacts:
    compile: BuildFacts = field(default_factory=BuildFacts)
    torch: str | None = None
    torch_cuda: tuple[int, int] | None = None  # torch.version.cuda
    installed: str | None = None  # exllamav2's version in the venv
    stamp: dict[str, Any] | None = None
    ninja: bool = True  # the venv's bin/ninja (pip's wheel): the JIT build runs that one


class EnsureExllamav2(Operation):
    """The venv holds the pinned exllamav2 with its extension built for this host, proven."""

    def __init__(self, prefix: str, venv: str, tc: Toolchain):
        self.prefix, self.venv, self.tc = prefix, venv, tc
        major, minor = (int(x) for x in tc.cuda.split("."))  # the recipe schema checks MAJOR.MINOR
        self.cuda_release = (major, minor)
        self.stamp_path = f"{venv}/{STAMP_NAME}"
        self.name = f"Ensure exllamav2 {tc.exllamav2} and its extension are built for this GPU"

    def read(self, host: Host) -> ExtFacts:
        def version(package: str) -> str | None:
            return python.read_package_version(host, self.venv, package)

        return ExtFacts(
            compile=read_compile_facts(host, cuda_build=True),
            torch=version("torch"),
            torch_cuda=python.parse_torch_cuda(read_fact(host, python.torch_cuda_command(self.venv))),
            installed=version("exllamav2"),
            stamp=builds.parse_stamp(read_fact(host, f"cat -- {shlex.quote(self.stamp_path)} 2>/dev/null || true")),
            ninja=read_fact(host, f"test -x {shlex.quote(self.venv + '/bin/ninja')} && echo yes || true").strip()
            == "yes",
        )

    def plan(self, facts: ExtFacts) -> tuple[ExtInputs, dict[str, str], str]:
        if facts.torch is None:
            raise OperationError(f"no torch in {self.venv}: run `invoke toolchain` first (exllamav2 builds against it)")
        if not same_release(facts.torch, self.tc.torch):
            raise OperationError(
                f"torch {facts.torch} is in {self.venv}, the recipe pins {self.tc.torch}: run `invoke toolchain`"
            )
        ce = compile_env(facts.compile, self.cuda_release, self.tc.cuda_arch)
        assert ce.arch and ce.cuobjdump  # a CUDA compile env always has both
        built_for = facts.torch_cuda
        if built_for is None:
            raise OperationError(f"torch {facts.torch} has no CUDA: exllamav2's extension needs a CUDA build of torch")
        if ce.release and built_for[0] != ce.release[0]:
            raise OperationError(
                f"torch {facts.torch} was built with CUDA {built_for[0]}.{built_for[1]}, the toolkit is "
                f"{ce.release[0]}.{ce.release[1]}: torch's cpp_extension refuses another CUDA major; "
                f"pin a +cu{ce.release[0]}x torch"
            )
        arch = torch_arch_list(ce.arch)
        inputs = ExtInputs(self.venv, self.tc.exllamav2, facts.torch, arch, ce.toolkit, ce.compiler)
        return inputs, {**ce.env, "TORCH_CUDA_ARCH_LIST": arch}, ce.cuobjdump

    def decide(self, facts: ExtFacts) -> Decision:
        inputs, env, cuobjdump = self.plan(facts)
        bid = inputs.build_id
        stamp = facts.stamp or {}
        if stamp.get("id") == bid and facts.installed == self.tc.exllamav2:
            return Decision.ok(f"built {stamp.get('built_at', '?')}, {bid} ({inputs.arch})")
        commands: list[Shell | Record] = []
        if facts.installed != self.tc.exllamav2 or not facts.ninja:
            why = (
                f"exllamav2 is {facts.installed or 'not installed'}, want {self.tc.exllamav2}"
                if facts.installed != self.tc.exllamav2
                else f"no ninja in {self.venv}/bin (the extension's build runs it from there)"
            )
            # tokenizers: exllamav2's import needs it, its metadata omits it
            # ninja: the JIT build runs it from the venv (jit_env), never whatever apt installed
            commands.append(
                Shell(
                    pip_install_keeping_torch(
                        self.venv, self.tc, f"exllamav2=={self.tc.exllamav2}", "tokenizers", NINJA
                    )
                )
            )
        else:
            why = "its extension is not built for these inputs" if not stamp else f"built from other inputs ({bid} now)"
        py = shlex.quote(self.venv + "/bin/python")
        site = f"$({py} -c 'import sysconfig; print(sysconfig.get_paths()[\"platlib\"])')"
        ext_dir = f"{self.prefix}/exllamav2/ext/{bid}"
        built = shlex.quote(f"{ext_dir}/{EXT}/{EXT}.so")
        jit = jit_env(env, self.venv, ext_dir, facts.compile.nproc or 2)
        commands += [
            # a module from other inputs would be imported instead of building (ext.py tries it first)
            Shell(f'site={site} && rm -f -- "$site"/{EXT}*.so'),
            Shell(f"mkdir -p -- {shlex.quote(ext_dir)} && {env_prefix(jit)} {py} -c 'import exllamav2.ext'"),
            Shell(
                f'site={site} && cp -f -- {built} "$site"/.{EXT}.so.new && '
                f'mv -f -- "$site"/.{EXT}.so.new "$site"/{EXT}.so'
            ),
        ]
        lib = ext_module(self.venv)
        proof = [
            Probe(f"{py} -c {shlex.quote(PROOF)} 2>&1", key="version"),
            Probe(
                f"{env_prefix(env)} {shlex.quote(cuobjdump)} --list-elf {lib}",
                key="cubins",
                expect=tuple(f"sm_{a}" for a in cubin_archs(inputs.arch)),
                what=f"{EXT}.so",
                after="exllamav2 would JIT or fail on this GPU: fix the toolkit or the arch and re-run",
            ),
        ]
        record = Record(self.stamp_path, "the inputs and the proof", json.dumps(asdict(inputs), sort_keys=True))
        return Decision.act(why, *commands, *proof, record)

    def apply(self, host: Host, decision: Decision) -> None:
        run_proven(host, decision, ext_stamp, after="re-run to resume the extension build")


def ext_module(venv: str) -> str:
    """Where this step installs the built module: a shell glob (the venv's python3.X), quoted."""
    return f"{shlex.quote(venv)}/lib/python3*/site-packages/{EXT}.so"


def same_release(installed: str, pinned: str) -> bool:
    """The installed torch is the pinned one, compared as pip compares versions: the public
    version only. The pin carries torch.__version__'s local tag (``2.7.1+cu118``), the installed
    distribution may not (PyPI's ``2.11.0`` is ``2.11.0+cu130`` at run time); which CUDA torch
    was built with is decided apart, from torch.version.cuda against the toolkit's major."""
    try:
        return Version(installed).public == Version(pinned).public
    except InvalidVersion:
        return installed == pinned


def jit_env(env: dict[str, str], venv: str, ext_dir: str, jobs: int) -> dict[str, str]:
    """The extension's JIT build environment: ``compile_env``'s (one toolkit, system directories)
    with the venv's ``bin/`` right after the toolkit's own directory, because torch's
    cpp_extension runs ``ninja`` from PATH and the only ninja this step can count on is the
    venv's (pip's wheel, a requirement of exllamav2): a host's apt may have none (a lent H200's
    image had none: "Ninja is required to load C++ extensions"). The venv's bin/ holds no nvcc or
    ptxas (pip's CUDA wheels keep theirs under site-packages), so the one-toolkit rule holds."""
    path = env.get("PATH", "").split(":")
    own = path[:1] if env.get("CUDA_HOME") else []
    rest = [d for d in path if d not in own]
    return {
        **env,
        "PATH": ":".join([*own, f"{venv}/bin", *rest]),
        "TORCH_EXTENSIONS_DIR": ext_dir,
        "MAX_JOBS": str(jobs),
    }


def cubin_archs(torch_list: str) -> list[str]:
    """ "7.0;8.9" -> ["70", "89"] (the cubin names cuobjdump prints)."""
    return [a.replace(".", "").removesuffix("+PTX") for a in torch_list.split(";") if a]


def ext_stamp(record: Record, proof: dict[str, str]) -> bytes:
    inputs = json.loads(record.meta)
    lines = proof.get("version", "").splitlines()

    def field_of(name: str) -> str | None:
        return next((x.split(":", 1)[1].strip() for x in lines if x.startswith(name + ":")), None)

    stamp = {
        "id": ExtInputs(**inputs).build_id,
        "built_at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "inputs": inputs,
        "exllamav2": field_of("version"),
        "ext": field_of("ext"),
        "torch": field_of("torch"),
        "cubins": sorted(cuda.parse_cuobjdump_list_elf(proof["cubins"])) if "cubins" in proof else None,
    }
    return (json.dumps(stamp, indent=2, sort_keys=True) + "\n").encode()
