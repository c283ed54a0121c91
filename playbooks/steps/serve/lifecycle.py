"""A server's lifecycle under deploy, with one owner (``EnsureServing``): start, wait, check,
record, promote, roll back. Each is a named method:

- ``decide``: restart only when what the service runs changed: a fingerprint of every rendered
  file and the artifact's sha256, kept in the deployment record (steps/serve/deploy_record.py),
  against what is running (the systemd invocation or the process's pid and start time).
  Unchanged, running and healthy: ``ok (running, unchanged)``. The same service from another
  recipe text (a gate threshold, or a record older than that) only has its record updated.
- ``start``: restart the service and wait for /health (503 while loading) within a time from
  the model's size; a service that exits while loading fails here.
- ``check_load``: this run's load log against the plan: layers left on the CPU, KV or compute
  buffers beyond the plan's margin, PTX JIT or "no kernel image" fail.
- ``record``: the record of what now runs, with the real buffer sizes beside the planner's and
  the recipe it serves (name, path, sha256 and its merged text: bare `invoke bench`, `stop` and
  `status` read it). Ungated, it is promoted at once; gated (provision), the gate promotes it.
- ``promote``: the files are copied to ``good/`` and the deployment becomes the rollback target.
- ``rollback``: ``good/`` is put back and the service restarted on it; the run fails saying why
  (and that the previous deployment answers again). It restores the last deployment that
  passed, not merely the previous files: a chain of broken deploys always falls back to one
  that served.
"""

from __future__ import annotations

import posixpath
import shlex
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from playbooks.errors import HostError
from playbooks.facts import read_fact
from playbooks.facts.server_log import judge_load, parse_load_log
from playbooks.facts.service import health_command, parse_health
from playbooks.host.base import Host
from playbooks.host.commands import check_path
from playbooks.host.ops import Decision, Operation, Record, Shell, run_command
from playbooks.steps.serve.deploy_record import (
    RECORD_VERSION,
    SNAPSHOT_KEYS,
    DeployLayout,
    fingerprint,
    good_of,
    read_record,
    write_record,
)
from playbooks.steps.serve.service_file import ServiceFile
from playbooks.steps.serve.service_manager import Manager, ProcessRunner, Running

#: /health polls: how often, and the least time a load may take
HEALTH_POLL_S = 0.5
MIN_HEALTH_TIMEOUT_S = 60
HEALTH_GRACE_S = 30
#: a model is read at no less than this from disk while loading (a slow HDD: the timeout is generous)
LOAD_BYTES_PER_S = 100e6


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


@dataclass(frozen=True)
class ServingFacts:
    running: Running
    record: dict[str, Any] | None
    health: int = 200  # GET /health's status now (0: nothing answered within curl's 5 s)


@dataclass(frozen=True)
class Started:
    """A restart that answered /health: its run, and when the restart began (monotonic)."""

    run: Running
    t0: float


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

    # -- acting: start, check, record (promote), or roll back ------------------------------

    def apply(self, host: Host, decision: Decision) -> None:
        before = read_record(host, self.layout) or {}
        if self.recipe and not any(isinstance(c, Shell) for c in decision.commands):
            self._record_recipe(host, before)
            return
        try:
            started = self.start(host)
            buffers = self.check_load(host, started)
        except HostError as exc:
            raise HostError(f"{exc}; {self.rollback(host)}") from None
        self.record(host, time.monotonic() - started.t0, buffers, before)

    def start(self, host: Host) -> Started:
        """Restart the service and wait for /health within the model's load time."""
        t0 = time.monotonic()
        run_command(host, self.manager.restart())
        first = self._running(host)
        timeout = health_timeout(self.artifact_bytes)
        code = 0
        while True:
            code = parse_health(read_fact(host, health_command(self.port)))
            now = self._running(host)
            if code == 200 and now.up:
                return Started(first, t0)
            if not now.up or (first.ident and now.ident != first.ident):
                raise HostError(f"{self.manager.describe()} exited while loading: {self._log_tail(host, first.ident)}")
            if time.monotonic() - t0 > timeout:
                raise HostError(
                    f"/health on 127.0.0.1:{self.port} still {code or 'not answering'} after {timeout:.0f} s: "
                    f"{self._log_tail(host, first.ident)}"
                )
            time.sleep(HEALTH_POLL_S)

    def check_load(self, host: Host, started: Started) -> dict[str, Any]:
        """This run's load log against the plan; the buffers it shows, as the record keeps them
        ({} for a model set's router: it loads nothing itself)."""
        out = self._run(host)(self.manager.log_command(started.run.ident), check=False, stream=False).stdout
        log = parse_load_log(out)
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
            return {}
        return {
            "kv_mib": log.kv_mib,
            "compute_mib": log.compute_mib,
            "model_mib": log.model_mib,
            "offloaded": list(log.offloaded) if log.offloaded else None,
            "planned": {"kv_mib": e.kv_mib, "compute_mib": e.compute_mib, "layers": e.layers},
        }

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

    def record(self, host: Host, seconds: float, buffers: dict[str, Any], before: dict[str, Any]) -> None:
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
            "ready_s": round(seconds, 2),
            "buffers": buffers,
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
        line = _buffers_line(buffers)
        host.printer.line(host.name, f"answering after {seconds:.1f} s" + (f"; {line}" if line else ""))

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
