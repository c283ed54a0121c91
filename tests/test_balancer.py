"""The load balancer's files (steps/serve/balancer.py): HAProxy's own check accepts every rendered
configuration, the unit scores <= 2.0 in systemd's exposure analysis, the key never appears in
either, and what cannot work is refused in one line. HAProxy running them in front of real
servers: tests/test_balancer_real.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from playbooks.config.recipe import load_recipe
from playbooks.errors import VoltaforgeError
from playbooks.steps.serve.balancer import (
    ADMIN_SOCKET,
    Backend,
    Balancer,
    backends_for,
    render_haproxy_config,
    render_lb_unit,
)
from tests.helpers import ROOT, inventory_for, recipe_with
from tests.test_units import exposure

KEYED = "service:\n  bind: 0.0.0.0\n  port: 9000\n  api_key_ref: lab-key\n"
needs_haproxy = pytest.mark.skipif(not shutil.which("haproxy"), reason="needs haproxy (ci/install-system-deps.sh)")
needs_systemd = pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="needs systemd-analyze")


def two(recipe, **kw) -> Balancer:
    kw.setdefault("admin_socket", ADMIN_SOCKET)
    return Balancer(recipe, (Backend("gpu-01", "10.0.0.1", 9000), Backend("gpu-02", "10.0.0.2", 9000)), **kw)


@needs_haproxy
@pytest.mark.parametrize("keyed", [False, True])
def test_haproxy_accepts_the_rendered_configuration(keyed, tmp_path):
    r = load_recipe(recipe_with(tmp_path, "tiny-cpu", KEYED)).recipe if keyed else load_recipe("tiny-cpu").recipe
    cfg = render_haproxy_config(two(r, bind="0.0.0.0" if keyed else "127.0.0.1"))
    (tmp_path / "creds").mkdir()
    (tmp_path / "creds" / "api-key").write_text("k\n")
    (tmp_path / "h.cfg").write_text(cfg)
    env = {**os.environ, "CREDENTIALS_DIRECTORY": str(tmp_path / "creds")}
    check = subprocess.run(["haproxy", "-c", "-f", str(tmp_path / "h.cfg")], capture_output=True, text=True, env=env)
    assert check.returncode == 0 and "Configuration file is valid" in check.stdout, check.stdout + check.stderr
    assert "server gpu-01 10.0.0.1:9000" in cfg and "option http-no-delay" in cfg
    # the runtime API a rolling change drains servers through: owner-only
    assert "stats socket /run/voltaforge-lb/admin.sock mode 600 level admin" in cfg
    assert ("api-key" in cfg) == keyed


@needs_systemd
def test_the_unit_is_hardened_and_holds_the_key_as_a_credential(tmp_path):
    loopback = render_lb_unit(two(load_recipe("tiny-cpu").recipe))
    assert "IPAddressDeny=any" in loopback and "IPAddressAllow=10.0.0.1" in loopback
    assert "RuntimeDirectory=voltaforge-lb\nRuntimeDirectoryMode=0700" in loopback
    assert exposure(loopback, tmp_path, "voltaforge-lb.service") <= 2.0
    keyed = render_lb_unit(two(load_recipe(recipe_with(tmp_path, "tiny-cpu", KEYED)).recipe, bind="0.0.0.0"))
    assert "LoadCredential=api-key:/etc/voltaforge/secrets/lab-key" in keyed and "IPAddressDeny" not in keyed
    assert exposure(keyed, tmp_path, "voltaforge-lb.service") <= 2.0


def test_what_cannot_work_is_refused(tmp_path):
    r = load_recipe("tiny-cpu").recipe
    with pytest.raises(VoltaforgeError, match=r"needs an API key \(its backends' service.api_key_ref\)"):
        two(r, bind="0.0.0.0")
    with pytest.raises(VoltaforgeError, match="at least one backend"):
        Balancer(r, ())
    with pytest.raises(VoltaforgeError, match="named twice: a"):
        Balancer(r, (Backend("a", "10.0.0.1", 1), Backend("a", "10.0.0.2", 1)))
    with pytest.raises(VoltaforgeError, match="is the stats page's"):
        two(r, port=8404)
    with pytest.raises(VoltaforgeError, match="is 102 bytes long, past the 97"):
        two(r, admin_socket="/" + "x" * 90 + "/admin.sock")
    with pytest.raises(VoltaforgeError, match="not an IPv4 address or a host name"):
        Backend("a", "10.0.0.1;rm", 1)
    # a server on loopback is reachable from its own host only
    with pytest.raises(VoltaforgeError, match="gpu-02: recipe tiny-cpu serves on 127.0.0.1 only"):
        backends_for(r, [("gpu-01", "10.0.0.1", True, [8080]), ("gpu-02", "10.0.0.2", False, [8080])])
    keyed = load_recipe(recipe_with(tmp_path, "tiny-cpu", KEYED)).recipe
    got = backends_for(keyed, [("gpu-01", "10.0.0.1", True, [9000]), ("gpu-02", "10.0.0.2", False, [9002, 9003])])
    # a host running one instance per GPU gives one backend per instance, named by its port
    assert [(b.name, b.address, b.port) for b in got] == [
        ("gpu-01", "127.0.0.1", 9000),
        ("gpu-02-9002", "10.0.0.2", 9002),
        ("gpu-02-9003", "10.0.0.2", 9003),
    ]


def test_lb_on_a_host_without_systemd_plans_a_managed_process(sshd_host, tmp_path, tmp_path_factory, capsys):
    """A real host (a private sshd, no systemd there): the dry run plans HAProxy as a managed
    process of the SSH user, its configuration under the prefix, and writes nothing."""
    from playbooks.cli.balancer import run_lb
    from playbooks.conduct.settings import Settings

    prefix = tmp_path_factory.mktemp("vf") / "prefix"  # short: the runtime API's socket lives under it
    inv = inventory_for(tmp_path, "lb-01", sshd_host, prefix=str(prefix))
    assert run_lb("lb-01", ["lb-01"], recipe="tiny-cpu", dry_run=True, settings=Settings(inventory=inv)) == 0
    out = capsys.readouterr().out
    assert f"{prefix}/deploy/voltaforge-lb/haproxy.cfg" in out and "systemctl" not in out, out[-3000:]
    # its runtime API in its state directory, and the backend's record of who fronts it
    assert f"{prefix}/deploy/voltaforge-lb/admin.sock" in out, out[-3000:]
    assert f"{prefix}/deploy/balancers/lb-01.json" in " ".join(out.split()), out[-3000:]
    assert not prefix.exists()


def test_a_prefix_too_long_for_the_runtime_api_socket_serves_without_it(sshd_host, tmp_path, capsys):
    """A prefix whose socket path HAProxy would refuse: the balancer is still planned, without
    the runtime API, and `invoke lb` says that provision changes these servers in place."""
    from playbooks.cli.balancer import run_lb
    from playbooks.conduct.settings import Settings

    prefix = tmp_path / ("p" * 40)
    inv = inventory_for(tmp_path, "lb-01", sshd_host, prefix=str(prefix))
    assert run_lb("lb-01", ["lb-01"], recipe="tiny-cpu", dry_run=True, settings=Settings(inventory=inv)) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "note: no runtime API: its socket" in out and "provision changes these servers in place" in out, out
    assert "deploy/balancers/lb-01.json" not in out and not prefix.exists()


def test_a_balancer_host_that_serves_nothing_fronts_what_the_inventory_places(
    sshd_host, tmp_path, tmp_path_factory, capsys
):
    """The balancer's own host serves nothing (no recipe anywhere for it); its backend has no
    deployment record yet: `invoke lb` says it balances what the inventory places there, and
    the dry run plans HAProxy in front of it, writing nothing on either."""
    import yaml

    from playbooks.cli.balancer import run_lb
    from playbooks.conduct.settings import Settings

    prefix, backend_prefix = tmp_path_factory.mktemp("vf") / "prefix", tmp_path / "backend"
    inv = inventory_for(tmp_path, "edge-01", sshd_host, prefix=str(prefix))
    data = yaml.safe_load(inv.read_text())
    # the backend: the same machine under another name (so its loopback server is reachable)
    data["hosts"]["box"] = {**data["hosts"]["edge-01"], "prefix": str(backend_prefix), "recipe": "tiny-cpu"}
    data["lb"] = {"host": "edge-01", "hosts": ["box"]}
    inv.write_text(yaml.safe_dump(data))
    assert run_lb(dry_run=True, settings=Settings(inventory=inv)) == 0
    said = " ".join(capsys.readouterr().out.split())
    assert "box: nothing deployed yet; balancing what the inventory places there (tiny-cpu)" in said, said
    assert "model tiny-llama: box 127.0.0.1:18080" in said, said
    assert f"{prefix}/deploy/voltaforge-lb/haproxy.cfg" in said, said
    assert not prefix.exists() and not backend_prefix.exists()


def test_the_running_check_probes_where_the_balancer_listens(tmp_path):
    """A balancer bound to every address is checked on loopback; one bound to an address
    (IPv6 loopback too) is checked there, not on 127.0.0.1 where nothing listens."""
    r = load_recipe("tiny-cpu").recipe
    keyed = load_recipe(recipe_with(tmp_path, "tiny-cpu", KEYED)).recipe
    assert two(r).probe_address == "127.0.0.1"
    assert two(r, bind="::1").probe_address == "::1"
    assert two(keyed, bind="0.0.0.0").probe_address == "127.0.0.1"
    assert two(keyed, bind="::").probe_address == "::1"
    assert two(keyed, bind="10.0.0.9").probe_address == "10.0.0.9"


def test_bench_lb_shares_are_the_counters_moved_between_two_reads():
    """steps/measure/bench_lb.py: what HAProxy sent each backend during a level (its stats read
    before and after); a backend new in between counts from zero, a restarted counter from its
    value now. The real run against HAProxy is in tests/test_balancer_real.py."""
    from playbooks.steps.measure.bench_lb import shares
    from playbooks.steps.serve.balancer import ServerStat

    before = [ServerStat("a", "UP", 10, "L7OK"), ServerStat("b", "UP", 4, "L7OK")]
    after = [ServerStat("a", "UP", 16, "L7OK"), ServerStat("b", "DOWN", 6, "L4CON"), ServerStat("c", "UP", 4, "L7OK")]
    got = shares(before, after)
    assert {k: (v["requests"], v["share"], v["up"]) for k, v in got.items()} == {
        "a": (6, 0.5, True),
        "b": (2, 0.167, False),
        "c": (4, 0.333, True),
    }
    assert shares(before, [ServerStat("a", "UP", 3, "L7OK")])["a"]["requests"] == 3  # restarted
    assert shares([], [ServerStat("a", "UP", 0, "")])["a"]["share"] is None  # nothing sent


def _fleet(tmp_path, hosts: dict[str, dict]):
    """An inventory of hosts, each serving tiny-cpu with some keys replaced."""
    import yaml

    from playbooks.conduct.settings import Settings
    from tests.helpers import ROOT

    entries = {}
    for name, over in hosts.items():
        d = tmp_path / name
        d.mkdir(parents=True)
        data = yaml.safe_load((ROOT / "recipes" / "tiny-cpu.yaml").read_text())
        for key, value in over.items():
            data[key] = {**data[key], **value} if isinstance(value, dict) else value
        (d / "defaults.yaml").write_text((ROOT / "recipes" / "defaults.yaml").read_text())
        (d / "tiny-cpu.yaml").write_text(yaml.safe_dump(data))
        entries[name] = {"host": f"10.0.0.{len(entries) + 1}", "recipe": str(d / "tiny-cpu.yaml")}
    inv = tmp_path / "inventory.yaml"
    inv.write_text(yaml.safe_dump({"hosts": entries}))
    settings = Settings(inventory=inv)
    return settings, [settings.host_spec(n) for n in hosts]


def test_a_fleet_is_grouped_by_model_name_with_one_key(tmp_path):
    """Two boxes with different recipes of one model (different quants, slots and context) are
    one model behind the balancer, each server taking its own slots; another model name, another
    group; a backend with another key, or one name over two base models: one line each."""
    from playbooks.conduct.fleet import placed_fleet

    keyed = {"service": {"bind": "0.0.0.0", "port": 9000, "api_key_ref": "lab-key"}}
    settings, specs = _fleet(
        tmp_path / "ok",
        {
            "v100-sxm": keyed | {"quant": "Q8_0", "parallel": 4},
            "v100-pcie": keyed | {"quant": "Q4_K_M", "parallel": 2, "context": 1024},
            "other": {"service": keyed["service"] | {"model_name": "tiny-chat"}},
        },
    )
    fleet = placed_fleet(settings, specs[0], specs, None, "lab-key")
    got = fleet.backends
    assert placed_fleet(settings, specs[0], specs, None, None).key_ref == "lab-key"  # theirs, unnamed
    assert [(b.name, b.model, b.slots, b.context) for b in got] == [
        ("v100-sxm", "tiny-llama", 4, 512),
        ("v100-pcie", "tiny-llama", 2, 1024),
        ("other", "tiny-chat", 2, 512),
    ]
    lb = Balancer(fleet.recipe, got, bind="0.0.0.0")
    assert (
        list(lb.models) == ["tiny-llama", "tiny-chat"] and lb.body_limit == 16384
    )  # 4 x 1024 tokens, below the 16 KiB floor
    assert lb.bufsize >= lb.body_limit + 16384 and lb.bufsize % 4096 == 0

    other_key = {"service": keyed["service"] | {"api_key_ref": "other-key"}}
    s2, bad = _fleet(tmp_path / "key", {"a": keyed, "b": other_key})
    with pytest.raises(
        VoltaforgeError, match=r"^b: tiny-cpu takes the key other-key, the balancer's edge checks lab-key"
    ):
        placed_fleet(s2, bad[0], bad, None, "lab-key")
    with pytest.raises(VoltaforgeError, match=r"^the backends take different keys \(a: lab-key, b: other-key\)"):
        placed_fleet(s2, bad[0], bad, None, None)

    import yaml

    from tests.helpers import ROOT

    config = yaml.safe_load((ROOT / "recipes" / "tiny-cpu.yaml").read_text())["model"]
    deeper = {"model": config | {"config": config["config"] | {"num_hidden_layers": 6}}}
    s3, mixed = _fleet(tmp_path / "weights", {"a": keyed, "b": keyed | deeper})
    with pytest.raises(VoltaforgeError, match=r"^model name tiny-llama is served from 2 different base models"):
        placed_fleet(s3, mixed[0], mixed, None, "lab-key")


@needs_systemd
def test_render_lb_writes_the_fleets_balancer_from_the_inventory_alone(tmp_path):
    """`invoke render --lb`: no host is contacted (the inventory's addresses lead nowhere), the
    inventory's lb: entry under the flags, the configuration groups both boxes' servers under
    their model with each one's slots, TLS on beyond loopback (the pair a credential), and the
    unit still scores <= 2.0."""
    keyed = {"service": {"bind": "0.0.0.0", "port": 9000, "api_key_ref": "lab-key"}}
    import yaml

    settings, _ = _fleet(tmp_path / "f", {"lb-01": keyed, "sxm-01": keyed, "pcie-01": keyed | {"parallel": 4}})
    # the hosts and bind from the inventory's lb: entry, the port by flag (which wins)
    inv = yaml.safe_load(settings.inventory.read_text())
    inv["lb"] = {"hosts": ["sxm-01", "pcie-01"], "bind": "0.0.0.0", "port": 9999}
    settings.inventory.write_text(yaml.safe_dump(inv))
    r = subprocess.run(
        [sys.executable, "-m", "invoke", "-r", str(ROOT), "render", "--lb", "lb-01", "--port", "8443",
         "--out", str(tmp_path / "out"), "--inventory", str(settings.inventory)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert "model tiny-llama: sxm-01 10.0.0.2:9000 (2 slots), pcie-01 10.0.0.3:9000 (4 slots)" in " ".join(
        r.stdout.split()
    )
    cfg = (tmp_path / "out/etc/voltaforge/lb/haproxy.cfg").read_text()
    assert 'bind 0.0.0.0:8443 ssl crt "${CREDENTIALS_DIRECTORY}/tls.pem"' in cfg and "maxconn 4" in cfg
    unit = (tmp_path / "out/etc/systemd/system/voltaforge-lb.service").read_text()
    assert "LoadCredential=tls.pem:/etc/voltaforge/lb/tls.pem" in unit
    assert exposure(unit, tmp_path, "voltaforge-lb.service") <= 2.0


def test_the_inventorys_lb_entry_settles_what_the_flags_leave_out(tmp_path):
    """`lb:` names the balancer's host, hosts, bind, port, key and pair; each flag given wins;
    `--tls off` drops the entry's pair; with neither, one line saying where to give it; a bad
    entry is one line at its line in the file."""
    import yaml

    from playbooks.conduct.balancer import edge_settings
    from playbooks.config.inventory import load_lb
    from playbooks.errors import RecipeError, UsageError

    inv = tmp_path / "inventory.yaml"
    lb = {"host": "edge-01", "hosts": ["sxm-01", "pcie-01"], "bind": "0.0.0.0", "port": 8443,
          "api_key_ref": "lab-key", "cert": "tls/cert.pem", "key": "tls/key.pem"}  # fmt: skip
    inv.write_text(yaml.safe_dump({"hosts": {"edge-01": {"host": "10.0.0.9"}}, "lb": lb}))
    entry = load_lb(inv)
    assert entry.cert == str(tmp_path / "tls/cert.pem")  # beside the inventory, wherever it is read from
    edge = edge_settings(entry)
    assert (edge.host, edge.hosts, edge.bind, edge.port, edge.key_ref, edge.tls) == (
        "edge-01", ("sxm-01", "pcie-01"), "0.0.0.0", 8443, "lab-key", None,
    )  # fmt: skip
    assert edge.cert == entry.cert and edge.key == entry.key
    flagged = edge_settings(entry, "lb-02", ["sxm-01"], "127.0.0.1", 9443, False)
    assert (flagged.host, flagged.hosts, flagged.bind, flagged.port, flagged.tls, flagged.cert) == (
        "lb-02", ("sxm-01",), "127.0.0.1", 9443, False, None,
    )  # fmt: skip
    bare = load_lb(tmp_path / "none.yaml")
    with pytest.raises(UsageError, match="pass --host, or give the inventory an lb: entry with host:"):
        edge_settings(bare)
    with pytest.raises(UsageError, match="pass --hosts, or give the inventory's lb: entry hosts:"):
        edge_settings(bare, "edge-01")
    assert (edge_settings(bare, "edge-01", ["a"]).bind, edge_settings(bare, "edge-01", ["a"]).port) == (
        "127.0.0.1", 8000,
    )  # fmt: skip

    for bad, words in [
        ({"bind": "all"}, r"inventory.yaml:3: lb.bind: must be an IP address"),
        ({"hosts": ["a", "a"]}, r"inventory.yaml:\d+: lb.hosts: .*named twice"),
        ({"cert": "c.pem"}, r"inventory.yaml:\d+: lb.*cert and key go together"),
        ({"api_key_ref": "../etc/shadow"}, r"inventory.yaml:\d+: lb.api_key_ref: .*secret's file name"),
        ({"port": 8443, "colour": "red"}, r"inventory.yaml:4: unknown key 'lb.colour'; allowed here: host, hosts"),
    ]:
        inv.write_text(yaml.safe_dump({"hosts": {}, "lb": bad}, sort_keys=False))
        with pytest.raises(RecipeError, match=words) as err:
            load_lb(inv)
        assert "\n" not in str(err.value)


def test_a_layout_of_two_quants_of_one_model_is_one_model_on_two_servers(tmp_path):
    """The local fleet's shape: `local` serves two recipes of one model (different quants) in a
    layout, another host a third: one model, three servers; the layout's two named by port."""
    import yaml

    from playbooks.conduct.fleet import placed_fleet
    from playbooks.conduct.settings import Settings

    keyed = {"service": {"bind": "0.0.0.0", "port": 9000, "api_key_ref": "lab-key"}}
    settings, _ = _fleet(tmp_path / "f", {"q8": keyed | {"quant": "Q8_0"}, "q4": keyed | {"quant": "Q4_K_M"}})
    inv = yaml.safe_load(settings.inventory.read_text())
    q8, q4 = inv["hosts"]["q8"]["recipe"], inv["hosts"]["q4"]["recipe"]
    Path(q4).rename(Path(q4).with_name("tiny-q4.yaml"))
    q4 = str(Path(q4).with_name("tiny-q4.yaml"))
    inv["hosts"] = {
        "local": {"serve": [{"recipe": q8, "port": 18301}, {"recipe": q4, "port": 18302}]},
        "box": {"host": "10.0.0.7", "recipe": q8},
    }
    settings.inventory.write_text(yaml.safe_dump(inv))
    s = Settings(inventory=settings.inventory)
    fleet = placed_fleet(s, s.host_spec("local"), [s.host_spec("local"), s.host_spec("box")], None, None)
    assert [(b.name, b.address, b.port, b.model) for b in fleet.backends] == [
        ("local-18301", "127.0.0.1", 18301, "tiny-llama"),
        ("local-18302", "127.0.0.1", 18302, "tiny-llama"),
        ("box", "10.0.0.7", 9000, "tiny-llama"),
    ]
    assert list(fleet.models) == ["tiny-llama"] and fleet.key_ref == "lab-key"


def test_render_lb_places_each_member_of_a_model_set_on_its_routers_port(tmp_path):
    """A set of the inventory (issue 55) is each member's server on the set's port: the edge
    routes every member's name to the router, which loads it on demand; a member's key is the
    edge's key check like any backend's, and `--recipe <set>` places that set alone."""
    import yaml

    from playbooks.conduct.fleet import placed_fleet
    from playbooks.conduct.settings import Settings
    from tests.model_set_members import WIDTHS, member_recipes

    recipes = member_recipes(tmp_path, {"bind": "0.0.0.0", "api_key_ref": "lab-key"})
    trio = {"set": "trio", "models": list(WIDTHS), "port": 8391}
    inv = tmp_path / "inventory.yaml"
    hosts = {
        "lb-01": {"host": "10.0.0.1"},
        "box": {"host": "10.0.0.9", "memory_budget_gib": 1.0, "serve": [trio]},
    }
    inv.write_text(yaml.safe_dump({"hosts": hosts}))
    settings = Settings(inventory=inv, recipes_dir=recipes)
    specs = [settings.host_spec(n) for n in ("lb-01", "box")]
    fleet = placed_fleet(settings, specs[0], specs[1:], None, "lab-key")
    assert [(b.model, b.address, b.port) for b in fleet.backends] == [(n, "10.0.0.9", 8391) for n in WIDTHS]
    assert placed_fleet(settings, specs[0], specs[1:], "trio", None).key_ref == "lab-key"
    with pytest.raises(VoltaforgeError, match=r"^box: small takes the key lab-key, the balancer's edge checks other"):
        placed_fleet(settings, specs[0], specs[1:], None, "other")
