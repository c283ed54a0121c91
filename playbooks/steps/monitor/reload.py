"""Prometheus runs the configuration on disk: a changed file is checked with promtool and then
read by the running Prometheus on SIGHUP (``systemctl reload`` under systemd), never a restart,
so a server added to or removed from the fleet costs no scrape history and no gap.

What was last loaded is a fingerprint kept beside the unit's state
(``<prefix>/deploy/voltaforge-prometheus/loaded.sha256``), written once Prometheus said the
reload worked (its own ``prometheus_config_last_reload_successful`` and a newer
``..._success_timestamp_seconds``, read from its /metrics)."""

from __future__ import annotations

import hashlib
import shlex
from dataclasses import dataclass

from playbooks.facts import read_fact
from playbooks.host.base import Host
from playbooks.host.ops import Decision, Operation, Shell
from playbooks.steps.serve.service_manager import Manager, ProcessRunner, Systemd

PROMTOOL = "/usr/bin/promtool"
#: how long a reload may take to show in Prometheus's own metrics
RELOAD_TIMEOUT_S = 30

# run by the host's python3: the reload's timestamp before the signal, then wait for a newer
# one with success; stdlib only (a host may have no curl)
_WAIT = """
import sys, time, urllib.request
url, before, limit = sys.argv[1], float(sys.argv[2]), time.monotonic() + float(sys.argv[3])
def read():
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    got = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name.startswith("prometheus_config_last_reload_success"):
            got[name] = float(value)
    return got
if before < 0:
    print(read().get("prometheus_config_last_reload_success_timestamp_seconds", 0)); sys.exit(0)
while time.monotonic() < limit:
    got = read()
    if got.get("prometheus_config_last_reload_successful") == 0:
        sys.exit("Prometheus refused the new configuration (prometheus_config_last_reload_successful 0)")
    if got.get("prometheus_config_last_reload_success_timestamp_seconds", 0) > before:
        sys.exit(0)
    time.sleep(0.2)
sys.exit("Prometheus did not reload within %s s" % sys.argv[3])
"""


@dataclass(frozen=True)
class Loaded:
    up: bool
    loaded: str  # the fingerprint of the configuration last reloaded ("" none)


class EnsureConfigLoaded(Operation):
    """The running Prometheus has read ``config`` (the text at ``path``): after the file step
    and the start, so a start in this run has read it already and the reload is a no-op."""

    def __init__(
        self, path: str, config: str, prefix: str, manager: Manager, metrics_url: str, *, sudo: bool, rules: str = ""
    ):
        self.path, self.config, self.manager, self.metrics_url, self.sudo = path, config, manager, metrics_url, sudo
        #: the rule file's text: a change of it is a reload too
        self.rules = rules
        self.state_file = f"{prefix}/deploy/voltaforge-prometheus/loaded.sha256"
        self.name = f"Ensure Prometheus has loaded {path}"

    @property
    def fingerprint(self) -> str:
        return hashlib.sha256((self.config + "\0" + self.rules).encode()).hexdigest()

    def read(self, host: Host) -> Loaded:
        running = self.manager.running(read_fact(host, self.manager.state_command()))
        loaded = read_fact(host, f"cat -- {shlex.quote(self.state_file)} 2>/dev/null || true").strip()
        return Loaded(running.up, loaded)

    def decide(self, facts: Loaded) -> Decision:
        if facts.loaded == self.fingerprint:
            return Decision.ok("its configuration and rules are the ones on disk")
        url, wait = shlex.quote(self.metrics_url), shlex.quote(_WAIT)
        if isinstance(self.manager, Systemd):
            signal = Shell(f"systemctl reload -- {shlex.quote(self.manager.unit)}", True)
        else:
            assert isinstance(self.manager, ProcessRunner)
            signal = Shell(f'kill -HUP "$(cat -- {shlex.quote(self.manager.pid_file)})"')
        record = (
            f"mkdir -p -- {shlex.quote(self.state_file.rsplit('/', 1)[0])} && "
            f"printf '%s\\n' {self.fingerprint} > {shlex.quote(self.state_file)}"
        )
        return Decision.act(
            "the file changed since Prometheus last read it" if facts.loaded else "not read since voltaforge wrote it",
            # the credentials files it names exist only for the running unit: root checks them
            Shell(f"{PROMTOOL} check config {shlex.quote(self.path)}", sudo=self.sudo),
            Shell(
                f"before=$(python3 -c {wait} {url} -1 0) && {signal.command} && "
                f'python3 -c {wait} {url} "$before" {RELOAD_TIMEOUT_S}',
                sudo=signal.sudo,
            ),
            Shell(record, sudo=self.sudo),
        )
