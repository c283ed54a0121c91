"""Provision benchmark (issue 12, item 3): prints figures, asserts nothing.

On private sshd test hosts on this machine's loopback (tests/testhosts.py: real OpenSSH, an
unprivileged user, strict host keys, each host its own prefix and its own port), through the
real `invoke provision` in a subprocess, as a user runs it:

1. one host from nothing to a passing gate (toolchain, build, quantize, deploy, gate);
2. the same host again: the no-op (facts and stamps only);
3. --hosts N more hosts from nothing at once (the fleet: builds come from the controller's
   fleet cache, compiles hit a shared ccache), then those N plus the first at once: the no-op
   of N+1 hosts side by side with the no-op of one.

Each host runs the tiny CPU recipe on a port of its own (the hosts share this machine's
network), with the CPU torch wheel from a local find-links directory. The hosts share this
machine's cores: N hosts at once on 2 cores measure the overhead of running in parallel, not
a fleet's real speed-up.

Usage: .venv/bin/python scripts/bench_provision.py [--hosts 3]   (as root: it makes a test user)
With --hosts 3 and every run passing it writes reports/local/bench-provision.json.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
#: the code a provision of the tiny recipe from nothing runs (results.py, ``measures``); the
#: other provision benchmarks (bench_quickstart.py, bench_provision_container.py) add to it
PROVISION_MEASURES = [
    "recipes/tiny-cpu.yaml",
    "playbooks/conduct/provision.py",
    "playbooks/conduct/toolchain.py",
    "playbooks/conduct/build.py",
    "playbooks/conduct/quantize.py",
    "playbooks/conduct/deploy.py",
    "playbooks/steps/build",
    "playbooks/steps/weights",
]
#: what this file measures: every step, the fleet cache, and the no-op's read pass
MEASURES = [*PROVISION_MEASURES, "playbooks/conduct/read_pass.py"]
sys.path.insert(0, str(ROOT / "tests"))  # tests/testhosts.py imports its siblings by name

from playbooks.results import write_result  # noqa: E402
from tests.helpers import shared_ccache  # noqa: E402
from tests.llamacpp_tools import TORCH_CPU, cpu_torch_wheel  # noqa: E402
from tests.testhosts import SshdHost, ensure_test_user, remove_test_user  # noqa: E402


def links_dir() -> Path:
    """The CPU torch wheel where the hosts' unprivileged user can read it."""
    wheel = cpu_torch_wheel()
    links = Path(tempfile.mkdtemp(prefix="vf-bench-links-", dir="/tmp"))
    os.chmod(links, 0o755)
    shutil.copyfile(wheel, links / wheel.name)
    os.chmod(links / wheel.name, 0o644)
    return links


def recipe_for(work: Path, port: int, links: Path) -> Path:
    data = yaml.safe_load((ROOT / "recipes" / "tiny-cpu.yaml").read_text())
    data["service"] = {**data["service"], "port": port}
    data["toolchain"] = {
        **data["toolchain"],
        "torch": TORCH_CPU,
        "torch_index": "https://pypi.org/simple",
        "torch_find_links": str(links),
    }
    d = work / f"recipe-{port}"
    d.mkdir()
    (d / "defaults.yaml").write_text((ROOT / "recipes" / "defaults.yaml").read_text())
    path = d / "tiny-cpu.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def inventory_entry(h: SshdHost, prefix: Path, recipe: Path) -> dict:
    """An sshd test host as an inventory entry: its address, key, known_hosts, prefix, recipe."""
    return {
        "host": h.hostname,
        "port": h.port,
        "user": h.user,
        "key_file": h.key_filename,
        "known_hosts": h.known_hosts,
        "prefix": str(prefix),
        "recipe": str(recipe),
    }


def provision(inventory: Path, hosts: list[str], log: Path) -> tuple[float, int]:
    t0 = time.monotonic()
    with open(log, "a") as out:
        r = subprocess.run(
            [sys.executable, "-m", "invoke", "-r", str(ROOT), "provision", "--host", ",".join(hosts),
             "--inventory", str(inventory)],
            cwd=inventory.parent, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    return time.monotonic() - t0, r.returncode


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, default=3, help="hosts provisioned at once beside the first (default 3)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="vf-bench-provision-"))
    account = ensure_test_user()
    links = links_dir()
    hosts: list[SshdHost] = []
    inventory = work / "inventory.yaml"
    entries: dict[str, dict] = {}
    log = work / "provision.log"
    try:
        for i in range(args.hosts + 1):
            h = SshdHost.create(work / f"sshd{i}", user=account.pw_name)
            hosts.append(h)
            prefix = h.prefix / "vf"
            shared_ccache(prefix, h.user)
            entries[f"bench{i}"] = inventory_entry(h, prefix, recipe_for(work, 18400 + i, links))
        inventory.write_text(yaml.safe_dump({"hosts": entries}))
        names = list(entries)
        rows = []
        first, code = provision(inventory, names[:1], log)
        rows.append(("1 host, from nothing", first, code))
        again, code = provision(inventory, names[:1], log)
        rows.append(("1 host, again (no-op)", again, code))
        if args.hosts:
            fleet, code = provision(inventory, names[1:], log)
            rows.append((f"{args.hosts} more hosts at once, from nothing", fleet, code))
            one, code1 = provision(inventory, names[:1], log)
            many, code = provision(inventory, names, log)
            rows.append(("1 host, no-op", one, code1))
            rows.append((f"{len(names)} hosts at once, no-op", many, code))
        print(f"invoke provision on sshd test hosts, {os.cpu_count()} cores; log: {log}")
        for what, seconds, rc in rows:
            print(f"  {what:<40} {seconds:8.1f} s   exit {rc}")
        if args.hosts:
            print(f"  no-op of {len(names)} hosts / no-op of 1: {many / one:.2f}x the time")
        if args.hosts == 3 and all(rc == 0 for _, _, rc in rows):
            write_result(
                ROOT / "reports" / "local" / "bench-provision.json",
                "scripts/bench_provision.py: provision of tiny-cpu on private sshd test hosts: one from nothing, "
                "again, three more at once, then the no-op of one and of all four",
                {
                    "one_host_from_nothing_s": round(first, 1),
                    "one_host_again_s": round(again, 1),
                    "three_more_from_nothing_s": round(fleet, 1),
                    "noop_one_host_s": round(one, 1),
                    "noop_four_hosts_s": round(many, 1),
                    "noop_four_over_one_x": round(many / one, 2),
                },
                {
                    "one_host_from_nothing_s": "s",
                    "one_host_again_s": "s",
                    "three_more_from_nothing_s": "s",
                    "noop_one_host_s": "s",
                    "noop_four_hosts_s": "s",
                    "noop_four_over_one_x": "x",
                },
                ".venv/bin/python scripts/bench_provision.py --hosts 3",
                notes=(
                    "Each host its own prefix (its ccache shared, ccache from ci/); the CPU torch wheel from a "
                    "local find-links directory; the controller's own cache (the pinned sdist, the fleet cache) "
                    "as it was. The hosts share this machine's 2 cores."
                ),
                extra={"rows": [{"what": w, "s": round(t, 1), "exit": rc} for w, t, rc in rows]},
                measures=MEASURES,
            )
        return 0
    finally:
        for h in hosts:
            # the managed llama-server processes run as the test user: stop them with the hosts
            subprocess.run(["pkill", "-u", account.pw_name, "-f", "llama-server"], check=False)
            h.close()
        remove_test_user(account.pw_name)
        shutil.rmtree(links, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
