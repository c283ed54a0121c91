"""The samples and figures the docs show are made by today's code (issue 35).

A result file that names the code paths it measures (``measures``, playbooks/results.py) is held
to them: when a commit after the one it was made at changed one of them, this fails and says
which maker re-makes it (``scripts/remake_samples.py``). Exempt by what they are: a transcribed
file (its run is gone; its text says "transcribed"), a GPU-only one (reports/h200/: no GPU
here) and a CI run's cost (reports/ci/: a record of the stop it names). Every other
committed result file is held, or is named below with why it is not yet.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from playbooks.results import ResultError, changed_since, load_result, parse_result
from tests.helpers import ROOT, doc_pages
from tests.test_readme_figures import BLOCK_MARK, MARK, result_files

#: measured-here files not held yet, with why: each one a maker away from being held
NOT_YET_HELD = {
    "reports/bench/noise.json": "the method's data set: the machine's run-to-run noise, not a sample of our output",
    "reports/bench/method.json": "a simulation over noise.json (scripts/bench_method.py), re-made from the data",
    "reports/bench/stability.json": "the issue-20 data set, kept as the evidence of that issue",
    "reports/bench/stability-busy.json": "the issue-20 data set beside a batch job, kept as that issue's evidence",
    "reports/local/provision-walk.json": "issue 59's walk before and after its change: a comparison of two commits "
    "(the one before is fixed), not a sample of today's code",
}


def _rel(path) -> str:
    return str(path.relative_to(ROOT))


def _exempt(path, r) -> str | None:
    if r.transcribed:
        return "transcribed"
    if _rel(path).startswith("reports/h200/"):
        return "GPU-only"
    if _rel(path).startswith("reports/ci/"):
        return "a CI run's cost at the commit it names: a record of that stop, not a sample of today's code"
    return None


def _shallow() -> bool:
    r = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--is-shallow-repository"], capture_output=True, text=True)
    return r.stdout.strip() == "true"


@pytest.mark.parametrize("path", result_files(), ids=_rel)
def test_a_held_result_was_made_by_the_code_it_measures(path):
    r = load_result(path)
    if not r.measures:
        assert _exempt(path, r) or _rel(path) in NOT_YET_HELD, (
            f"{_rel(path)}: measured here, yet names no code paths it measures (measures) and is not "
            "in NOT_YET_HELD: give its maker measures= (scripts/remake_samples.py)"
        )
        return
    for p in r.measures:
        assert (ROOT / p).exists(), f"{_rel(path)} measures {p}, which is not in the checkout"
    if _shallow():
        pytest.fail("a shallow clone cannot say what changed since a result's commit: clone with history")
    changed = changed_since(r.commit, r.measures, ROOT)
    assert not changed, (
        f"{_rel(path)} was made at {r.commit}; {', '.join(r.measures)} changed since ({', '.join(changed)}): "
        "re-make it (scripts/remake_samples.py --stale) and commit it"
    )


def test_not_yet_held_names_only_files_that_need_it():
    """The list only shrinks: a file that now names its code paths, or is gone, leaves it."""
    for rel in NOT_YET_HELD:
        r = load_result(ROOT / rel)
        assert not r.measures and not _exempt(ROOT / rel, r), rel


def test_a_change_after_the_commit_is_caught():
    """Held to a path that changed after the result's commit: the checker names the commits;
    to one that did not: nothing. (This file's first commit is older than HEAD, and the test
    file itself changed since the first commit of the repository.)"""
    first = subprocess.run(
        ["git", "-C", str(ROOT), "rev-list", "--max-parents=0", "HEAD"], capture_output=True, text=True
    ).stdout.split()[0][:7]
    assert changed_since(first, ["playbooks/results.py"], ROOT)
    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    assert changed_since(head, ["playbooks/results.py"], ROOT) == []
    with pytest.raises(ResultError, match="git log 0000000..HEAD"):
        changed_since("0000000", ["playbooks"], ROOT)


def test_measures_are_paths_inside_the_checkout():
    good = load_result(ROOT / "reports/h200/gate.json").model_dump(by_alias=True)
    assert parse_result({**good, "measures": ["playbooks/steps/build"]}).measures == ["playbooks/steps/build"]
    for bad in ("/etc/passwd", "../elsewhere", " "):
        with pytest.raises(ResultError, match="not a path inside the checkout"):
            parse_result({**good, "measures": [bad]}, "gate.json")


def test_the_docs_pick_a_re_made_file_up(tmp_path):
    """scripts/remake_samples.py rewrites each page's marked figures and sample blocks from the
    files: a re-made file's new figure and output land where the old ones were, as the page
    wrote them, and the figure checker then passes."""
    import importlib.util
    import shutil

    from tests.test_readme_figures import check

    spec = importlib.util.spec_from_file_location("remake_samples", ROOT / "scripts" / "remake_samples.py")
    assert spec and spec.loader
    remake = importlib.util.module_from_spec(spec)
    sys.modules["remake_samples"] = remake  # (its dataclasses look their module up)
    spec.loader.exec_module(remake)
    shutil.copytree(ROOT / "reports", tmp_path / "reports")
    noop = tmp_path / "reports/local/provision-noop.json"
    data = json.loads(noop.read_text())
    data["figures"]["wall_s"] = 1234.5
    data["extra"]["output"] = "a new sample\nof two lines"
    noop.write_text(json.dumps(data))
    page = (ROOT / "docs" / "provision.md").read_text()
    new = remake.pick_up(page, tmp_path)
    assert "1234.50 s<!-- result: reports/local/provision-noop.json wall_s -->" in new
    assert "<!-- result-block: reports/local/provision-noop.json -->\n```text\na new sample\nof two lines\n```" in new
    assert check(new, tmp_path)[0] == [] and check(page, tmp_path)[0] != []
    assert remake.pick_up(page) == page  # today's files: nothing to change


def _paragraph_and_one_before(text: str, pos: int) -> str:
    """The paragraph holding ``pos`` and the one before it (a block's marker sits under the
    sentence that introduces it; a table row under the sentence above the table)."""
    start = text.rfind("\n\n", 0, pos)
    before = text.rfind("\n\n", 0, max(start, 0))
    end = text.find("\n\n", pos)
    return text[max(before, 0) : end if end != -1 else len(text)]


def unlabelled(text: str, name: str, root=ROOT) -> list[str]:
    """Every figure from a transcribed or GPU-only file whose text does not say so next to it
    (issue 35: such a figure is exempt from being re-made, so the reader is told)."""
    found = []
    for m in [*MARK.finditer(text), *BLOCK_MARK.finditer(text)]:
        rel = m.group("file")
        r = load_result(root / rel)
        # the markers' own paths say "h200": only the reader's text counts
        near = re.sub(r"<!--.*?-->", "", _paragraph_and_one_before(text, m.start()), flags=re.S).lower()
        line = text.count("\n", 0, m.start()) + 1
        if r.transcribed and "transcribed" not in near:
            found.append(f"{name}:{line}: {rel} is transcribed ({r.source}); say so next to the figure")
        if rel.startswith("reports/h200/") and not ("gpu" in near or "h200" in near):
            found.append(f"{name}:{line}: {rel} is GPU-only; say so next to the figure")
    return found


@pytest.mark.parametrize("page", doc_pages(), ids=lambda p: p.name)
def test_a_transcribed_or_gpu_only_figure_says_so(page):
    assert unlabelled(page.read_text(), page.name) == []


def test_an_unlabelled_transcribed_figure_is_found():
    plain = "Intro.\n\nIt took 2984 s<!-- result: reports/local/build-sm70-full.json wall_s --> cold.\n"
    assert unlabelled(plain, "x.md") == [
        "x.md:3: reports/local/build-sm70-full.json is transcribed "
        f"({load_result(ROOT / 'reports/local/build-sm70-full.json').source}); say so next to the figure"
    ]
    assert unlabelled(plain.replace("cold.", "cold (transcribed)."), "x.md") == []
    gpu = "Intro.\n\nIt took 0.1 s<!-- result: reports/h200/build.json second_run_s --> (transcribed).\n"
    assert unlabelled(gpu, "x.md") == ["x.md:3: reports/h200/build.json is GPU-only; say so next to the figure"]
