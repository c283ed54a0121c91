"""The router's preset and command line as the llama.cpp engine renders them (issue 55): each
member's section is its own recipe's llama-server flags less what the router owns, and the
router's command line carries the plan's count. tests/test_set_edge_real.py serves them for real."""

from __future__ import annotations

import configparser
import re
import subprocess

import pytest

from playbooks.config.recipe import load_recipe
from playbooks.errors import VoltaforgeError
from playbooks.steps.serve.engine_llamacpp import (
    LLAMACPP_SERVER,
    ROUTER_OWNED,
    llama_server_argv,
    render_models_preset,
    router_argv,
)
from playbooks.steps.serve.router import RouterSet, preset_path, set_layout
from playbooks.steps.serve.units import ServerLayout, parse_exec_start
from tests.test_render import needs_systemd, stub_executables


def test_each_section_is_its_recipes_own_flags_less_what_the_router_owns():
    small = load_recipe("tiny-cpu").recipe
    big = load_recipe("qwen2.5-14b-v100-32gb").recipe
    text = render_models_preset(
        [(small, "/srv/m/small.gguf"), (big, "/srv/m/big.gguf")], load_at_start=frozenset({big.served_name})
    )
    ini = configparser.ConfigParser(interpolation=None, default_section="*")
    ini.read_string("[top]\n" + text)  # the INI's version line sits before any section
    assert ini["top"]["version"] == "1"
    assert ini.sections() == ["top", small.served_name, big.served_name]
    for recipe, path in ((small, "/srv/m/small.gguf"), (big, "/srv/m/big.gguf")):
        section = ini[recipe.served_name]
        assert section["model"] == path
        argv, _ = llama_server_argv(recipe, ServerLayout())
        flags = [a for a in argv[1:] if a.startswith("--") and a not in ROUTER_OWNED]
        assert sorted(k for k in section if k not in ("model", "load-on-startup")) == sorted(f[2:] for f in flags)
        assert section["ctx-size"] == str(recipe.context * recipe.parallel)
        assert section["parallel"] == str(recipe.parallel) and section["fit"] == "off"
        assert not {"host", "port", "alias", "api-key-file", "metrics"} & set(section)
    assert ini[big.served_name]["gpu-layers"] == "all" and ini[big.served_name]["load-on-startup"] == "true"
    assert ini[small.served_name]["gpu-layers"] == "0" and "load-on-startup" not in ini[small.served_name]


def test_the_routers_command_line_carries_the_count_and_what_children_inherit():
    argv = router_argv(ServerLayout(prefix="/opt/vf"), "/opt/vf/serve/lab/models.ini", 2, 8080, sleep_idle_s=600)
    assert argv[:6] == [
        "/opt/vf/llama.cpp/current/bin/llama-server",
        "--models-preset",
        "/opt/vf/serve/lab/models.ini",
        "--models-max",
        "2",
        "--models-autoload",
    ]
    assert " ".join(argv[6:]) == (
        "--sleep-idle-seconds 600 --host 127.0.0.1 --port 8080 --metrics --no-webui --log-verbosity 4"
    )
    with pytest.raises(VoltaforgeError, match="--models-max 0: a set keeps at least one model resident"):
        router_argv(ServerLayout(), "/x.ini", 0, 8080)


def _set(keyed: bool, gpu: bool) -> RouterSet:
    small = load_recipe("tiny-cpu").recipe
    big = load_recipe("qwen2.5-14b-v100-32gb").recipe
    return RouterSet(
        name="lab",
        members=((small, "/opt/vf/models/s/gguf/Q4_K_M.gguf"), (big, "/opt/vf/models/b/gguf/Q4_K_M.gguf")),
        port=8300,
        bind="127.0.0.1",
        models_max=1,
        gpu=gpu,
        gpu_indexes=(2, 3) if gpu else (0,),
        sleep_idle_s=600,
        load_at_start=frozenset({big.served_name}),
        api_key_file="/etc/voltaforge/secrets/lab.key" if keyed else None,
    )


@pytest.mark.parametrize("keyed,gpu", [(False, False), (True, True)])
def test_a_sets_files_are_its_routers_unit_and_its_preset(keyed, gpu):
    """The engine renders a set's unit in a server's own template (its sandbox, its key as a
    credential) with the router's command line, read back by systemd's rules as a managed
    process runs it; and the preset it names, with each member's GGUF by its own path."""
    s = _set(keyed, gpu)
    layout = set_layout("/opt/vf", "lab")
    unit, preset = LLAMACPP_SERVER.render_set_files(s, layout)
    assert unit.path == "/etc/systemd/system/voltaforge-set-lab.service" and unit.kind == "unit"
    assert preset.path == "/opt/vf/serve/voltaforge-set-lab/models.ini" == preset_path(layout)
    argv = parse_exec_start(unit.text)
    want = router_argv(layout, preset.path, 1, 8300, "127.0.0.1", 600, "%d/api-key" if keyed else None)
    assert argv == want
    assert "Description=voltaforge llama-server for model set lab (tiny-cpu, qwen2.5-14b-v100-32gb)" in unit.text
    assert ("LoadCredential=api-key:/etc/voltaforge/secrets/lab.key" in unit.text) == keyed
    assert ("Environment=CUDA_VISIBLE_DEVICES=2,3" in unit.text) == gpu
    assert ("DeviceAllow=/dev/nvidia3 rw" in unit.text) == gpu and "IPAddressDeny=any" in unit.text
    # its own empty cache: where the router looks for hub models at start (a dynamic user has no home)
    assert "CacheDirectory=voltaforge-set-lab\nEnvironment=LLAMA_CACHE=%C/voltaforge-set-lab\n" in unit.text
    assert preset.text == render_models_preset(list(s.members), s.load_at_start)
    assert "model = /opt/vf/models/b/gguf/Q4_K_M.gguf" in preset.text


def test_an_engine_without_a_router_has_no_set_files():
    from playbooks.steps.serve.engine_exllamav2 import EXLLAMAV2_SERVER

    with pytest.raises(NotImplementedError, match="serves one model per server"):
        EXLLAMAV2_SERVER.render_set_files(_set(False, False), set_layout("/opt/vf", "lab"))


@needs_systemd
@pytest.mark.parametrize("keyed,gpu", [(False, False), (True, True)])
def test_a_sets_unit_is_hardened_and_verifies(keyed, gpu, tmp_path):
    """The router's unit under systemd (issue 56) scores <= 2.0 in systemd's own exposure
    analysis and verifies against an executable that exists, as every server's unit does
    (tests/test_render.py): the sandbox a router runs its children in is a server's."""
    layout = set_layout(str(tmp_path / "prefix"), "lab")
    unit, _ = LLAMACPP_SERVER.render_set_files(_set(keyed, gpu), layout)
    stub_executables(layout, parse_exec_start(unit.text)[0])
    path = tmp_path / "voltaforge-set-lab.service"
    path.write_text(unit.text)
    r = subprocess.run(["systemd-analyze", "security", "--offline=true", str(path)], capture_output=True, text=True)
    m = re.search(r"Overall exposure level for \S+: ([\d.]+)", r.stdout)
    assert m and float(m.group(1)) <= 2.0, r.stdout + r.stderr
    r = subprocess.run(["systemd-analyze", "verify", "--man=no", str(path)], capture_output=True, text=True)
    assert r.returncode == 0 and not r.stderr.strip(), r.stderr
