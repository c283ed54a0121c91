"""The quiet view of a run (cli/live.py), fed the lines a real cold `invoke provision` printed
(its log, fixture): piped, a line per step and the failure with the failing command's last
lines; on a terminal, a live line with the compile's and the quantizer's progress; with -v,
every line."""

from __future__ import annotations

import io

from rich.console import Console

from playbooks.cli.live import TAIL_LINES, LiveView
from tests.helpers import fixture_body

LINES = fixture_body("thishost-provision-log-cold-and-gate-failure.txt").splitlines()


def feed(view: LiveView, lines=LINES) -> None:
    with view:
        for line in lines:
            view.line("local", line)


def test_piped_it_is_a_line_per_step_and_the_failure_with_what_led_to_it():
    out = io.StringIO()
    feed(LiveView(Console(file=out, width=120, force_terminal=False)))
    shown = out.getvalue().splitlines()
    assert shown[:3] == ["[local] build", "[local] quantize", "[local] gate"]
    # the failing command's output before the failure, then the failure, nothing else
    *before, failure = shown[shown.index("[local] gate") + 1 :]
    assert failure.startswith("[local] failed: Ensure voltaforge-llama-server passes the gate")
    assert before == [
        "[local]   | $ sudo systemctl daemon-reload && systemctl enable --quiet -- "
        "voltaforge-llama-server.service && systemctl restart -- voltaforge-llama-server.service"
    ]
    assert len(shown) == 5 and not any("Building CXX" in x or "Retrying" in x for x in shown)


def test_a_failure_after_much_output_shows_its_last_lines_only():
    out = io.StringIO()
    lines = ["== build ==", "$ cmake --build b", *(f"[{i:3d}%] Building CXX object x/f{i}.o" for i in range(40))]
    feed(LiveView(Console(file=out, width=120, force_terminal=False)), [*lines, "failed: Ensure llama.cpp - exit 2"])
    shown = out.getvalue().splitlines()
    assert len(shown) == 1 + TAIL_LINES + 1 and shown[-2] == "[local]   | [ 39%] Building CXX object x/f39.o"


def test_on_a_terminal_the_live_line_follows_the_compile_and_the_quantizer():
    view = LiveView(Console(file=io.StringIO(), width=120, force_terminal=True))
    seen = []
    with view:
        for line in LINES:
            view.line("local", line)
            assert view._progress is not None
            seen += [t.description for t in view._progress.tasks]
    assert any(s.startswith("[local] build: [") and "%] " in s and s.endswith(".o") for s in seen), seen
    assert "[local] quantize: [3/39] token_embd.weight" in seen
    assert "[local] build: changed: Ensure the llama.cpp 0c1e570 tree is unpacked" in seen


def test_verbose_shows_every_line_as_it_comes():
    out = io.StringIO()
    feed(LiveView(Console(file=out, width=120, force_terminal=True), verbose=True))
    assert out.getvalue().splitlines() == [f"[local] {line}" for line in LINES]
