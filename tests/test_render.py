"""Everything deploy installs, rendered for every shipped recipe: each unit scores <= 2.0 in
systemd's own exposure analysis and passes `systemd-analyze verify` against executables that
really exist (a prefix in a temporary directory); the argv carries every tuned flag; TabbyAPI's
config is YAML without a key; parse_exec_start reads back exactly what exec_line wrote."""

import random
import re
import shutil
import subprocess

import pytest
import yaml

from playbooks.config.recipe import list_recipes, load_recipe
from playbooks.errors import VoltaforgeError
from playbooks.plan.gpus import get_gpu
from playbooks.steps.serve.engine_exllamav2 import render_tabbyapi_config
from playbooks.steps.serve.service_files import render_service_files
from playbooks.steps.serve.units import RenderedFile, ServerLayout, exec_line, parse_exec_start
from tests.helpers import ROOT, recipe_with

RECIPES = [p.stem for p in list_recipes()]
needs_systemd = pytest.mark.skipif(
    not shutil.which("systemd-analyze"),
    reason="needs systemd-analyze (Debian package systemd: ci/install-system-deps.sh)",
)


def cases():
    for name in RECIPES:
        r = load_recipe(name).recipe
        if r.gpu_count > 1:  # one server over its cards (a layer split)
            yield name, tuple(range(r.gpu_count))
            continue
        yield name, (0,)
        if not get_gpu(r.gpu).is_cpu:
            yield name, (0, 1, 3)
        elif r.backend == "llamacpp" and not r.rpc:
            yield name, (0, 1)  # a layout's CPU instances: the template without a GPU


def units(files: list[RenderedFile]) -> list[RenderedFile]:
    return [f for f in files if f.kind == "unit"]


def stub_executables(layout: ServerLayout, argv0: str) -> None:
    """verify checks that ExecStart's program exists and is executable: make it so under the prefix."""
    from pathlib import Path

    p = Path(argv0)
    assert p.is_relative_to(layout.prefix), argv0  # never touch the real host
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text("#!/bin/sh\n")
    p.chmod(0o755)


@needs_systemd
@pytest.mark.parametrize("name,gpus", list(cases()), ids=str)
def test_every_unit_is_hardened_and_verifies(name, gpus, tmp_path):
    layout = ServerLayout(prefix=str(tmp_path / "prefix"))
    files = render_service_files(load_recipe(name).recipe, layout, gpus)
    for f in units(files):
        argv = parse_exec_start(f.text)
        stub_executables(layout, argv[0])
        unit_name = f.path.rsplit("/", 1)[1]
        # a template is verified as one of its instances (systemd loads templates only so)
        path = tmp_path / unit_name.replace("@.", f"@{gpus[-1]}.")
        path.write_text(f.text)
        r = subprocess.run(
            ["systemd-analyze", "security", "--offline=true", str(path)], capture_output=True, text=True, timeout=60
        )
        m = re.search(r"Overall exposure level for \S+: ([\d.]+)", r.stdout)
        assert m and float(m.group(1)) <= 2.0, r.stdout + r.stderr
        r = subprocess.run(["systemd-analyze", "verify", "--man=no", str(path)], capture_output=True, text=True)
        assert r.returncode == 0 and not r.stderr.strip(), r.stderr


@needs_systemd
def test_verify_really_checks_the_program(tmp_path):
    """The check above is not vacuous: without the stub, verify fails on the missing program."""
    layout = ServerLayout(prefix=str(tmp_path / "prefix"))
    (f,) = render_service_files(load_recipe("tiny-cpu").recipe, layout)
    path = tmp_path / "voltaforge-llama-server.service"
    path.write_text(f.text)
    r = subprocess.run(["systemd-analyze", "verify", "--man=no", str(path)], capture_output=True, text=True)
    assert r.returncode != 0 and "is not executable" in r.stderr


def argv_of(name: str, gpus=None, path=None):
    files = render_service_files(load_recipe(path or name).recipe, gpu_indexes=gpus)
    return files, parse_exec_start(units(files)[0].text)


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.mark.parametrize("name", [n for n in RECIPES if load_recipe(n).recipe.backend == "llamacpp"])
def test_llama_server_argv_carries_every_tuned_flag(name):
    r = load_recipe(name).recipe
    _, argv = argv_of(name)
    assert flag(argv, "--fit") == "off"
    assert flag(argv, "--ubatch-size") == str(r.planner.n_ubatch)
    assert flag(argv, "--batch-size") == str(r.batch or 2048)
    assert flag(argv, "--ctx-size") == str(r.context * r.parallel) and flag(argv, "--parallel") == str(r.parallel)
    assert flag(argv, "--cache-type-k") == r.cache.k and flag(argv, "--cache-type-v") == r.cache.v
    assert flag(argv, "--model") == "/opt/voltaforge/serve/voltaforge-llama-server/model.gguf"
    assert flag(argv, "--port") == str(r.service.port) and "--metrics" in argv
    # a draft and a speculation type reach the argv exactly when the recipe has them
    assert ("--model-draft" in argv) == (r.draft is not None)
    assert (flag(argv, "--spec-type") if "--spec-type" in argv else None) == r.spec_type
    # a split: its devices' shares, never llama.cpp's default by free memory
    shares = ",".join(f"{x:g}" for x in (r.tensor_split or [1.0] * r.device_count))
    assert (flag(argv, "--tensor-split") if "--tensor-split" in argv else None) == (shares if r.split else None)


def test_draft_batch_and_key_reach_the_argv(tmp_path):
    draft_config = ROOT / "recipes/models/qwen2.5-7b-instruct.config.json"
    extra = (
        "batch: 1024\ncache: {k: q8_0, v: q8_0}\n"
        f"draft:\n  model: {{path: /srv/models/qwen-7b, config: {draft_config}}}\n"
        "service:\n  bind: 0.0.0.0\n  port: 9000\n  api_key_ref: lab-key\n"
    )
    path = recipe_with(tmp_path, "qwen2.5-14b-v100-16gb", extra)
    files, argv = argv_of("", path=path)
    assert flag(argv, "--model-draft") == "/opt/voltaforge/serve/voltaforge-llama-server/draft.gguf"
    assert flag(argv, "--gpu-layers-draft") == "all"
    assert flag(argv, "--cache-type-k-draft") == "q8_0" and flag(argv, "--cache-type-v-draft") == "q8_0"
    assert flag(argv, "--batch-size") == "1024" and flag(argv, "--api-key-file") == "%d/api-key"
    assert "LoadCredential=api-key:/etc/voltaforge/secrets/lab-key" in files[0].text


def test_batch_below_ubatch_is_refused(tmp_path):
    from playbooks.errors import RecipeError

    with pytest.raises(RecipeError, match="needs -ub <= -b"):
        load_recipe(recipe_with(tmp_path, "qwen2.5-14b-v100-16gb", "batch: 256\n"))


def test_several_gpus_get_a_template_and_one_env_file_each():
    r = load_recipe("qwen2.5-14b-v100-16gb").recipe
    files, argv = argv_of("qwen2.5-14b-v100-16gb", (0, 2))
    assert [f.path for f in files] == [
        "/etc/systemd/system/voltaforge-llama-server@.service",
        "/etc/voltaforge/voltaforge-llama-server@0.env",
        "/etc/voltaforge/voltaforge-llama-server@2.env",
    ]
    assert [f.kind for f in files] == ["unit", "env", "env"]
    unit = files[0].text
    assert "EnvironmentFile=/etc/voltaforge/voltaforge-llama-server@%i.env" in unit
    assert "DeviceAllow=/dev/nvidia%i rw" in unit and "Environment=CUDA_VISIBLE_DEVICES" not in unit
    assert flag(argv, "--port") == "${VOLTAFORGE_PORT}"
    # the shared model link, not one per instance
    assert flag(argv, "--model") == "/opt/voltaforge/serve/voltaforge-llama-server/model.gguf"
    port = r.service.port
    assert files[2].text.splitlines()[1:] == ["CUDA_VISIBLE_DEVICES=2", f"VOLTAFORGE_PORT={port + 2}"]
    one = render_service_files(r, gpu_indexes=(3,))
    assert [f.path for f in one] == ["/etc/systemd/system/voltaforge-llama-server.service"]
    assert "Environment=CUDA_VISIBLE_DEVICES=3" in one[0].text and "DeviceAllow=/dev/nvidia3 rw" in one[0].text


def test_bad_gpu_indexes_are_refused():
    r = load_recipe("qwen2.5-14b-v100-16gb").recipe
    for bad in [(), (0, 0), (-1,), (64,)]:
        with pytest.raises(VoltaforgeError):
            render_service_files(r, gpu_indexes=bad)


def test_a_cpu_recipe_s_instances_are_the_template_without_a_gpu():
    """A layout's `instances: 2` of a CPU recipe: the same template, a port each, no device."""
    r = load_recipe("tiny-cpu").recipe
    layout = ServerLayout(unit_name="voltaforge-tiny-cpu.service")
    files = render_service_files(r, layout, gpu_indexes=(0, 1))
    assert [f.path for f in files] == [
        "/etc/systemd/system/voltaforge-tiny-cpu@.service",
        "/etc/voltaforge/voltaforge-tiny-cpu@0.env",
        "/etc/voltaforge/voltaforge-tiny-cpu@1.env",
    ]
    unit = files[0].text
    directives = [line for line in unit.splitlines() if not line.startswith("#")]
    assert "PrivateDevices=yes" in directives
    assert not [d for d in directives if "nvidia" in d or "CUDA" in d]
    assert "instance %i" in unit
    assert files[2].text.splitlines()[1:] == [f"VOLTAFORGE_PORT={r.service.port + 1}"]
    # each recipe of a layout has its own model link
    assert flag(parse_exec_start(unit), "--model") == "/opt/voltaforge/serve/voltaforge-tiny-cpu/model.gguf"


def test_layout_paths():
    layout = ServerLayout(prefix="/srv/vf")
    r = load_recipe("tiny-cpu").recipe
    assert layout.service == "voltaforge-llama-server"
    assert layout.serve_dir == "/srv/vf/serve/voltaforge-llama-server"
    assert layout.model_file(r) == "/srv/vf/serve/voltaforge-llama-server/model.gguf"
    assert layout.draft_file(r) == "/srv/vf/serve/voltaforge-llama-server/draft.gguf"
    # TabbyAPI names the model by its directory: the link carries the served name
    assert layout.tabbyapi_model_link(r) == "/srv/vf/serve/voltaforge-tabbyapi/models/tiny-llama"
    with pytest.raises(AttributeError):
        layout.prefix = "/x"  # type: ignore[misc]


@pytest.mark.parametrize("name", [n for n in RECIPES if load_recipe(n).recipe.backend == "exllamav2"])
def test_tabbyapi_config_and_unit(name):
    r = load_recipe(name).recipe
    files = render_service_files(r)
    assert [(f.path, f.kind) for f in files] == [
        ("/etc/systemd/system/voltaforge-tabbyapi.service", "unit"),
        ("/etc/voltaforge/tabbyapi/config.yml", "config"),
    ]
    cfg = yaml.safe_load(files[1].text)
    assert cfg["network"] == {
        "host": r.service.bind,
        "port": r.service.port,
        "disable_auth": True,  # loopback and no key: like llama-server
        "disable_fetch_requests": True,
        "send_tracebacks": False,
        "api_servers": ["OAI"],
    }
    m = cfg["model"]
    assert (m["model_dir"], m["model_name"]) == ("/opt/voltaforge/serve/voltaforge-tabbyapi/models", r.served_name)
    # a shipped recipe: its repo's last part, or its local directory's name; never a path
    assert r.served_name == (r.model.repo or r.model.path or "").rstrip("/").rsplit("/", 1)[-1]
    assert m["max_seq_len"] == r.context and m["cache_mode"] == r.cache.k and m["max_batch_size"] == r.parallel
    assert m["cache_size"] % 256 == 0 and m["cache_size"] >= r.context * r.parallel
    assert parse_exec_start(files[0].text) == [
        "/opt/voltaforge/venv/bin/python",
        "/opt/voltaforge/tabbyAPI/main.py",
        "--config",
        "/etc/voltaforge/tabbyapi/config.yml",
    ]
    assert "WorkingDirectory=/opt/voltaforge/serve/voltaforge-tabbyapi" in files[0].text
    assert "LoadCredential" not in files[0].text


def test_tabbyapi_with_a_key_keeps_it_out_of_the_config(tmp_path):
    extra = "service:\n  bind: 0.0.0.0\n  port: 5000\n  api_key_ref: lab-key\n"
    r = load_recipe(recipe_with(tmp_path, "seed-exl2-3.3-v100-16gb", extra)).recipe
    unit, config = render_service_files(r)
    cfg = yaml.safe_load(config.text)
    assert cfg["network"]["disable_auth"] is False and cfg["network"]["host"] == "0.0.0.0"
    keys = {k for section in cfg.values() for k in section}
    assert "lab-key" not in config.text and not keys & {"api_key", "admin_key", "api_tokens"}
    assert "LoadCredential=api_tokens.yml:/etc/voltaforge/tabbyapi/api_tokens.yml" in unit.text
    assert "IPAddressDeny" not in unit.text
    links = ServerLayout().tabbyapi_links()
    assert links["api_tokens.yml"] == "/run/credentials/voltaforge-tabbyapi.service/api_tokens.yml"


def test_the_tabbyapi_config_says_where_it_and_its_keys_are_as_the_server_runs():
    """Its header names its own path and the keys' file: /etc and a credential under systemd,
    the state directory as a managed process (the header said /etc and a credential for both)."""
    r = load_recipe("seed-exl2-3.3-v100-16gb").recipe
    head = render_tabbyapi_config(r).splitlines()[:3]
    assert head[0].startswith("# /etc/voltaforge/tabbyapi/config.yml: rendered by voltaforge")
    assert head[2] == (
        "# API keys are never here: they are /etc/voltaforge/tabbyapi/api_tokens.yml, 0600, "
        "the unit's credential (LoadCredential)."
    )
    state = "/opt/vf/state/voltaforge-tabbyapi"
    head = render_tabbyapi_config(r, ServerLayout(prefix="/opt/vf", process_state=state)).splitlines()[:3]
    assert head[0].startswith(f"# {state}/config.yml: rendered by voltaforge")
    assert head[2] == f"# API keys are never here: they are {state}/api_tokens.yml, 0600."


AWKWARD = [
    "",
    " ",
    "plain",
    "with space",
    'say "hi"',
    "100%",
    "%%",
    "%d",
    "$HOME",
    "${PATH}",
    "$$",
    "back\\slash",
    "\\",
    "\\\"'",
    "'single'",
    "semi;colon",
    "tab\tnot",  # refused: control character
    "unicode é ✓",
    "trailing\\",
]


def test_parse_exec_start_round_trips_awkward_strings():
    argv = [a for a in AWKWARD if "\t" not in a]
    assert parse_exec_start("ExecStart=" + exec_line(["/bin/x", *argv])) == ["/bin/x", *argv]


def test_parse_exec_start_round_trips_random_argv():
    rng = random.Random(20261130)
    alphabet = "ab Z09_./:=,+@-%$\\\"' ;é{}()*?#~`!&|<>[]"
    for _ in range(2000):
        argv = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12))) for _ in range(rng.randint(1, 6))]
        line = exec_line(argv)
        assert parse_exec_start(f"[Service]\nType=exec\nExecStart={line}\nRestart=no\n") == argv, line


def test_parse_exec_start_keeps_raw_specifiers_and_variables():
    line = exec_line(["/bin/x", "--port", "${VOLTAFORGE_PORT}", "--key", "%d/api-key", "50%"], frozenset({2, 4}))
    assert parse_exec_start("ExecStart=" + line) == [
        "/bin/x",
        "--port",
        "${VOLTAFORGE_PORT}",
        "--key",
        "%d/api-key",
        "50%",
    ]


def test_parse_exec_start_refuses_what_it_cannot_read():
    with pytest.raises(VoltaforgeError, match="exactly one"):
        parse_exec_start("[Service]\n")
    with pytest.raises(VoltaforgeError, match="unterminated"):
        parse_exec_start('ExecStart=/bin/x "open')
