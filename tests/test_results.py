"""playbooks/results.py: a result file is written whole with what it was measured on, and a
file that cannot say how, where or when it was measured does not load."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from playbooks.results import (
    MEASURED_HERE,
    Result,
    ResultError,
    checkout_commit,
    describe_machine,
    load_result,
    parse_result,
    write_result,
)
from tests.helpers import ROOT

GOOD = {
    "schema": 1,
    "title": "a copy on every core",
    "figures": {"copy_gb_s": 46.0, "threads": 2},
    "units": {"copy_gb_s": "GB/s", "threads": "count"},
    "command": "python3 playbooks/facts/probes/membw_probe.py --threads 2",
    "commit": "e5dfcb1",
    "machine": "Debian 12, 2 CPUs",
    "date": "2026-12-01",
    "source": MEASURED_HERE,
}


def test_write_result_fills_commit_machine_and_date_and_loads_back(tmp_path):
    path = tmp_path / "reports" / "local" / "x.json"
    figures, units = {"wall_s": 2.88, "hosts": 4}, {"wall_s": "s", "hosts": "count"}
    written = write_result(path, "t", figures, units, "invoke provision")
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    assert written.commit == head.stdout.strip() == checkout_commit()
    assert written.machine == describe_machine() and "CPUs" in written.machine
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", written.date)
    assert written.source == MEASURED_HERE and not written.transcribed
    assert load_result(path) == written
    data = json.loads(path.read_text())
    assert list(data)[:2] == ["schema", "title"] and data["figures"] == {"wall_s": 2.88, "hosts": 4}
    assert not list(path.parent.glob("*.partial"))


def test_write_result_takes_what_it_is_given(tmp_path):
    r = write_result(
        tmp_path / "r.json",
        "t",
        {"a_s": 1.0},
        {"a_s": "s"},
        "cmd",
        source="transcribed: the README of commit e5dfcb1",
        machine="a lent H200",
        notes="n",
        extra={"output": "text"},
        commit="20cabc3",
        date="2026-11-30",
    )
    assert (r.machine, r.commit, r.date, r.transcribed, r.extra) == (
        "a lent H200",
        "20cabc3",
        "2026-11-30",
        True,
        {"output": "text"},
    )


def test_outside_a_checkout_the_commit_must_be_given(tmp_path, monkeypatch):
    monkeypatch.setattr("playbooks.results.checkout_commit", lambda where=None: None)
    with pytest.raises(ResultError, match="no commit"):
        write_result(tmp_path / "r.json", "t", {"a": 1}, {"a": "s"}, "cmd")
    assert not (tmp_path / "r.json").exists()
    assert checkout_commit(tmp_path) is None  # tmp_path is no git checkout


def test_write_result_refuses_a_bad_result_and_writes_nothing(tmp_path):
    with pytest.raises(ResultError, match=r"r\.json: units must name exactly the figures"):
        write_result(tmp_path / "r.json", "t", {"a": 1}, {"b": "s"}, "cmd")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"command": ""}, "command"),
        ({"command": "  "}, "command: must not be blank"),
        ({"commit": "HEAD"}, "commit: must be a git commit sha"),
        ({"commit": "e5dfcb"}, "commit"),
        ({"date": "30.11.2026"}, "date: must be a UTC date"),
        ({"date": "2026-02-30"}, "date"),
        ({"date": "2026-11-30 12:00"}, "date"),
        ({"machine": ""}, "machine"),
        ({"source": "measured"}, "source: must be"),
        ({"source": "transcribed: "}, "source"),
        ({"figures": {}}, "figures"),
        ({"figures": {"copy_gb_s": float("nan"), "threads": 2}}, "not a finite number"),
        ({"figures": {"copy_gb_s": True, "threads": 2}}, "not a finite number"),
        ({"figures": {"Copy GB/s": 1.0, "threads": 2}}, "figure name"),
        ({"units": {"copy_gb_s": "GB/s"}}, r"without a unit \['threads'\]"),
        ({"units": {"copy_gb_s": "GB/s", "threads": " "}}, "blank unit"),
        ({"schema": 2}, "schema"),
        ({"speed": 3}, "speed: Extra inputs are not permitted"),
    ],
)
def test_an_invalid_result_is_refused_naming_the_field(change, message):
    with pytest.raises(ResultError, match=message):
        parse_result({**GOOD, **change}, "reports/x.json")


@pytest.mark.parametrize("missing", ["command", "commit", "date", "machine", "source", "title", "units"])
def test_a_result_without_its_provenance_is_refused(missing):
    data = {k: v for k, v in GOOD.items() if k != missing}
    with pytest.raises(ResultError, match=rf"reports/x\.json: {missing}: Field required"):
        parse_result(data, "reports/x.json")


def test_load_result_errors_name_the_file(tmp_path):
    with pytest.raises(ResultError, match="no such result file"):
        load_result(tmp_path / "none.json")
    (tmp_path / "bad.json").write_text("{\n  'a': 1\n}")
    with pytest.raises(ResultError, match=r"bad\.json:2: invalid JSON"):
        load_result(tmp_path / "bad.json")
    (tmp_path / "list.json").write_text("[]")
    with pytest.raises(ResultError, match="holds a JSON object"):
        load_result(tmp_path / "list.json")


def test_the_file_round_trips_by_its_json_names():
    r = Result.model_validate(GOOD)
    assert json.loads(r.as_json()) == {**GOOD, "notes": "", "extra": {}}
