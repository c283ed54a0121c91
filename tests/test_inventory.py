"""inventory.yaml and the ~/.ssh/config fallback."""

import pytest

from playbooks.config.inventory import load_inventory, resolve_host
from playbooks.errors import RecipeError


def test_inventory_entry(tmp_path):
    inv = tmp_path / "inventory.yaml"
    inv.write_text(
        "hosts:\n  v100-01:\n    host: 10.0.0.21\n    user: deploy\n    gpu: v100-16gb\n    recipe: tiny-cpu\n"
    )
    spec = resolve_host("v100-01", inv)
    assert (spec.host, spec.user, spec.port, spec.gpu, spec.prefix) == (
        "10.0.0.21",
        "deploy",
        22,
        "v100-16gb",
        "/opt/voltaforge",
    )


def test_unlisted_host_falls_back_to_ssh_config(tmp_path):
    cfg = tmp_path / "ssh_config"
    cfg.write_text("Host gpu-box\n  HostName 192.0.2.7\n  User lab\n  Port 2222\n  IdentityFile /keys/lab\n")
    spec = resolve_host("gpu-box", tmp_path / "none.yaml", ssh_config=cfg)
    assert (spec.host, spec.user, spec.port, spec.key_file) == ("192.0.2.7", "lab", 2222, "/keys/lab")


def test_local_needs_no_ssh(tmp_path):
    assert resolve_host("local", tmp_path / "none.yaml").local


def test_bad_inventory_messages(tmp_path):
    inv = tmp_path / "inventory.yaml"
    inv.write_text("hosts:\n  v100-01:\n    host: 10.0.0.21\n    gpu: v100-99gb\n")
    with pytest.raises(RecipeError, match=r"inventory.yaml:4: hosts.v100-01.gpu: unknown GPU"):
        load_inventory(inv)
    inv.write_text("hosts:\n  v100-01:\n    hostname: 10.0.0.21\n")
    with pytest.raises(
        RecipeError, match=r"inventory.yaml:3: unknown key 'hosts.v100-01.hostname'; allowed here: .*host, user, port"
    ):
        load_inventory(inv)
    inv.write_text("hosts:\n  v100-01:\n    host: 10.0.0.21\n    prefix: /opt/vf; rm -rf /\n")
    with pytest.raises(RecipeError, match=r"prefix"):
        load_inventory(inv)
    inv.write_text("hosts: [\n")
    with pytest.raises(RecipeError, match=r"inventory.yaml:2: invalid YAML"):
        load_inventory(inv)


@pytest.mark.parametrize(
    "name,ok",
    [
        ("v100-01", True),
        ("gpu.lab.example", True),
        ("10.0.0.21", True),
        ("::1", True),
        ("5", False),  # the resolver's shorthand for 0.0.0.5, not a name
        ("10.1", False),  # 10.0.0.1 to inet_aton
        ("box.42", False),  # no top-level domain is all digits
        ("a..b", False),
        ("", False),
    ],
)
def test_host_addresses(name, ok):
    from playbooks.config.inventory import is_host_address

    assert is_host_address(name) is ok


def test_local_reads_an_entry_named_local(tmp_path):
    """`--host local` is this machine; an entry named local gives it what it serves and where
    (a layout of two recipes here), so a fleet's shape can be tried on one machine."""
    from playbooks.config.inventory import resolve_host

    inv = tmp_path / "inventory.yaml"
    assert resolve_host("local", inv).local  # no inventory: this machine, nothing more
    inv.write_text(
        "hosts:\n  local:\n    prefix: /srv/vf\n    serve:\n"
        "      - {recipe: tiny-cpu, instances: 2, port: 18300}\n      - {recipe: tiny-rpc-cpu, port: 18400}\n"
    )
    spec = resolve_host("local", inv)
    assert spec.local and spec.host == "localhost" and spec.prefix == "/srv/vf"
    assert [p.recipe for p in spec.serve] == ["tiny-cpu", "tiny-rpc-cpu"]
