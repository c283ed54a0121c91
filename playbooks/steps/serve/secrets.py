"""A keyed server's API key: where the host keeps it, who may read it, and how the server and
the bench client get it, without the key ever reaching a command line, a log or a report.

The key lives in one file on the host, ``/etc/voltaforge/secrets/<service.api_key_ref>``,
root-owned, mode 0600 (or 0400): the operator puts it there. Then:

- under systemd the unit loads it as a credential (``LoadCredential=api-key:...``) and
  llama-server reads ``--api-key-file %d/api-key``;
- as a managed process (no systemd) deploy copies it to ``<state>/credentials/api-key``, 0600,
  owned by the user the process runs as (``%d`` there, service_manager.process_argv), with
  ``install``: the bytes move from file to file on the host, never through argv or the wire;
- the bench client reads it over the existing connection (``cat`` as root, stdout only, not
  streamed to any log), keeps it in memory, redacts it from the host's output, and sends it
  as ``Authorization: Bearer``.

A file that group or others can read is refused in one line naming it, before anything
changes: a key others can read is no key.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

from playbooks.config.recipe import Recipe
from playbooks.errors import VoltaforgeError
from playbooks.host.base import Host
from playbooks.host.commands import check_path
from playbooks.host.ops import Decision, Operation, OperationError, Shell, Upload

SECRETS_DIR = "/etc/voltaforge/secrets"
#: what an API key may hold (it reaches YAML and HTTP headers; never a shell): a bracket set,
#: shared with TabbyAPI's tokens file check on the host (steps/serve/engine_exllamav2.py)
KEY_CHARS = "A-Za-z0-9._~+/=-"
KEY_RE = re.compile(f"[{KEY_CHARS}]{{8,512}}")
_USER_RE = re.compile(r"[a-z_][a-z0-9_-]{0,31}\$?")


def secret_path(recipe: Recipe) -> str | None:
    """The recipe's key file on its host, or None for a server without a key."""
    ref = recipe.service.api_key_ref
    return f"{SECRETS_DIR}/{ref}" if ref else None


@dataclass(frozen=True)
class SecretState:
    """What the host says of a key file: never its content."""

    exists: bool
    mode: int = 0
    owner: str = ""
    size: int = 0


def state_command(path: str) -> str:
    q = shlex.quote(check_path(path))
    return f"if [ -f {q} ]; then stat -L -c '%a|%U|%s' -- {q}; else echo missing; fi"


def parse_state(output: str) -> SecretState:
    text = output.strip().splitlines()[0] if output.strip() else "missing"
    if text == "missing" or text.count("|") != 2:
        return SecretState(False)
    mode, owner, size = text.split("|")
    return SecretState(True, int(mode, 8), owner, int(size))


def judge(path: str, st: SecretState) -> str | None:
    """Why this key file cannot be used (one line naming it), or None."""
    if not st.exists:
        return f"the API key file {path} does not exist on the host: put the key there (root, mode 0600)"
    if st.mode & 0o077:
        return (
            f"the API key file {path} is mode {st.mode:04o}: others can read the key; "
            f"`chmod 600 {path}` (and use a new key if it was shared)"
        )
    if st.size == 0:
        return f"the API key file {path} is empty: put the key in it"
    return None


def read_api_key(host: Host, path: str) -> str:
    """The key, read over the existing connection and held in memory only: checked first (mode,
    size), then its first line, never streamed into the host's log, redacted from its output."""
    q = shlex.quote(check_path(path))
    out = host.sudo(f"{state_command(path)}; if [ -f {q} ]; then head -n1 -- {q}; fi", check=False, stream=False)
    first, _, rest = out.stdout.partition("\n")
    why = judge(path, parse_state(first))
    if why:
        raise VoltaforgeError(f"{host.name}: {why}")
    key = rest.strip()
    host.redact(key)
    if not KEY_RE.fullmatch(key):
        raise VoltaforgeError(
            f"{host.name}: the API key in {path} is not a key: want 8 to 512 of A-Z a-z 0-9 . _ ~ + / = -"
        )
    return key


def api_key_for(host: Host, recipe: Recipe) -> str | None:
    """The recipe's key from its host (None: the server has none)."""
    path = secret_path(recipe)
    return read_api_key(host, path) if path else None


class CheckSecret(Operation):
    """The key file exists, is not empty, and nobody but its owner can read it: checked before
    anything changes (a missing or open key stops the deployment here)."""

    def __init__(self, path: str):
        self.path = check_path(path)
        self.name = f"Ensure the API key file {path} is private"

    def read(self, host: Host) -> SecretState:
        return parse_state(host.sudo(state_command(self.path), check=False, stream=False).stdout)

    def decide(self, facts: SecretState) -> Decision:
        why = judge(self.path, facts)
        if why:
            raise OperationError(why)
        return Decision.ok(f"mode {facts.mode:04o}, owner {facts.owner}")


@dataclass(frozen=True)
class CopyFacts:
    secret: SecretState
    same: bool  # the copy holds the same bytes, mode 0600, owned by the user
    note: str  # what differs, for the decision


class EnsureCredentialCopy(Operation):
    """A managed process's credential: the key copied where ``--api-key-file`` reads it
    (``<state>/credentials/api-key``), 0600, owned by the user the process runs as. The facts
    say only same / differs (``cmp``), never the key."""

    def __init__(self, secret: str, dest: str, user: str):
        if not _USER_RE.fullmatch(user):
            raise VoltaforgeError(f"cannot hand a credential to user {user!r}: not a user name")
        self.secret, self.dest, self.user = check_path(secret), check_path(dest), user
        self.name = f"Ensure {dest} holds the API key of {secret} (0600, {user})"

    def read(self, host: Host) -> CopyFacts:
        s, d = shlex.quote(self.secret), shlex.quote(self.dest)
        out = host.sudo(
            f"{state_command(self.secret)}; "
            f"if [ ! -f {d} ]; then echo absent; elif ! cmp -s -- {s} {d}; then echo differs; "
            f"else stat -c '%a|%U' -- {d}; fi",
            check=False,
            stream=False,
        ).stdout.splitlines()
        state = parse_state(out[0] if out else "")
        copy = out[1].strip() if len(out) > 1 else "absent"
        same = copy == f"600|{self.user}"
        note = {"absent": "no copy yet", "differs": "the key changed"}.get(copy, f"the copy is {copy}")
        return CopyFacts(state, same, note)

    def decide(self, facts: CopyFacts) -> Decision:
        why = judge(self.secret, facts.secret)
        if why:
            raise OperationError(why)
        if facts.same:
            return Decision.ok("the copy is current (0600)")
        u, s, d = shlex.quote(self.user), shlex.quote(self.secret), shlex.quote(self.dest)
        parent = shlex.quote(self.dest.rsplit("/", 1)[0])
        return Decision.act(
            facts.note,
            Shell(f"install -d -m 0700 -o {u} -- {parent} && install -m 0600 -o {u} -- {s} {d}", True),
        )


class EnsureSecretFile(Operation):
    """A secret voltaforge makes or is given on the controller (the balancer's TLS key and
    certificate) written to the host, 0600: compared by sha256, sent on stdin (Upload), never
    shown (a dry run names its size and digest only)."""

    def __init__(self, path: str, content: bytes, *, sudo: bool):
        self.path, self.sudo = check_path(path), sudo
        self.upload = Upload(self.path, content, 0o600, None, sudo)
        self.name = f"Ensure {path} holds the balancer's TLS pair (0600)"

    def read(self, host: Host) -> tuple[str | None, str]:
        q = shlex.quote(self.path)
        run = host.sudo if self.sudo else host.run
        out = run(
            f"if [ -f {q} ]; then sha256sum < {q} | cut -c1-64; stat -c '%a' -- {q}; fi", check=False, stream=False
        )
        lines = out.stdout.split()
        return (lines[0], lines[1]) if len(lines) == 2 else (None, "")

    def decide(self, facts: tuple[str | None, str]) -> Decision:
        digest, mode = facts
        if digest == self.upload.digest and mode == "600":
            return Decision.ok(f"current (sha256 {digest[:12]})")
        return Decision.act("not there yet" if digest is None else "another pair, or another mode", self.upload)
