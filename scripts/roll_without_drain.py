"""A pytest plugin for scripts/bench_roll.py's comparison run only: the roll's drain and return
made no-ops (each server restarted in place, still in rotation), so the same load shows what
the drain saves. Never loaded by the suite."""

from __future__ import annotations

from playbooks.host.ops import Decision
from playbooks.steps.serve import runtime_api


def pytest_configure(config) -> None:
    def in_place(self, facts) -> Decision:
        return Decision.ok("left in rotation (scripts/roll_without_drain.py)")

    runtime_api.DrainServer.decide = in_place  # type: ignore[method-assign]
    runtime_api.ReadyServer.decide = in_place  # type: ignore[method-assign]
