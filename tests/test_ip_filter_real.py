"""An RPC worker's address filter, enforced for real (issue 31): the unit `invoke rpc-worker`
renders for a worker on the booted container's network address, allowing only the address of
the server that dials it, drops a connection from any other address and serves the allowed one.

The RPC protocol has no authentication, so this filter (systemd's IPAddressDeny=any plus
IPAddressAllow=) is all that stands between the worker's memory and the network. systemd
enforces it with BPF programs on the unit's cgroup; inside systemd-nspawn those load only
when the container may call bpf() (``--system-call-filter=bpf``, tests/testhosts.py), else
the filter is silently not applied, which is why it is tested with packets, not as text.

What stands in for the worker: the rendered unit exactly, but for its ExecStart, which runs a
small HTTP server (python3, in the image) on the worker's address and port instead of
ggml-rpc-server (not built in this container: tests/test_rpc_split_real.py runs the real one).
The filter belongs to the unit's cgroup, not to the program. The second source address is a
TEST-NET-1 address (RFC 5737) on this side of the container's veth, routed back through it;
the control is a twin unit without the filter lines, which that same address does reach.
"""

from __future__ import annotations

import json
import subprocess
import zlib
from pathlib import Path

import httpx
import pytest
import yaml

from playbooks.config.recipe import load_recipe
from playbooks.steps.serve.rpc_worker import RpcLayout, render_rpc_unit, rpc_argv
from playbooks.steps.serve.units import exec_line
from tests.helpers import ROOT

pytestmark = pytest.mark.slow
PORT = 18155


def _worker_recipe(tmp_path: Path, endpoint: str, allow: str):
    data = yaml.safe_load((ROOT / "recipes" / "tiny-rpc-cpu.yaml").read_text())
    data["rpc"] = [{"endpoint": endpoint, "worker": "box", "allow_from": [allow]}]
    (tmp_path / "defaults.yaml").write_text((ROOT / "recipes" / "defaults.yaml").read_text())
    path = tmp_path / "tiny-rpc-cpu.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_recipe(path).recipe


def _get(url: str, source: str) -> int | str:
    """GET from one source address: the status, or what went wrong."""
    transport = httpx.HTTPTransport(local_address=source)
    try:
        with httpx.Client(transport=transport, trust_env=False, timeout=3) as web:
            return web.get(url).status_code
    except httpx.TimeoutException:
        return "timed out"
    except httpx.HTTPError as exc:
        return type(exc).__name__


def _install(host, name: str, text: str) -> None:
    path = f"/etc/systemd/system/{name}"
    subprocess.run(host.ssh_command(f"cat > {path}"), input=text, text=True, check=True, timeout=60)
    host.run_inside(f"systemctl daemon-reload && systemctl start {name}")


@pytest.mark.timeout(300)
def test_the_rpc_workers_filter_drops_a_stranger_and_serves_the_server(nspawn_host, tmp_path):
    host = nspawn_host
    link = host.link
    server, worker_addr = link.host_addr, host.hostname  # the dialing server's address is this side's
    recipe = _worker_recipe(tmp_path, f"{worker_addr}:{PORT}", server)
    worker = recipe.rpc[0]
    layout = RpcLayout("/opt/voltaforge", PORT)
    unit = render_rpc_unit(recipe, worker, layout)
    real = f"ExecStart={exec_line(rpc_argv(recipe, worker, layout))}\n"
    assert real in unit and "IPAddressDeny=any\n" in unit and f"IPAddressAllow={server}\n" in unit
    stand_in = f"ExecStart=/usr/bin/python3 -m http.server --bind {worker_addr} --directory /usr/share %d\n"
    filtered = unit.replace(real, stand_in % PORT)
    # the control: the same unit without its filter lines, on the next port
    open_twin = "".join(
        line for line in unit.replace(real, stand_in % (PORT + 1)).splitlines(keepends=True)
        if not line.startswith(("IPAddressDeny=", "IPAddressAllow="))
    )  # fmt: skip
    stranger = f"192.0.2.{zlib.crc32(link.name.encode()) % 250 + 2}"
    units = ("vf-rpc-filtered.service", "vf-rpc-open.service")
    try:
        _install(host, units[0], filtered)
        _install(host, units[1], open_twin)
        shown = host.run_inside(f"systemctl show -p IPAddressDeny -p IPAddressAllow --value {units[0]}").stdout
        assert "0.0.0.0/0" in shown and f"{server}/32" in shown, shown
        subprocess.run(["ip", "addr", "replace", f"{stranger}/32", "dev", link.host_if], check=True)
        subprocess.run(["ip", "-n", link.name, "route", "replace", f"{stranger}/32", "dev", link.ns_if], check=True)
        for name, port in zip(units, (PORT, PORT + 1), strict=True):
            for _ in range(50):  # until the stand-in listens (it is Type=exec: started = exec'd)
                if host.run_inside(f"ss -Htln 'sport = :{port}' | grep -q .", check=False).returncode == 0:
                    break
            assert host.run_inside(f"systemctl is-active {name}").stdout.strip() == "active"
        seen = {
            "server -> worker": _get(f"http://{worker_addr}:{PORT}/", server),
            "stranger -> worker": _get(f"http://{worker_addr}:{PORT}/", stranger),
            "stranger -> unfiltered twin": _get(f"http://{worker_addr}:{PORT + 1}/", stranger),
        }
        print("\n" + json.dumps(seen))
        assert seen == {"server -> worker": 200, "stranger -> worker": "timed out", "stranger -> unfiltered twin": 200}
    finally:
        subprocess.run(["ip", "addr", "del", f"{stranger}/32", "dev", link.host_if], check=False)
        host.run_inside(
            f"systemctl stop {' '.join(units)}; rm -f {' '.join('/etc/systemd/system/' + u for u in units)}; "
            "systemctl daemon-reload",
            check=False,
        )
