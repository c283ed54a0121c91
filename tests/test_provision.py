"""`invoke provision`: the parts that need no built host.

- A recipe that cannot fit is refused at preflight with the plan's numbers, before anything
  is written (the prefix is not even created); a dry run goes on past it, each later step
  saying what it would run once the blocking checks are fixed.
- Several hosts at once: an unknown one fails in one line, the other is still done (here a
  dry run of this machine, which changes nothing), the exit code says one failed.
- A host whose key changed: one line, nothing run there.
- The summary's pure parts: a step's status and its one-line why.

The whole pipeline on a real host (from nothing to a passing gate, again, a recipe change, a
failed gate, Ctrl-C, two hosts one broken) is tests/test_provision_real.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from playbooks.conduct.provision import step_status, step_why
from playbooks.host.ops import Change
from tests.helpers import ROOT, inventory_for


def provision(*args: str, env: dict[str, str] | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "invoke", "-r", str(ROOT), "provision", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **(env or {})},
    )


def tiny_variant(tmp_path: Path, name: str, **over) -> Path:
    data = yaml.safe_load((ROOT / "recipes" / "tiny-cpu.yaml").read_text())
    data.update(over)
    (tmp_path / "defaults.yaml").write_text((ROOT / "recipes" / "defaults.yaml").read_text())
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_a_recipe_that_cannot_fit_is_refused_at_preflight_with_the_plans_numbers(tmp_path):
    huge = tiny_variant(tmp_path, "huge", context=2048, parallel=4000)
    prefix = tmp_path / "prefix"
    r = provision("--host", "local", "--recipe", str(huge), env={"INVOKE_VOLTAFORGE_PREFIX": str(prefix)})
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr
    [line] = [x for x in r.stdout.splitlines() if x.startswith("local: failed at preflight")]
    assert "fit: Q4_K_M does not fit by" in line and "at 2048 tokens x 4000: needs" in r.stdout
    assert "GiB (weights" in r.stdout and "KV " in r.stdout and "compute " in r.stdout
    assert "fix: choose" in r.stdout
    assert not prefix.exists()  # nothing written: not even the prefix or its lock


def test_a_dry_run_goes_past_a_blocked_preflight_with_the_plan_of_work(tmp_path):
    """Issue 22, tried as a new user would: a dry run of a V100 recipe on this machine (no GPU)
    printed no command at all. Now: preflight fails with every blocking check (here the missing
    GPU and a plan that cannot fit), each later step says what it would run once fixed (the
    build's cmake among them), the fix line repeats the command as typed, and nothing is
    written."""
    big = ROOT / "recipes" / "qwen2.5-14b-v100-16gb.yaml"
    data = yaml.safe_load(big.read_text())
    data["parallel"] = 4000  # no plan fits this
    data["model"]["config"] = str(ROOT / "recipes" / data["model"]["config"])
    (tmp_path / "defaults.yaml").write_text((ROOT / "recipes" / "defaults.yaml").read_text())
    (tmp_path / "crowded.yaml").write_text(yaml.safe_dump(data))
    prefix = tmp_path / "prefix"
    out = tmp_path / "summary.json"
    r = provision(
        "--host", "local", "--recipe", "crowded.yaml", "--dry-run", "--json", str(out),
        env={"INVOKE_VOLTAFORGE_PREFIX": str(prefix)}, cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr
    [o] = json.loads(out.read_text())
    steps = {s["step"]: s for s in o["steps"]}
    pre = steps["preflight"]
    assert pre["status"] == "failed" and "gpu: no NVIDIA GPU visible" in pre["why"], pre
    assert "fit: Q4_K_M does not fit by" in pre["why"]  # the second blocking check, on the same line
    assert steps["toolchain"]["status"] == steps["build"]["status"] == "would run after the fix", steps
    assert "would run: " in r.stdout and "cmake" in r.stdout  # the build's commands, already known
    assert o["fix"].endswith("then `invoke provision --host local --recipe crowded.yaml` resumes at preflight")
    assert "install the NVIDIA driver" in o["fix"]
    assert not prefix.exists()


def test_several_hosts_one_unknown_the_other_still_done(tmp_path):
    prefix = tmp_path / "prefix"
    out = tmp_path / "summary.json"
    r = provision(
        "--host",
        "local,no-such-host.invalid",
        "--dry-run",
        "--json",
        str(out),
        env={"INVOKE_VOLTAFORGE_PREFIX": str(prefix)},
    )
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr
    by_host = {o["host"]: o for o in json.loads(out.read_text())}
    bad = by_host["no-such-host.invalid"]
    assert bad["failed"] and bad["steps"][0]["status"] == "failed"
    assert "cannot resolve host name 'no-such-host.invalid'" in bad["steps"][0]["why"]
    assert "\n" not in bad["steps"][0]["why"]
    assert all(s["status"] == "not reached" for s in bad["steps"][1:])
    local = by_host["local"]
    assert not local["failed"], local
    # a dry run of a machine that has nothing: the first steps would change, nothing failed
    assert local["steps"][0]["status"] == "ok"
    assert local["steps"][1]["status"] == "would change"
    assert not prefix.exists()  # and it changed nothing
    assert "1 of 2 hosts provisioned; failed: no-such-host.invalid" in r.stdout
    # each host has its own log
    assert Path(local["log"]).read_text() and Path(bad["log"]).name == "no-such-host.invalid.log"


@pytest.mark.slow
def test_a_host_whose_key_changed_fails_in_one_line(sshd_host, tmp_path):
    inv = inventory_for(tmp_path, "box", sshd_host, prefix=str(sshd_host.prefix / "vf"))
    sshd_host.regenerate_host_key()
    r = provision("--host", "box", "--inventory", str(inv), cwd=tmp_path)
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr
    [line] = [x for x in r.stdout.replace("\n", " ").split("box: failed at ")[1:2]]
    assert line.startswith("preflight: box (127.0.0.1:") and "host key CHANGED" in line
    assert list(sshd_host.prefix.iterdir()) == []  # nothing ran there


def _change(status: str, why: str, step: str = "Ensure x") -> Change:
    return Change("h", step, status, why)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "changes,dry,status,why",
    [
        ([_change("ok", "a"), _change("ok", "b")], False, "ok", "all 2 in place"),
        ([_change("ok", "present (3 files)")], False, "ok", "present (3 files)"),
        ([_change("ok", "a"), _change("changed", "not running")], False, "changed", "1 of 2 changed: not running"),
        ([_change("changed", "x"), _change("changed", "x")], True, "would change", "2 of 2 changed: x"),
        ([_change("changed", "x"), _change("failed", "disk full")], False, "failed", "disk full"),
    ],
)
def test_a_steps_status_and_why(changes, dry, status, why):
    assert step_status(changes, dry) == status
    assert step_why(changes) == why


def test_a_long_why_is_cut_to_one_line_at_a_word():
    why = step_why([_change("changed", "w" * 150), _change("changed", "v" * 150)])
    assert len(why) < 230 and why.endswith("…")
    # words: the cut falls between two, never inside one (issue 52: "nothing was ch")
    long = [_change("changed", f"unit {n} was rewritten: its ExecStart changed") for n in range(9)]
    why = step_why(long)
    assert why.endswith("…") and len(why) <= len("9 of 9 changed: ") + 200
    kept = why.removeprefix("9 of 9 changed: ").removesuffix("…").replace(";", " ").split()
    assert kept and set(kept) <= {"unit", "was", "rewritten:", "its", "ExecStart", "changed", *"012345678"}
