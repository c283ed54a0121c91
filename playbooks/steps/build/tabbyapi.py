"""TabbyAPI, the OpenAI-compatible server for EXL2, at its pinned commit, using the toolchain venv.

TabbyAPI is not on the package index; it is a git repository. Its source reaches the host the
first way that works:

1. a copy staged on the controller (``~/.cache/voltaforge/sources/tabbyAPI-<sha>.tar.gz``,
   made with ``git archive``) is pushed, checksummed: the way for hosts without internet,
   and for a fleet (fetched once);
2. else the host fetches exactly that commit from the repository (``git fetch --depth 1``
   by full sha: no branch can move under it);
3. else the step fails and says exactly what to stage and where.

The tree lands in ``<prefix>/tabbyAPI`` with a marker holding the sha; its Python
dependencies go into the toolchain venv with the pinned torch named, so the resolver can
not move it (TabbyAPI's own torch/exllamav2 pins live in extras we do not install: exllamav2
is built for the host by ``steps/build/exllamav2.py``). Proof: its ExLlamaV2 backend imports in the
venv.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

from playbooks.config.recipe import Toolchain
from playbooks.facts import read_fact
from playbooks.host.base import Host
from playbooks.host.ops import Decision, Operation, OperationError, PushFile, Shell
from playbooks.steps.build.llamacpp_source import file_sha256, source_cache_dir
from playbooks.steps.build.proven_build import Probe, run_proven
from playbooks.steps.build.toolchain import pip_install_keeping_torch

MARKER = ".voltaforge-ref"
PROOF = "import main, backends.exllamav2.model; print('tabbyAPI', 'ok')"


def staged_archive(ref: str, cache: Path | None = None) -> Path:
    """Where a staged copy of TabbyAPI at ``ref`` lies on the controller."""
    return (cache or source_cache_dir()) / f"tabbyAPI-{ref}.tar.gz"


def stage_hint(tc: Toolchain, where: Path) -> str:
    return (
        f"on a machine with internet: git clone {tc.tabbyapi_repo} tabbyAPI && git -C tabbyAPI archive "
        f"--format=tar.gz -o tabbyAPI-{tc.tabbyapi_ref}.tar.gz {tc.tabbyapi_ref}; copy that file to {where} "
        "on this controller and re-run"
    )


@dataclass(frozen=True)
class TabbyFacts:
    marker: str | None  # the sha the installed tree was made from
    git: bool
    reachable: bool  # the host can fetch from the repository (asked only when needed)
    staged: bool = False  # the controller holds a staged copy (the controller's state is a fact too)


class EnsureTabbyAPI(Operation):
    """TabbyAPI at the pinned commit in <prefix>/tabbyAPI, its dependencies in the venv, proven."""

    def __init__(self, prefix: str, venv: str, tc: Toolchain, cache: Path | None = None):
        self.prefix, self.venv, self.tc = prefix, venv, tc
        self.dir = f"{prefix}/tabbyAPI"
        self.archive = staged_archive(tc.tabbyapi_ref, cache)
        self.name = f"Ensure TabbyAPI {tc.tabbyapi_ref[:12]} is installed"

    def read(self, host: Host) -> TabbyFacts:
        marker = read_fact(host, f"cat -- {shlex.quote(self.dir + '/' + MARKER)} 2>/dev/null || true").strip() or None
        git = bool(read_fact(host, "command -v git 2>/dev/null || true").strip())
        reachable = False
        staged = self.archive.is_file()
        if marker != self.tc.tabbyapi_ref and not staged and git:
            probe = f"timeout 20 git ls-remote --exit-code {shlex.quote(self.tc.tabbyapi_repo)} HEAD >/dev/null 2>&1"
            reachable = read_fact(host, f"{probe} && echo yes || true").strip() == "yes"
        return TabbyFacts(marker=marker, git=git, reachable=reachable, staged=staged)

    def decide(self, facts: TabbyFacts) -> Decision:
        ref = self.tc.tabbyapi_ref
        if facts.marker == ref:
            return Decision.ok(f"TabbyAPI {ref[:12]} at {self.dir}")
        q, tmp = shlex.quote(self.dir), shlex.quote(self.dir + ".vf-new")
        fetch: list[Shell | PushFile]
        if facts.staged:
            pushed = f"{self.prefix}/src/{self.archive.name}"
            how = f"from the copy staged on the controller ({self.archive.name})"
            fetch = [
                Shell(f"mkdir -p -- {shlex.quote(self.prefix + '/src')}"),
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
                f"TabbyAPI {ref[:12]} is not on the host, {why}, and nothing is staged: "
                + stage_hint(self.tc, self.archive)
            )
        pip = pip_install_keeping_torch(self.venv, self.tc, f"{self.dir}.vf-new")
        return Decision.act(
            f"TabbyAPI {ref[:12]} is {'at ' + facts.marker[:12] if facts.marker else 'not installed'}; {how}",
            *fetch,
            Shell(pip),
            Probe(f"cd {tmp} && {shlex.quote(self.venv + '/bin/python')} -c {shlex.quote(PROOF)} 2>&1", key="import"),
            Shell(f"echo {shlex.quote(ref)} > {tmp}/{MARKER} && rm -rf -- {q} && mv -T -- {tmp} {q}"),
        )

    def apply(self, host: Host, decision: Decision) -> None:
        run_proven(host, decision, lambda record, proof: b"")  # the marker is written last, by a command
