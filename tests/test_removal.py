"""steps/serve/removal.py's decisions, pure (the real runs: tests/test_lifecycle_real.py on this
machine, tests/test_layout_real.py under systemd): what is stopped, what is removed, and what is
refused because a record on the host named it."""

import pytest

from playbooks.facts.service import UnitState
from playbooks.host.ops import OperationError
from playbooks.steps.serve.removal import EnsureAbsent, EnsureStopped, Present, parse_present, present_command
from playbooks.steps.serve.service_manager import ProcessRunner, Running, Systemd

PREFIX = "/opt/vf"
UNIT = "/etc/systemd/system/voltaforge-tiny.service"


@pytest.mark.parametrize(
    "state,commands",
    [
        (UnitState("active", "running", 10, enabled="enabled", loaded="loaded"), ["disable --now"]),
        (UnitState("inactive", "dead", enabled="enabled", loaded="loaded"), ["disable --now"]),
        (UnitState("activating", "start", enabled="disabled", loaded="loaded"), ["disable --now"]),
        (UnitState("inactive", "dead", enabled="disabled", loaded="loaded"), []),
        (UnitState("inactive", "dead", enabled="", loaded="not-found"), []),
        (UnitState("failed", "failed", enabled="disabled", loaded="loaded"), ["reset-failed"]),
    ],
)
def test_a_unit_is_stopped_and_disabled_while_it_runs_or_is_enabled(state, commands):
    d = EnsureStopped(Systemd("voltaforge-tiny@1.service"), "voltaforge-tiny@1").decide(state)
    assert [c for c in commands if all(c in s for s in d.shown())] == commands and len(d.shown()) == len(commands)
    assert all("-- voltaforge-tiny@1.service" in s for s in d.shown())


def test_a_managed_process_is_stopped_only_when_it_runs():
    mgr = ProcessRunner(f"{PREFIX}/deploy/x", "/bin/llama-server", ("/bin/llama-server",))
    op = EnsureStopped(mgr, "x")
    assert op.decide(Running(True, "1:2", 4242, "pid 4242")).reason == "running (pid 4242)"
    assert op.decide(Running(False, "", 0, "pid 0")).commands == ()


def test_what_is_there_goes_with_the_directories_it_leaves_empty():
    etc = "/etc/voltaforge/tabbyapi"
    paths = [UNIT, f"{etc}/config.yml", f"{PREFIX}/deploy/x"]
    op = EnsureAbsent("x", paths, PREFIX, sudo=True, dirs=[etc], reload=True)
    d = op.decide(Present(frozenset({UNIT, f"{etc}/config.yml"}), {etc: frozenset({"config.yml"})}))
    assert d.shown() == [f"rm -rf -- {UNIT} {etc}/config.yml", f"rmdir -- {etc}", "systemctl daemon-reload"]
    # another file in the directory keeps it; nothing there: ok
    d = op.decide(Present(frozenset({f"{etc}/config.yml"}), {etc: frozenset({"config.yml", "other"})}))
    assert d.shown() == [f"rm -rf -- {etc}/config.yml"]
    assert op.decide(Present(frozenset(), {})).commands == ()


@pytest.mark.parametrize(
    "path",
    [
        "/etc/voltaforge/secrets/key",  # the operator's
        "/etc/passwd",
        f"{PREFIX}/models/m",  # weights stay
        f"{PREFIX}/llama.cpp/current",  # builds stay
        f"{PREFIX}/deploy",  # the whole deploy directory
        f"{PREFIX}/deploy/../models",
        "/etc/systemd/system/sshd.service",
        "relative/path",
        "/var/lib/prometheus",  # Debian's package's own data
        "/var/lib/private",
        f"{PREFIX}/monitor",  # the directory itself: emptied, then rmdir'd only when empty
    ],
)
def test_a_path_voltaforge_does_not_install_is_refused(path):
    with pytest.raises(OperationError, match="not a file voltaforge installs"):
        EnsureAbsent("x", [path], PREFIX, sudo=False)


def test_the_presence_read_round_trips_odd_names(tmp_path):
    import subprocess

    odd = tmp_path / "a dir"
    odd.mkdir()
    (odd / "it's").write_text("")
    link = tmp_path / "dangling"
    link.symlink_to(tmp_path / "nowhere")
    command = present_command([str(link), str(tmp_path / "missing")], [str(odd)])
    out = subprocess.run(["sh", "-c", command], capture_output=True, text=True).stdout
    assert parse_present(out) == Present(frozenset({str(link)}), {str(odd): frozenset({"it's"})})
