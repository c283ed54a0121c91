"""A finished artifact made on one host copied to another (`invoke quantize --on H2`).

EXL2 conversion needs a CUDA GPU, and a big GGUF quantize wants RAM and disk more than the
serving host may have: any host of the inventory can make the artifact, and this operation,
run on the serving host, brings it over. The bytes stream source -> controller -> target
(nothing is staged on the controller's disk) and are hashed as they pass: a GGUF's against
the sha256 its manifest recorded, an EXL2 directory's against a ``sha256sum`` run on the
source. They land under ``<artifact>.partial`` and are renamed only when every file matched,
so an interrupted copy never leaves a file that looks finished.

An artifact is known by its identity file: a GGUF by ``<file>.manifest.json`` (its sha256),
an EXL2 directory by its stamp (its inputs' id). Same identity on both hosts: ``ok`` and no
byte moves. The target's copy of a GGUF manifest names the target's path and mtime, so the
cheap size+mtime check of later runs holds there too.
"""

from __future__ import annotations

import hashlib
import io
import json
import shlex
from dataclasses import dataclass
from typing import Any

from playbooks.errors import HostError
from playbooks.facts import lines, read_fact
from playbooks.facts.artifacts import parse_stat_size_mtime, stat_size_mtime_command
from playbooks.facts.files import cat_command, parse_json_object
from playbooks.host import Host
from playbooks.host.base import Process
from playbooks.host.commands import check_path
from playbooks.host.ops import Command, Decision, Operation, OperationError, Record, Shell, run_command

#: how long one read of the source may stall before the copy is given up
READ_TIMEOUT_S = 300


@dataclass(frozen=True)
class Artifact:
    """A file (GGUF) or a directory (EXL2) and the file that names what it is."""

    path: str
    identity: str  # the manifest (GGUF) or the stamp inside the directory (EXL2)
    is_dir: bool

    @classmethod
    def gguf(cls, path: str) -> Artifact:
        return cls(check_path(path), f"{path}.manifest.json", False)

    @classmethod
    def exl2(cls, path: str, stamp_name: str) -> Artifact:
        return cls(check_path(path), f"{path}/{stamp_name}", True)

    def moved(self, path: str) -> Artifact:
        """The same artifact at another path (another host's prefix)."""
        return Artifact(path, self.identity.replace(self.path, path, 1), self.is_dir)

    @property
    def key(self) -> str:
        """The identity's field that names the content: a GGUF's sha256, an EXL2 stamp's id."""
        return "id" if self.is_dir else "sha256"


@dataclass(frozen=True)
class CopyFile(Record):
    """One file streamed from the source host into the target's ``.partial`` copy (``path``);
    a Record: its operation's ``apply`` moves the bytes, ``run_command`` never sees it."""

    source: str = ""
    sha256: str = ""
    size: int = 0
    mode: int = 0o644

    def show(self) -> str:
        return f"copy {self.what}:{self.source} ({self.size} bytes, sha256 {self.sha256[:12]}) to {self.path}"


@dataclass(frozen=True)
class SourceFacts:
    identity: dict[str, Any] | None
    files: tuple[tuple[str, int, str], ...] = ()  # (relative name, bytes, sha256)


@dataclass(frozen=True)
class CopyFacts:
    source: SourceFacts
    target_identity: dict[str, Any] | None
    target_size: int | None  # a GGUF file's size on the target (None: absent)


def files_with_sha256_command(directory: str) -> str:
    """Every regular file under a directory: size, sha256 and relative name, one per line."""
    q = shlex.quote(directory)
    return (
        f"cd -- {q} 2>/dev/null && find . -type f -printf '%P\\n' | LC_ALL=C sort | "
        'while IFS= read -r f; do printf \'%s %s %s\\n\' "$(stat -c %s -- "$f")" '
        '"$(sha256sum < "$f" | cut -d" " -f1)" "$f"; done; true'
    )


def parse_files_with_sha256(output: str) -> tuple[tuple[str, int, str], ...]:
    found = []
    for line in lines(output):
        size, _, rest = line.partition(" ")
        digest, _, name = rest.partition(" ")
        if size.isdigit() and len(digest) == 64 and name:
            found.append((name, int(size), digest))
    return tuple(found)


class _StreamReader(io.RawIOBase):
    """A source ``cat``'s stdout as a file object, hashed as it is read."""

    def __init__(self, proc: Process):
        self._proc, self._left = proc, b""
        self.digest = hashlib.sha256()
        self.size = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        if not self._left:
            self._left = self._proc.read(READ_TIMEOUT_S)
        n = min(len(buf), len(self._left))
        buf[:n] = self._left[:n]
        self.digest.update(self._left[:n])
        self.size += n
        self._left = self._left[n:]
        return n


def stream_file(source: Host, target: Host, cmd: CopyFile) -> None:
    """cat on the source -> the target's atomic write; the bytes must hash to what was promised."""
    proc = source.spawn(f"cat -- {shlex.quote(cmd.source)}")
    reader = _StreamReader(proc)
    try:
        target.write_file(cmd.path, io.BufferedReader(reader, 1 << 20), cmd.mode)
    finally:
        code = proc.close()
    if code != 0:
        raise HostError(f"{source.name}: cannot read {cmd.source}: {proc.stderr.strip() or f'exit {code}'}")
    got = reader.digest.hexdigest()
    if reader.size != cmd.size or got != cmd.sha256:
        raise HostError(
            f"{cmd.source} from {source.name} arrived as {reader.size} bytes with sha256 {got[:12]}, "
            f"want {cmd.size} bytes with {cmd.sha256[:12]}: the file changed while it was copied; re-run"
        )


class EnsureArtifactCopy(Operation):
    """The artifact that ``source`` holds at ``src`` is on this host at ``dst``, byte for byte.

    ``pending``: a dry run where the source has not made the artifact yet; the copy is shown
    as what would follow, instead of failing on its absence.
    """

    def __init__(self, source: Host, src: Artifact, dst: Artifact, pending: bool = False):
        self.source, self.src, self.dst, self.pending = source, src, dst, pending
        self.name = f"Ensure {dst.path} is the copy of {source.name}'s"

    def read(self, host: Host) -> CopyFacts:
        identity = parse_json_object(read_fact(self.source, cat_command(self.src.identity)))
        files: tuple[tuple[str, int, str], ...] = ()
        if identity is not None:
            if self.src.is_dir:
                files = parse_files_with_sha256(read_fact(self.source, files_with_sha256_command(self.src.path)))
            else:
                st = parse_stat_size_mtime(read_fact(self.source, stat_size_mtime_command(self.src.path)))
                digest = identity.get("sha256")
                if st is not None and isinstance(digest, str):
                    files = (("", st[0], digest),)
        target_identity = parse_json_object(read_fact(host, cat_command(self.dst.identity)))
        st = parse_stat_size_mtime(read_fact(host, stat_size_mtime_command(self.dst.path)))
        return CopyFacts(SourceFacts(identity, files), target_identity, st[0] if st and not self.dst.is_dir else None)

    def decide(self, facts: CopyFacts) -> Decision:
        src = facts.source
        key = self.src.key
        if src.identity is None or not src.files:
            if self.pending:
                return Decision.act(
                    f"{self.source.name} makes it first",
                    Record(self.dst.path, f"the copy of {self.source.name}'s {self.src.path}, once it is made"),
                )
            raise OperationError(f"{self.source.name} has no finished {self.src.path} (no {self.src.identity})")
        want = src.identity.get(key)
        have = (facts.target_identity or {}).get(key)
        size_ok = self.dst.is_dir or facts.target_size == src.files[0][1]
        if want and have == want and size_ok:
            return Decision.ok(f"artifact present: the same {key} {str(want)[:12]} as {self.source.name}'s")
        partial = f"{self.dst.path}.partial"
        qp, qd, qo = shlex.quote(partial), shlex.quote(self.dst.path), shlex.quote(self.dst.path + ".old")
        commands: list[Command] = [Shell(f"rm -rf -- {qp}" + (f" && mkdir -p -- {qp}" if self.dst.is_dir else ""))]
        for name, size, digest in src.files:
            source = f"{self.src.path}/{name}" if name else self.src.path
            target = f"{partial}/{name}" if name else partial
            commands.append(CopyFile(target, self.source.name, source=source, sha256=digest, size=size))
        # the finished name appears only by renaming a complete, checked copy
        swap = f"rm -rf -- {qo} && {{ [ ! -e {qd} ] || mv -T -- {qd} {qo}; }} && mv -T -- {qp} {qd} && rm -rf -- {qo}"
        commands.append(Shell(swap))
        if not self.dst.is_dir:
            # the manifest read above, the one the bytes were checked against (never read again)
            commands.append(Record(self.dst.identity, "the manifest, naming this copy", json.dumps(src.identity)))
        why = "not on this host" if facts.target_identity is None else f"this host has {key} {str(have)[:12]}"
        total = sum(size for _, size, _ in src.files)
        return Decision.act(f"{why}, {self.source.name} has {str(want)[:12]}: copying {total} bytes", *commands)

    def apply(self, host: Host, decision: Decision) -> None:
        try:
            self._copy(host, decision)
        except HostError:
            # nothing half-copied stays behind; the previous copy, if any, was never touched
            host.run(f"rm -rf -- {shlex.quote(self.dst.path + '.partial')}", check=False, stream=False)
            raise

    def _copy(self, host: Host, decision: Decision) -> None:
        for cmd in decision.commands:
            if isinstance(cmd, CopyFile):
                if "/" in cmd.path.removeprefix(f"{self.dst.path}.partial/"):
                    host.run(f"mkdir -p -- {shlex.quote(cmd.path.rsplit('/', 1)[0])}", stream=False)
                stream_file(self.source, host, cmd)
            elif isinstance(cmd, Record):
                if cmd.meta:  # a dry run's placeholder has none: it is never applied
                    self._write_manifest(host, json.loads(cmd.meta))
            else:
                run_command(host, cmd)

    def _write_manifest(self, host: Host, identity: dict[str, Any]) -> None:
        """The source's manifest, naming this host's path and the copy's mtime."""
        st = parse_stat_size_mtime(read_fact(host, stat_size_mtime_command(self.dst.path)))
        if st is None:
            raise OperationError(f"{self.dst.path} is not there after the copy")
        copied_from = {"host": self.source.name, "path": self.src.path}
        copied = {**identity, "path": self.dst.path, "mtime": st[1], "copied_from": copied_from}
        host.write_file(self.dst.identity, (json.dumps(copied, indent=2, sort_keys=True) + "\n").encode(), 0o644)
