"""The recipe's port is free, or held by this service itself: checked before anything changes,
so a port someone else holds fails before a file is touched."""

from __future__ import annotations

from playbooks.facts.service import listeners_command, parse_listeners
from playbooks.host.base import Host
from playbooks.host.ops import Decision, Operation, OperationError
from playbooks.steps.serve.service_manager import Manager, Running


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
