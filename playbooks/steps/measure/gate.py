"""The smoke-benchmark gate as the last operation of a provision: the deployment that just
started is measured (steps/measure/bench_run.py) and either becomes the one later failures roll back
to, or is rolled back itself.

Idempotent like every operation: the verdict is kept in the deployment record on the host,
with the fingerprint of what was measured and a hash of the gate's criteria. The same
deployment, the same criteria and a pass: ``ok`` without a request sent (``force`` measures
again). A new deployment, a changed threshold, a failed or missing verdict: measure.

A failed gate restores the deployment before this one (``EnsureServing.rollback``): the one
that passed last. When there is none, a deployment made by `invoke deploy` (no gate) keeps
serving and the run fails; a first deployment ever is stopped, as a failed start is.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from playbooks.config.recipe import LoadedRecipe
from playbooks.errors import HostError
from playbooks.host.base import Host
from playbooks.host.ops import Decision, Operation, Record
from playbooks.steps.measure import bench, roofline
from playbooks.steps.serve.deploy_record import good_of, read_record, write_record
from playbooks.steps.serve.lifecycle import EnsureServing


def criteria_hash(loaded: LoadedRecipe) -> str:
    """What the verdict depends on besides the deployment: the gate's thresholds and workload."""
    blob = json.dumps(loaded.recipe.gate.model_dump(mode="json"), sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def gate_figures(result: dict[str, Any]) -> dict[str, Any]:
    """The figures a provision summary shows (the report has the rest)."""
    levels = result.get("levels") or []
    single = bench.decode_figure(levels[0]) if levels else None
    # the judged decode's 95% half-width over this run's rounds (none in a result from before
    # the estimates): the line shows the figure with the spread it was measured with
    spread = ((levels[0].get("decode") or {}).get("halfwidth") if levels else None) or None
    best = max(levels, key=lambda lv: lv.get("aggregate_tok_s") or 0, default=None)
    ttft = (levels[0].get("ttft_p95_s") if levels else None) or None
    return {
        "single_tok_s": round(single, 1) if single else None,
        "single_halfwidth": round(spread, 1) if single and spread else None,
        "roofline_tok_s": result.get("roofline_tok_s"),
        "mbu": result.get("mbu"),
        "cache_resident": bool(result.get("cache_resident")),
        "peak_aggregate_tok_s": round(best["aggregate_tok_s"], 1) if best and best.get("aggregate_tok_s") else None,
        "peak_at": best["concurrency"] if best else None,
        "ttft_p95_ms": round(ttft * 1000) if ttft else None,
    }


def figures_line(fig: dict[str, Any]) -> str:
    if "answered" in fig:  # a model set's gate (steps/measure/set_gate.py)
        return set_figures_line(fig)
    parts = []
    if fig.get("single_tok_s") is not None:
        mbu = ""
        if roofline.above(fig.get("mbu")):
            mbu = f" ({roofline.ABOVE_CEILING}: {fig['mbu']:.2f}x the {fig['roofline_tok_s']:g} tok/s roofline)"
        elif fig.get("mbu"):
            mbu = f" ({fig['mbu']:.0%} of the {fig['roofline_tok_s']:g} tok/s roofline)"
        elif fig.get("cache_resident"):
            mbu = f" (cache-resident: {roofline.DOES_NOT_BIND})"
        spread = f" ± {fig['single_halfwidth']:g}" if fig.get("single_halfwidth") else ""
        parts.append(f"{fig['single_tok_s']:g}{spread} tok/s single stream{mbu}")
    if fig.get("peak_aggregate_tok_s") is not None:
        parts.append(f"{fig['peak_aggregate_tok_s']:g} tok/s aggregate at {fig['peak_at']}")
    if fig.get("ttft_p95_ms") is not None:
        parts.append(f"TTFT p95 {fig['ttft_p95_ms']} ms")
    return ", ".join(parts) or "no figures"


def set_figures_line(fig: dict[str, Any]) -> str:
    """A model set's gate in one line: how many members passed their own gates, and each one's
    first token after a swap and warm decode (steps/measure/set_gate.py)."""
    each = fig.get("per_member") or []
    passed = sum(1 for m in each if m.get("passed"))
    parts = []
    for m in each:
        name = m.get("name", "?")
        swap = (m.get("swap") or {}).get("first_token_s")
        decode = m.get("single_tok_s")
        got = [f"swap {swap:g} s" if swap is not None else "", f"{decode:g} tok/s" if decode is not None else ""]
        parts.append(f"{name} " + ", ".join(g for g in got if g) if any(got) else name)
    return f"{passed} of {fig.get('members', 0)} members passed their gates" + (
        f" ({'; '.join(parts)})" if parts else ""
    )


class EnsureGate(Operation):
    """The running deployment passed the recipe's gate."""

    def __init__(
        self,
        serving: EnsureServing,
        loaded: LoadedRecipe,
        prefix: str,
        force: bool = False,
        out_dir: Path | None = None,
    ):
        self.serving, self.loaded, self.prefix, self.force, self.out_dir = serving, loaded, prefix, force, out_dir
        self.criteria = criteria_hash(loaded)
        g = loaded.recipe.gate
        self.name = f"Ensure {serving.layout.service} passes the gate (>= {g.min_tok_s:g} tok/s single stream)"
        #: what the last apply measured, for the provision summary
        self.result: dict[str, Any] | None = None
        self.reports: dict[str, Path] = {}

    def read(self, host: Host) -> dict[str, Any]:
        return read_record(host, self.serving.layout) or {}

    def decide(self, facts: dict[str, Any]) -> Decision:
        rec = facts
        verdict = rec.get("gate") or {}
        measured = verdict.get("fingerprint") == rec.get("fingerprint") == self.serving.want
        if verdict.get("status") == "passed" and measured and verdict.get("criteria") == self.criteria:
            if not self.force:
                return Decision.ok(f"passed {verdict.get('at')}: {figures_line(verdict.get('figures') or {})}")
            why = "measured again (--rebench)"
        elif rec.get("fingerprint") != self.serving.want:
            why = "a new deployment"
        elif verdict.get("status") == "failed" and measured:
            why = "it failed the gate before"
        elif verdict.get("status") == "passed":
            why = "the gate's criteria changed"
        else:
            why = "never measured"
        where = str(self.out_dir or "the bench reports on this machine")
        return Decision.act(why, Record(where, f"the gate's sweep over {list(self.loaded.recipe.gate.levels)} streams"))

    def apply(self, host: Host, decision: Decision) -> None:
        # the measuring machinery (client, statistics, reports) only when the gate runs: a
        # no-op reads the verdict above and never loads it
        from playbooks.steps.measure.bench_run import gate_run

        layout = self.serving.layout
        result, files, _ = gate_run(self.loaded, host, self.prefix, layout, self.out_dir)
        self.result, self.reports = result, files
        judged = result["gate"]
        verdict = {
            "status": "passed" if judged["passed"] else "failed",
            "fingerprint": (read_record(host, layout) or {}).get("fingerprint"),
            "criteria": self.criteria,
            "at": result["at"],
            "figures": gate_figures(result),
            "reasons": judged["reasons"],
            "report": str(files["markdown"]),
        }
        outcome = keep_verdict(host, self.serving, verdict, judged["passed"])
        if outcome is None:
            host.printer.line(host.name, f"gate passed: {figures_line(verdict['figures'])}")
            return
        raise HostError(f"the gate failed: {'; '.join(judged['reasons'])}; {outcome} (report {files['markdown']})")


def keep_verdict(host: Host, serving: EnsureServing, verdict: dict[str, Any], passed: bool) -> str | None:
    """The gate's verdict into the deployment's record: passed, the deployment becomes the
    rollback target (None); failed, the one before is put back, and what happened is said."""
    layout = serving.layout
    rec = read_record(host, layout) or {}
    rec["gate"] = verdict
    good = good_of(rec) or {}
    same_as_good = bool(good) and good.get("fingerprint") == rec.get("fingerprint")
    if passed:
        if same_as_good:
            rec["good"] = {**good, "gate": verdict}
            write_record(host, layout, rec)
        else:
            serving.promote(host, rec)
        return None
    write_record(host, layout, rec)
    if same_as_good:
        return "no earlier deployment to go back to (this one was made by `invoke deploy`): it keeps serving"
    return serving.rollback(host)
