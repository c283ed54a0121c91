"""The engine interface's server facts (plan/engine_base.py): each engine names its own server,
and what the bench and the layout ask of it comes from there."""

import pytest

from playbooks.plan.engines import ENGINES, EXLLAMAV2, LLAMACPP, engine_of_server
from playbooks.steps.measure.bench_client import request_body


def test_each_engine_names_its_own_server():
    servers = [e.server for e in ENGINES]
    assert all(servers) and len(set(servers)) == len(servers), servers
    assert all(engine_of_server(e.server) is e for e in ENGINES)
    with pytest.raises(ValueError, match="unknown server 'vllm'; known: llama-server, tabbyapi"):
        engine_of_server("vllm")


@pytest.mark.parametrize(
    ("e", "field"), [(LLAMACPP, "ignore_eos"), (EXLLAMAV2, "ban_eos_token")], ids=lambda x: getattr(x, "name", x)
)
def test_a_bench_request_runs_to_max_tokens_in_its_servers_terms(e, field):
    # each server gets the field it honours (llama-server's extension, TabbyAPI's sampler
    # option), and only that one
    body = request_body("hi", 16, 7, e.server)
    assert body[field] is True
    assert not {"ignore_eos", "ban_eos_token"} - {field} & body.keys()
    assert (body["max_tokens"], body["seed"], body["stream"]) == (16, 7, True)
