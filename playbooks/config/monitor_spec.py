"""The inventory's ``monitor:`` entry: where `invoke monitor` runs Prometheus, which hosts it
watches, and where each part listens. Every field is also a flag of `invoke monitor`, which wins.

    monitor:
      host: local                 # the inventory host that runs Prometheus
      hosts: [gpu-01, gpu-02]     # the fleet it watches (default: every inventory host)
      bind: 127.0.0.1             # where Prometheus listens (default: loopback)
      port: 9090
      exporters: loopback         # or `address`: each host's exporters on its inventory address
      scrape_interval_s: 15

Nothing listens on every interface by default: Prometheus and the exporters listen on loopback,
which a monitor on the same host reaches; a fleet watched from another host names
``exporters: address`` (each host's inventory address, an IP) and Prometheus's ``bind``."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from playbooks.config.inventory import (
    DEFAULT_INVENTORY,
    InventoryFile,
    check_bind,
    check_host_name,
    check_host_names,
)
from playbooks.config.yamlfile import explain_validation, load_yaml

#: Prometheus's own port, and the exporters' (the node exporter's registered default, and the
#: next free one in Prometheus's port allocation list for ours)
PROMETHEUS_PORT = 9090
NODE_EXPORTER_PORT = 9100
GPU_EXPORTER_PORT = 9835
#: the slots exporter's, beside Prometheus on the monitor host (loopback only)
SLOTS_EXPORTER_PORT = 9836


class MonitorSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str | None = Field(None, description="the inventory host that runs Prometheus")
    hosts: tuple[str, ...] = Field((), description="the hosts it watches (default: every inventory host)")
    bind: str = "127.0.0.1"
    port: int = Field(PROMETHEUS_PORT, ge=1, le=65535)
    exporters: Literal["loopback", "address"] = "loopback"
    node_exporter_port: int = Field(NODE_EXPORTER_PORT, ge=1, le=65535)
    gpu_exporter_port: int = Field(GPU_EXPORTER_PORT, ge=1, le=65535)
    slots_exporter_port: int = Field(SLOTS_EXPORTER_PORT, ge=1, le=65535)
    scrape_interval_s: int = Field(15, ge=1, le=300)

    @field_validator("host")
    @classmethod
    def _host(cls, v):
        return v if v is None else check_host_name(v)

    @field_validator("hosts")
    @classmethod
    def _hosts(cls, v):
        return check_host_names(v)

    @field_validator("bind")
    @classmethod
    def _bind(cls, v):
        return check_bind(v)


def load_monitor(path: Path = DEFAULT_INVENTORY) -> MonitorSpec:
    """The inventory's ``monitor:`` entry (the defaults when there is none or no file)."""
    path = Path(path)
    if not path.exists():
        return MonitorSpec()
    data, lines = load_yaml(path)
    if data is None:
        return MonitorSpec()
    try:
        entry = InventoryFile.model_validate(data).monitor
        return MonitorSpec.model_validate(entry or {})
    except ValidationError as exc:
        raise explain_validation(exc, path, lines, MonitorSpec, prefix=("monitor",)) from None
