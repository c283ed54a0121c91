"""A measurement carries the host facts it depends on and its time, and tune reuses it only on the
same facts and within its age (issue 34, item 5): the provenance fact against this machine's own
output and a captured nvidia-smi row, and the reuse rule, pure."""

from __future__ import annotations

import platform
import subprocess
from datetime import datetime, timezone
from pathlib import Path

from playbooks.conduct.tune_store import kept_level
from playbooks.facts.provenance import Provenance, parse_provenance, provenance_command

FIXTURES = Path(__file__).parent / "fixtures"


def test_the_provenance_of_this_machine(tmp_path):
    """tests/fixtures/thishost-provenance.txt: the command's output on this machine (no GPU, no
    stored bandwidth fact). Run again here it gives this kernel, and a stored fact's time."""
    captured = parse_provenance((FIXTURES / "thishost-provenance.txt").read_text())
    assert captured.gpu == "none" and captured.membw_at == "none" and captured.kernel != "unknown"
    (tmp_path / "facts").mkdir()
    (tmp_path / "facts" / "membw.json").write_text('{"version": 1, "measured_at": "2026-12-01T15:00:00Z"}\n')
    out = subprocess.run(["sh", "-c", provenance_command(str(tmp_path))], capture_output=True, text=True, check=True)
    now = parse_provenance(out.stdout)
    assert now.kernel == platform.release() and now.membw_at == "2026-12-01T15:00:00Z"


def test_a_gpu_line_and_output_that_is_not_ours():
    # the name and driver of the Volta row of nvidia-smi-csv-compute-cap-titanv-volta-driver570.txt
    # (../shared/fixtures), as --query-gpu=name,driver_version --format=csv,noheader prints them
    got = parse_provenance("kernel=5.15.0-105-generic\ncpu_model=Intel(R) Xeon(R)\ngpu=NVIDIA TITAN V, 570.86.15\n")
    assert got.gpu == "NVIDIA TITAN V, 570.86.15" and got.membw_at == "none"
    assert parse_provenance("") == Provenance() and parse_provenance("junk\n=\nx=y\n") == Provenance()


def _row(level: float, at: str, prov: Provenance, key: str = "k", error: str | None = None) -> dict:
    lv = {"decode": {"mean": level}} | ({"error": error} if error else {})
    return {"key": key, "level": lv, "at": at, "provenance": prov.as_dict()}


def test_a_kept_measurement_is_reused_only_on_the_same_facts_and_within_its_age():
    here = Provenance("6.1.0-28-amd64", "AMD EPYC", "Tesla V100-SXM2-16GB, 535.183.01", "2026-12-01T15:00:00Z")
    now = datetime(2026, 12, 3, 8, 0, tzinfo=timezone.utc)
    fresh = _row(120.0, "2026-12-02T08:00:00Z", here)
    assert kept_level([fresh], "k", here, now, 7) == ({"decode": {"mean": 120.0}}, None)
    assert kept_level([fresh], "other", here, now, 7) == (None, None)  # nothing kept: nothing said
    # a new driver: measured again, saying which fact moved
    driver = Provenance(here.kernel, here.cpu_model, "Tesla V100-SXM2-16GB, 550.54.15", here.membw_at)
    level, why = kept_level([fresh], "k", driver, now, 7)
    assert level is None and why is not None and "gpu: 'Tesla V100-SXM2-16GB, 535.183.01' -> " in why
    # the bandwidth fact measured again: the ceiling the figure was judged against moved
    level, why = kept_level(
        [fresh], "k", Provenance(here.kernel, here.cpu_model, here.gpu, "2026-12-03T07:00:00Z"), now, 7
    )
    assert level is None and "membw_at" in (why or "")
    # too old, or kept before measurements had a time or facts
    old = _row(118.0, "2026-11-20T08:00:00Z", here)
    assert kept_level([old], "k", here, now, 7) == (None, "it is older than 7 days")
    assert kept_level([old], "k", here, now, 30)[0] == {"decode": {"mean": 118.0}}
    legacy = {"key": "k", "level": {"decode": {"mean": 117.0}}}
    level, why = kept_level([legacy], "k", here, now, 7)
    assert level is None and "not recorded" in (why or "")
    # a failed measurement is never reused; a usable one after it is
    failed = _row(0.0, "2026-12-02T08:00:00Z", here, error="the server exited")
    assert kept_level([failed, fresh], "k", here, now, 7)[0] == {"decode": {"mean": 120.0}}
