"""Rendered systemd units: hardened (systemd's own scoring), quoted by systemd's rules (proven
by a real systemd in the booted container), secrets only as credentials."""

import re
import shutil
import subprocess

import pytest

from playbooks.config.recipe import list_recipes, load_recipe
from playbooks.errors import VoltaforgeError
from playbooks.steps.serve.engine_llamacpp import render_llama_server_unit
from playbooks.steps.serve.units import exec_line, systemd_quote
from tests.helpers import recipe_with, spec_for

LLAMACPP = [p.stem for p in list_recipes() if load_recipe(p.stem).recipe.backend == "llamacpp"]


def exposure(unit_text: str, tmp_path, name="voltaforge-llama-server.service") -> float:
    path = tmp_path / name
    path.write_text(unit_text)
    r = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", str(path)], capture_output=True, text=True, timeout=60
    )
    m = re.search(r"Overall exposure level for \S+: ([\d.]+)", r.stdout)
    assert m, r.stdout + r.stderr
    return float(m.group(1))


@pytest.mark.skipif(
    not shutil.which("systemd-analyze"),
    reason="needs systemd-analyze (Debian package systemd: ci/install-system-deps.sh)",
)
@pytest.mark.parametrize("name", LLAMACPP)
def test_every_rendered_unit_scores_at_most_2(name, tmp_path):
    unit = render_llama_server_unit(load_recipe(name).recipe)
    assert exposure(unit.text, tmp_path) <= 2.0


@pytest.mark.skipif(
    not shutil.which("systemd-analyze"),
    reason="needs systemd-analyze (Debian package systemd: ci/install-system-deps.sh)",
)
def test_open_service_with_api_key(tmp_path):
    r = load_recipe(
        recipe_with(
            tmp_path, "qwen2.5-14b-v100-16gb", "service:\n  bind: 0.0.0.0\n  port: 8443\n  api_key_ref: lab-key\n"
        )
    ).recipe
    unit = render_llama_server_unit(r)
    assert "LoadCredential=api-key:/etc/voltaforge/secrets/lab-key" in unit.text
    assert "--api-key-file %d/api-key" in unit.text and "--host 0.0.0.0" in unit.text
    assert "IPAddressDeny" not in unit.text  # opened on purpose, guarded by the key
    assert exposure(unit.text, tmp_path) <= 2.0


def test_gpu_and_cpu_units_differ_where_cuda_needs_it():
    gpu = render_llama_server_unit(load_recipe("qwen2.5-14b-v100-16gb").recipe).text
    cpu = render_llama_server_unit(load_recipe("tiny-cpu").recipe).text
    assert (
        "DeviceAllow=/dev/nvidia0 rw" in gpu and "PrivateDevices=" not in gpu and "MemoryDenyWriteExecute=" not in gpu
    )
    assert "--gpu-layers all" in gpu and "Environment=CUDA_VISIBLE_DEVICES=0" in gpu
    assert "PrivateDevices=yes" in cpu and "MemoryDenyWriteExecute=yes" in cpu and "--gpu-layers 0" in cpu
    assert "--ctx-size 1024 --parallel 2" in cpu  # -c is the total over the slots


def test_exllamav2_recipe_is_not_a_llama_server_unit():
    with pytest.raises(VoltaforgeError, match="serves llamacpp recipes"):
        render_llama_server_unit(load_recipe("seed-exl2-3.3-v100-16gb").recipe)


@pytest.mark.parametrize(
    "arg,quoted",
    [
        ("/opt/voltaforge/models/m.gguf", "/opt/voltaforge/models/m.gguf"),
        ("with space", '"with space"'),
        ('say "hi"', '"say \\"hi\\""'),
        ("100%", '"100%%"'),
        ("$HOME", '"$$HOME"'),
        ("back\\slash", '"back\\\\slash"'),
    ],
)
def test_systemd_quote(arg, quoted):
    assert systemd_quote(arg) == quoted


def test_control_characters_are_refused():
    with pytest.raises(VoltaforgeError, match="control characters"):
        systemd_quote("a\nExecStartPre=/bin/sh")


TRICKY = ["plain", "with space", 'say "hi"', "100% sure", "$HOME and ${PATH}", "back\\slash", "semi;colon", "'single'"]


@pytest.mark.slow
def test_quoting_survives_a_real_systemd(nspawn_host):
    """systemd in the booted container parses the rendered ExecStart; printf gets each
    argument back exactly (one per line in the journal)."""
    from playbooks.host import connect

    unit = (
        "[Unit]\nDescription=vf quoting probe\n[Service]\nType=oneshot\nExecStart="
        + exec_line(["/usr/bin/printf", "<%s>\\n", *TRICKY])
        + "\n"
    )
    # the format string itself must reach printf as <%s>\n: it went through systemd_quote too
    with connect(spec_for(nspawn_host)) as host:
        host.write_file("/etc/systemd/system/vf-quote.service", unit.encode(), 0o644, sudo=True)
        host.sudo("systemctl daemon-reload && systemctl start vf-quote.service", stream=False)
        out = host.sudo("journalctl -u vf-quote.service -o cat --no-pager", stream=False).stdout
        host.sudo("rm -f /etc/systemd/system/vf-quote.service && systemctl daemon-reload", stream=False)
    got = re.findall(r"^<(.*)>$", out, re.M)
    assert got[-len(TRICKY) :] == TRICKY
