"""TabbyAPI's pinned commit staged on the controller (``invoke stage-tabbyapi``), where the
tabbyapi step and ``invoke wheelhouse`` look first.

It comes from the first of:

1. the copy already staged (``~/.cache/voltaforge/sources/tabbyAPI-<sha>.tar.gz``);
2. a file made with ``git archive`` elsewhere: ``--archive FILE``, else the path in
   ``VOLTAFORGE_TABBYAPI_ARCHIVE`` (for a controller without GitHub);
3. the repository, where the controller reaches it: exactly that commit fetched (``git fetch
   --depth 1`` by full sha: no branch can move under it) and archived the same way.

A file is taken only when it is that commit: ``git archive`` of a commit writes the commit id
into the tar's pax header (``git get-tar-commit-id`` reads it), and that id is checked against
the recipe's ``toolchain.tabbyapi_ref``; a file of another commit, or no archive of a commit at
all, is refused in one line. With none of the three, the message says what to run where.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

from playbooks.config.recipe import Toolchain
from playbooks.errors import VoltaforgeError
from playbooks.steps.build.tabbyapi import ARCHIVE_ENV, stage_hint, staged_archive

FETCH_TIMEOUT_S = 120


def archive_commit(path: Path) -> str | None:
    """The commit a ``git archive`` tarball was made from (its pax header's comment), or None."""
    try:
        with tarfile.open(path, "r:*") as tar:
            commit = tar.pax_headers.get("comment", "")
    except (OSError, tarfile.TarError, EOFError):
        return None
    return commit if len(commit) == 40 and all(c in "0123456789abcdef" for c in commit) else None


def commit_of(source: Path, said: str = "--archive") -> str:
    """The commit ``source`` was archived from, or one line saying why it is none (``said``:
    where the path came from)."""
    if not source.is_file():
        raise VoltaforgeError(f"{said} {source} is not a file")
    commit = archive_commit(source)
    if commit is None:
        raise VoltaforgeError(f"{said} {source} is not an archive `git archive` made of a commit")
    return commit


def _check(tc: Toolchain, source: Path, said: str) -> None:
    commit = commit_of(source, said)
    if commit != tc.tabbyapi_ref:
        raise VoltaforgeError(
            f"{said} {source} is TabbyAPI at {commit[:12]}, not the pinned {tc.tabbyapi_ref[:12]} "
            "(toolchain.tabbyapi_ref)"
        )


def _fetch(tc: Toolchain, target: Path) -> str | None:
    """The pinned commit fetched and archived into ``target``; None when done, else why not."""
    git = shutil.which("git")
    if git is None:
        return "git is not installed on this controller"
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="vf-tabbyapi-") as tmp:
        part = target.with_name(target.name + ".part")
        steps = [
            [git, "init", "-q", tmp],
            [git, "-C", tmp, "fetch", "-q", "--depth", "1", tc.tabbyapi_repo, tc.tabbyapi_ref],
            [git, "-C", tmp, "archive", "--format=tar.gz", "-o", str(part), "FETCH_HEAD"],
        ]
        env = {**os.environ, "GIT_TERMINAL_PROMPT": "0"}  # a private or moved repository: fail, never ask
        for argv in steps:
            try:
                r = subprocess.run(argv, capture_output=True, text=True, timeout=FETCH_TIMEOUT_S, env=env)
            except subprocess.TimeoutExpired:
                part.unlink(missing_ok=True)
                return f"{tc.tabbyapi_repo} did not answer within {FETCH_TIMEOUT_S} s"
            if r.returncode != 0:
                part.unlink(missing_ok=True)
                last = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]
                return f"fetching {tc.tabbyapi_ref[:12]} from {tc.tabbyapi_repo} failed ({last[:200]})"
    if archive_commit(part) != tc.tabbyapi_ref:
        part.unlink(missing_ok=True)
        return f"the archive fetched from {tc.tabbyapi_repo} is not commit {tc.tabbyapi_ref[:12]}"
    part.replace(target)
    return None


def stage(
    tc: Toolchain, archive: Path | None = None, cache: Path | None = None, fetch: bool = True
) -> tuple[Path, str]:
    """TabbyAPI at ``tc.tabbyapi_ref`` in the controller's cache: the path and how it got there
    (``ok``: already staged). ``archive``: a file to take (else ``VOLTAFORGE_TABBYAPI_ARCHIVE``);
    ``fetch``: try the repository when no file is given."""
    target = staged_archive(tc.tabbyapi_ref, cache)
    given, said = archive, "--archive"
    if given is None and os.environ.get(ARCHIVE_ENV):
        given, said = Path(os.environ[ARCHIVE_ENV]), ARCHIVE_ENV
    staged = target.is_file() and archive_commit(target) == tc.tabbyapi_ref
    if given is not None:
        _check(tc, given, said)  # a wrong file is refused even when the right one is staged
        if staged:
            return target, "ok: already staged"
        target.parent.mkdir(parents=True, exist_ok=True)
        part = target.with_name(target.name + ".part")
        shutil.copyfile(given, part)
        part.replace(target)
        return target, f"changed: copied from {given}"
    if staged:
        return target, "ok: already staged"
    why = _fetch(tc, target) if fetch else "not fetched"
    if why is None:
        return target, f"changed: fetched from {tc.tabbyapi_repo}"
    raise VoltaforgeError(f"TabbyAPI {tc.tabbyapi_ref[:12]} is not staged on this controller: {why}; {stage_hint(tc)}")
