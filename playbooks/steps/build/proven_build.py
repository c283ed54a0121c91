"""What every build step shares (llama.cpp, its Python bindings, ExLlamaV2's extension): a build
named by a hash of its inputs (:func:`inputs_id`), proven by probes whose output lands in a
stamp beside it, and a failure reported with the compiler's last lines."""

from __future__ import annotations

import hashlib
import json
import posixpath
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from playbooks.errors import HostError
from playbooks.facts import cuda
from playbooks.host.base import Host
from playbooks.host.ops import (
    Decision,
    OperationError,
    Record,
    Shell,
    run_command,
)


@dataclass(frozen=True)
class Probe(Shell):
    """A read-only command whose output the operation checks and records (the proof);
    ``expect``: for the cubin listing, the archs that must have real cubins."""

    key: str = ""
    expect: tuple[str, ...] = ()
    may_fail: bool = False  # recorded either way (a CUDA build on a box without the driver)
    # for the cubin listing: what was listed, and what a failed proof leaves behind
    what: str = "libggml-cuda.so"
    after: str = "the build is kept for inspection and current is unchanged"


def build_failure(exc: HostError, after: str, during: str = "the build") -> HostError:
    """One line for the ways a long build dies that have a known fix: a full disk (the
    compiler's line names the file), a dropped connection, a toolchain that cannot build for
    the card (facts/cuda.parse_nvcc_error: its line and its fix). Anything else keeps its own
    message (a compile error's tail is what the user needs)."""
    text = str(exc)
    full = next((line for line in text.splitlines() if "No space left on device" in line), None)
    if full:
        return OperationError(f"disk full during {during} ({full.strip()[-160:]}): free space and {after}")
    if toolchain := cuda.parse_nvcc_error(text):
        e = toolchain[0]
        return OperationError(f"{during} stopped at a toolchain error ({e.line[-160:]}): {e.hint}; then {after}")
    if "lost while running" in text:
        return OperationError(f"{text.splitlines()[0]}: {after}")
    return exc


def run_proven(
    host: Host,
    decision: Decision,
    stamp: Callable[[Record, dict[str, str]], bytes],
    after: str | None = None,
) -> None:
    """Run a build's commands; the probes' outputs are checked and go into the stamp, which is
    written only after every probe passed (a build without a stamp does not count). ``after``:
    what to do once a full disk or a dropped connection killed a command (``build_failure``)."""
    try:
        _run_proven(host, decision, stamp)
    except OperationError:
        raise
    except HostError as exc:
        if after is None:
            raise
        raise build_failure(exc, after) from None


def _run_proven(host: Host, decision: Decision, stamp: Callable[[Record, dict[str, str]], bytes]) -> None:
    proof: dict[str, str] = {}
    for cmd in decision.commands:
        if isinstance(cmd, Probe):
            result = host.run(cmd.command, stream=False, check=not cmd.may_fail)
            proof[cmd.key] = result.stdout if result.ok else f"(exit {result.exited}) {result.stdout.strip()[-300:]}"
            if cmd.expect:
                check_cubins(proof[cmd.key], cmd.expect, cmd.what, cmd.after)
        elif isinstance(cmd, Record):
            host.write_file(cmd.path, stamp(cmd, proof), 0o644)
        else:
            run_command(host, cmd)


def check_cubins(
    listing: str,
    wanted: tuple[str, ...],
    what: str = "libggml-cuda.so",
    after: str = "the build is kept for inspection and current is unchanged",
) -> None:
    """Real cubins for every planned arch, not only PTX (PTX alone means a JIT at first start,
    or "no kernel image is available" when the PTX is newer than the driver)."""
    archs = cuda.parse_cuobjdump_list_elf(listing)
    missing = sorted(set(wanted) - archs)
    if missing:
        raise OperationError(
            f"{what} has no {', '.join(missing)} cubins (found: {', '.join(sorted(archs)) or 'none'}): {after}"
        )


def stamp_bytes(record: Record, proof: dict[str, str]) -> bytes:
    version = proof.get("version", "")
    line = next((x for x in version.splitlines() if x.startswith("version:")), version.strip())
    stamp = {
        "id": posixpath.basename(posixpath.dirname(record.path)),
        "built_at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "inputs": json.loads(record.meta) if record.meta else None,
        "llama_server_version": line.removeprefix("version:").strip(),
        "cubins": sorted(cuda.parse_cuobjdump_list_elf(proof["cubins"])) if "cubins" in proof else None,
    }
    return (json.dumps(stamp, indent=2, sort_keys=True) + "\n").encode()


def inputs_id(label: str, inputs: Mapping[str, Any]) -> str:
    """A build's name: ``label`` and the first 12 hex digits of the sha256 of its inputs (sorted
    JSON), so the same inputs always name the same build and any change names another."""
    blob = json.dumps(dict(inputs), sort_keys=True).encode()
    return f"{label}-{hashlib.sha256(blob).hexdigest()[:12]}"
