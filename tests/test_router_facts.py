"""facts/router.py's parsers on what the pinned router and /proc print, and on garbage (which
parses to nothing, never an exception). The real router's output is parsed in
tests/test_router_real.py, as `invoke status` will read it."""

from __future__ import annotations

import json

import pytest

from playbooks.facts.router import Child, Member, parse_children, parse_models

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
