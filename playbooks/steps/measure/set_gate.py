"""A model set's gate as the last operation of its provision (issue 55): the router that just
started is asked for its list and for one short completion of every member, through the port
the clients use, with the set's key. Each completion loads its member (the router starts its
child, stopping the least recently used one past ``--models-max``), so a passed gate means every
member loads and answers under the count the plan gave. Passed, the deployment becomes the
rollback target; failed, the one before is put back (steps/measure/gate.py ``keep_verdict``).

What it does not judge yet: each member's speed against a threshold (its recipe's own gate, per
model, is the set's second part). Idempotent like the recipe gate: the verdict is kept in the
record with the fingerprint it judged.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

from playbooks.config.recipe import Recipe
from playbooks.errors import HostError
from playbooks.facts.router import parse_models
from playbooks.host.base import Host
from playbooks.host.ops import Decision, Operation, Record
from playbooks.steps.measure.gate import keep_verdict, set_figures_line
from playbooks.steps.serve.deploy import EnsureServing, health_timeout, read_record
from playbooks.steps.serve.secrets import api_key_for

#: what each member is asked: a few tokens, enough to prove the child loaded and decodes
PROMPT = "The capital of France is"
MAX_TOKENS = 4


class EnsureSetGate(Operation):
    """Every member of the set is listed by its router and answers a completion through it."""

    def __init__(self, serving: EnsureServing, members: Sequence[Recipe]):
        self.serving, self.members = serving, tuple(members)
        names = [r.served_name for r in self.members]
        self.criteria = hashlib.sha256(json.dumps([names, PROMPT, MAX_TOKENS]).encode()).hexdigest()[:16]
        self.name = f"Ensure {serving.layout.service} answers for each of {', '.join(names)}"
        #: what the last apply measured (the provision summary's figures), and its reports (none)
        self.result: dict[str, Any] | None = None
        self.reports: dict[str, Any] = {}

    def read(self, host: Host) -> dict[str, Any]:
        return read_record(host, self.serving.layout) or {}

    def decide(self, facts: dict[str, Any]) -> Decision:
        verdict = facts.get("gate") or {}
        judged = verdict.get("fingerprint") == facts.get("fingerprint") == self.serving.want
        if verdict.get("status") == "passed" and judged and verdict.get("criteria") == self.criteria:
            return Decision.ok(f"passed {verdict.get('at')}: {set_figures_line(verdict.get('figures') or {})}")
        if facts.get("fingerprint") != self.serving.want:
            why = "a new deployment"
        elif verdict.get("status") == "failed" and judged:
            why = "it failed the gate before"
        elif verdict.get("status") in (None, "pending", "not run"):
            why = "never judged"
        else:
            why = "the set's members changed"
        return Decision.act(why, Record(self.serving.layout.record, f"one completion from each of {len(self.members)}"))

    def apply(self, host: Host, decision: Decision) -> None:
        figures, reasons = self._ask(host)
        self.result = figures
        verdict = {
            "status": "failed" if reasons else "passed",
            "fingerprint": (read_record(host, self.serving.layout) or {}).get("fingerprint"),
            "criteria": self.criteria,
            "at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "figures": figures,
            "reasons": reasons,
        }
        outcome = keep_verdict(host, self.serving, verdict, not reasons)
        if outcome is None:
            host.printer.line(host.name, f"gate passed: {set_figures_line(figures)}")
            return
        raise HostError(f"the gate failed: {'; '.join(reasons)}; {outcome}")

    def _ask(self, host: Host) -> tuple[dict[str, Any], list[str]]:
        """The router's list, then one completion per member in the set's order."""
        import httpx  # only when the gate runs: a no-op provision never loads the HTTP client

        key = api_key_for(host, self.members[0])
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        # a member's first answer waits for its child to load: as long as a start may take
        timeout = health_timeout(self.serving.artifact_bytes)
        reasons: list[str] = []
        load_s: dict[str, float] = {}
        # a connection per request: the router at 0c1e570 may close a kept-alive connection after
        # a proxied answer without saying so, and the next request on it then fails as "Server
        # disconnected without sending a response" (seen in a cold CI run, under load)
        fresh = httpx.Limits(max_keepalive_connections=0)
        with host.forward(self.serving.port) as local:
            with httpx.Client(
                base_url=f"http://127.0.0.1:{local}", headers=headers, timeout=timeout, limits=fresh
            ) as client:
                try:
                    listed = {m.name for m in parse_models(client.get("/v1/models").text)}
                except httpx.HTTPError as exc:
                    return {"members": len(self.members), "answered": 0}, [f"GET /v1/models: {exc}"]
                missing = [r.served_name for r in self.members if r.served_name not in listed]
                if missing:
                    reasons.append(f"the router does not list {', '.join(missing)}")
                for r in self.members:
                    t0 = time.monotonic()
                    body = {"model": r.served_name, "prompt": PROMPT, "max_tokens": MAX_TOKENS}
                    try:
                        got = client.post("/v1/completions", json=body)
                    except httpx.HTTPError as exc:
                        reasons.append(f"{r.served_name}: {exc}")
                        continue
                    if got.status_code != 200:
                        reasons.append(f"{r.served_name}: HTTP {got.status_code}: {got.text[:200]}")
                        continue
                    answered = _model_of(got)
                    if answered != r.served_name:
                        reasons.append(f"{r.served_name}: answered as {answered!r}")
                        continue
                    load_s[r.served_name] = round(time.monotonic() - t0, 2)
        figures = {"members": len(self.members), "answered": len(load_s), "first_answer_s": load_s}
        return figures, reasons


def _model_of(response: Any) -> str | None:
    """The ``model`` an answer names (an httpx response)."""
    try:
        body = response.json()
    except ValueError:
        return None
    model = body.get("model") if isinstance(body, dict) else None
    return model if isinstance(model, str) else None
