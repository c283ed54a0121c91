"""`invoke deploy`: the rendered service installed, started, checked against the plan, and
rolled back to the last deployment that worked when it is not right.

The operations, in order (each reads facts, decides, and is ``ok`` when already right):

1. ``CheckPort``: the recipe's port is free, or held by this service itself. A port someone
   else holds fails here, before a file is touched.
2. ``EnsureModelLink``: ``<prefix>/serve/<service>/model.gguf`` (or ``model/`` for EXL2)
   points at the artifact ``invoke quantize`` verified; its manifest is read (never the
   multi-GB file): no manifest, no deploy.
3. ``EnsureServiceFile`` per rendered file (unit, config, env): uploaded only when it
   differs; a dry run prints the unified diff.
4. ``EnsureServing``: restarts the service only when what it runs changed: a fingerprint
   of every rendered file and the artifact's sha256, kept in the deployment record
   ``<prefix>/deploy/<service>/deployed.json``, against what is running (the systemd
   invocation or the process's pid and start time). Unchanged and running: ``ok (running,
   unchanged)``. Else restart, wait for /health (503 while loading) within a time from the
   model's size, then read this run's load log and fail on layers left on the CPU, KV or
   compute buffers beyond the plan's margin, PTX JIT or "no kernel image". Passed: the files
   and the link are copied to ``good/`` and the record written, with the real buffer sizes
   beside the planner's and the recipe it serves (name, path, sha256 and its merged text:
   bare `invoke bench`, `stop` and `status` read it). The same service from another recipe
   text (a gate threshold, or a record older than that) only has its record updated.
   Failed: ``good/`` is put back, the service restarted on it, and the run fails saying why
   (and that the previous deployment answers again).

Rollback restores the last deployment that passed, not merely the previous files: a chain
of broken deploys always falls back to one that served.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import posixpath
import shlex
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from playbooks.config.recipe import Recipe
from playbooks.errors import HostError, VoltaforgeError
from playbooks.facts import read_fact
from playbooks.facts.builds import parse_readlink, readlink_command
from playbooks.facts.files import cat_command, parse_json_object
from playbooks.facts.server_log import judge_load, parse_load_log
from playbooks.facts.service import health_command, listeners_command, parse_health, parse_listeners
from playbooks.host.base import Host
from playbooks.host.commands import check_path
from playbooks.host.ops import Decision, Operation, OperationError, Record, Shell, Upload, run_command
from playbooks.steps.serve.secrets import KEY_CHARS
from playbooks.steps.serve.service_manager import Manager, ProcessRunner, Running

#: the fingerprint's format: bump when what it covers changes
FINGERPRINT_VERSION = 1
#: the record's format (2: the rollback target is described whole, and the gate's verdict kept;
#: 3: the recipe it serves, its text included, so bare `invoke bench`/`stop` can load it again)
RECORD_VERSION = 3
#: /health polls: how often, and the least time a load may take
HEALTH_POLL_S = 0.5
MIN_HEALTH_TIMEOUT_S = 60
HEALTH_GRACE_S = 30
#: a model is read at no less than this from disk while loading (a slow HDD: the timeout is generous)
LOAD_BYTES_PER_S = 100e6


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


@dataclass(frozen=True)
class ServiceFile:
    """A rendered file and where it goes on this host."""

    path: str
    text: str
    mode: int = 0o644
    sudo: bool = False

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()


@dataclass(frozen=True)
class Expectations:
    """What the load log must show: the plan's numbers (MiB) and how many layers go to the GPU."""

    layers: int | None  # None: a CPU recipe, nothing offloaded
    kv_mib: float | None
    compute_mib: float | None
    margin: float = 0.10
    # a MoE on a GPU: the weights the plan puts there (all but token_embd and the experts of
    # the --n-cpu-moe layers), so a load that keeps more or fewer experts in host RAM fails
    device_model_mib: float | None = None
    # a split over several devices: (weights MiB, KV MiB) of each, in llama.cpp's device order
    devices: tuple[tuple[float, float], ...] = ()


def health_timeout(model_bytes: int) -> float:
    """Long enough to read the model from a slow disk, never under a minute."""
    return max(MIN_HEALTH_TIMEOUT_S, HEALTH_GRACE_S + model_bytes / LOAD_BYTES_PER_S)


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


# ------------------------------------------------------------------------------------------
# 1. the port
# ------------------------------------------------------------------------------------------


class CheckPort(Operation):
    """Nothing but this service listens on the port (checked before anything changes)."""

    def __init__(self, port: int, manager: Manager, sudo: bool):
        self.port, self.manager, self.sudo = port, manager, sudo
        self.name = f"Ensure port {port} is free for {manager.describe().split(' (')[0]}"

    def read(self, host: Host) -> tuple[str, Running]:
        run = host.sudo if self.sudo else host.run
        listeners = run(listeners_command(self.port), check=False, stream=False).stdout
        state = run(self.manager.state_command(), check=False, stream=False).stdout
        return listeners, self.manager.running(state)

    def decide(self, facts: tuple[str, Running]) -> Decision:
        output, ours = facts
        listeners = parse_listeners(output)
        if not listeners:
            return Decision.ok(f"nothing listens on {self.port}")
        others = [li for li in listeners if not (ours.up and ours.pid in li.pids)]
        if not others:
            return Decision.ok(f"{self.port} is this service's own (pid {ours.pid})")
        who = others[0]
        name = f"{who.process} (pid {', '.join(map(str, who.pids))})" if who.pids else "another program"
        raise OperationError(
            f"port {self.port} is in use by {name} on {who.address}, not by this service: "
            "stop it, or give the recipe another service.port"
        )


# ------------------------------------------------------------------------------------------
# 2. the model link
# ------------------------------------------------------------------------------------------


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


class EnsureTabbyTokens(Operation):
    """TabbyAPI's api_tokens.yml (root, 0600) holds the recipe's API key and an admin key of
    its own, generated on the host. The key is read from its secret file on the host and never
    crosses the wire, argv or a log (the comparison feeds grep its pattern on stdin; printf is
    the shell's builtin); the facts say only missing / same / differs."""

    def __init__(self, secret: str, tokens: str, owner: str | None = None):
        # owner: a managed process's user, who must read its copy (0600 still); else root's
        self.secret, self.tokens, self.owner = check_path(secret), check_path(tokens), owner
        self.name = f"Ensure {tokens} holds the API key of {secret}"

    def read(self, host: Host) -> str:
        s, t = shlex.quote(self.secret), shlex.quote(self.tokens)
        return host.sudo(
            f"if [ ! -s {s} ]; then echo no-secret; elif [ ! -f {t} ]; then echo missing; "
            # the key goes to grep as a pattern on stdin (-f -), never in its argv (`ps` shows argv)
            f"""elif head -n1 -- {s} | sed 's/.*/api_key: "&"/' | grep -qxF -f - -- {t}; then echo same; """
            "else echo differs; fi",
            check=False,
            stream=False,
        ).stdout.strip()

    def decide(self, facts: str) -> Decision:
        if facts == "no-secret":
            raise OperationError(
                f"the recipe's API key is not on the host: put it in {self.secret} (root, mode 0600) first"
            )
        if facts == "same":
            return Decision.ok("the API key is current")
        s, t = shlex.quote(self.secret), shlex.quote(self.tokens)
        script = (
            f"umask 077; key=$(head -n1 -- {s}); "
            f'case "$key" in ""|*[!{KEY_CHARS}]*) echo "the key in {self.secret} has characters an API key '
            f'should not" >&2; exit 1;; esac; '
            "admin=$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \\n'); "
            f'printf \'api_key: "%s"\\nadmin_key: "%s"\\n\' "$key" "$admin" > {t}.new && '
            + (f"chown -- {shlex.quote(self.owner)} {t}.new && " if self.owner else "")
            + f"mv -T -- {t}.new {t}"
        )
        return Decision.act("no tokens file yet" if facts == "missing" else "the API key changed", Shell(script, True))


# ------------------------------------------------------------------------------------------
# 3. the rendered files
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Diff(Record):
    """A unified diff, shown by a dry run; applying it is the Upload beside it."""

    def show(self) -> str:
        return self.meta


class EnsureServiceFile(Operation):
    """A rendered file holds exactly what the recipe renders; a dry run shows the diff."""

    def __init__(self, f: ServiceFile):
        self.file = f
        self.upload = Upload(f.path, f.text.encode(), f.mode, None, f.sudo)
        self.name = f"Ensure {f.path} is up to date"

    def read(self, host: Host) -> str | None:
        q = shlex.quote(self.file.path)
        run = host.sudo if self.file.sudo else host.run
        out = run(f"if [ -f {q} ]; then echo present; cat -- {q}; fi", check=False, stream=False).stdout
        return out.split("\n", 1)[1] if out.startswith("present\n") else None

    def decide(self, facts: str | None) -> Decision:
        if facts == self.file.text:
            return Decision.ok(f"unchanged (sha256 {self.file.sha256[:12]})")
        diff = "".join(
            difflib.unified_diff(
                (facts or "").splitlines(keepends=True),
                self.file.text.splitlines(keepends=True),
                "/dev/null" if facts is None else f"{self.file.path} (on the host)",
                f"{self.file.path} (rendered)",
                n=1,
            )
        ).rstrip("\n")
        shown = Diff(self.file.path, "the diff", diff)
        if facts is None:
            return Decision.act("not installed yet", shown, self.upload)
        changed = sum(1 for line in diff.splitlines() if line.startswith(("+", "-")) and line[1:2] not in "+-")
        return Decision.act(f"{changed} line(s) differ", shown, self.upload)

    def apply(self, host: Host, decision: Decision) -> None:
        for cmd in decision.commands:
            if not isinstance(cmd, Diff):
                run_command(host, cmd)


# ------------------------------------------------------------------------------------------
# 4. serving
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServingFacts:
    running: Running
    record: dict[str, Any] | None
    health: int = 200  # GET /health's status now (0: nothing answered within curl's 5 s)


@dataclass
class Served:
    """What a start proved (the health wait and the load log), for the record."""

    seconds: float
    log_problems: list[str] = field(default_factory=list)
    buffers: dict[str, Any] = field(default_factory=dict)


class EnsureServing(Operation):
    """The service runs what was rendered, answers /health, and its load log matches the plan."""

    def __init__(
        self,
        manager: Manager,
        layout: DeployLayout,
        files: Sequence[ServiceFile],
        link: str,
        artifact: str,
        artifact_sha256: str,
        artifact_bytes: int,
        port: int,
        expect: Expectations,
        gated: bool = False,
        recipe: dict[str, str] | None = None,
        served_name: str | None = None,
        members: Sequence[dict[str, str]] = (),
    ):
        self.manager, self.layout, self.files, self.link = manager, layout, tuple(files), link
        self.artifact, self.artifact_sha256, self.artifact_bytes = artifact, artifact_sha256, artifact_bytes
        self.port, self.expect, self.gated = port, expect, gated
        #: the recipe it serves, as the record keeps it (config/recorded.py: name, path, sha256, yaml)
        self.recipe = recipe
        #: the model's name on the API, kept in the record for `invoke status` and bench
        self.served_name = served_name
        #: a model set's members (config/recorded.py's record of each recipe, with its served
        #: name): what its router serves, for `invoke status`, stop and the balancer
        self.members = [dict(m) for m in members]
        self.sudo = not isinstance(manager, ProcessRunner)
        self.want = fingerprint(self.files, artifact_sha256, artifact)
        self.name = f"Ensure {manager.describe()} serves on 127.0.0.1:{port}"

    # -- facts and decision ------------------------------------------------------------------

    def _run(self, host: Host) -> Any:
        return host.sudo if self.sudo else host.run

    def read(self, host: Host) -> ServingFacts:
        # /health too, in the same batch of reads: a hung server is not "running, unchanged"
        health = parse_health(read_fact(host, health_command(self.port)))
        return ServingFacts(self._running(host), read_record(host, self.layout), health)

    def _running(self, host: Host) -> Running:
        return self.manager.running(self._run(host)(self.manager.state_command(), check=False, stream=False).stdout)

    def decide(self, facts: ServingFacts) -> Decision:
        rec = facts.record or {}
        same_run = rec.get("run") == facts.running.ident
        healthy = facts.health == 200
        if facts.running.up and rec.get("fingerprint") == self.want and same_run and healthy:
            unchanged = f"running, unchanged ({facts.running.detail}, deployed {rec.get('at', '?')})"
            if self.recipe and (rec.get("recipe") or {}).get("sha256") != self.recipe["sha256"]:
                # the same service from another recipe text (a gate threshold, a description, or a
                # record older than recipes in records): the record learns it, nothing restarts
                return Decision.act(
                    f"{unchanged}; the record names another recipe text"
                    if rec.get("recipe")
                    else f"{unchanged}; the record does not name its recipe yet",
                    Record(self.layout.record, f"the recipe it serves ({self.recipe['name']}), without a restart"),
                )
            return Decision.ok(unchanged)
        if not facts.running.up:
            why = "not running"
        elif rec.get("fingerprint") != self.want:
            why = self._what_changed(rec)
        elif same_run:
            answer = f"answers {facts.health}" if facts.health else "does not answer within 5 s"
            why = f"running, unchanged, but /health on 127.0.0.1:{self.port} {answer}"
        else:
            why = "running, but not the run that was checked (restarted outside voltaforge)"
        restart = self.manager.restart()
        return Decision.act(
            why,
            restart,
            Record(self.layout.record, f"/health within {health_timeout(self.artifact_bytes):.0f} s, the load log "
                   "against the plan, then the deployment (or the rollback)"),
        )  # fmt: skip

    def _what_changed(self, rec: dict[str, Any]) -> str:
        if not rec:
            return "never deployed by voltaforge"
        old = rec.get("files") or {}
        changed = [posixpath.basename(f.path) for f in self.files if old.get(f.path) != f.sha256]
        parts = [f"{', '.join(changed)} changed"] if changed else []
        if (rec.get("artifact") or {}).get("sha256") != self.artifact_sha256:
            parts.append("the model changed")
        return "; ".join(parts) or "the deployment changed"

    # -- acting ------------------------------------------------------------------------------

    def apply(self, host: Host, decision: Decision) -> None:
        before = read_record(host, self.layout) or {}
        if self.recipe and not any(isinstance(c, Shell) for c in decision.commands):
            self._record_recipe(host, before)
            return
        try:
            served = self._start(host)
        except HostError as exc:
            raise HostError(f"{exc}; {self.rollback(host)}") from None
        self._remember(host, served, before)

    def _start(self, host: Host) -> Served:
        t0 = time.monotonic()
        run_command(host, self.manager.restart())
        first = self._running(host)
        timeout = health_timeout(self.artifact_bytes)
        code = 0
        while True:
            code = parse_health(read_fact(host, health_command(self.port)))
            now = self._running(host)
            if code == 200 and now.up:
                break
            if not now.up or (first.ident and now.ident != first.ident):
                raise HostError(f"{self.manager.describe()} exited while loading: {self._log_tail(host, first.ident)}")
            if time.monotonic() - t0 > timeout:
                raise HostError(
                    f"/health on 127.0.0.1:{self.port} still {code or 'not answering'} after {timeout:.0f} s: "
                    f"{self._log_tail(host, first.ident)}"
                )
            time.sleep(HEALTH_POLL_S)
        log = parse_load_log(self._run(host)(self.manager.log_command(first.ident), check=False, stream=False).stdout)
        e = self.expect
        problems = judge_load(
            log,
            expect_layers=e.layers,
            planned_kv_mib=e.kv_mib,
            planned_compute_mib=e.compute_mib,
            margin=e.margin,
            planned_device_model_mib=e.device_model_mib,
            planned_devices=e.devices,
        )
        if problems:
            raise HostError(f"the load log disagrees with the plan: {'; '.join(problems)}")
        if not (log.kv_mib or log.compute_mib or log.model_mib or e.kv_mib or e.compute_mib or e.layers):
            # nothing loaded and nothing planned: a model set's router (its children load on demand)
            return Served(time.monotonic() - t0, [], {})
        buffers = {
            "kv_mib": log.kv_mib,
            "compute_mib": log.compute_mib,
            "model_mib": log.model_mib,
            "offloaded": list(log.offloaded) if log.offloaded else None,
            "planned": {"kv_mib": e.kv_mib, "compute_mib": e.compute_mib, "layers": e.layers},
        }
        return Served(time.monotonic() - t0, [], buffers)

    def _log_tail(self, host: Host, ident: str) -> str:
        out = self._run(host)(self.manager.log_command(ident), check=False, stream=False).stdout
        log = parse_load_log(out)
        if log.problems:
            return log.problems[0]
        tail = [line.strip() for line in out.splitlines() if line.strip()]
        return f"its log ends: {tail[-1][:300]}" if tail else "it logged nothing"

    def _record_recipe(self, host: Host, record: dict[str, Any]) -> None:
        """What runs is unchanged: only the recipe it serves is written into its record (and
        into its rollback target's, when that is this same deployment)."""
        record["recipe"] = self.recipe
        good = record.get("good")
        if isinstance(good, dict) and "copies" in good and good.get("fingerprint") == record.get("fingerprint"):
            good["recipe"] = self.recipe
        write_record(host, self.layout, record)

    def _remember(self, host: Host, served: Served, before: dict[str, Any]) -> None:
        """Record what now runs. Ungated, it becomes the rollback target at once; gated, the
        rollback target stays the one before until the gate passes (``promote``)."""
        record = {
            "version": RECORD_VERSION,
            "fingerprint": self.want,
            "run": self._running(host).ident,
            "at": _now(),
            "manager": self.manager.kind,
            "files": {f.path: f.sha256 for f in self.files},
            "link": self.link,
            "artifact": {"path": self.artifact, "sha256": self.artifact_sha256, "bytes": self.artifact_bytes},
            "port": self.port,
            "ready_s": round(served.seconds, 2),
            "buffers": served.buffers,
            "gate": {"status": "pending" if self.gated else "not run"},
            "good": good_of(before),
        }
        if self.recipe:
            record["recipe"] = self.recipe
        if self.served_name:
            record["served_name"] = self.served_name
        if self.members:
            record["members"] = self.members
        if self.gated:
            write_record(host, self.layout, record)
        else:
            self.promote(host, record)
        buffers = _buffers_line(served.buffers)
        host.printer.line(host.name, f"answering after {served.seconds:.1f} s" + (f"; {buffers}" if buffers else ""))

    def promote(self, host: Host, record: dict[str, Any]) -> None:
        """This deployment worked: its files are copied to ``good/`` and it becomes the one a
        later failure rolls back to."""
        good = self.layout.good_dir
        cmds = [f"rm -rf -- {shlex.quote(good)}.new && mkdir -p -m 0700 -- {shlex.quote(good)}.new"]
        for i, f in enumerate(self.files):
            cmds.append(f"cp -p -- {shlex.quote(f.path)} {shlex.quote(f'{good}.new/{i}')}")
        cmds.append(f"rm -rf -- {shlex.quote(good)} && mv -T -- {shlex.quote(good)}.new {shlex.quote(good)}")
        self._run(host)(" && ".join(cmds), stream=False)
        record["good"] = {
            **{k: record.get(k) for k in SNAPSHOT_KEYS},
            "copies": {str(i): {"path": f.path, "mode": f.mode} for i, f in enumerate(self.files)},
        }
        write_record(host, self.layout, record)

    def rollback(self, host: Host) -> str:
        """Put the last good deployment back and start it; say what happened in one clause."""
        rec = read_record(host, self.layout) or {}
        good = good_of(rec)
        if not good:
            try:
                run_command(host, self.manager.stop())
            except HostError:
                pass
            return "nothing served here before: the new service is stopped"
        cmds = []
        for i, entry in good["copies"].items():
            path = check_path(entry["path"])
            src = shlex.quote(f"{self.layout.good_dir}/{int(i)}")
            cmds.append(f"cp -p -- {src} {shlex.quote(path)}")
        art = (good.get("artifact") or {}).get("path")
        if art:
            cmds.append(
                f"ln -sfn -- {shlex.quote(check_path(art))} {shlex.quote(self.link)}.new && "
                f"mv -T -- {shlex.quote(self.link)}.new {shlex.quote(self.link)}"
            )
        try:
            self._run(host)(" && ".join(cmds), stream=False)
            run_command(host, self.manager.restart())
            deadline = time.monotonic() + health_timeout(int((good.get("artifact") or {}).get("bytes") or 0))
            port = int(good.get("port") or self.port)
            while parse_health(read_fact(host, health_command(port))) != 200:
                if time.monotonic() > deadline:
                    return f"rolled back to the deployment of {good.get('at')}, but it does not answer either"
                time.sleep(HEALTH_POLL_S)
        except HostError as exc:
            return f"the rollback failed too: {exc}"
        # the record describes what runs again: the good deployment, in its new run
        restored = {k: v for k, v in good.items() if k != "copies"}
        restored |= {"version": RECORD_VERSION, "run": self._running(host).ident, "good": good, "link": self.link}
        restored["manager"] = self.manager.kind
        write_record(host, self.layout, restored)
        return f"rolled back to the deployment of {good.get('at')}, which answers again"


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


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _buffers_line(b: dict[str, Any]) -> str:
    """The load log's buffers beside the plan's, as the record keeps them ('' for none: a
    router loads no model itself)."""
    if not b:
        return ""
    planned = b.get("planned") or {}
    parts = []
    for key, label in (("kv_mib", "KV cache"), ("compute_mib", "compute buffer")):
        real = sum((b.get(key) or {}).values())
        plan = planned.get(key)
        parts.append(f"{label} {real:.2f} MiB" + (f" (plan {plan:.2f})" if plan is not None else ""))
    if b.get("offloaded"):
        n, m = b["offloaded"]
        parts.append(f"{n}/{m} layers on the GPU")
    return ", ".join(parts)


def systemd_only(recipe: Recipe, gpu_indexes: Sequence[int] = (0,)) -> str | None:
    """Why this deployment cannot run as a managed process (None: it can). Deploy refuses it
    on a host without systemd; preflight judges a host's missing systemd by it."""
    if len(gpu_indexes) > 1 and recipe.gpu_count == 1:
        return "one server per GPU (or CPU instance) is a systemd instance template"
    return None


def require_systemd(booted: bool, manager: str, host: str) -> None:
    """`--manager systemd` on a host without it: one line, before anything is touched."""
    if manager == "systemd" and not booted:
        raise VoltaforgeError(
            f"{host}: systemd is not running there (no /run/systemd/system): a unit cannot be started; "
            "deploy with --manager process to run the same command line as a managed process"
        )
