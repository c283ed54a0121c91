"""The reads a host's last settled check made, kept on the controller, so the next run fetches
them all in its first round trip (host/prefetch.py): a no-op is then one remote call.

Kept under ``$VOLTAFORGE_CACHE/reads`` (``~/.cache/voltaforge``), keyed by the host's name, its
address and prefix, and the recipe (its name and text): another recipe or prefix reads other
paths. Only reads are kept (a reads pass asks for nothing else),
mode 0600 (commands name paths of the host). A file that cannot be read is an empty start:
the passes find the reads again, in a round trip or two more.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from playbooks.config.inventory import HostSpec
from playbooks.config.recipe import LoadedRecipe
from playbooks.host.prefetch import Call
from playbooks.steps.build.llamacpp_source import source_cache_dir

VERSION = 1
KEEP_DAYS = 30


@dataclass(frozen=True)
class KnownReads:
    path: Path

    @classmethod
    def of(cls, spec: HostSpec, loaded: LoadedRecipe) -> KnownReads:
        recipe = loaded.recipe.model_dump_json()
        where = [spec.name, spec.host, spec.user, spec.port, spec.prefix, spec.local]
        key = json.dumps([*where, str(loaded.path), recipe])
        digest = hashlib.sha256(key.encode()).hexdigest()[:16]
        return cls(source_cache_dir().parent / "reads" / f"{spec.name}-{digest}.json")

    def load(self) -> list[Call]:
        try:
            data = json.loads(self.path.read_text())
            if data.get("version") != VERSION:
                return []
            return [Call.from_json(c) for c in data["calls"]]
        except (OSError, ValueError, KeyError, TypeError):
            return []

    def save(self, calls: list[Call]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            json.dump({"version": VERSION, "calls": [c.to_json() for c in calls]}, fh)
        os.replace(tmp, self.path)
        self._prune()

    def _prune(self) -> None:
        """Hosts and prefixes come and go (every test makes some): a record unused for
        KEEP_DAYS is dropped (it only saves a round trip)."""
        old = time.time() - KEEP_DAYS * 86400
        for other in self.path.parent.glob("*.json"):
            try:
                if other.stat().st_mtime < old:
                    other.unlink()
            except OSError:
                pass
