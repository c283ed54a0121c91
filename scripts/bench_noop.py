"""No-op benchmark (issue 22, item 2): a second `invoke provision` beside pyinfra's, printed side
by side in one run; asserts nothing.

1. ``--host local``: this machine with the built-in default (provisioned first when it is
   not), its no-op run RUNS times;
2. one SSH host: a private sshd on loopback (tests/testhosts.py: real OpenSSH, an unprivileged
   user, strict host keys) provisioned from nothing, then its no-op RUNS times;
3. ten SSH hosts at once: ten more sshd daemons, each an inventory entry of its own (its own
   port, host key, connection), all on the first host's prefix. One machine: the ten read the
   same files on the same 2 cores, so this is the controller's and the daemons' overhead of ten
   at once, pessimistic for a fleet, where each host reads its own;
4. pyinfra (installed into its own venv from the package index when ``--pyinfra`` names no
   existing one): an 8-operation deploy (directories, files, a link) on the same sshd, applied
   once, then its no-op RUNS times.

Every run is the real command in a subprocess, as a user types it, with bytecode written (as on
a user's machine; this machine sets PYTHONDONTWRITEBYTECODE, which is unset here). Figures: the
median wall time, and voltaforge's remote calls per host from its --json summary.

Usage: .venv/bin/python scripts/bench_noop.py [--runs 5] [--pyinfra /tmp/pyinfra-venv]
Writes reports/local/bench-noop.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # tests/testhosts.py imports its siblings by name

from playbooks.results import write_result  # noqa: E402
from scripts.bench_provision import inventory_entry, links_dir, recipe_for  # noqa: E402
from tests.helpers import shared_ccache  # noqa: E402
from tests.testhosts import SshdHost, ensure_test_user, remove_test_user  # noqa: E402

ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
INVOKE = [sys.executable, "-m", "invoke", "-r", str(ROOT)]

#: what the file measures (results.py, ``measures``): the no-op is the CLI's start, the
#: provision conductor, its reads pass and the host layer's batch (issue 36, item 5)
MEASURES = [
    "tasks.py",
    "playbooks/cli/main.py",
    "playbooks/cli/tasks.py",
    "playbooks/cli/command.py",
    "playbooks/cli/configured.py",
    "playbooks/cli/provision.py",
    "playbooks/conduct/provision.py",
    "playbooks/conduct/read_pass.py",
    "playbooks/conduct/known_reads.py",
    "playbooks/host/prefetch.py",
    "playbooks/host/ssh.py",
    "playbooks/steps/measure/gate.py",
]

PYINFRA_DEPLOY = """
from pyinfra.operations import files

base = "{base}"
for name in ("a", "b", "c", "d"):
    files.directory(name=f"dir {{name}}", path=f"{{base}}/{{name}}", mode="755")
files.put(name="file one", src="{src}", dest=f"{{base}}/a/one.txt", mode="644")
files.put(name="file two", src="{src}", dest=f"{{base}}/b/two.txt", mode="644")
files.link(name="link", path=f"{{base}}/c/one", target=f"{{base}}/a/one.txt")
files.file(name="empty file", path=f"{{base}}/d/empty", mode="600")
"""


@dataclass
class Runs:
    """One case's runs: wall seconds and the controller's CPU seconds (user + system of the
    command and what it waited for: over SSH that is the controller alone, its paramiko too)."""

    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    calls: list[int] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.wall)

    @property
    def median_cpu(self) -> float:
        return statistics.median(self.cpu)

    def spread(self, values: list[float] | None = None) -> str:
        v = self.wall if values is None else values
        return f"{min(v):.2f}-{max(v):.2f}"


def timed(cmd: list[str], log: Path, cwd: Path | None = None) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds of the command and its waited-for children, exit code)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    with open(log, "a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        r = subprocess.run(cmd, cwd=cwd, env=ENV, stdout=out, stderr=subprocess.STDOUT)
    wall = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, r.returncode


def provision(
    args: list[str], log: Path, summary: Path, cwd: Path | None = None
) -> tuple[float, float, int, list[int]]:
    seconds, cpu, rc = timed([*INVOKE, "provision", *args, "--json", str(summary)], log, cwd)
    try:
        data = json.loads(summary.read_text())
        hosts = data if isinstance(data, list) else data.get("hosts", [data])
        calls = [int(h.get("remote_calls", 0)) for h in hosts]
    except (OSError, ValueError, AttributeError):
        calls = []
    return seconds, cpu, rc, calls


def noops(args: list[str], runs: int, log: Path, summary: Path, cwd: Path | None = None) -> Runs:
    out = Runs()
    for _ in range(runs):
        seconds, cpu, rc, calls = provision(args, log, summary, cwd)
        if rc != 0:
            raise SystemExit(f"a no-op run failed (exit {rc}): see {log}")
        out.wall.append(seconds)
        out.cpu.append(cpu)
        out.calls = calls
    return out


def pyinfra_venv(where: str | None) -> Path:
    venv = Path(where or tempfile.mkdtemp(prefix="vf-pyinfra-"))
    if not (venv / "bin" / "pyinfra").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "pyinfra"], check=True)
    return venv


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5, help="no-op runs per case (default 5)")
    ap.add_argument("--fleet", type=int, default=10, help="SSH hosts at once (default 10)")
    ap.add_argument("--pyinfra", help="a venv with pyinfra (made here when it has none)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="vf-bench-noop-"))
    log, summary = work / "runs.log", work / "summary.json"
    account = ensure_test_user()
    links = links_dir()
    hosts: list[SshdHost] = []
    try:
        # 1. this machine, the README's quick start
        first, _, rc, _ = provision([], log, summary, ROOT)
        if rc != 0:
            raise SystemExit(f"provisioning this machine failed (exit {rc}): see {log}")
        local = noops([], args.runs, log, summary, ROOT)

        # 2. one SSH host from nothing, then its no-op
        entries: dict[str, dict] = {}
        for i in range(args.fleet + 1):
            h = SshdHost.create(work / f"sshd{i}", user=account.pw_name)
            hosts.append(h)
        prefix = hosts[0].prefix / "vf"
        shared_ccache(prefix, hosts[0].user)
        recipe = recipe_for(work, 18500, links)
        for i, h in enumerate(hosts):
            entries[f"noop{i}"] = inventory_entry(h, prefix, recipe)
        inventory = work / "inventory.yaml"
        inventory.write_text(yaml.safe_dump({"hosts": entries}))
        inv = ["--inventory", str(inventory)]
        cold, _, rc, _ = provision(["--host", "noop0", *inv], log, summary, work)
        if rc != 0:
            raise SystemExit(f"provisioning the SSH host failed (exit {rc}): see {log}")
        one = noops(["--host", "noop0", *inv], args.runs, log, summary, work)

        # 3. the fleet: the first run of each new entry finds its reads (no known reads yet)
        fleet = ",".join(list(entries)[1:])
        provision(["--host", fleet, *inv], log, summary, work)
        many = noops(["--host", fleet, *inv], args.runs, log, summary, work)

        # 4. pyinfra on the same sshd
        venv = pyinfra_venv(args.pyinfra)
        base = hosts[0].prefix / "pyinfra"
        src = work / "one.txt"
        src.write_text("one\n")
        os.chmod(work, 0o755)
        os.chmod(src, 0o644)
        deploy = work / "deploy.py"
        deploy.write_text(PYINFRA_DEPLOY.format(base=base, src=src))
        h = hosts[0]
        pinv = work / "pyinfra_inventory.py"
        pinv.write_text(
            f"hosts = [({h.hostname!r}, {{'ssh_port': {h.port}, 'ssh_user': {h.user!r}, "
            f"'ssh_key': {str(h.key_filename)!r}, 'ssh_known_hosts_file': {str(h.known_hosts)!r}, "
            "'ssh_strict_host_key_checking': 'yes'})]\n"
        )
        pyinfra = [str(venv / "bin" / "pyinfra"), "-y", str(pinv), str(deploy)]
        _, _, rc = timed(pyinfra, log, work)
        if rc != 0:
            raise SystemExit(f"pyinfra's first run failed (exit {rc}): see {log}")
        py = Runs()
        for _ in range(args.runs):
            seconds, cpu, rc = timed(pyinfra, log, work)
            if rc != 0:
                raise SystemExit(f"pyinfra's no-op failed (exit {rc}): see {log}")
            py.wall.append(seconds)
            py.cpu.append(cpu)
        version = subprocess.run([str(venv / "bin" / "pyinfra"), "--version"], capture_output=True, text=True)

        # what each SSH host after the first costs the controller: the fleet's CPU less one host's,
        # over the hosts it adds (ten sshd daemons on two cores give no fair wall figure for this)
        per_host_cpu = (many.median_cpu - one.median_cpu) / (args.fleet - 1)
        print(
            f"no-op of `invoke provision` (tiny-cpu), median of {args.runs} (min-max), {os.cpu_count()} cores; "
            f"log: {log}"
        )
        rows = [
            ("voltaforge, --host local", local, f"{local.calls[0] if local.calls else '?'} remote call(s)"),
            ("voltaforge, 1 SSH host", one, f"{one.calls[0] if one.calls else '?'} remote call(s)"),
            (f"voltaforge, {args.fleet} SSH hosts at once", many, f"{max(many.calls or [0])} remote call(s) per host"),
            (f"pyinfra {version.stdout.strip()}, 8 operations, 1 SSH host", py, ""),
        ]
        print(f"  {'':<44} {'wall s':>6} {'(min-max)':>11}  {'CPU s':>5} {'(min-max)':>11}")
        for what, r, calls in rows:
            print(f"  {what:<44} {r.median:6.2f} {r.spread():>11}  {r.median_cpu:5.2f} {r.spread(r.cpu):>11}  {calls}")
        print(
            f"  {args.fleet} hosts / 1 host: {many.median / one.median:.2f}x wall; each SSH host after the first: "
            f"{per_host_cpu:.3f} s controller CPU; voltaforge 1 SSH host / pyinfra: {one.median / py.median:.2f}x"
        )
        print(f"  (from nothing: this machine {first:.0f} s, the SSH host {cold:.0f} s)")
        figures = {
            "noop_local_s": round(local.median, 2),
            "noop_one_ssh_s": round(one.median, 2),
            "noop_fleet_s": round(many.median, 2),
            "fleet_over_one_x": round(many.median / one.median, 2),
            "pyinfra_noop_s": round(py.median, 2),
            "one_ssh_over_pyinfra_x": round(one.median / py.median, 2),
            "cpu_one_ssh_s": round(one.median_cpu, 2),
            "cpu_fleet_s": round(many.median_cpu, 2),
            "cpu_per_extra_host_s": round(per_host_cpu, 3),
            "cpu_pyinfra_s": round(py.median_cpu, 2),
            "remote_calls_local": local.calls[0] if local.calls else -1,
            "remote_calls_one_ssh": one.calls[0] if one.calls else -1,
            "remote_calls_fleet_max": max(many.calls or [-1]),
            "fleet_hosts": args.fleet,
        }
        units = {k: "s" for k in figures if k.endswith("_s")}
        units |= {k: "x" for k in figures if k.endswith("_x")}
        units |= {k: "calls" for k in figures if k.startswith("remote_calls")}
        units["fleet_hosts"] = "hosts"
        write_result(
            ROOT / "reports" / "local" / "bench-noop.json",
            "scripts/bench_noop.py: the no-op of invoke provision (tiny-cpu) beside pyinfra's, one run",
            figures,
            units,
            f".venv/bin/python scripts/bench_noop.py --runs {args.runs} --fleet {args.fleet}",
            notes=(
                f"Medians of {args.runs} runs, the spread in extra; CPU: user + system seconds of the command and "
                "its children (over SSH, the controller alone). Bytecode written (PYTHONDONTWRITEBYTECODE unset). The "
                "SSH hosts are private sshd daemons on this machine's loopback; the fleet's entries share the first "
                "host's prefix (one machine, 2 cores). pyinfra: " + version.stdout.strip()
            ),
            measures=MEASURES,
            extra={
                "from_nothing_local_s": round(first, 1),
                "from_nothing_ssh_s": round(cold, 1),
                "runs": {
                    name: {"wall_s": [round(x, 3) for x in r.wall], "cpu_s": [round(x, 3) for x in r.cpu]}
                    for name, r in (("local", local), ("one_ssh", one), ("fleet", many), ("pyinfra", py))
                },
            },
        )
        return 0
    finally:
        subprocess.run(["pkill", "-u", account.pw_name, "-f", "llama-server"], check=False)
        for h in hosts:
            h.close()
        remove_test_user(account.pw_name)
        shutil.rmtree(links, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
