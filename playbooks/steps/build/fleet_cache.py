"""The fleet cache on the controller: proven builds kept by their build id, so a second host
with the same inputs receives a copy instead of compiling again (the Python bindings need no
cache: they are a small wheel on the build's own libraries, made in seconds)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from playbooks.steps.build.llamacpp_source import source_cache_dir


@dataclass(frozen=True)
class FleetCache:
    """Proven builds kept on the controller by their input hash: a fleet of ten V100s with the
    same arch, toolkit, compiler, ref, flags and prefix compiles once, the other nine get the
    archive copied and re-proven."""

    root: Path

    @classmethod
    def default(cls) -> FleetCache:
        return cls(source_cache_dir().parent / "builds")

    def archive(self, build_id: str) -> Path:
        return self.root / f"{build_id}.tar.gz"

    def ids(self) -> tuple[str, ...]:
        if not self.root.is_dir():
            return ()
        return tuple(sorted(p.name.removesuffix(".tar.gz") for p in self.root.glob("*.tar.gz")))
