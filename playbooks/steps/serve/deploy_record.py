"""A deployment's record on its host, ``<prefix>/deploy/<service>/deployed.json``: where a
deployment keeps its state, what it started (the fingerprint of every rendered file and the
artifact), and the rollback target it names (``good``). Written by the serving lifecycle
(steps/serve/lifecycle.py) and the gate; read by status, bench, stop (facts/deployments.py)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from playbooks.facts import read_fact
from playbooks.facts.files import cat_command, parse_json_object
from playbooks.host.base import Host
from playbooks.steps.serve.service_file import ServiceFile

#: the fingerprint's format: bump when what it covers changes
FINGERPRINT_VERSION = 1
#: the record's format (2: the rollback target is described whole, and the gate's verdict kept;
#: 3: the recipe it serves, its text included, so bare `invoke bench`/`stop` can load it again)
RECORD_VERSION = 3


@dataclass(frozen=True)
class DeployLayout:
    """Where a deployment keeps its state on the host."""

    prefix: str
    service: str  # the unit name without .service

    @property
    def serve_dir(self) -> str:
        return f"{self.prefix}/serve/{self.service}"

    @property
    def state_dir(self) -> str:
        return f"{self.prefix}/deploy/{self.service}"

    @property
    def record(self) -> str:
        return f"{self.state_dir}/deployed.json"

    @property
    def good_dir(self) -> str:
        return f"{self.state_dir}/good"


def read_record(host: Host, layout: DeployLayout) -> dict[str, Any] | None:
    """The deployment record: what was started, when, from which files, and its buffers."""
    return parse_json_object(read_fact(host, cat_command(layout.record)))


def fingerprint(files: Sequence[ServiceFile], artifact_sha256: str, artifact_path: str) -> str:
    blob = json.dumps(
        {
            "v": FINGERPRINT_VERSION,
            "files": {f.path: f.sha256 for f in files},
            "artifact": [artifact_path, artifact_sha256],
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


#: what a rollback target keeps of its deployment's record (with ``copies``: where good/'s files go)
SNAPSHOT_KEYS = (
    "fingerprint", "at", "files", "artifact", "port", "ready_s", "buffers", "gate", "recipe", "served_name",
    "members",
)  # fmt: skip


def good_of(record: dict[str, Any]) -> dict[str, Any] | None:
    """The rollback target a record names (records of version 1 kept only the file copies)."""
    good = record.get("good")
    if not good:
        return None
    if "copies" in good:
        return dict(good)
    return {**{k: record.get(k) for k in SNAPSHOT_KEYS}, "copies": good}


def write_record(host: Host, layout: DeployLayout, record: dict[str, Any]) -> None:
    host.write_file(layout.record, (json.dumps(record, indent=2, sort_keys=True) + "\n").encode(), 0o644)
