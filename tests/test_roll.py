"""A rolling change's parts, pure: HAProxy's runtime API read back (``show stat`` captured from
Debian 12's HAProxy 2.6.12 while one server drained with a request in flight, and once it
finished: tests/fixtures/haproxy-2.6-show-stat-*.csv), the drain and return decided from it,
the record `invoke lb` leaves on a backend host, and one server per model out at a time.

What the real parts do under load: tests/test_roll_real.py (managed processes) and
tests/test_layout_real.py (systemd, through the CLI)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from playbooks.conduct.fronted import Fronted, FrontedServer, fronting, parse_fronted, record_text
from playbooks.conduct.roll import Roll, restarts
from playbooks.conduct.settings import Settings
from playbooks.errors import VoltaforgeError
from playbooks.host.base import Printer
from playbooks.host.ops import Decision, Record, Shell
from playbooks.steps.serve.balancer import parse_stats
from playbooks.steps.serve.runtime_api import DrainServer, ReadyServer, RuntimeApi, server_line

FIXTURES = Path(__file__).parent / "fixtures"
DRAINING = (FIXTURES / "haproxy-2.6-show-stat-draining.csv").read_text()
DRAINED = (FIXTURES / "haproxy-2.6-show-stat-drained.csv").read_text()
UP = (FIXTURES / "haproxy-2.6-show-stat-up.csv").read_text()  # both in rotation, nothing running
API = RuntimeApi("/run/voltaforge-lb/admin.sock", sudo=True)


def test_show_stat_gives_each_servers_state_and_what_it_runs_now():
    assert {s.name: (s.status, s.in_flight) for s in parse_stats(UP, "m")} == {"a": ("UP", 0), "b": ("UP", 0)}
    now = {s.name: (s.status, s.in_flight, s.requests) for s in parse_stats(DRAINING, "m")}
    assert now == {"a": ("DRAIN", 1, 1), "b": ("UP", 1, 1)}
    after = {s.name: (s.status, s.in_flight) for s in parse_stats(DRAINED, "m")}
    assert after == {"a": ("DRAIN", 0), "b": ("UP", 0)}


def test_a_drain_is_one_command_to_the_socket_and_ok_once_drained():
    drain = DrainServer(API, "m", "b", 300)
    decided = drain.decide(parse_stats(UP, "m"))
    assert decided.commands == (API.shown("set server model_m/b state drain"),) and drain.alone is None
    assert "UP, 0 in flight" in decided.reason
    # drained, a request still running: sent again, then waited for
    still = DrainServer(API, "m", "a", 300).decide(parse_stats(DRAINING, "m"))
    assert still.commands and "1 in flight" in still.reason
    done = DrainServer(API, "m", "a", 300)
    assert done.decide(parse_stats(DRAINED, "m")).commands == () and done.requests == 1


def test_the_only_server_in_rotation_is_said_and_a_server_gone_is_changed_in_place():
    # a is drained: b is the model's last server in rotation
    last = DrainServer(API, "m", "b", 300)
    last.decide(parse_stats(DRAINED, "m"))
    assert last.alone and "only server of model m in rotation" in last.alone and "503" in last.alone
    # a model of one server
    single = DrainServer(API, "m", "b", 300)
    single.decide([s for s in parse_stats(UP, "m") if s.name == "b"])
    assert single.alone
    gone = DrainServer(API, "m", "zz", 300).decide(parse_stats(DRAINED, "m"))
    assert gone.commands == () and "no longer lists zz" in gone.reason


def test_back_in_rotation_once_up():
    back = ReadyServer(API, "m", "a")
    decided = back.decide(next(s for s in parse_stats(DRAINED, "m") if s.name == "a"))
    assert decided.commands == (API.shown("set server model_m/a state ready"),) and back.requests == 1
    assert ReadyServer(API, "m", "b").decide(parse_stats(DRAINED, "m")[1]).commands == ()


def test_names_that_reach_the_socket_are_checked():
    for bad in ("a b", "a;reboot", "m/x", "", "-x"):
        with pytest.raises(VoltaforgeError):
            server_line(bad, "s", "drain")
        with pytest.raises(VoltaforgeError):
            server_line("m", bad, "drain")
    with pytest.raises(VoltaforgeError, match="shorter prefix"):
        RuntimeApi("/" + "x" * 87 + "/admin.sock", sudo=False)  # 99 bytes
    with pytest.raises(VoltaforgeError, match="not an absolute path"):
        RuntimeApi("admin.sock", sudo=False)
    # the socket's path is quoted on the command line; the command itself goes on stdin
    shown = RuntimeApi("/srv/my lb/admin.sock", sudo=False).command()
    assert shown.endswith("'/srv/my lb/admin.sock'")


def test_the_record_on_a_backend_host_reads_back_and_junk_is_one_line():
    f = Fronted("lb-01", API, (FrontedServer(18100, "tiny-llama", "box-18100", 3),))
    (read,) = parse_fronted(record_text(f).replace("\n", "") + "\n")
    assert read == f
    assert fronting([read], 18100) == [(read, f.servers[0])] and fronting([read], 18101) == []
    for junk in ("{}", "not json", '{"balancer": "a b", "socket": "/s", "sudo": false, "servers": []}'):
        with pytest.raises(VoltaforgeError, match="run `invoke lb` again"):
            parse_fronted(junk)


def test_only_a_restart_makes_a_turn():
    assert restarts(Decision.act("x", Shell("systemctl restart u")))
    assert not restarts(Decision.act("the record learns its recipe", Record("/p", "the recipe")))


class Lines(Printer):
    def __init__(self) -> None:
        super().__init__()
        self.said: list[str] = []

    def line(self, host: str, text: str) -> None:
        self.said.append(f"{host}: {text}")


class Named:
    name = "box"


def test_one_server_of_a_model_out_at_a_time_and_other_models_in_parallel(tmp_path):
    roll = Roll(Settings(inventory=tmp_path / "none.yaml"))
    lines = Lines()
    order: list[str] = []
    lane = [("lb", "m")]
    entered = threading.Event()

    def first() -> None:
        with roll._hold(Named(), lines, "a", lane, dry_run=False):  # type: ignore[arg-type]
            entered.set()
            time.sleep(0.3)
            order.append("a done")

    t = threading.Thread(target=first)
    t.start()
    entered.wait(5)
    # another model's lane is free at once
    with roll._hold(Named(), lines, "c", [("lb", "other")], dry_run=False):  # type: ignore[arg-type]
        order.append("c")
    with roll._hold(Named(), lines, "b", lane, dry_run=False):  # type: ignore[arg-type]
        order.append("b")
    t.join()
    assert order == ["c", "a done", "b"]
    assert "box: b: waiting for a (model m: one server out at a time)" in lines.said
