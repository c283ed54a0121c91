"""TabbyAPI, the OpenAI-compatible server for EXL2, at its pinned commit, using the toolchain venv.

TabbyAPI is not on the package index; it is a git repository. Its source reaches the host the
first way that works:

1. a copy staged on the controller (``~/.cache/voltaforge/sources/tabbyAPI-<sha>.tar.gz``,
   made with ``git archive``) is pushed, checksummed: the way for hosts without internet,
   and for a fleet (fetched once);
2. else the host fetches exactly that commit from the repository (``git fetch --depth 1``
   by full sha: no branch can move under it);
3. else the step fails and says exactly what to stage and where.

Its Python dependencies go into the toolchain venv the same way: from a wheelhouse the
controller made for the venv's Python (``invoke wheelhouse``, steps/build/wheelhouse.py),
pushed checksummed and installed with ``--no-index``, else from the host's index. Either way
the installed torch is named with its version, so the resolver cannot move it (TabbyAPI's own
torch/exllamav2 pins live in extras we do not install: exllamav2 is built for the host by
``steps/build/exllamav2.py``).

The tree lands in ``<prefix>/tabbyAPI`` with a marker holding the sha, after its proof
(steps/build/tabbyapi_proof.py): the new tree's server started without a model on a free
loopback port answers ``/health``, and ``/v1/models`` is 401 without its key and 200 with it.
It loads no model; where exllamav2 is installed TabbyAPI's start imports it and its extension,
which ExLlamaV2's step (run before this one) has built, so nothing compiles.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

from playbooks.config.recipe import Toolchain
from playbooks.facts import read_fact
from playbooks.host.base import Host
from playbooks.host.ops import Decision, Operation, OperationError, PushFile, Shell
from playbooks.steps.build import tabbyapi_proof, wheelhouse
from playbooks.steps.build.llamacpp_source import file_sha256, source_cache_dir
from playbooks.steps.build.proven_build import Probe, run_proven
from playbooks.steps.build.toolchain import pip_install_keeping_torch

MARKER = ".voltaforge-ref"
PROOF_SCRIPT = Path(tabbyapi_proof.__file__)
#: the venv's Python version and its torch, if any (one line each; torch absent: empty)
VENV_FACTS = (
    "import sys, importlib.metadata as m\n"
    "print('%d.%d' % sys.version_info[:2])\n"
    "try: print(m.version('torch'))\n"
    "except m.PackageNotFoundError: print()"
)


def staged_archive(ref: str, cache: Path | None = None) -> Path:
    """Where a staged copy of TabbyAPI at ``ref`` lies on the controller."""
    return (cache or source_cache_dir()) / f"tabbyAPI-{ref}.tar.gz"


#: where `invoke stage-tabbyapi` takes a file from when none is given (steps/build/tabbyapi_stage.py)
ARCHIVE_ENV = "VOLTAFORGE_TABBYAPI_ARCHIVE"


def stage_hint(tc: Toolchain) -> str:
    """What to run where, for a controller that has no staged copy."""
    ref = tc.tabbyapi_ref
    return (
        f"run `invoke stage-tabbyapi` where {tc.tabbyapi_repo} is reachable; without it, on a machine "
        f"with internet: git clone {tc.tabbyapi_repo} tabbyAPI && git -C tabbyAPI archive --format=tar.gz "
        f"-o tabbyAPI-{ref}.tar.gz {ref}, then here `invoke stage-tabbyapi --archive tabbyAPI-{ref}.tar.gz` "
        f"(or set {ARCHIVE_ENV} to that file)"
    )


@dataclass(frozen=True)
class TabbyFacts:
    marker: str | None  # the sha the installed tree was made from
    git: bool
    reachable: bool  # the host can fetch from the repository (asked only when needed)
    staged: bool = False  # the controller holds a staged copy (the controller's state is a fact too)
    python: str | None = None  # the venv's Python, "3.11" (asked only when installing)
    torch: str | None = None  # the torch installed in the venv, kept where it is
    wheels: bool = False  # the controller holds a wheelhouse for that Python


class EnsureTabbyAPI(Operation):
    """TabbyAPI at the pinned commit in <prefix>/tabbyAPI, its dependencies in the venv, proven."""

    def __init__(self, prefix: str, venv: str, tc: Toolchain, cache: Path | None = None):
        self.prefix, self.venv, self.tc, self.cache = prefix, venv, tc, cache
        self.dir = f"{prefix}/tabbyAPI"
        self.archive = staged_archive(tc.tabbyapi_ref, cache)
        self.name = f"Ensure TabbyAPI {tc.tabbyapi_ref[:12]} is installed"

    def wheelhouse(self, python: str) -> Path:
        return wheelhouse.packed(self.tc.tabbyapi_ref, wheelhouse.python_tag(python), self.cache)

    def read(self, host: Host) -> TabbyFacts:
        marker = read_fact(host, f"cat -- {shlex.quote(self.dir + '/' + MARKER)} 2>/dev/null || true").strip() or None
        git = bool(read_fact(host, "command -v git 2>/dev/null || true").strip())
        reachable, python, torch = False, None, None
        staged = self.archive.is_file()
        if marker == self.tc.tabbyapi_ref:
            return TabbyFacts(marker=marker, git=git, reachable=False, staged=staged)
        if not staged and git:
            probe = f"timeout 20 git ls-remote --exit-code {shlex.quote(self.tc.tabbyapi_repo)} HEAD >/dev/null 2>&1"
            reachable = read_fact(host, f"{probe} && echo yes || true").strip() == "yes"
        # the venv's Python; before the toolchain step made it (a dry run), the python3 it is made from
        py, code = shlex.quote(f"{self.venv}/bin/python"), shlex.quote(VENV_FACTS)
        ask = f"{{ test -x {py} && {py} -c {code} || python3 -c {code}; }} 2>/dev/null || true"
        lines = read_fact(host, ask).splitlines()
        if lines and wheelhouse.PYTHON.match(lines[0].strip()):
            python, torch = lines[0].strip(), (lines[1].strip() if len(lines) > 1 else "") or None
        wheels = python is not None and self.wheelhouse(python).is_file()
        return TabbyFacts(marker, git, reachable, staged, python, torch, wheels)

    def decide(self, facts: TabbyFacts) -> Decision:
        ref = self.tc.tabbyapi_ref
        if facts.marker == ref:
            return Decision.ok(f"TabbyAPI {ref[:12]} at {self.dir}")
        q, new = shlex.quote(self.dir), f"{self.dir}.vf-new"
        tmp, src = shlex.quote(new), f"{self.prefix}/src"
        fetch: list[Shell | PushFile]
        if facts.staged:
            pushed = f"{src}/{self.archive.name}"
            how = f"from the copy staged on the controller ({self.archive.name})"
            fetch = [
                Shell(f"mkdir -p -- {shlex.quote(src)}"),
                PushFile(pushed, self.archive, file_sha256(self.archive)),
                Shell(f"rm -rf -- {tmp} && mkdir -p -- {tmp} && tar -xzf {shlex.quote(pushed)} -C {tmp}"),
            ]
        elif facts.reachable:
            how = f"fetched from {self.tc.tabbyapi_repo}"
            repo = shlex.quote(self.tc.tabbyapi_repo)
            fetch = [
                Shell(
                    f"rm -rf -- {tmp} && git init -q {tmp} && "
                    f"git -C {tmp} fetch -q --depth 1 {repo} {shlex.quote(ref)} && "
                    f"git -C {tmp} -c advice.detachedHead=false checkout -q FETCH_HEAD"
                )
            ]
        else:
            why = "git is not installed there" if not facts.git else f"it cannot reach {self.tc.tabbyapi_repo}"
            raise OperationError(
                f"TabbyAPI {ref[:12]} is not on the host, {why}, and nothing is staged: " + stage_hint(self.tc)
            )
        if facts.python is None:
            raise OperationError(f"neither the toolchain venv {self.venv} nor python3 runs on the host")
        deps, how_deps = self._dependencies(facts, new, src)
        proof, switch = f"{new}/.voltaforge-proof.py", f"rm -rf -- {q} && mv -T -- {tmp} {q}"
        return Decision.act(
            f"TabbyAPI {ref[:12]} is {'at ' + facts.marker[:12] if facts.marker else 'not installed'}; {how}; "
            f"its dependencies {how_deps}",
            *fetch,
            *deps,
            PushFile(proof, PROOF_SCRIPT, file_sha256(PROOF_SCRIPT)),
            Probe(f"{shlex.quote(self.venv + '/bin/python')} {shlex.quote(proof)} {tmp} 2>&1", key="proof"),
            Shell(f"rm -f -- {shlex.quote(proof)} && echo {shlex.quote(ref)} > {tmp}/{MARKER} && {switch}"),
        )

    def _dependencies(self, facts: TabbyFacts, tree: str, src: str) -> tuple[list[Shell | PushFile], str]:
        """The pip install of the tree: offline from the controller's wheelhouse for the venv's
        Python when there is one, else from the host's index; the installed torch named."""
        assert facts.python is not None
        if not facts.wheels:
            pip = pip_install_keeping_torch(self.venv, self.tc, tree)
            return [Shell(pip)], f"from the host's index (no wheelhouse for Python {facts.python} on the controller)"
        tar = self.wheelhouse(facts.python)
        pushed = f"{src}/{tar.name}"
        wheels = pushed.removesuffix(".tar")
        keep = [f"torch=={facts.torch}"] if facts.torch else []
        argv = [f"{self.venv}/bin/pip", "install", "--disable-pip-version-check", "--no-index"]
        pip = " ".join(shlex.quote(a) for a in [*argv, "--find-links", wheels, tree, *keep])
        w = shlex.quote(wheels)
        return [
            Shell(f"mkdir -p -- {shlex.quote(src)}"),
            PushFile(pushed, tar, file_sha256(tar)),
            Shell(f"rm -rf -- {w} && mkdir -p -- {w} && tar -xf {shlex.quote(pushed)} -C {w}"),
            Shell(f"{pip} && rm -rf -- {w}"),
        ], f"offline from the controller's wheelhouse ({tar.name})"

    def apply(self, host: Host, decision: Decision) -> None:
        run_proven(host, decision, lambda record, proof: b"")  # the marker is written last, by a command
