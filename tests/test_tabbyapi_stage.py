"""`invoke stage-tabbyapi`: TabbyAPI's pinned commit into the controller's cache, with real git.

A repository made here stands in for GitHub (a local path: the URL check of the recipe schema is
bypassed with ``model_copy``, the fetch is the same ``git fetch --depth 1`` by full sha); its
``git archive`` is the file an operator carries to a controller without internet. Checked: the
archive's commit (git writes it into the tar's pax header) is the pinned one, or the file is
refused in one line and nothing is staged; with no file and no repository the message says what
to run where; a second run changes nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from playbooks.config.recipe import Toolchain
from playbooks.errors import VoltaforgeError
from playbooks.steps.build.tabbyapi import ARCHIVE_ENV, staged_archive
from playbooks.steps.build.tabbyapi_stage import archive_commit, stage
from tests.helpers import ROOT, recipe_with


def git(*args: str, cwd: Path) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@x", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@x"}  # fmt: skip
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path) -> tuple[Path, str, str]:
    """A repository with two commits: (path, the pinned sha, an older sha)."""
    path = tmp_path / "tabbyAPI"
    path.mkdir()
    git("init", "-q", cwd=path)
    (path / "pyproject.toml").write_text('[project]\nname = "tabbyAPI"\ndependencies = []\n')
    git("add", ".", cwd=path)
    git("commit", "-qm", "one", cwd=path)
    older = git("rev-parse", "HEAD", cwd=path)
    (path / "main.py").write_text("print('tabby')\n")
    git("add", ".", cwd=path)
    git("commit", "-qm", "two", cwd=path)
    return path, git("rev-parse", "HEAD", cwd=path), older


def pinned(repo_path: Path | str, ref: str) -> Toolchain:
    return Toolchain().model_copy(update={"tabbyapi_repo": str(repo_path), "tabbyapi_ref": ref})


def archive_of(repo_path: Path, ref: str, out: Path) -> Path:
    git("archive", "--format=tar.gz", "-o", str(out), ref, cwd=repo_path)
    return out


def test_fetched_from_the_repository_at_exactly_the_pinned_commit_then_left_alone(repo, tmp_path, monkeypatch):
    monkeypatch.delenv(ARCHIVE_ENV, raising=False)
    path, sha, _ = repo
    tc = pinned(path, sha)
    staged, how = stage(tc, cache=tmp_path / "cache")
    assert how == f"changed: fetched from {path}" and staged == staged_archive(sha, tmp_path / "cache")
    assert archive_commit(staged) == sha
    again, how = stage(tc, cache=tmp_path / "cache")
    assert again == staged and how == "ok: already staged"


def test_a_file_of_the_pinned_commit_is_taken_another_refused(repo, tmp_path, monkeypatch):
    monkeypatch.delenv(ARCHIVE_ENV, raising=False)
    path, sha, older = repo
    cache = tmp_path / "cache"
    wrong = archive_of(path, older, tmp_path / "old.tar.gz")
    with pytest.raises(
        VoltaforgeError, match=rf"^--archive {wrong} is TabbyAPI at {older[:12]}, not the pinned {sha[:12]}"
    ):
        stage(pinned("https://nowhere.invalid/x", sha), wrong, cache)
    junk = tmp_path / "junk.tar.gz"
    junk.write_bytes(b"not a tar")
    with pytest.raises(VoltaforgeError, match="is not an archive `git archive` made of a commit"):
        stage(pinned("https://nowhere.invalid/x", sha), junk, cache)
    assert not staged_archive(sha, cache).exists()
    # the variable, for a controller that is given the file once
    monkeypatch.setenv(ARCHIVE_ENV, str(archive_of(path, sha, tmp_path / "right.tar.gz")))
    staged, how = stage(pinned("https://nowhere.invalid/x", sha), cache=cache)
    assert how == f"changed: copied from {tmp_path / 'right.tar.gz'}" and archive_commit(staged) == sha
    with pytest.raises(VoltaforgeError, match=f"^--archive {wrong} is TabbyAPI at"):  # staged, still refused
        stage(pinned("https://nowhere.invalid/x", sha), wrong, cache)


def test_with_nothing_to_take_the_message_says_what_to_run_where(tmp_path, monkeypatch):
    monkeypatch.delenv(ARCHIVE_ENV, raising=False)
    tc = pinned(tmp_path / "no-such-repository", "0" * 40)
    with pytest.raises(VoltaforgeError) as exc:
        stage(tc, cache=tmp_path / "cache")
    said = str(exc.value)
    assert "\n" not in said and said.startswith(f"TabbyAPI {'0' * 12} is not staged on this controller: fetching")
    assert "run `invoke stage-tabbyapi` where" in said and f"or set {ARCHIVE_ENV} to that file" in said
    assert f"`invoke stage-tabbyapi --archive tabbyAPI-{'0' * 40}.tar.gz`" in said
    assert not list((tmp_path / "cache").rglob("*.tar.gz*"))


def test_the_task_stages_a_given_file_and_a_second_run_changes_nothing(repo, tmp_path):
    """Through the CLI, with a recipe that pins the repository's commit."""
    path, sha, _ = repo
    recipe = recipe_with(tmp_path, "tiny-cpu", "")
    recipe.write_text(recipe.read_text().replace("toolchain:\n", f"toolchain:\n  tabbyapi_ref: {sha}\n", 1))
    env = {**os.environ, "VOLTAFORGE_CACHE": str(tmp_path / "cache")}
    env.pop(ARCHIVE_ENV, None)
    cmd = [sys.executable, "-m", "invoke", "-r", str(ROOT), "stage-tabbyapi", "--recipe", str(recipe)]
    given = archive_of(path, sha, tmp_path / "carried.tar.gz")
    first = subprocess.run([*cmd, "--archive", str(given)], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert first.returncode == 0 and first.stdout.startswith(f"TabbyAPI {sha[:12]}: changed: copied from"), first
    second = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tmp_path)
    assert second.returncode == 0 and f"TabbyAPI {sha[:12]}: ok: already staged" in second.stdout, second
