"""Every measured figure in README.md comes from a result file under reports/ (playbooks/results.py),
and the README shows what the file holds.

The marker, an HTML comment (invisible on GitHub) right after the figure and its unit:

    single stream **131.5 tok/s**<!-- result: reports/h200/gate.json single_stream_tok_s -->
    198 / 200 / 199 tok/s<!-- result: reports/h200/gate.json aggregate_2_tok_s aggregate_4_tok_s aggregate_8_tok_s -->

A marker with k names reads the last k figures before it on its own line, in order; each must equal
the file's figure rounded as the README shows it (half up: 578.5 shows as 578.5 or 579, never 578).
A duration written `13 min 56 s` is read as 836 s and needs the unit "s"; a unit written between
the figure and the marker (`131.5 tok/s**`, `23.4%`) must be the file's. A sample output shown
whole is marked on the line before its fence and must equal the file's `extra["output"]`:

    <!-- result-block: reports/local/provision-noop.json -->
    ```text
    ...

The rule that catches a figure added without a file: outside fenced blocks, every number in bold
(`**...**`) followed by a unit of time, speed, size, clock, power, temperature, a percentage or a
ratio must be covered by a marker. Computed figures (plans, rooflines from datasheets, published
sizes) are not bold-with-a-unit and carry no marker; they are tested where they are computed.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

import pytest

from playbooks.facts.server_log import parse_load_log
from playbooks.results import Result, ResultError, load_result, parse_result
from tests.helpers import ROOT, doc_pages, docs_text

README = ROOT / "README.md"
REPORTS = ROOT / "reports"

MARK = re.compile(r"<!-- result: (?P<file>reports/[\w./-]+\.json)(?P<keys>(?: [a-z][a-z0-9_]*)+) -->")
BLOCK_MARK = re.compile(r"<!-- result-block: (?P<file>reports/[\w./-]+\.json) -->")
ANY_MARK = re.compile(r"<!--\s*result")
FENCE = re.compile(r"^```[^\n]*\n.*?^```[ \t]*$", re.M | re.S)
CODE = re.compile(r"(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)  # an inline code span: a marker shown, not used
# a figure as the README writes it: `13 min 56 s`, `1,745`, `131.5`, `-7.3` (a sign after no digit);
# not the digits of `sm_90`, `tg64`, `v1.2`, nor `12` of a date `2026-12-06`
FIGURE = re.compile(
    r"(?<![\w.,/-])(?:(?P<min>\d+) min (?P<sec>\d+(?:\.\d+)?) s(?![\w/])"
    r"|(?P<neg>-)?(?P<num>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?))"
)
BOLD = re.compile(r"\*\*([^*]+)\*\*")
SERIES = re.compile(r"\s*/\s*")
UNIT_AFTER = re.compile(
    r"(?:\s?(?:tok/s|GB/s|MB/s|ms|min|s|h|MiB|GiB|GB|MB|MHz|W|°C)|%|x)(?![\w/])"
)  # `8192 x 2`: no unit

# Places another change was rewriting with new measurements, exempt from the bold rule while
# they carried no marker at all. None now: both (the bench section, the CI time paragraph) carry
# their markers. A place added here is exempt only until its first marker.
PENDING: list[tuple[str, re.Pattern[str], re.Pattern[str]]] = []


@dataclass(frozen=True)
class Token:
    start: int
    end: int
    text: str
    value: Decimal  # seconds for a duration
    decimals: int
    duration: bool


def _tokens(text: str, start: int = 0, end: int | None = None) -> list[Token]:
    out = []
    for m in FIGURE.finditer(text, start, len(text) if end is None else end):
        if m["min"]:
            sec = m["sec"]
            value = Decimal(m["min"]) * 60 + Decimal(sec)
            out.append(Token(m.start(), m.end(), m[0], value, len(sec.partition(".")[2]), True))
        else:
            num = m["num"].replace(",", "")
            value = -Decimal(num) if m["neg"] else Decimal(num)
            out.append(Token(m.start(), m.end(), m[0], value, len(num.partition(".")[2]), False))
    return out


def shown(value: float, decimals: int) -> Decimal:
    """The file's figure rounded as the README shows it (half up)."""
    return Decimal(repr(float(value))).quantize(Decimal(1).scaleb(-decimals), rounding=ROUND_HALF_UP)


def _fences(text: str) -> list[tuple[int, int]]:
    """Fenced blocks and inline code spans: what is in them is shown, not marked up."""
    fences = [(m.start(), m.end()) for m in FENCE.finditer(text)]
    spans = [(m.start(), m.end()) for m in CODE.finditer(text) if not _inside(m.start(), fences)]
    return fences + spans


def _inside(pos: int, spans: list[tuple[int, int]]) -> bool:
    return any(a <= pos < b for a, b in spans)


def _line(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def _blank_markers(text: str) -> str:
    """The text with every marker replaced by spaces: offsets stay, figures inside a marker vanish."""
    return MARK.sub(lambda m: " " * len(m[0]), BLOCK_MARK.sub(lambda m: " " * len(m[0]), text))


def _load(rel: str, cache: dict[str, Result | str], root: Path) -> Result | str:
    if rel not in cache:
        try:
            cache[rel] = load_result(root / rel)
        except ResultError as exc:
            cache[rel] = str(exc)
    return cache[rel]


def check(text: str, root: Path = ROOT, name: str = "README.md") -> tuple[list[str], set[int]]:
    """(problems, offsets of the figures the markers cover) for a page's text (``name``: the
    page, as problems name it)."""
    problems: list[str] = []
    covered: set[int] = set()
    cache: dict[str, Result | str] = {}
    fences = _fences(text)
    blank = _blank_markers(text)
    marks = [m for m in MARK.finditer(text) if not _inside(m.start(), fences)]
    known = {m.start() for m in marks}
    for m in ANY_MARK.finditer(text):
        if m.start() not in known and not BLOCK_MARK.match(text, m.start()) and not _inside(m.start(), fences):
            bad = text[m.start() :][:80]
            problems.append(f"{name}:{_line(text, m.start())}: a result marker that cannot be read: {bad!r}")
    previous_end = 0
    for m in marks:
        where = f"{name}:{_line(text, m.start())}"
        if text[m.start() - 1 : m.start()] in ("", "\n"):
            problems.append(f"{where}: a marker must not start a line (there it starts an HTML block)")
        keys = m["keys"].split()
        line_start = text.rfind("\n", 0, m.start()) + 1
        found = _tokens(blank, max(line_start, previous_end), m.start())
        previous_end = m.end()
        result = _load(m["file"], cache, root)
        if isinstance(result, str):
            problems.append(f"{where}: {result}")
            continue
        if len(found) < len(keys):
            problems.append(f"{where}: {len(keys)} figure(s) named, {len(found)} on the line before the marker")
            continue
        tokens = found[-len(keys) :]
        suffix = blank[tokens[-1].end : m.start()].strip(" *")
        for key, tok in zip(keys, tokens, strict=True):
            covered.add(tok.start)
            if key not in result.figures:
                problems.append(f"{where}: {m['file']} has no figure {key!r} (it has {sorted(result.figures)})")
                continue
            value, unit = result.figures[key], result.units[key]
            if tok.duration and unit != "s":
                problems.append(f"{where}: {tok.text!r} is a duration but {m['file']} {key} is in {unit}")
            elif shown(value, tok.decimals) != tok.value:
                problems.append(
                    f"{where}: README shows {tok.text!r}, {m['file']} {key} = {value} {unit} "
                    f"(shown as {shown(value, tok.decimals)})"
                )
        unit = result.units.get(keys[-1])
        if suffix and unit and suffix != unit:
            problems.append(
                f"{where}: the README writes {suffix!r} before the marker, {m['file']} {keys[-1]} is in {unit}"
            )
    for m in BLOCK_MARK.finditer(text):
        if _inside(m.start(), fences):
            continue
        where = f"{name}:{_line(text, m.start())}"
        fence = FENCE.match(text, m.end() + 1)
        if text[m.end() : m.end() + 1] != "\n" or fence is None:
            problems.append(f"{where}: a result-block marker must be the line right before a fenced block")
            continue
        result = _load(m["file"], cache, root)
        if isinstance(result, str):
            problems.append(f"{where}: {result}")
            continue
        body = fence[0].split("\n", 1)[1].rsplit("\n", 1)[0]
        output = result.extra.get("output")
        if not isinstance(output, str):
            problems.append(f"{where}: {m['file']} has no extra.output to compare the block with")
        elif [ln.rstrip() for ln in body.splitlines()] != [ln.rstrip() for ln in output.splitlines()]:
            problems.append(f"{where}: the block differs from {m['file']}'s extra.output")
        else:
            covered.update(t.start for t in _tokens(blank, fence.start(), fence.end()))
    return problems, covered


def _pending(text: str) -> list[tuple[int, int]]:
    spans = []
    for _, start_re, end_re in PENDING:
        start = start_re.search(text)
        if start is None:
            continue
        end = end_re.search(text, start.end() + 1)
        span = (start.start(), end.start() if end else len(text))
        if not ANY_MARK.search(text, *span):
            spans.append(span)
    return spans


def unmarked(text: str, covered: set[int], name: str = "README.md") -> list[str]:
    """Bold figures with a unit that no marker covers (outside fenced blocks and pending places)."""
    blank = _blank_markers(text)
    fences, pending = _fences(text), _pending(text)
    found = []
    for b in BOLD.finditer(blank):
        if _inside(b.start(), fences) or _inside(b.start(), pending):
            continue
        tokens = _tokens(blank, b.start(1), b.end(1))
        needs = [False] * len(tokens)
        for i in reversed(range(len(tokens))):  # `32.1 / 36.9 GB/s`: the unit is every figure's
            tok = tokens[i]
            series = i + 1 < len(tokens) and needs[i + 1] and SERIES.fullmatch(blank, tok.end, tokens[i + 1].start)
            needs[i] = bool(tok.duration or UNIT_AFTER.match(blank, tok.end, b.end(1)) or series)
        for tok, need in zip(tokens, needs, strict=True):
            if need and tok.start not in covered:
                found.append(f"{name}:{_line(text, tok.start)}: {b[0]!r}: {tok.text} has no result marker")
    return found


# -- the README and the docs as they are ---------------------------------------------------------

PAGES = doc_pages()


def _page_id(p: Path) -> str:
    return str(p.relative_to(ROOT))


def page_with(snippet: str) -> str:
    """The text of the one page that holds ``snippet`` (what a checker test edits)."""
    (text,) = [t for t in (p.read_text() for p in PAGES) if snippet in t]
    return text


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_every_marked_figure_is_the_result_files(page):
    problems, _ = check(page.read_text(), name=_page_id(page))
    assert problems == []


def test_the_markers_are_read():
    """A broken pattern would find none, and every page would pass."""
    covered = sum(len(check(p.read_text(), name=_page_id(p))[1]) for p in PAGES)
    assert covered >= 40
    assert "docs/bench.md" in {_page_id(p) for p in PAGES} and len(PAGES) >= 15


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_no_bold_figure_goes_without_a_result_file(page):
    text = page.read_text()
    assert unmarked(text, check(text, name=_page_id(page))[1], _page_id(page)) == []


def result_files() -> list[Path]:
    """The committed result files (reports/AREA/NAME.json). Not what is merely lying there:
    `invoke verify-recipe` writes its gate reports under reports/RECIPE/ by default."""
    listed = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "--", "reports/*/*.json"], capture_output=True, text=True
    )
    if listed.returncode != 0:  # not a checkout: every file there
        return sorted(REPORTS.glob("*/*.json"))
    return sorted(ROOT / line for line in listed.stdout.splitlines() if line.count("/") == 2)


@pytest.mark.parametrize("path", result_files(), ids=lambda p: str(p.relative_to(REPORTS)))
def test_every_result_file_validates(path):
    load_result(path)


def test_every_result_file_of_ours_is_cited_by_the_readme():
    """A result file nobody reads is a figure that was dropped from the README: drop the file."""
    text = docs_text()
    cited = {m["file"] for m in MARK.finditer(text)} | {m["file"] for m in BLOCK_MARK.finditer(text)}
    ours = [p for p in result_files() if p.parent.name in ("h200", "local")]
    assert [str(p.relative_to(ROOT)) for p in ours if str(p.relative_to(ROOT)) not in cited] == []


def test_load_figures_are_their_committed_fixtures():
    """Where a result names the load log it came from, the log says the same; the transcribed
    H200 loads name theirs (a device check run replaces them with files of its own)."""
    from tests.helpers import fixture_body

    for name in ("gate-load", "moe-load"):
        r = load_result(REPORTS / "h200" / f"{name}.json")
        assert not r.transcribed or "fixture" in r.extra, name
    for r in map(load_result, result_files()):
        if "fixture" not in r.extra:
            continue
        log = parse_load_log(fixture_body(Path(r.extra["fixture"]).name))
        assert r.extra["fixture"] in r.source
        assert r.figures["kv_mib"] == log.kv_mib["CUDA0"]
        assert r.figures["compute_mib"] == log.compute_mib["CUDA0"]
        assert r.figures["gpu_weights_mib"] == log.model_device_mib
        assert log.offloaded == (r.figures["offloaded_layers"],) * 2


def test_the_moe_sweeps_derived_figures_follow_from_its_measured_ones():
    """The host's read rate at each N and the GPU's share at N=0 are arithmetic on the measured
    tok/s and the plan's bytes per token: they hold for some tok/s inside its rounding."""
    from playbooks.plan.model_config import load_config_file
    from playbooks.plan.moe import expert_layout

    r = load_result(REPORTS / "h200" / "moe-sweep.json")
    layout = expert_layout(load_config_file(ROOT / "recipes/models/qwen3-30b-a3b.config.json"), "Q4_K_M")
    gpu_gb_s = 4800  # the H200's datasheet bandwidth, as the README takes it

    def host_gb_s(tok_s: float, n: int) -> float:
        gpu, host = layout.per_token(n)
        return host / (1 / tok_s - gpu / (gpu_gb_s * 1e9)) / 1e9

    for n in (12, 24, 36, 48):
        tok_s = r.figures[f"tg_tok_s_n{n}"]
        low, high = host_gb_s(tok_s - 0.05, n), host_gb_s(tok_s + 0.05, n)
        assert low - 0.05 <= r.figures[f"host_gb_s_n{n}"] <= high + 0.05, n
    gpu0, _ = layout.per_token(0)
    share = r.figures["tg_tok_s_n0"] / (gpu_gb_s * 1e9 / gpu0) * 100
    assert round(share) == r.figures["gpu_roofline_pct_n0"]


TRANSCRIBED_FROM = re.compile(r"transcribed: (README of commit (?P<commit>[0-9a-f]{7,40})|(?P<path>(tests|docs)/\S+))")


def test_a_transcribed_result_names_where_its_numbers_were_recorded():
    """Honest about what it is: a commit whose README held the figures, or a committed file."""
    for path in result_files():
        r = load_result(path)
        if not r.transcribed:
            continue
        m = TRANSCRIBED_FROM.match(r.source)
        assert m, (path, r.source)
        if m["commit"]:
            assert (
                subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{m['commit']}^{{commit}}"]).returncode == 0
            )
        else:
            assert (ROOT / m["path"]).is_file(), (path, m["path"])


# -- the checker catches what it is for -----------------------------------------------------------


def test_a_changed_figure_is_caught():
    marked = "**131.5 tok/s**<!-- result: reports/h200/gate.json single_stream_tok_s -->"
    text = page_with(marked)
    problems, _ = check(text.replace(marked, marked.replace("131.5", "135.1")))
    assert len(problems) == 1
    assert "README shows '135.1', reports/h200/gate.json single_stream_tok_s = 131.5" in problems[0]


def test_a_figure_in_another_unit_a_missing_key_or_file_is_caught():
    marked = "**131.5 tok/s**<!-- result: reports/h200/gate.json single_stream_tok_s -->"
    text = page_with(marked)
    for wrong, message in [
        (marked.replace("tok/s", "GB/s"), "writes 'GB/s' before the marker"),
        (marked.replace("single_stream_tok_s", "single_stream"), "has no figure 'single_stream'"),
        (marked.replace("gate.json", "gates.json"), "no such result file"),
        (marked.replace("<!-- result: ", "<!-- result "), "a result marker that cannot be read"),
    ]:
        problems, _ = check(text.replace(marked, wrong))
        assert len(problems) == 1 and message in problems[0], (wrong, problems)


def test_rounding_is_read_as_shown():
    assert shown(578.5, 1) == Decimal("578.5") and shown(578.5, 0) == Decimal("579")
    assert shown(836, 0) == Decimal("836") and shown(0.25, 1) == Decimal("0.3")
    (duration,) = _tokens("took 9 min 39 s here")
    assert (duration.value, duration.decimals, duration.duration) == (Decimal(579), 0, True)
    assert [t.text for t in _tokens("sm_90 tg64 1,745 s, 1.29x and 23.4%")] == ["1,745", "1.29", "23.4"]


def test_a_changed_sample_block_is_caught():
    text = README.read_text()  # the front door's sample
    assert "<!-- result-block: reports/local/provision-noop.json -->" in text
    last = load_result(REPORTS / "local" / "provision-noop.json").extra["output"].splitlines()[-1]
    edited = text.replace(f"\n{last}\n```", "\n99.99 s wall\n```")
    assert edited != text
    problems, _ = check(edited)
    assert len(problems) == 1 and "the block differs from reports/local/provision-noop.json" in problems[0]


def test_a_new_bold_figure_without_a_marker_is_caught():
    anchor = "# Where things are\n"
    text = page_with(anchor)
    new = "\nA new run took **12.3 s** and **2 min 5 s** at **1 / 2 MB/s**; the plan says **64**, **8192 x 2**.\n"
    added = text.replace(anchor, anchor + new)
    problems, covered = check(added)
    assert problems == []
    found = [f.split(": ", 2)[2] for f in unmarked(added, covered)]
    assert found == [f"{x} has no result marker" for x in ("12.3", "2 min 5 s", "1", "2")]


def test_the_bench_section_and_the_ci_paragraph_are_under_the_rule():
    """They were exempt while another change rewrote them; now an edited figure there fails."""
    text = page_with("**40.6 min**")
    assert not PENDING and unmarked(text, check(text)[1]) == []
    edited = text.replace("**40.6 min**", "**39.0 min**")
    assert edited != text and check(edited)[0]


def test_a_result_file_without_its_provenance_fails_validation(tmp_path):
    good = load_result(REPORTS / "h200" / "gate.json").model_dump(by_alias=True)
    parse_result(good)
    for missing in ("command", "commit", "date"):
        with pytest.raises(ResultError, match=rf"{missing}: Field required"):
            parse_result({k: v for k, v in good.items() if k != missing}, "gate.json")
        with pytest.raises(ResultError, match=missing):
            parse_result({**good, missing: ""}, "gate.json")
    # and a README marker naming such a file is a problem, not a pass
    (tmp_path / "reports" / "h200").mkdir(parents=True)
    (tmp_path / "reports" / "h200" / "gate.json").write_text('{"schema": 1, "title": "t"}')
    problems, _ = check("**131.5 tok/s**<!-- result: reports/h200/gate.json single_stream_tok_s -->\n", tmp_path)
    assert len(problems) == 1 and "Field required" in problems[0]
