"""A model set's gate as the last operation of its provision (issue 55, per model since issue 56):
each member judged by its own recipe's gate, through the router's port the clients use, with
the set's key.

For each member, in the set's order:

1. **the swap**: the resident set is filled without it (the ``--models-max`` members before it
   in the set's order asked for once each, so the router holds its count and this member is
   not among them); where every member fits at once (the count is the whole set) it is unloaded
   instead (``POST /models/unload``). Then one streamed request for it: its first token waits
   for the router to stop the least recently used child (an eviction) and to load this one. That
   time is what a user pays on a swap; it is reported per member, not gated (a recipe's gate
   has no threshold for it; ``max_ttft_ms`` is a warm server's).
2. **warm decode**: the levels its recipe's gate judges (one stream; the aggregate's level too
   where the recipe gates an aggregate), each a warm-up round then rounds until the decode's
   95% interval is within the recipe's ``ci_target`` (bench_run.round_bounds, the same bounds
   as a server's gate), its ceiling from its own plan (bench_ceilings.ceilings: the CPU's measured
   copy rate and last-level cache, a GPU's datasheet), judged by ``bench.judge`` with its recipe's
   thresholds exactly as a single server's gate is.

The set passes when every member passes. Passed, the deployment becomes the rollback target;
failed, the one before is put back (steps/measure/gate.py ``keep_verdict``). The figures per
member go into the record's verdict, the provision's lines and a JSON and a Markdown report.
Idempotent like the recipe gate: the verdict is kept with the fingerprint and criteria it judged.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from playbooks.config.recipe import Gate, LoadedRecipe
from playbooks.errors import HostError
from playbooks.facts import read_fact, system
from playbooks.facts.router import parse_models
from playbooks.host.base import Host
from playbooks.host.ops import Decision, Operation, Record
from playbooks.plan.engines import engine
from playbooks.plan.gpus import get_gpu
from playbooks.steps.measure import bench, bench_client
from playbooks.steps.measure.gate import criteria_hash, keep_verdict, set_figures_line
from playbooks.steps.serve.deploy_record import read_record
from playbooks.steps.serve.lifecycle import EnsureServing, health_timeout
from playbooks.steps.serve.secrets import api_key_for

#: the method's version: part of the criteria, so a verdict of an older method is judged again
METHOD = 2
#: words of the probe whose token count sizes the prompts (bench_run.prompt_words does the same)
PROBE_WORDS = 64


class EnsureSetGate(Operation):
    """Every member of the set passes its own recipe's gate through the router, and its first
    token after a swap is measured."""

    def __init__(
        self,
        serving: EnsureServing,
        members: Sequence[LoadedRecipe],
        models_max: int,
        prefix: str,
        out_dir: Path | None = None,
    ):
        self.serving, self.members, self.models_max = serving, tuple(members), models_max
        self.prefix, self.out_dir = prefix, out_dir
        names = [m.recipe.served_name for m in self.members]
        each = [criteria_hash(m) for m in self.members]
        self.criteria = hashlib.sha256(json.dumps([METHOD, names, each, models_max]).encode()).hexdigest()[:16]
        self.name = f"Ensure {serving.layout.service} passes each member's gate ({', '.join(names)})"
        #: what the last apply measured (the provision summary's figures), and its reports
        self.result: dict[str, Any] | None = None
        self.reports: dict[str, Path] = {}

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
            why = "the set's members or their gates changed"
        where = str(self.out_dir or "the bench reports on this machine")
        return Decision.act(why, Record(where, f"each of {len(self.members)} members: a swap, then its own gate"))

    def apply(self, host: Host, decision: Decision) -> None:
        from playbooks.steps.measure.bench_run import bench_dir

        at = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        members, reasons = self._ask(host)
        figures = {
            "members": len(self.members),
            "answered": sum(1 for m in members if m.get("single_tok_s") is not None),
            "models_max": self.models_max,
            "per_member": members,
        }
        self.result = figures
        where = self.out_dir or bench_dir() / host.name / self.serving.layout.service / at.replace(":", "")
        self.reports = write_set_reports(self.serving.layout.service, host.name, at, figures, reasons, where)
        verdict = {
            "status": "failed" if reasons else "passed",
            "fingerprint": (read_record(host, self.serving.layout) or {}).get("fingerprint"),
            "criteria": self.criteria,
            "at": at,
            "figures": figures,
            "reasons": reasons,
            "report": str(self.reports["markdown"]),
        }
        for m in members:
            host.printer.line(host.name, f"{m['name']}: {member_line(m)}")
        outcome = keep_verdict(host, self.serving, verdict, not reasons)
        if outcome is None:
            host.printer.line(host.name, f"gate passed: {set_figures_line(figures)}")
            return
        raise HostError(f"the gate failed: {'; '.join(reasons)}; {outcome} (report {self.reports['markdown']})")

    def _ask(self, host: Host) -> tuple[list[dict[str, Any]], list[str]]:
        """The router's list, then each member in the set's order (a list: a record's keys are
        kept sorted): its swap and its own gate."""
        import httpx  # only when the gate runs: a no-op provision never loads the HTTP client

        key = api_key_for(host, self.members[0].recipe)
        # a member's first answer waits for its child to load: as long as a start may take
        timeout = health_timeout(self.serving.artifact_bytes)
        ceilings = _host_ceilings(host, self.prefix, self.members)
        reasons: list[str] = []
        out: list[dict[str, Any]] = []
        with host.forward(self.serving.port) as local:
            url = f"http://127.0.0.1:{local}"
            # a connection per request: the router at 0c1e570 may close a kept-alive connection after
            # a proxied answer without saying so, and the next request on it then fails as "Server
            # disconnected without sending a response" (seen in a cold CI run, under load)
            fresh = httpx.Limits(max_keepalive_connections=0)
            headers = bench_client.auth_headers(key)
            with httpx.Client(base_url=url, headers=headers, timeout=timeout, limits=fresh, trust_env=False) as client:
                try:
                    listed = {m.name for m in parse_models(client.get("/v1/models").text)}
                except httpx.HTTPError as exc:
                    return [], [f"GET /v1/models: {exc}"]
                missing = [m.recipe.served_name for m in self.members if m.recipe.served_name not in listed]
                if missing:
                    return [], [f"the router does not list {', '.join(missing)}"]
                for i, loaded in enumerate(self.members):
                    name = loaded.recipe.served_name
                    # the text its prompts are cut from, read once for its swap and its levels
                    text = _corpus(loaded.recipe.gate)
                    swap, why = self._swap(client, url, key, i, timeout, text)
                    if why:
                        out.append({"name": name, "swap": swap, "passed": False, "reasons": [why]})
                        reasons.append(f"{name}: {why}")
                        continue
                    figures = _warm_gate(url, key, loaded, text, swap.pop("words"), ceilings[name])
                    out.append({"name": name, "swap": swap, **figures})
                    reasons += [f"{name}: {r}" for r in figures["reasons"]]
        return out, reasons

    def _swap(
        self, client: Any, url: str, key: str | None, i: int, timeout: float, text: bench.Corpus
    ) -> tuple[dict[str, Any], str | None]:
        """Member ``i`` out of the resident set and the set full (or, where all fit, it alone
        unloaded); then its first token, timed. Returns the swap's figures (with the words a
        prompt of its gate's length takes) or why it failed."""
        loaded = self.members[i]
        name, kind = loaded.recipe.served_name, engine(loaded.recipe.backend).server
        others = [m.recipe.served_name for j, m in enumerate(self.members) if j != i]
        if len(self.members) > self.models_max:
            # the count filled with others, the least recently used of them first: the one the
            # router stops for this member
            fill = (others[i:] + others[:i])[-self.models_max :]
            for other in fill:
                got = bench_client.probe_prompt_tokens(url, text.cut(0, 8), kind, timeout, key, True, other)
                if got.error:
                    return {}, f"filling the resident set with {other} before its swap: {got.error}"
            swap: dict[str, Any] = {"kind": "eviction", "evicted": fill[0], "resident_before": fill}
        else:
            reply = client.post("/models/unload", json={"model": name})
            if reply.status_code not in (200, 400):  # 400: "model is not running", already out
                return {}, f"POST /models/unload answered {reply.status_code}: {reply.text[:200]}"
            if not _wait_state(client, name, "unloaded", timeout):
                return {}, f"still not unloaded {timeout:g} s after POST /models/unload"
            swap = {"kind": "cold load (every member fits at once: nothing is evicted)"}
        states = {m.name: m.state for m in parse_models(client.get("/v1/models").text)}
        if states.get(name) != "unloaded":
            return {}, f"was {states.get(name)} before its swap, not unloaded: the router does not hold its count"
        first = bench_client.probe_prompt_tokens(
            url, text.cut(0, PROBE_WORDS), kind, timeout, key, True, name, max_tokens=4
        )
        if first.error:
            return {}, f"its first request after a swap: {first.error}"
        swap["first_token_s"] = round(first.ttft or 0.0, 3)
        swap["words"] = bench.words_for(loaded.recipe.gate.prompt_tokens, PROBE_WORDS, first.prompt_tokens or 1)
        return swap, None


def _corpus(g: Gate) -> bench.Corpus:
    from playbooks.steps.measure.bench_run import workload_text

    return workload_text(g.workload)


def _wait_state(client: Any, name: str, state: str, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if {m.name: m.state for m in parse_models(client.get("/v1/models").text)}.get(name) == state:
            return True
        time.sleep(0.1)
    return False


def _host_ceilings(host: Host, prefix: str, members: Sequence[LoadedRecipe]) -> dict[str, dict[str, Any]]:
    """Each member's decode roofline as its server's gate computes it (bench_ceilings.ceilings): on a
    CPU the host's copy rate (its stored fact, else measured once) and last-level cache, read
    once for the whole set."""
    from playbooks.steps.measure.bench_ceilings import ceilings, host_membw, host_python

    membw = llc = None
    if any(get_gpu(m.recipe.gpu).is_cpu for m in members):
        membw = host_membw(host, prefix, host_python(host, prefix))["gb_s"]
        llc = system.parse_llc(read_fact(host, system.LLC_COMMAND)).size_bytes
    return {
        m.recipe.served_name: ceilings(m, membw, llc) if get_gpu(m.recipe.gpu).is_cpu else ceilings(m, None)
        for m in members
    }


def _warm_gate(
    url: str, key: str | None, loaded: LoadedRecipe, text: bench.Corpus, words: int, ceiling: dict[str, Any]
) -> dict[str, Any]:
    """One member's own gate, warm: the levels it judges, its ceiling, ``bench.judge``."""
    from playbooks.steps.measure.bench_run import thresholds

    r, g = loaded.recipe, loaded.recipe.gate
    levels = [1] + ([g.at_concurrency] if g.min_aggregate_tok_s and g.at_concurrency != 1 else [])
    summaries, samples = [], []
    for c in levels:
        summary, got = member_level(url, text, words, c, g, engine(r.backend).server, key, r.served_name)
        summaries.append(summary)
        samples += got
    dead = any(lv.get("errors") == lv.get("requests") for lv in summaries)
    result: dict[str, Any] = {"levels": summaries, "complete": not dead}
    if not result["complete"]:
        result["error"] = f"every request for {r.served_name} failed"
    result |= ceiling
    single = bench.decode_figure(summaries[0]) if summaries else None
    roof = result.get("roofline_tok_s")
    result["mbu"] = round(single / roof, 4) if single and roof else None
    result["sanity"] = bench.sanity(samples, bool(r.model.generate))
    judged = bench.judge(result, thresholds(loaded), {})
    spread = (summaries[0].get("decode") or {}).get("halfwidth") if summaries else None
    agg = next((lv for lv in summaries if lv["concurrency"] == g.at_concurrency), None)
    agg = agg if g.min_aggregate_tok_s else None
    ttft = summaries[0].get("ttft_p95_s") if summaries else None
    return {
        "single_tok_s": round(single, 1) if single else None,
        "single_halfwidth": round(spread, 1) if single and spread else None,
        "roofline_tok_s": result.get("roofline_tok_s"),
        "mbu": result["mbu"],
        "cache_resident": bool(result.get("cache_resident")),
        "roofline_basis": result.get("roofline_basis"),
        "aggregate_tok_s": round(agg["aggregate_tok_s"], 1) if agg and agg.get("aggregate_tok_s") else None,
        "ttft_p95_ms": round(ttft * 1000) if ttft else None,
        "gate": {"min_tok_s": g.min_tok_s, "min_roofline_fraction": g.min_roofline_fraction},
        "passed": judged["passed"],
        "reasons": judged["reasons"],
    }


def member_level(
    url: str, text: bench.Corpus, words: int, c: int, g: Gate, kind: str, key: str | None, model: str
) -> tuple[dict[str, Any], list[bench_client.Sample]]:
    """One level of one member, as bench_run.sweep_level runs a server's (a warm-up round left
    out, then rounds until the judged decode settles within ``ci_target``, between the gate's
    bounds), every request naming the member: the router routes by it."""
    import asyncio

    from playbooks.steps.measure.bench_run import REQUEST_TIMEOUT_S, round_bounds
    from playbooks.steps.measure.bench_stats import estimate, settled

    def run(prompts: list[str], seed: int) -> tuple[list[bench_client.Sample], float]:
        return asyncio.run(
            bench_client.run_level(url, prompts, c, g.max_tokens, seed, kind, REQUEST_TIMEOUT_S, key, True, model)
        )

    least, most = round_bounds(g, c)
    warm = bench.prompts_for(text, words, c, seed=100_000 + c)
    run(warm, 100_000)
    rounds: list[bench.Round] = []
    while True:
        got, took = run(bench.prompts_for(text, words, c, seed=1000 * c + len(rounds)), 1 + len(rounds) * c)
        rounds.append((got, took))
        if all(s.error for s in got):
            break
        values, _ = bench.judged_rounds(rounds)
        if len(rounds) >= most or settled(estimate(values), least, most, g.ci_target):
            break
    samples = [s for got, _ in rounds for s in got]
    return bench.level_summary(c, samples, sum(t for _, t in rounds), warmup=len(warm), rounds=rounds), samples


def member_line(m: dict[str, Any]) -> str:
    """One member's gate in a line: its swap's first token, its warm decode against its roofline,
    its verdict."""
    swap = m.get("swap") or {}
    parts = []
    if swap.get("first_token_s") is not None:
        how = f"evicting {swap['evicted']}" if swap.get("evicted") else "a cold load"
        parts.append(f"first token after a swap {swap['first_token_s']:g} s ({how})")
    if m.get("single_tok_s") is not None:
        spread = f" ± {m['single_halfwidth']:g}" if m.get("single_halfwidth") else ""
        share = (
            f" ({m['mbu']:.0%} of its {m['roofline_tok_s']:g} tok/s roofline)"
            if m.get("mbu") and m["mbu"] <= 1
            else " (cache-resident: no roofline binds)"
            if m.get("cache_resident")
            else ""
        )
        parts.append(f"warm decode {m['single_tok_s']:g}{spread} tok/s{share}")
    verdict = "passed its gate" if m.get("passed") else f"FAILED: {'; '.join(m.get('reasons') or ['no figures'])}"
    return ", ".join(parts + [verdict])


def write_set_reports(
    service: str, host: str, at: str, figures: dict[str, Any], reasons: list[str], where: Path
) -> dict[str, Path]:
    """The set gate's report: its figures as JSON, and a Markdown table, one row a member."""
    where.mkdir(parents=True, exist_ok=True)
    body = {"service": service, "host": host, "at": at, "passed": not reasons, "reasons": reasons, **figures}
    (where / "set-gate.json").write_text(json.dumps(body, indent=1, sort_keys=True) + "\n")
    rows = [
        f"# {service} on {host}, {at}: {'passed' if not reasons else 'FAILED'}",
        "",
        f"{figures['members']} members, at most {figures['models_max']} resident (`--models-max`).",
        "",
        "| member | first token after a swap | swap | warm decode tok/s | roofline tok/s | share | gate | verdict |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for m in figures["per_member"]:
        swap = m.get("swap") or {}
        dec = m.get("single_tok_s")
        spread = f" ± {m['single_halfwidth']:g}" if m.get("single_halfwidth") else ""
        rows.append(
            "| "
            + " | ".join(
                [
                    m["name"],
                    f"{swap['first_token_s']:g} s" if swap.get("first_token_s") is not None else "-",
                    f"evicts {swap['evicted']}" if swap.get("evicted") else "cold load" if swap else "-",
                    "-" if dec is None else f"{dec:g}{spread}",
                    f"{m['roofline_tok_s']:g}" if m.get("roofline_tok_s") else "none binds",
                    f"{m['mbu']:.0%}" if m.get("mbu") else "-",
                    f">= {(m.get('gate') or {}).get('min_tok_s', 0):g} tok/s",
                    "passed" if m.get("passed") else "failed: " + "; ".join(m.get("reasons") or []),
                ]
            )
            + " |"
        )
    (where / "set-gate.md").write_text("\n".join(rows) + "\n")
    return {"json": where / "set-gate.json", "markdown": where / "set-gate.md"}
