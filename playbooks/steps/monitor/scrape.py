"""Prometheus's configuration, from the targets `invoke monitor` found (conduct/monitor.py):
pure, so the file is the same on every run that finds the same fleet (a second run changes
nothing; a server added or removed changes it, and Prometheus is reloaded, not restarted).

One scrape job per way of asking, as Prometheus wants it (the key, the path and the URL
parameters are a job's, not a target's): the servers without a key, the servers of each key
(``authorization.credentials_file``: the key is read from a 0600 file, never written in this
text), and one job per model of a router-mode set, asked ``/metrics?model=NAME&autoload=false``
(the router answers for a loaded model and refuses with 400 for one it has not loaded, so a
scrape never loads one; that target is ``up 0`` while the model sleeps). Every server's series
carry the job ``llama-server`` and its ``host``, ``model``, ``engine`` and ``service``."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import yaml

from playbooks.errors import VoltaforgeError

_LABEL_VALUE = re.compile(r"^[A-Za-z0-9._:/@+-]{1,128}$")
_ADDRESS = re.compile(r"^[A-Za-z0-9.:\[\]-]{1,260}:[0-9]{1,5}$")
_PATH = re.compile(r"^/[A-Za-z0-9._/-]*$")
_JOB = re.compile(r"^[a-z][a-z0-9-]{0,62}$")


@dataclass(frozen=True)
class Target:
    """One thing Prometheus scrapes, as the monitor host reaches it."""

    job: str  # the series' job label: llama-server, node, gpu, edge, prometheus
    address: str  # host:port
    labels: tuple[tuple[str, str], ...] = ()
    path: str = "/metrics"
    params: tuple[tuple[str, str], ...] = ()
    #: a file on the monitor host holding the bearer key (0600, the scraper's own)
    credentials_file: str | None = None
    scheme: str = "http"
    #: what the operator reads in a line when it cannot be reached ("gpu-01: llama-server mid")
    what: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if not _JOB.match(self.job):
            raise VoltaforgeError(f"scrape job {self.job!r}: lower-case letters, digits and - only")
        if not _ADDRESS.match(self.address):
            raise VoltaforgeError(f"scrape target {self.address!r} is not host:port")
        if not _PATH.match(self.path):
            raise VoltaforgeError(f"scrape path {self.path!r} is not a plain path")
        if self.scheme not in ("http", "https"):
            raise VoltaforgeError(f"scrape scheme {self.scheme!r}: http or https")
        for key, value in (*self.labels, *self.params):
            if not re.fullmatch(r"[a-z_][a-z0-9_]{0,62}", key) or not _LABEL_VALUE.match(value):
                raise VoltaforgeError(f"scrape label or parameter {key}={value!r} is not plain text")

    @property
    def url(self) -> str:
        query = "&".join(f"{k}={v}" for k, v in self.params)
        return f"{self.scheme}://{self.address}{self.path}" + (f"?{query}" if query else "")


def _job_name(t: Target) -> str:
    """A scrape config's name: the job, then what sets its way of asking apart."""
    parts = [t.job]
    if t.credentials_file:
        parts.append("key-" + t.credentials_file.rsplit("/", 1)[-1].removeprefix("key-"))
    parts += [v for _, v in t.params if v not in ("false",)]
    if t.scheme != "http":
        parts.append(t.scheme)
    return re.sub(r"[^A-Za-z0-9_-]", "_", "-".join(parts))


def render_config(targets: Sequence[Target], interval_s: int, rule_files: Sequence[str] = ()) -> str:
    """prometheus.yml: the global interval, the rule files (steps/monitor/rules.py), then one
    scrape config per way of asking, each target with its labels; stable order (by job name,
    then address)."""
    jobs: dict[str, list[Target]] = {}
    for t in sorted(set(targets), key=lambda t: (_job_name(t), t.address, t.labels)):
        jobs.setdefault(_job_name(t), []).append(t)
    configs = []
    for name, members in jobs.items():
        first = members[0]
        config: dict = {"job_name": name, "metrics_path": first.path, "scheme": first.scheme}
        if first.params:
            config["params"] = {k: [v] for k, v in first.params}
        if first.credentials_file:
            config["authorization"] = {"type": "Bearer", "credentials_file": first.credentials_file}
        config["static_configs"] = [{"targets": [t.address], "labels": dict(t.labels)} for t in members]
        if name != first.job:
            # the series' job is the kind of thing scraped, whatever key or model asked
            config["relabel_configs"] = [{"target_label": "job", "replacement": first.job}]
        configs.append(config)
    doc: dict = {"global": {"scrape_interval": f"{interval_s}s", "evaluation_interval": f"{interval_s}s"}}
    if rule_files:
        doc["rule_files"] = list(rule_files)
    doc["scrape_configs"] = configs
    head = "# rendered by voltaforge (`invoke monitor`) - do not edit; run `invoke monitor` again instead.\n"
    return head + yaml.safe_dump(doc, sort_keys=False, default_flow_style=False)
