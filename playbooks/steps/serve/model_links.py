"""The links a server reads its model through: ``<prefix>/serve/<service>/model.gguf`` (or
``model/`` for EXL2) pointing at the artifact `invoke quantize` verified (its manifest read,
never the multi-GB file: no manifest, no deploy), an artifact a model set's preset names by its
own path, and fixed links (TabbyAPI's working directory)."""

from __future__ import annotations

import posixpath
import shlex
from dataclasses import dataclass
from typing import Any

from playbooks.facts import read_fact
from playbooks.facts.builds import parse_readlink, readlink_command
from playbooks.facts.files import cat_command, parse_json_object
from playbooks.host.base import Host
from playbooks.host.commands import check_path
from playbooks.host.ops import Decision, Operation, OperationError, Shell


@dataclass(frozen=True)
class LinkFacts:
    target: str | None  # where the link points now
    manifest: dict[str, Any] | None  # the artifact's manifest (None: not made)


class EnsureModelLink(Operation):
    """The service's model link points at the verified artifact."""

    def __init__(self, link: str, artifact: str, manifest: str, hint: str):
        self.link, self.artifact, self.manifest, self.hint = check_path(link), check_path(artifact), manifest, hint
        self.name = f"Ensure {link} points at the verified model"

    def read(self, host: Host) -> LinkFacts:
        target = parse_readlink(read_fact(host, readlink_command(self.link)))
        return LinkFacts(target, parse_json_object(read_fact(host, cat_command(self.manifest))))

    def decide(self, facts: LinkFacts) -> Decision:
        if facts.manifest is None or not facts.manifest.get("sha256") and not facts.manifest.get("id"):
            raise OperationError(f"model file missing: no verified {self.artifact} (no {self.manifest}): {self.hint}")
        if facts.target == self.artifact:
            return Decision.ok(f"-> {self.artifact}")
        q = shlex.quote(self.link)
        tmp = shlex.quote(self.link + ".new")
        return Decision.act(
            f"points at {facts.target}" if facts.target else "no link yet",
            Shell(
                f"mkdir -p -- {shlex.quote(posixpath.dirname(self.link))} && "
                f"ln -sfn -- {shlex.quote(self.artifact)} {tmp} && mv -T -- {tmp} {q}"
            ),
        )


class CheckArtifact(Operation):
    """An artifact a server reads by its own path (a model set's preset names each member's GGUF)
    is the verified one: its manifest is there. Nothing to change: no manifest, no deploy."""

    def __init__(self, artifact: str, manifest: str, hint: str):
        self.artifact, self.manifest, self.hint = check_path(artifact), manifest, hint
        self.name = f"Ensure {artifact} is verified"

    def read(self, host: Host) -> dict[str, Any] | None:
        return parse_json_object(read_fact(host, cat_command(self.manifest)))

    def decide(self, facts: dict[str, Any] | None) -> Decision:
        if facts is None or not facts.get("sha256") and not facts.get("id"):
            raise OperationError(f"model file missing: no verified {self.artifact} (no {self.manifest}): {self.hint}")
        return Decision.ok(f"sha256 {str(facts.get('sha256') or facts.get('id'))[:12]}")


class EnsureSymlink(Operation):
    """A link points at a fixed target (TabbyAPI's working directory: templates/, logs/, ...)."""

    def __init__(self, link: str, target: str):
        self.link, self.target = check_path(link), check_path(target)
        self.name = f"Ensure {link} -> {target}"

    def read(self, host: Host) -> str | None:
        return parse_readlink(read_fact(host, readlink_command(self.link)))

    def decide(self, facts: str | None) -> Decision:
        if facts == self.target:
            return Decision.ok("link in place")
        q, tmp = shlex.quote(self.link), shlex.quote(self.link + ".new")
        return Decision.act(
            f"points at {facts}" if facts else "no link yet",
            Shell(f"ln -sfn -- {shlex.quote(self.target)} {tmp} && mv -T -- {tmp} {q}"),
        )
