"""`bash scripts/device_check.sh --rehearse`, as CI runs it: the EXL2 phase's payload made for
this Python and measured against what one device call carries, its wheelhouse installed
offline into a clean venv, each phase run until its first GPU call, the results archive
written. So the device script cannot rot while no GPU is lent (issue 37 item 3)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.helpers import ROOT

VENDORED = ROOT.parent / "shared" / "vendor" / "tabbyAPI-79126f904c2e00aece026b36bb70bbb87e4892b2.tar.gz"


@pytest.mark.slow
def test_the_device_script_rehearses_here_to_its_first_gpu_call():
    if not VENDORED.is_file():
        pytest.skip(f"{VENDORED} is not here")
    env = {**os.environ, "PYTHON": sys.executable, "VF_TABBYAPI": str(VENDORED)}
    r = subprocess.run(
        ["bash", "scripts/device_check.sh", "--rehearse"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    m = re.search(r"= ([\d.]+) MiB of 64 \((\d+) wheels", out)
    assert m and float(m.group(1)) <= 64, out
    assert "== exl2 facts: done" in out and "== exl2 install: done" in out
    # every later phase runs in the device venv until its first GPU call
    assert "== exl2 ext: needs a GPU - needs a GPU: the build step's EnsureExllamav2" in out
    assert "== exl2 convert: needs a GPU - needs a GPU: the quantize step's EnsureExl2Quant at 3.3, 4 bpw" in out
    assert "== exl2 tabbyapi: needs a GPU - needs a GPU: the tabbyapi step (its proof starts TabbyAPI" in out
    # the archive holds each phase's result
    names = {f"exl2-{p}.json" for p in ("facts", "install", "ext", "convert", "tabbyapi")}
    assert names <= set(out.split())
    # what is not written yet is said, not passed
    assert "== exl2 bench: not written yet" in out
