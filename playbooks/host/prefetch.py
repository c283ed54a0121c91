"""Reads in one round trip: many read-only commands sent to a host as one script, and their
outputs kept for the pass that asked for them.

A no-op run is all reads (every fact and stamp of every step) and, command by command, pays a
round trip per read: over SSH that was 6.4-6.8 s for one host. Here the reads are gathered
and sent at once:

- :class:`Reads` is what one host answered, keyed by the exact call (command, sudo,
  environment, timeout, stdin); a host in a *reads pass* (``Host.reading``) answers every
  call from it, and a call it does not hold is a *miss*: remembered, answered as if empty.
- :func:`batch_script` turns the misses into one shell script that runs each command exactly
  as it would run alone (``read_line``: the same locale and options, stdin from a
  here-document) and prints every exit code and exact stdout and stderr byte count before the bytes, so
  any output, binary or without a final newline, comes back whole; :func:`parse_batch` reads
  that back. Pure, both.

Only commands a reads pass asked for are ever batched, and a reads pass runs the steps as a
dry run does (facts read, decisions made, nothing applied), so a batch holds reads only. The
conductor (conduct/provision.py) runs passes until one has no miss: its decisions are what a
normal run would decide, made with one remote call when the host's reads are known.
"""

from __future__ import annotations

import base64
import re
import secrets
import shlex
from dataclasses import dataclass, field
from hashlib import sha256

from playbooks.errors import HostError
from playbooks.host.commands import build_command


@dataclass(frozen=True)
class Call:
    """One read, as the host layer runs it."""

    command: str
    sudo: bool = False
    env: tuple[tuple[str, str], ...] = ()
    timeout: float | None = None
    stdin: bytes | None = field(default=None, repr=False)

    def line(self, sudo_binary: bool) -> str:
        return build_command(self.command, env=dict(self.env), sudo=sudo_binary, timeout=self.timeout)

    def to_json(self) -> dict:
        stdin = base64.b64encode(self.stdin).decode() if self.stdin is not None else None
        return {
            "command": self.command,
            "sudo": self.sudo,
            "env": [list(kv) for kv in self.env],
            "timeout": self.timeout,
            "stdin": stdin,
        }

    @classmethod
    def from_json(cls, data: dict) -> Call:
        stdin = base64.b64decode(data["stdin"]) if data.get("stdin") is not None else None
        env = tuple((str(k), str(v)) for k, v in data.get("env") or ())
        return cls(str(data["command"]), bool(data.get("sudo")), env, data.get("timeout"), stdin)


Answer = tuple[bytes, bytes, int]  # stdout, stderr, exit code


class NotARead(HostError):
    """A reads pass reached a call that is not a read (it streams or writes): the pass is
    abandoned and the run goes on the normal way."""


@dataclass
class Reads:
    """The answers one host gave, and the calls a pass asked for that were not among them."""

    answers: dict[Call, Answer] = field(default_factory=dict)
    misses: list[Call] = field(default_factory=list)
    asked: list[Call] = field(default_factory=list)  # every call of the pass, in order

    def answer(self, call: Call) -> Answer:
        if call not in self.asked:
            self.asked.append(call)
        found = self.answers.get(call)
        if found is not None:
            return found
        if call not in self.misses:
            self.misses.append(call)
        return b"", b"", 0

    def new_pass(self) -> None:
        self.misses, self.asked = [], []


#: a here-document's stdin larger than this is not batched (a read, not a file transfer)
MAX_STDIN = 256 * 1024
_HEADER = re.compile(rb"(VF-[0-9a-f]{16}) codes ([-\d ]*)\n\1 sizes ([\d ]*)\n")


def read_line(call: Call, sudo_binary: bool) -> str:
    """The shell text one read runs as inside the batch.

    A plain read (no sudo binary, no variables, no time limit) runs in a subshell of the batch's
    own bash, with the same locale and ``pipefail`` as ``build_command`` gives it: a fork, not
    two execs (``env``, then ``bash``). A no-op's 60 reads spent most of their time starting
    those processes. ``eval`` keeps a broken read to itself, as ``bash -c`` does. Anything else
    runs exactly as alone."""
    if sudo_binary or call.env or call.timeout is not None:
        return call.line(sudo_binary)
    return f'( unset "${{!vf_batch_@}}"; export LC_ALL=C; set -o pipefail; eval {shlex.quote(call.command)} )'


def batch_script(calls: list[Call], sudo_binary: list[bool], marker: str | None = None) -> tuple[str, str]:
    """(script, marker): every call started at once (reads only: the order cannot change an
    answer), each with its own stdin (or none); then ``<marker> codes <exit>...``,
    ``<marker> sizes <stdout bytes> <stderr bytes>...`` and every output's bytes in order. The batch's own
    variables are ``vf_batch_*``, unset in each read's subshell, so a read meets none of them."""
    marker = marker or f"VF-{secrets.token_hex(8)}"
    out = ["vf_batch_t=$(mktemp -d) || exit 1", "trap 'rm -rf -- \"$vf_batch_t\"' EXIT"]
    for i, (call, sudo) in enumerate(zip(calls, sudo_binary, strict=True)):
        if call.stdin is None:
            feed = "</dev/null"
        else:
            if len(call.stdin) > MAX_STDIN:
                raise ValueError(f"{call.command[:60]}: stdin of {len(call.stdin)} bytes is not a read")
            encoded = base64.b64encode(call.stdin).decode()
            tag = f"VF_IN_{sha256(call.stdin).hexdigest()[:12]}"
            out.append(f"base64 -d > \"$vf_batch_t/i{i}\" <<'{tag}'\n{encoded}\n{tag}")
            feed = f'<"$vf_batch_t/i{i}"'
        out.append(
            f'{{ {read_line(call, sudo)} ; }} {feed} >"$vf_batch_t/o{i}" 2>"$vf_batch_t/e{i}" & vf_batch_p{i}=$!'
        )
    # The answers: every exit code on one line, every size on the next (one `stat`), then every
    # output in order (one `cat`): three processes for the lot, not three per read.
    files = " ".join(f"o{i} e{i}" for i in range(len(calls)))
    for i in range(len(calls)):
        out.append(f'wait "$vf_batch_p{i}"; vf_batch_c{i}=$?')
    codes = " ".join(f"$vf_batch_c{i}" for i in range(len(calls)))
    out.append(f"printf '%s codes %s\\n' {marker} \"{codes}\"")
    if not calls:
        return "\n".join([*out, f"printf '%s sizes \\n' {marker}"]) + "\n", marker
    out.append('cd -- "$vf_batch_t" || exit 1')
    out.append(f"printf '%s sizes %s\\n' {marker} \"$(stat -c %s -- {files} | tr '\\n' ' ')\"")
    out.append(f"cat -- {files}")
    return "\n".join(out) + "\n", marker


def parse_batch(output: bytes, marker: str, count: int) -> list[Answer]:
    """The answers of a batch, in order; HostError when the output is cut short or garbled (a
    lost connection mid-batch)."""
    m = _HEADER.match(output)
    if not m or m.group(1).decode() != marker:
        got = output[:80].decode("utf-8", "replace")
        raise HostError(f"the batched reads came back without their header (0 of {count} answers): {got!r}")
    codes = [int(x) for x in m.group(2).split()]
    sizes = [int(x) for x in m.group(3).split()]
    if len(codes) != count or len(sizes) != 2 * count:
        raise HostError(f"the batched reads came back with {len(codes)} exit codes for {count} reads")
    answers: list[Answer] = []
    pos = m.end()
    for i in range(count):
        n_out, n_err = sizes[2 * i], sizes[2 * i + 1]
        if pos + n_out + n_err > len(output):
            raise HostError(f"the batched reads came back cut short in read {i + 1} of {count}")
        answers.append((output[pos : pos + n_out], output[pos + n_out : pos + n_out + n_err], codes[i]))
        pos += n_out + n_err
    return answers
