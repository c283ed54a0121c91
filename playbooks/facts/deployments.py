"""What a host serves: its deployment records (``<prefix>/deploy/<service>/deployed.json``,
written by `invoke deploy`), all listed by one command, and how long a process has run.

Pure parsers: garbage parses to an unreadable record or to no figure, never an exception.
"""

from __future__ import annotations

import hashlib
import json
import shlex
from dataclasses import dataclass
from typing import Any

from playbooks.facts import lines


def deployments_command(prefix: str) -> str:
    """One line per deployment record under the prefix: the service's name, a tab, the record
    with its newlines taken out (json.dumps escapes those inside strings, so it stays JSON)."""
    root = shlex.quote(f"{prefix}/deploy")
    return (
        f'for f in {root}/*/deployed.json; do [ -f "$f" ] || continue; d=${{f%/deployed.json}}; '
        "printf '%s\\t' \"${d##*/}\"; tr -d '\\n\\r' < \"$f\" 2>/dev/null; echo; done; true"
    )


@dataclass(frozen=True)
class RecordedRecipe:
    """The recipe a deployment serves, as its record keeps it (config/recorded.py)."""

    name: str
    path: str
    sha256: str
    yaml: str


@dataclass(frozen=True)
class Deployment:
    service: str  # the unit's name without .service (the state directory's name)
    record: dict[str, Any] | None  # None: the file is unreadable or not a JSON object

    @property
    def recipe(self) -> RecordedRecipe | None:
        """The recorded recipe; None for a record written before voltaforge kept it, or one
        whose text does not match its sha256 (edited by hand: not trusted)."""
        return _recorded((self.record or {}).get("recipe"))

    @property
    def members(self) -> tuple[RecordedRecipe, ...]:
        """A model set's members (its router's record names them), each as ``recipe`` is
        kept; () for any other deployment. A member whose entry does not verify is left out."""
        return tuple(r for r, _ in self._members())

    @property
    def member_names(self) -> tuple[str, ...]:
        """Each of :attr:`members`' served name (the name the router routes), in its order."""
        return tuple(name for _, name in self._members())

    def _members(self) -> list[tuple[RecordedRecipe, str]]:
        entries = (self.record or {}).get("members")
        out = []
        for e in entries if isinstance(entries, list) else []:
            r = _recorded(e)
            if r is not None:
                name = e.get("served_name")
                out.append((r, name if isinstance(name, str) and name else r.name))
        return out

    def _get(self, key: str) -> Any:
        return (self.record or {}).get(key)

    @property
    def port(self) -> int | None:
        port = self._get("port")
        return port if isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536 else None

    @property
    def manager(self) -> str:
        """``systemd`` or ``process`` (``unknown`` for a record that does not say)."""
        kind = self._get("manager")
        return kind if kind in ("systemd", "process") else "unknown"

    @property
    def model(self) -> str | None:
        artifact = self._get("artifact")
        path = artifact.get("path") if isinstance(artifact, dict) else None
        return path if isinstance(path, str) else None

    @property
    def served_name(self) -> str | None:
        """The model's name on the API (llama-server --alias, TabbyAPI's model directory)."""
        name = self._get("served_name")
        return name if isinstance(name, str) else None

    @property
    def at(self) -> str | None:
        at = self._get("at")
        return at if isinstance(at, str) else None

    @property
    def gate(self) -> dict[str, Any]:
        gate = self._get("gate")
        return gate if isinstance(gate, dict) else {}

    @property
    def unit_file(self) -> str | None:
        """The unit file this deployment runs (a managed process keeps its copy in its state
        directory, systemd in /etc/systemd/system), from the record's list of files."""
        files = self._get("files")
        if not isinstance(files, dict):
            return None
        units = sorted(str(p) for p in files if str(p).endswith(".service"))
        own = [p for p in units if p.rsplit("/", 1)[-1] == f"{self.service}.service"]
        return (own or units)[0] if units else None


def _recorded(entry: object) -> RecordedRecipe | None:
    """One recipe entry of a record, trusted only when its text matches its sha256."""
    if not isinstance(entry, dict):
        return None
    values = [entry.get(k) for k in ("name", "path", "sha256", "yaml")]
    if not all(isinstance(v, str) and v for v in values):
        return None
    name, path, sha, text = (str(v) for v in values)
    if hashlib.sha256(text.encode()).hexdigest() != sha:
        return None
    return RecordedRecipe(name, path, sha, text)


def parse_deployments(output: str) -> list[Deployment]:
    """``deployments_command``'s lines, sorted by service; a line without a service is skipped."""
    found = {}
    for line in lines(output):
        service, sep, text = line.partition("\t")
        if not sep or not service.strip():
            continue
        try:
            record = json.loads(text) if text.strip() else None
        except ValueError:
            record = None
        found[service] = Deployment(service, record if isinstance(record, dict) else None)
    return [found[s] for s in sorted(found)]


def process_age_command(pid: int) -> str:
    """Seconds since the process started ('' when there is none)."""
    return f"ps -o etimes= -p {int(pid)} 2>/dev/null; true"


def parse_process_age(output: str) -> int | None:
    text = output.strip()
    return int(text) if text.isdigit() else None
