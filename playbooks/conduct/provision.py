"""`invoke provision`: every step, in order, on one host or many at once.

    preflight -> toolchain -> build -> quantize -> deploy -> gate

Each step is a list of operations (the same ones its own task runs), so a step whose state is
already right is ``ok`` with the reason, a dry run shows every command and changes nothing,
and a re-run after a failure resumes where it stopped: what was finished reads as ``ok``.

- preflight judges the host's facts against the recipe first; a blocking check (a recipe that
  cannot fit this GPU, with the plan's numbers; no NVIDIA driver; ...) stops the host before
  anything is downloaded or written.
- deploy starts a changed service *gated*: the last deployment that passed stays the rollback
  target until the gate (steps/measure/gate.py) passes on the new one; a failed gate rolls back.
- A model set of the host's layout (conduct/model_sets.py) is one target: its members are each
  judged by preflight, share the first member's toolchain and build (one host, one build), are
  each quantized, and are served by one router (conduct/set_deploy.py), whose gate asks each
  member for an answer (steps/measure/set_gate.py).
- The host lock is held for the whole run (a dry run only reads); Ctrl-C or a lost
  connection drops it (host/lock.py), and every step switches things in whole (builds and
  quantized files are made aside and renamed), so nothing is left half-switched.

Many hosts run in parallel threads, each with its own log file holding everything its
commands printed, and live output prefixed with the host's name. One host failing does not
stop the others; the summary shows all of them and the exit code is 1 when any failed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from playbooks.conduct.build import build_step
from playbooks.conduct.converge import prefix_needs_sudo
from playbooks.conduct.deploy import deploy_ops
from playbooks.conduct.known_reads import KnownReads
from playbooks.conduct.logs import log_dir
from playbooks.conduct.model_sets import ServedSet
from playbooks.conduct.placements import Served
from playbooks.conduct.quantize import quantize_step
from playbooks.conduct.read_pass import read_pass
from playbooks.conduct.roll import DRAIN_BOUND_S, DeployRoll, Roll
from playbooks.conduct.set_deploy import set_deploy_ops
from playbooks.conduct.settings import Settings
from playbooks.conduct.toolchain import toolchain_step
from playbooks.config.inventory import HostSpec
from playbooks.config.recipe import LoadedRecipe
from playbooks.errors import HostError, VoltaforgeError
from playbooks.host import Host
from playbooks.host.base import Printer
from playbooks.host.local import LocalHost
from playbooks.host.lock import host_lock
from playbooks.host.ops import Change, Interrupted, Operation, run_ops, summarize
from playbooks.host.output import BufferedPrinter, HostPrinter
from playbooks.steps.measure.gate import EnsureGate
from playbooks.steps.measure.set_gate import EnsureSetGate
from playbooks.steps.preflight import gather, judge, rpc_endpoints
from playbooks.steps.serve.lifecycle import EnsureServing
from playbooks.words import clip

#: the built-in default: the tiny CPU recipe, which needs no GPU and no download
DEFAULT_RECIPE = "tiny-cpu"


STEPS = ("preflight", "toolchain", "build", "quantize", "deploy", "gate")

#: what one provision target is: a recipe (its servers), or a model set (its router and members)
Target = Served | ServedSet


@dataclass(frozen=True)
class Options:
    dry_run: bool = False
    rebench: bool = False
    reports: Path | None = None  # where the gate's reports go (default: the bench cache)
    # the command as typed, without --dry-run and --json: what a fix line tells the user to run
    # again (a bare `invoke provision --host H` would provision the default recipe instead)
    command: str = "invoke provision"
    #: how long a server drained on its balancer may take to finish its requests (conduct/roll.py)
    drain_timeout_s: float = DRAIN_BOUND_S


@dataclass
class StepOutcome:
    step: str
    status: str  # changed | ok | failed | would change | would run after the fix | not reached
    seconds: float = 0.0
    why: str = ""
    changes: list[Change] = field(default_factory=list)


@dataclass
class HostOutcome:
    host: str
    recipe: str
    log: Path
    steps: list[StepOutcome] = field(default_factory=list)
    gate: dict[str, Any] | None = None
    reports: dict[str, str] = field(default_factory=dict)
    endpoint: str | None = None
    fix: str | None = None
    seconds: float = 0.0
    remote_calls: int = 0  # commands and scripts sent (the host layer's count)

    @property
    def failed(self) -> bool:
        return any(s.status == "failed" for s in self.steps)

    def failure(self) -> StepOutcome | None:
        return next((s for s in self.steps if s.status == "failed"), None)


def step_status(changes: Sequence[Change], dry_run: bool) -> str:
    if any(c.status == "failed" for c in changes):
        return "failed"
    if any(c.status == "changed" for c in changes):
        return "would change" if dry_run else "changed"
    return "ok"


def step_why(changes: Sequence[Change]) -> str:
    """One line for the summary: the failure, else what changed, else that all was in place."""
    failed = next((c for c in changes if c.status == "failed"), None)
    if failed:
        return failed.why
    changed = [c for c in changes if c.status == "changed"]
    if changed:
        # one line: cut at a word (the table above it and the log keep each change's whole why)
        whys = clip("; ".join(dict.fromkeys(c.why for c in changed)), 200)
        return f"{len(changed)} of {len(changes)} changed: {whys}"
    if len(changes) == 1:
        return changes[0].why
    return f"all {len(changes)} in place"


def fix_for(step: str, command: str, detail: str) -> str:
    resume = f"then `{command}` resumes at {step}"
    if detail:
        return f"{detail}; {resume}"
    return f"fix the cause above; {resume} (the log has every line)"


class Provisioner:
    """One provision run over some hosts: resolves them (one line and exit 2 for a name or
    recipe that does not exist, before any connection), then runs each in its own thread."""

    def __init__(self, settings: Settings, options: Options, console: Printer | None = None):
        self.settings, self.options = settings, options
        self.console = console or Printer()
        self.cancel = threading.Event()
        self.run_dir = log_dir() / f"provision-{time.strftime('%Y%m%d-%H%M%S')}"
        #: servers behind a balancer change one at a time, across the run's hosts
        self.roll = Roll(settings, options.drain_timeout_s)
        self._open: dict[str, Host] = {}
        self._lock = threading.Lock()

    # -- per host ----------------------------------------------------------------------------

    def run_host(self, spec: HostSpec, served: Target) -> HostOutcome:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # a host's layout: a log per recipe, run one after the other
        log_path = self.run_dir / (f"{spec.name}-{served.name}.log" if spec.serve else f"{spec.name}.log")
        outcome = HostOutcome(spec.name, served.name, log_path)
        t0 = time.monotonic()
        with open(log_path, "w", encoding="utf-8") as log:
            printer = HostPrinter(log, self.console)
            try:
                self._provision(spec, served, printer, outcome)
            except (HostError, VoltaforgeError) as exc:
                # connecting (unreachable, host key changed, sudo) or a step that could not
                # even be planned: one line, on the step it happened in
                step = STEPS[len(outcome.steps)] if len(outcome.steps) < len(STEPS) else "gate"
                text = str(exc).removeprefix(f"{spec.name}: ")
                outcome.steps.append(StepOutcome(step, "failed", 0.0, summarize(text)))
                printer.line(spec.name, f"failed: {step}: {text}")  # whole, into the log too
            finally:
                with self._lock:
                    self._open.pop(spec.name, None)
            for s in outcome.steps:
                for c in s.changes:
                    if c.status == "failed" and c.detail:
                        log.write(f"--- {s.step}: {c.step} failed:\n{c.detail}\n")
            failed = outcome.failure()
            if failed and outcome.fix is None:
                outcome.fix = fix_for(failed.step, self.options.command, "")
            done = len(outcome.steps)
            outcome.steps += [StepOutcome(s, "not reached") for s in STEPS[done:]]
        outcome.seconds = time.monotonic() - t0
        return outcome

    def _provision(self, spec: HostSpec, served: Target, printer: Printer, outcome: HostOutcome) -> None:
        opts = self.options
        with self.settings.connect(spec, printer) as host:
            with self._lock:
                self._open[spec.name] = host
            if self.cancel.is_set():
                raise Interrupted("interrupted before it started")
            try:
                if not opts.dry_run and self._settled(host, spec, served, printer, outcome):
                    return  # nothing to do, known from one round trip: no lock taken, nothing written
                self._run_steps(host, spec, served, printer, outcome, opts.dry_run)
                if not opts.dry_run and not outcome.failed:
                    # the reads of the host as it is now, for the next run's one round trip
                    self._read_pass(host, spec, served, outcome)
            finally:
                outcome.remote_calls = host.remote_calls

    def _run_steps(
        self,
        host: Host,
        spec: HostSpec,
        served: Target,
        printer: Printer,
        outcome: HostOutcome,
        dry_run: bool,
        probing: bool = False,
    ) -> None:
        """Preflight, then every step: for real under the host lock, or as a dry run.
        ``probing``: a reads pass, which goes past what fails to find every read it needs."""
        # 1. preflight: facts judged against the recipe, before anything is written
        t = time.monotonic()
        printer.line(spec.name, "== preflight ==")
        model_dir = f"{spec.prefix}/models"
        members = _members(served)
        facts = gather(host, spec.prefix, model_dir, rpc_endpoints(members[0]))
        # a set: each member judged on the set's cards (each fits alone: the set's plan said so)
        checks = [
            c
            for loaded in members
            for c in judge(facts, loaded, model_dir, spec.prefix, spec.gpu, served.gpus if spec.serve else None).checks
        ]
        checks = list({(c.name, c.status, c.detail): c for c in checks}.values())  # a host check once
        blocking = [c for c in checks if c.status == "fail" and c.blocking]
        if blocking:
            # every blocking check, not the first only: a user fixes them all in one go
            why = "; ".join(f"{b.name}: {b.detail}" for b in blocking)
            outcome.steps.append(StepOutcome("preflight", "failed", time.monotonic() - t, why))
            fixes = "; ".join(dict.fromkeys(b.fix for b in blocking if b.fix))
            outcome.fix = fix_for("preflight", self.options.command, fixes)
            if dry_run:
                # the plan of work goes on: what each later step would run once fixed
                sudo = prefix_needs_sudo(host, spec.prefix)
                self._steps(host, spec, served, sudo, printer, outcome, dry_run, blocked=True, probing=probing)
            return
        warned = [c for c in checks if c.status == "warn"]
        why = f"{len(checks)} checks pass" + (
            f", {len(warned)} warning{'s' if len(warned) > 1 else ''}: {warned[0].name}: {warned[0].detail}"
            if warned
            else ""
        )
        outcome.steps.append(StepOutcome("preflight", "ok", time.monotonic() - t, why))
        sudo = prefix_needs_sudo(host, spec.prefix)
        if dry_run:
            self._steps(host, spec, served, sudo, printer, outcome, dry_run, probing=probing)
        else:
            with host_lock(host, spec.prefix, sudo=sudo):
                self._steps(host, spec, served, sudo, printer, outcome, dry_run)

    def _settled(self, host: Host, spec: HostSpec, served: Target, printer: Printer, outcome: HostOutcome) -> bool:
        """Whether the host has nothing to do, decided from its reads fetched in one round trip
        (``_read_pass``). True (the outcome filled, the lines printed) when every step is ok;
        False when anything would change, and the run goes on the normal way, under the lock,
        reading afresh."""
        found = self._read_pass(host, spec, served, outcome)
        if found is None:
            return False
        trial, buffered = found
        if [s.status for s in trial.steps] != ["ok"] * len(STEPS):
            return False
        buffered.replay(printer)
        outcome.steps, outcome.gate, outcome.endpoint = trial.steps, trial.gate, trial.endpoint
        return True

    def _read_pass(
        self, host: Host, spec: HostSpec, served: Target, outcome: HostOutcome
    ) -> tuple[HostOutcome, BufferedPrinter] | None:
        """Every step checked as a dry run checks it, from batched reads (conduct/read_pass.py)."""

        def fresh() -> HostOutcome:
            return HostOutcome(outcome.host, outcome.recipe, outcome.log)

        def check(printer: BufferedPrinter, trial: HostOutcome) -> None:
            self._run_steps(host, spec, served, printer, trial, dry_run=True, probing=True)

        if isinstance(served, ServedSet):
            return None  # a set's reads are not batched yet: it goes the normal way, under the lock
        return read_pass(host, KnownReads.of(spec, served.loaded), fresh, check)

    def _steps(
        self,
        host: Host,
        spec: HostSpec,
        served: Target,
        sudo: bool,
        printer: Printer,
        outcome: HostOutcome,
        dry_run: bool,
        blocked: bool = False,
        probing: bool = False,
    ) -> None:
        """The steps after preflight. ``blocked``: a dry run past a failed preflight, where
        each step shows what it would run once the blocking checks are fixed."""
        opts, prefix = self.options, spec.prefix
        members = _members(served)
        loaded = members[0]  # a set's members share its host's toolchain and build
        gates: list[EnsureGate | EnsureSetGate] = []

        def deploy_and_gate() -> list[Operation]:
            if isinstance(served, ServedSet):
                ops = set_deploy_ops(served, host, prefix, "auto", gated=True)
                serving = [op for op in ops if isinstance(op, EnsureServing)]
                gates.extend(
                    EnsureSetGate(op, served.members, served.models_max, prefix, out_dir=opts.reports) for op in serving
                )
                return ops
            ops = deploy_ops(loaded, host, prefix, "auto", served.gpus, gated=True, server=served.layout(prefix))
            for op in ops:
                if isinstance(op, EnsureServing):
                    gates.append(EnsureGate(op, loaded, prefix, force=opts.rebench, out_dir=opts.reports))
            return ops

        makers: list[tuple[str, Callable[[], list[Operation]]]] = [
            ("toolchain", lambda: toolchain_step(loaded, host, prefix, sudo)),
            ("build", lambda: build_step(loaded, host, prefix, sudo)),
            ("quantize", lambda: [op for m in members for op in quantize_step(m, prefix)]),
            ("deploy", deploy_and_gate),
            ("gate", lambda: list(gates)),
        ]
        pending = blocked or probing  # a dry run whose earlier step would change things (or is blocked)
        rolled: DeployRoll | None = None
        for step, make in makers:
            t = time.monotonic()
            printer.line(spec.name, f"== {step} ==")
            if self.cancel.is_set():
                raise Interrupted(f"interrupted before {step}")
            try:
                ops = make()
                if step == "deploy" and not pending:
                    # a restart behind a balancer (a server's, or a set's router under every
                    # member's name): drained first, one server at a time
                    rolled = self.roll.deploy(host, prefix, served.name, printer, ops, gates, dry_run)
                elif step == "gate" and rolled:
                    ops = [g for g in ops if id(g) not in rolled.gated]
            except (VoltaforgeError, HostError) as exc:
                text = str(exc).removeprefix(f"{spec.name}: ")
                why = summarize(text)  # the summary's column holds one line, as run_ops's does
                if dry_run and pending:
                    after = "after the fix" if blocked else "after the above"
                    outcome.steps.append(StepOutcome(step, "not reached", time.monotonic() - t, f"{after}: {why}"))
                    continue
                printer.line(spec.name, f"failed: {step}: {text}")  # whole, into the log too
                outcome.steps.append(StepOutcome(step, "failed", time.monotonic() - t, why))
                return
            if step == "deploy" and rolled:
                changes = rolled.deploy
            else:
                changes = run_ops(host, ops, dry_run=dry_run, keep_going=probing, cancel=self.cancel)
                if step == "gate" and rolled:
                    changes = rolled.gate + changes
            status = step_status(changes, dry_run)
            if status == "failed" and dry_run and pending:
                status = "not reached"
            if blocked and status == "would change":
                status = "would run after the fix"
            outcome.steps.append(StepOutcome(step, status, time.monotonic() - t, step_why(changes), changes))
            if status == "failed":
                return
            pending = pending or status in ("would change", "would run after the fix")
        for g in gates:
            if g.result:
                outcome.reports = {k: str(v) for k, v in g.reports.items()}
        if gates and outcome.steps[-1].status in ("ok", "changed"):
            outcome.endpoint = self._endpoint(host, spec, outcome, gates[0])

    def _endpoint(
        self, host: Host, spec: HostSpec, outcome: HostOutcome, gate: EnsureGate | EnsureSetGate
    ) -> str | None:
        """Where the service answers once its gate passed (the gate's figures into the outcome)."""
        rec = gate.read(host)
        verdict = rec.get("gate") or {}
        if verdict.get("status") != "passed":
            return None
        outcome.gate = verdict.get("figures")
        where = "this machine" if isinstance(host, LocalHost) else spec.name
        return f"http://127.0.0.1:{rec.get('port')}/v1 on {where}"

    # -- all hosts ---------------------------------------------------------------------------

    def run_layout(self, targets: Sequence[tuple[HostSpec, Target]]) -> list[HostOutcome]:
        """One host's recipes, one after the other (a layout shares the host's build and lock)."""
        return [self.run_host(spec, served) for spec, served in targets]

    def run(self, targets: Sequence[tuple[HostSpec, Target]]) -> list[HostOutcome]:
        """Hosts in parallel, each host's recipes in turn; outcomes in the order given."""
        by_host: dict[str, list[tuple[HostSpec, Target]]] = {}
        for spec, served in targets:
            by_host.setdefault(spec.name, []).append((spec, served))
        if len(by_host) == 1:
            return self.run_layout(targets)
        pool = ThreadPoolExecutor(max_workers=min(len(by_host), 16), thread_name_prefix="provision")
        futures = [pool.submit(self.run_layout, group) for group in by_host.values()]
        try:
            while True:
                done, rest = wait_futures(futures, timeout=0.5)
                if not rest:
                    break
        except KeyboardInterrupt:
            self.interrupt()
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        pool.shutdown()
        return [o for f in futures for o in f.result()]

    def interrupt(self) -> None:
        """Ctrl-C: no new operation starts; open connections close, which ends the commands
        running on them and drops each host's lock."""
        self.cancel.set()
        with self._lock:
            hosts = list(self._open.values())
        for host in hosts:
            try:
                host.close()
            except Exception:  # noqa: BLE001 - closing what may already be broken
                pass


def _members(target: Target) -> list[LoadedRecipe]:
    """The recipes a target serves: a recipe itself, a set's members in its order."""
    return list(target.members) if isinstance(target, ServedSet) else [target.loaded]


def resolve_targets(
    settings: Settings, hosts: Sequence[str], recipe: str | None, default_recipe: str
) -> list[tuple[HostSpec, Target]]:
    """Every host's inventory entry and recipes (the flag's, else the inventory's for that
    host: its one recipe or each of its layout and its model sets, else the default), loaded
    and checked before anything connects."""
    if len(set(hosts)) != len(hosts):
        raise VoltaforgeError(f"--host {','.join(hosts)}: a host is named twice")
    targets = []
    for name in hosts:
        spec = settings.host_spec(name)
        targets += [(spec, s) for s in settings.targets(name, recipe, default_recipe)]
    return targets
