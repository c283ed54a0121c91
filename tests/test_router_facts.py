"""facts/router.py's parsers on what the pinned router and /proc print, and on garbage (which
parses to nothing, never an exception). The real router's output is parsed in
tests/test_set_deploy_real.py and tests/test_set_edge_real.py, as `invoke status` reads it."""

from __future__ import annotations

import json

import pytest

from playbooks.facts.router import Child, Member, parse_children, parse_models, parse_routed, routed_command
from tests.helpers import fixture_body

#: the shape of GET /models at 0c1e570 (tools/server/server-models.cpp, get_router_models), one
#: member running, one never loaded, one whose child died
MODELS = {
    "data": [
        {"id": "small", "object": "model", "status": {"value": "loaded", "args": ["llama-server", "--port", "41077"]}},
        {"id": "mid", "object": "model", "status": {"value": "unloaded", "args": []}},
        {"id": "large", "status": {"value": "unloaded", "args": [], "failed": True, "exit_code": 1}},
        {"id": "odd", "status": {"value": "exploded"}},
    ]
}


def test_the_routers_list():
    assert parse_models(json.dumps(MODELS)) == [
        Member("small", "loaded", 41077),
        Member("mid", "unloaded"),
        Member("large", "unloaded", failed=True, exit_code=1),
        Member("odd", "unknown"),
    ]
    assert parse_models(json.dumps(MODELS["data"])) == parse_models(json.dumps(MODELS))  # a bare list too


@pytest.mark.parametrize("text", ["", "not json", "[1, 2]", '{"data": 5}', '{"data": [{"id": 3}]}', "null"])
def test_garbage_is_no_members(text):
    assert parse_models(text) == []


CHILDREN = """child=4242
VmHWM:\t   61440 kB
VmRSS:\t   59392 kB
RssAnon:\t   20480 kB
RssFile:\t   38912 kB
argv=/opt/vf/llama.cpp/current/bin/llama-server --model /m/a.gguf --host 127.0.0.1 --port 41077 --alias small
child=4250
VmRSS:\t    1024 kB
"""


def test_the_children_and_what_each_holds():
    first, cut = parse_children(CHILDREN)
    assert first == Child(4242, 41077, rss_kb=59392, peak_kb=61440, anon_kb=20480, file_kb=38912)
    assert first.held_bytes == (20480 + 38912) * 1024
    assert cut == Child(4250, None, rss_kb=1024) and cut.held_bytes is None  # a record cut short
    assert parse_children("") == [] and parse_children("child=x\nVmRSS: lots\n") == []


#: a router's log at 0c1e570 as a managed process writes it (its header says which run): its own
#: stamped lines and its children's, each prefixed with the child's pid
ROUTER_LOG = "thishost-llama-server-router-0c1e570.log"


def test_when_each_member_was_last_routed_since_the_routers_latest_start(tmp_path):
    from playbooks.host.local import LocalHost

    text = fixture_body(ROUTER_LOG)
    expected = {}
    for line in text.splitlines():  # the last stamp of each model routed, read by hand
        if " proxy_reques: proxying request to model " in line and not line.startswith("["):
            stamp, name = line.split()[0], line.split()[-4]
            minutes, s, ms, us = (int(p) for p in stamp.split("."))
            expected[name] = minutes * 60 + s + ms / 1e3 + us / 1e6
    assert sorted(expected) == ["large", "mid", "small"]
    assert parse_routed(text) == pytest.approx(expected) and expected["mid"] > expected["large"] > expected["small"]
    # a child's start says "initializing" too: only the router's own start forgets what it routed
    started = text.splitlines()[0]
    assert "llama_server: initializing" in started and parse_routed(text + "\n" + started) == {}
    # the command run here on the file: the router's start and one line per model
    log = tmp_path / "server.log"
    log.write_text(text)
    with LocalHost() as host:
        out = host.run(routed_command(str(log)), check=False, stream=False).stdout
        assert parse_routed(out) == parse_routed(text) and len(out.splitlines()) == 1 + len(expected)
        assert host.run(routed_command(str(tmp_path / "none.log")), check=False, stream=False).stdout == ""


@pytest.mark.parametrize(
    "text",
    ["", "I srv  proxy_reques: proxying request to model small on port 4\n", "0.00.1.2 I srv  proxy_reques: x\n"],
)
def test_a_log_without_stamps_says_nothing(text):
    assert parse_routed(text) == {}


def test_a_members_line_says_when_it_was_last_used():
    from playbooks.cli.status import _member_text

    base = {"recipe": "small", "state": "loaded", "child_pid": 7, "held_bytes": 2**20}
    assert _member_text(base | {"used": True, "idle_s": 75}) == (
        "small: loaded, child pid 7, holds 1.0 MiB, last used 1 min 15 s ago"
    )
    assert _member_text(base | {"state": "unloaded", "child_pid": None, "used": False, "idle_s": None}) == (
        "small: unloaded, not used since the router started"
    )
    assert _member_text(base | {"used": None, "idle_s": None}) == "small: loaded, child pid 7, holds 1.0 MiB"


def test_what_each_process_holds_on_the_cards():
    """facts/gpu_processes.py on two transcribed captures (no card here): each pid's memory in
    bytes, a name with a path kept whole; a process on two cards summed; garbage is nothing."""
    from playbooks.facts.gpu_processes import parse_compute_apps
    from playbooks.plan.gpus import MIB
    from tests.helpers import fixture_body

    l40s = parse_compute_apps(fixture_body("nvidia-smi-compute-apps-l40s-three-processes.txt"))
    assert l40s == {44378: 1836 * MIB, 44966: 974 * MIB, 52114: 6294 * MIB}
    assert sum(l40s.values()) == 9104 * MIB  # the capture's own sum (9123 MiB used on the card)
    vllm = parse_compute_apps(fixture_body("nvidia-smi-compute-apps-two-vllm-engines.txt"))
    assert vllm == {3858903: 6265 * MIB, 3880364: 5530 * MIB}
    two_cards = "pid, process_name, used_gpu_memory [MiB]\n7, llama-server, 100 MiB\n7, llama-server, 50 MiB\n"
    assert parse_compute_apps(two_cards) == {7: 150 * MIB}
    assert parse_compute_apps("8, x, [N/A]\nnot, a, line\n9, y, 3 parsecs\n") == {}


def test_a_child_on_a_card_is_shown_with_what_it_holds_there():
    from playbooks.cli.status import _member_text

    m = {"recipe": "chat", "state": "loaded", "child_pid": 7, "held_bytes": 6 * 2**30, "held_on": "GPU"}
    assert _member_text(m) == "chat: loaded, child pid 7, holds 6.00 GiB on its cards"
