"""`invoke toolchain`, `invoke build` and `invoke quantize` of tiny-cpu on a host without internet:
the Debian 12 container of ``provisionable_nspawn_host`` (its own network namespace, no route
out), provisioned over SSH from nothing but its image, pip installing only from the
bind-mounted wheelhouse (tests/wheelhouse.py).

The real step code: ``run_toolchain`` (venv, the CPU torch from the wheelhouse, the lock),
``run_build`` (the server: from the controller's fleet cache when it holds this build, else
compiled in the container and kept there for the next host; the llama-cpp-python bindings,
always compiled in the container from the pushed sdist) and ``run_quantize`` (Q4_K_M: F16,
imatrix, Q4_K_M, each verified); each returns 0, and a second run of each changes nothing.

Measured on this kind of machine (2 cores shared with other work, nice 10; seconds, first run /
second run; `VOLTAFORGE_CACHE=<empty dir> pytest tests/test_nspawn_offline.py` for cold,
the same again with the default cache for warm):

                cold (empty test cache, load ~4)        warm (fleet cache holds the server)
    setup       93 (rootfs 73, wheelhouse 12 with       1.4 (boot)
                pip's own cache warm, unpack 8, boot)
    toolchain   18.3 / 0.7                              18.0 / 0.8
    build       1226.9 / 2.5: the server compiled       336.9 / 1.5: the server copied from
                in the container 13.4 min, the          the fleet cache, the bindings
                bindings 7.0 min                        compiled (5.5 min)
    quantize    33.5 / 1.5                              18.2 / 1.5
    whole test  23 min 3 s                              6 min 24 s

An earlier cold run with less load on the machine took 13 min 16 s in all. The shared ccache
does not shorten the bindings' compile (0 hits in 127 calls when warm): pip builds them in a
random /tmp/pip-req-build-* directory, so no compiler command line repeats. It serves a
compile of the server (a new flag, a lost fleet cache).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml

from playbooks.steps.build import FleetCache
from tests.helpers import ROOT, inventory_for
from tests.llamacpp_tools import TORCH_CPU

pytestmark = pytest.mark.slow


def _recipe(tmp_path: Path, wheelhouse: str) -> Path:
    """tiny-cpu whose torch comes from PyPI's index (an index the host cannot reach: pip's
    configuration there says no-index) or the wheelhouse, as test_quantize_real.py's does."""
    data = yaml.safe_load((ROOT / "recipes" / "tiny-cpu.yaml").read_text())
    data["toolchain"] = {
        **data["toolchain"],
        "torch": TORCH_CPU,
        "torch_index": "https://pypi.org/simple",
        "torch_find_links": wheelhouse,
    }
    (tmp_path / "defaults.yaml").write_text((ROOT / "recipes" / "defaults.yaml").read_text())
    path = tmp_path / "tiny-offline.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.timeout(3600)  # cold: the server and the bindings compiled in the container on 2 cores
def test_toolchain_build_quantize_offline_in_a_container(provisionable_nspawn_host, tmp_path, capsys):
    from playbooks.cli.build import run_build
    from playbooks.cli.quantize import run_artifacts, run_quantize
    from playbooks.cli.settings import Settings
    from playbooks.cli.toolchain import run_toolchain

    host = provisionable_nspawn_host
    prefix = str(host.prefix)
    recipe = _recipe(tmp_path, str(host.wheelhouse))
    settings = Settings(inventory=inventory_for(tmp_path, "box", host, prefix=prefix))

    # offline for real: no route out of the container, and pip there knows only the wheelhouse
    probe = host.run_inside("curl -sS --max-time 5 -o /dev/null https://pypi.org/simple/", check=False)
    assert probe.returncode != 0, probe
    pip_conf = host.run_inside("python3 -c 'import configparser as c; p = c.ConfigParser(); "
                               "p.read(\"/etc/pip.conf\"); print(dict(p[\"global\"]))'").stdout  # fmt: skip
    assert "'no-index': 'true'" in pip_conf and str(host.wheelhouse) in pip_conf

    fleet = FleetCache.default()
    fleet_before = set(fleet.ids())
    times: dict[str, list[float]] = {}

    def step(name: str, run) -> str:
        t0 = time.monotonic()
        code = run()
        times.setdefault(name, []).append(round(time.monotonic() - t0, 1))
        (tmp_path / "times.json").write_text(json.dumps(times))  # kept by pytest, also on a failure
        out = capsys.readouterr().out
        assert code == 0, out[-4000:]
        return out

    def toolchain():
        return run_toolchain("box", str(recipe), settings=settings)

    def build():
        return run_build("box", str(recipe), settings=settings)

    def quantize():
        return run_quantize("box", str(recipe), quant="Q4_K_M", settings=settings)

    for name, run in (("toolchain", toolchain), ("build", build), ("quantize", quantize)):
        first = step(name, run)
        assert "box: 0 changed" not in first and " changed, " in first, first[-3000:]
        again = step(name, run)
        assert "box: 0 changed" in again, again[-3000:]
        if name == "build":
            server = "proven in the controller's fleet cache" in first
            assert server == bool(set(fleet.ids()) & fleet_before), first[-3000:]
            assert "FORCE_CMAKE=1" in first  # the bindings: compiled here, from the pushed sdist

    # what the host got: the wheelhouse's torch, bindings from the same archive as the server
    lock = json.loads(host.run_inside(f"cat {prefix}/toolchain.lock").stdout)
    assert lock["torch"]["version"] == TORCH_CPU and lock["torch"]["find_links"] == str(host.wheelhouse)
    stamp = json.loads(host.run_inside(f"cat {prefix}/venv/voltaforge-llama-cpp-python.json").stdout)
    server_stamp = json.loads(host.run_inside(f"cat {prefix}/llama.cpp/current/voltaforge-stamp.json").stdout)
    assert stamp["inputs"]["source_sha256"] == server_stamp["inputs"]["source_sha256"]
    assert stamp["import"] == "0.3.36" and stamp["system_info"].startswith("CPU : ")
    assert run_artifacts("box", as_json=True, settings=settings) == 0
    listed = json.loads(capsys.readouterr().out)
    assert sorted(a["quant"] for a in listed) == ["F16", "Q4_K_M"]
    assert all(a["verification"]["run"]["finite"] for a in listed)
    # the fleet cache holds the server build now: the next host with these inputs copies it
    assert server_stamp["id"] in fleet.ids()

    ccache = host.run_inside(f"CCACHE_DIR={prefix}/llama.cpp/ccache ccache -s", check=False, user="deploy").stdout
    report = {"seconds": times, "server_from_fleet_cache": server, "ccache": ccache.strip().splitlines()}
    (tmp_path / "times.json").write_text(json.dumps(report, indent=2))
    with capsys.disabled():
        print(f"\nnspawn offline provisioning, seconds (first run, second run): {json.dumps(report, indent=1)}")
