"""A change behind a balancer, one server at a time, losing no request (`invoke provision`).

When provision's deploy step would restart a server that a balancer fronts (the record `invoke
lb` left on the host: conduct/fronted.py), that server is changed alone:

    drain it on the balancer (HAProxy's runtime API: new requests go to the model's other
    servers; those it runs finish, up to the drain bound) -> restart it with the change ->
    the gate -> back in rotation once HAProxy's health check passes -> the next server

A failed start or gate rolls that server back (deploy's own rollback), puts it back in rotation
and stops the roll of its model: no later server of that model is changed in this run, so the
others keep serving what passed before. One server of a model is out at a time: each model
behind each balancer is a lane, whose lock a server holds from its drain until it is back, so
hosts change in parallel only where they serve different models. Servers take turns in the
order their hosts reach deploy (a host's own servers in its order). A model with a single
server in rotation cannot keep serving: it is said, and changed in place once its in-flight
requests end (new ones get the balancer's 503 meanwhile).

A model set's router (issue 56) is one server in several backends: the balancer routes each
member's name to it, so its record names it once per member. Its turn drains it in every one
of those backends (holding each member's lane), restarts it once for whatever member changed,
runs the set's gate (each member's own, steps/measure/set_gate.py) and puts it back in all of
them; the members' other servers carry their names meanwhile.

The whole of it is operations, so a dry run lists, per server, the drain, the restart, the gate
and the return, each with its command (Roll.planned: the order per lane, for the summary).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

from playbooks.conduct.fronted import Fronted, FrontedServer, fronting, read_fronted, records_dir
from playbooks.conduct.settings import Settings
from playbooks.errors import HostError, VoltaforgeError
from playbooks.host import Host
from playbooks.host.base import Printer
from playbooks.host.ops import Change, Decision, Operation, Shell, run_ops
from playbooks.steps.measure.gate import EnsureGate
from playbooks.steps.measure.set_gate import EnsureSetGate
from playbooks.steps.serve.lifecycle import EnsureServing
from playbooks.steps.serve.runtime_api import DrainServer, ReadyServer
from playbooks.words import clip

#: how long a drained server's requests may take to finish before it is changed anyway (a long
#: generation streams for minutes; HAProxy's own server timeout is 15)
DRAIN_BOUND_S = 300.0


@dataclass
class Lane:
    """One model behind one balancer: one of its servers out at a time."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    holder: str = ""
    #: why the roll of this model stopped (a server's failed start or gate), None while it goes on
    stopped: str | None = None


@dataclass(frozen=True)
class Rolled:
    """One server's turn, as the summary tells it."""

    host: str
    recipe: str
    server: str
    model: str
    balancer: str
    drained_s: float
    cut: int  # requests still running when the drain's bound passed
    while_out: int | None  # requests HAProxy sent it between its drain and its return (0)
    result: str  # "changed" | "rolled back" | "failed"
    back: bool = True  # HAProxy took it back in rotation (its `state ready` answered)


@dataclass
class DeployRoll:
    """What the deploy step did, rolled: its changes and those of the gates it ran."""

    deploy: list[Change]
    gate: list[Change]
    gated: set[int]  # id() of the gates already run


class Roll:
    """One provision run's rolling changes, shared by its host threads."""

    def __init__(self, settings: Settings, drain_bound_s: float = DRAIN_BOUND_S):
        self.settings, self.drain_bound_s = settings, drain_bound_s
        self._guard = threading.Lock()
        self._lanes: dict[tuple[str, str], Lane] = {}
        #: per lane (balancer, model): the servers a dry run would change, in its order
        self.planned: dict[tuple[str, str], list[str]] = {}
        self.rolled: list[Rolled] = []
        self.notes: list[str] = []

    def lane(self, balancer: str, model: str) -> Lane:
        with self._guard:
            return self._lanes.setdefault((balancer, model), Lane())

    def note(self, printer: Printer, host: str, text: str) -> None:
        printer.line(host, text)
        with self._guard:
            if text not in self.notes:
                self.notes.append(text)

    # -- one host's deploy step ------------------------------------------------------------------

    def deploy(
        self,
        host: Host,
        prefix: str,
        recipe: str,
        printer: Printer,
        ops: Sequence[Operation],
        gates: Sequence[EnsureGate | EnsureSetGate],
        dry_run: bool,
    ) -> DeployRoll | None:
        """The deploy step (and the gates of the servers it restarts), rolled; None when no
        balancer fronts a server this step would restart (the step runs as usual)."""
        servings = [op for op in ops if isinstance(op, EnsureServing)]
        records = read_fronted(host, prefix)
        behind = {id(op): fronting(records, op.port) for op in servings}
        if not any(behind.values()):
            return None
        gate_of = {id(g.serving): g for g in gates}
        with ExitStack() as links:
            # the balancers first: one that cannot be reached fails the step before anything here
            # is written (a server it fronts must not restart without its drain)
            lb_hosts: dict[str, Host | None] = {}
            skipped: dict[str, str] = {}  # a balancer passed by, and why (a note per server)
            for op in servings:
                if behind[id(op)] and restarts(op.check(host)):
                    for f, s in behind[id(op)]:
                        if f.balancer not in lb_hosts:
                            lb_hosts[f.balancer] = self._connect(links, f, printer)
                            self._answers(host, prefix, f, s, lb_hosts, skipped)
            out = DeployRoll(run_ops(host, [op for op in ops if not isinstance(op, EnsureServing)], dry_run), [], set())
            if any(c.status == "failed" for c in out.deploy):
                return out
            for op in servings:
                fronts = behind[id(op)]
                if not fronts or not restarts(op.check(host)):
                    out.deploy += run_ops(host, [op], dry_run)
                else:
                    gate = gate_of.get(id(op))
                    for f, s in fronts:
                        if f.balancer not in lb_hosts:
                            lb_hosts[f.balancer] = self._connect(links, f, printer)
                            self._answers(host, prefix, f, s, lb_hosts, skipped)
                    self._turn(host, recipe, printer, op, gate, fronts, lb_hosts, skipped, out, dry_run)
                    if gate:
                        out.gated.add(id(gate))
                if any(c.status == "failed" for c in out.deploy + out.gate):
                    break
        return out

    def _connect(self, links: ExitStack, fronted: Fronted, printer: Printer) -> Host | None:
        """The balancer's host, connected; None when this inventory does not know it."""
        try:
            spec = self.settings.host_spec(fronted.balancer)
        except VoltaforgeError:
            return None
        try:
            return links.enter_context(self.settings.connect(spec, printer))
        except HostError as exc:
            raise HostError(
                f"the balancer's host {fronted.balancer}, where its servers here are drained first, cannot be "
                f"reached: {exc}; nothing was restarted"
            ) from None

    def _answers(
        self,
        host: Host,
        prefix: str,
        f: Fronted,
        s: FrontedServer,
        lb_hosts: dict[str, Host | None],
        skipped: dict[str, str],
    ) -> None:
        """A balancer whose record is here but whose runtime API does not answer (HAProxy
        stopped or gone) drains nothing: the step fails before anything is written, naming the
        balancer and the commands that settle it; with --in-place its servers here change in
        place (nothing is served through a balancer that does not run)."""
        lb = lb_hosts[f.balancer]
        if lb is None:
            skipped[f.balancer] = f"its balancer's host {f.balancer} is not in this inventory"
            return
        why = f.api.unanswered(lb)
        if why is None:
            return
        record = f"{records_dir(prefix)}/{f.balancer}.json"
        if self.settings.in_place:
            lb_hosts[f.balancer] = None
            skipped[f.balancer] = f"the balancer on {f.balancer} does not answer ({why}): --in-place"
            return
        raise HostError(
            f"{s.server} is fronted by the balancer on {f.balancer} (its record {record} on {host.name}), whose "
            f"runtime API does not answer: {why}. Start it again with `invoke lb --host {f.balancer}`, take it off "
            f"with `invoke lb --host {f.balancer} --remove` (its records go with it), or pass --in-place to change "
            "the servers it fronted here without a drain; nothing was changed"
        )

    def _turn(
        self,
        host: Host,
        recipe: str,
        printer: Printer,
        serving: EnsureServing,
        gate: EnsureGate | EnsureSetGate | None,
        fronts: list[tuple[Fronted, FrontedServer]],
        lb_hosts: dict[str, Host | None],
        skipped: dict[str, str],
        out: DeployRoll,
        dry_run: bool,
    ) -> None:
        """One server: drained on every balancer that fronts it, changed, gated, put back."""
        name = fronts[0][1].server
        reachable = [(f, s) for f, s in fronts if lb_hosts[f.balancer] is not None]
        for f, _ in fronts:
            if lb_hosts[f.balancer] is None:
                self.note(printer, host.name, f"{name}: {skipped[f.balancer]}: changed in place")
        lanes = sorted({(f.balancer, s.model) for f, s in reachable})
        if dry_run:
            for key in lanes:
                with self._guard:
                    self.planned.setdefault(key, []).append(name)
        with self._hold(host, printer, name, lanes, dry_run):
            stopped = [self.lane(*key).stopped for key in lanes if self.lane(*key).stopped]
            if stopped:
                out.deploy.append(
                    Change(host.name, serving.name, "failed", f"not changed: the roll stopped at {stopped[0]}")
                )
                return
            drains = [(f, s, DrainServer(f.api, s.model, s.server, self.drain_bound_s)) for f, s in reachable]
            readies = []
            try:
                for f, s, drain in drains:
                    lb = lb_hosts[f.balancer]
                    assert lb is not None
                    out.deploy += run_ops(lb, [drain], dry_run)
                    if any(c.status == "failed" for c in out.deploy):
                        return  # not drained: the server is not touched (and not "back in rotation")
                    readies.append((f, s, lb))
                    if drain.alone:
                        self.note(printer, host.name, drain.alone)
                out.deploy += run_ops(host, [serving], dry_run)
                if gate and not any(c.status == "failed" for c in out.deploy):
                    out.gate += run_ops(host, [gate], dry_run)
            finally:
                failed = next((c for c in out.deploy + out.gate if c.status == "failed"), None)
                backs = []
                for f, s, lb in readies:
                    back = ReadyServer(f.api, s.model, s.server)
                    done = [dry_ready(lb.name, back)] if dry_run else run_ops(lb, [back])
                    out.deploy += done
                    backs.append((back, all(c.status != "failed" for c in done)))
                # not back in rotation: the next server must not go out too
                failed = failed or next((c for c in out.deploy if c.status == "failed"), None)
                if failed is not None:
                    for key in lanes:
                        self.lane(*key).stopped = f"{name} ({clip(failed.why, 160)})"
                if not dry_run and backs:
                    self._told(host, recipe, printer, name, drains, backs, failed)

    def _told(
        self,
        host: Host,
        recipe: str,
        printer: Printer,
        name: str,
        drains: list[tuple[Fronted, FrontedServer, DrainServer]],
        backs: list[tuple[ReadyServer, bool]],
        failed: Change | None,
    ) -> None:
        """One line per server and balancer: how long its drain took, what HAProxy sent it while
        it was out (nothing, unless something else put it back), how it ended."""
        for (f, s, drain), (back, returned) in zip(drains, backs, strict=False):  # backs: the drained, in order
            while_out = (
                back.requests - drain.requests if back.requests is not None and drain.requests is not None else None
            )
            result = "changed" if failed is None else "rolled back" if "rolled back" in failed.why else "failed"
            done = Rolled(
                host.name, recipe, name, s.model, f.balancer, drain.seconds, drain.cut, while_out, result, returned
            )
            with self._guard:
                self.rolled.append(done)
            printer.line(host.name, rolled_line(done))

    @contextmanager
    def _hold(
        self, host: Host, printer: Printer, name: str, lanes: list[tuple[str, str]], dry_run: bool
    ) -> Iterator[None]:
        """The lanes' locks (in one order: no two hosts wait on each other), for one server's turn."""
        if dry_run:
            yield
            return
        held = []
        try:
            for key in lanes:
                lane = self.lane(*key)
                if not lane.lock.acquire(blocking=False):
                    printer.line(
                        host.name, f"{name}: waiting for {lane.holder} (model {key[1]}: one server out at a time)"
                    )
                    lane.lock.acquire()
                lane.holder = name
                held.append(lane)
            yield
        finally:
            for lane in reversed(held):
                lane.holder = ""
                lane.lock.release()


def restarts(decision: Decision) -> bool:
    """Whether a deployment's decision restarts its server (not just its record)."""
    return any(isinstance(c, Shell) for c in decision.commands)


def rolled_line(r: Rolled) -> str:
    cut = f", {r.cut} cut at the bound" if r.cut else ""
    sent = "?" if r.while_out is None else str(r.while_out)
    back = "back in rotation" if r.back else f"NOT back in rotation (see above; `invoke lb --host {r.balancer}`)"
    return (
        f"rolled {r.server} (model {r.model}, balancer on {r.balancer}): drained in {r.drained_s:.1f} s{cut}, "
        f"{sent} requests sent to it while out, {r.result}, {back}"
    )


def dry_ready(lb: str, back: ReadyServer) -> Change:
    shown = tuple(c.show() for c in [back.api.shown(back.line)])
    return Change(lb, back.name, "changed", "dry run: would run 1 command (back once its health check passes)", shown)
