"""`invoke bench --against`: the deployed recipe (A) and another configuration (B) measured in
one run, their blocks interleaved A B B A, each block on a fresh process (the conductor starts
them), and the change judged from the cycles (steps/measure/paired.py says why and how).

The workload is A's gate's (levels, prompt and completion sizes, its text), the same requests
for both sides (each side's prompts sized by its own tokenizer's count, cut at the same seeded
offsets). A block is, at every level in turn, whole rounds (a round: one request per stream, all
at once) of at least paired.BLOCK_REQUESTS requests. Each process starts with a warm-up round
at the widest level, left out.
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from playbooks.config.recipe import Gate
from playbooks.host import Host
from playbooks.steps.measure import bench, bench_client
from playbooks.steps.measure.bench_run import REQUEST_TIMEOUT_S, prompt_words, workload_text
from playbooks.steps.measure.paired import (
    BLOCK_REQUESTS,
    CYCLES,
    MARGIN,
    ORDER,
    paired_change,
    rounds_per_block,
    schedule,
    verdict_text,
)


class Side:
    """One of the two servers: where it answers and how it is asked."""

    def __init__(self, name: str, port: int, kind: str, api_key: str | None):
        self.name, self.port, self.kind, self.api_key = name, port, kind, api_key
        self.url = ""
        self.words = 0


def _judged(rounds: dict[str, list[bench.Round]]) -> tuple[str, dict[str, dict[str, list[float | None]]]]:
    """Whose rates both sides are judged by, and each side's per-round figures by it: the
    client's where it could time both sides' tokens, else the servers' own (both must report
    one; TabbyAPI does not: then each side by its own judged source, the result's "mixed")."""
    own = {s: bench.judged_values([x for got, _ in rounds[s] for x in got])[1] for s in ("a", "b")}
    if own["a"] == own["b"]:
        source = own["a"]
    else:
        answered = [x for s in ("a", "b") for got, _ in rounds[s] for x in got if x.error is None]
        has = all("predicted_per_second" in x.timings for x in answered)
        source = "server" if has else "mixed"
    per_side = {s: bench.round_observations(rounds[s], own[s] if source == "mixed" else source) for s in ("a", "b")}
    return source, per_side


def _level(rounds: dict[str, list[bench.Round]], order: list[tuple[int, str, int]], c: int) -> dict[str, Any]:
    """One level's result from its rounds (each side's in run order, rounds_per_block(c) a block)."""
    per_block = rounds_per_block(c)
    source, per_side = _judged(rounds)
    taken = {"a": 0, "b": 0}
    blocks: list[tuple[int, str, float | None]] = []
    for cycle, side, _ in order:
        values = per_side[side]["decode"][taken[side] : taken[side] + per_block]
        taken[side] += per_block
        # a block's figure: the mean of its rounds' (none where a round failed: the cycle is left out)
        whole = [v for v in values if v is not None]
        blocks.append((cycle, side, statistics.fmean(whole) if len(whole) == len(values) else None))
    errors = {s: sum(1 for got, _ in rounds[s] for x in got if x.error) for s in ("a", "b")}

    def mean(values: list[float | None]) -> float | None:
        ok = [v for v in values if v]
        return round(statistics.fmean(ok), 3) if ok else None

    return {
        "concurrency": c,
        "rounds_per_block": per_block,
        "source": source,
        "blocks": [{"cycle": cy, "side": s, "decode": None if v is None else round(v, 3)} for cy, s, v in blocks],
        "a": {"decode": mean(per_side["a"]["decode"]), "aggregate": mean(per_side["a"]["aggregate"])},
        "b": {"decode": mean(per_side["b"]["decode"]), "aggregate": mean(per_side["b"]["aggregate"])},
        "errors": errors,
        "requests": {s: sum(len(got) for got, _ in rounds[s]) for s in ("a", "b")},
    }


def measure_against(
    host: Host,
    a: Side,
    b: Side,
    g: Gate,
    fresh: Callable[[Side], str | None],
    cycles: int = CYCLES,
    say: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Every level of ``g``, the two sides' blocks interleaved on ``host``'s loopback, each block
    on a process of its own that ``fresh(side)`` starts (it stops the one before and returns a
    failure's line, or None); per level the blocks, each side's means and the change of B
    against A (:func:`paired.paired_change`, at 5% over the levels). ``{"error": ...}`` when a
    side does not start, answer or serve completions."""
    text = workload_text(g.workload)
    order = schedule(cycles)
    sides = {"a": a, "b": b}
    rounds: dict[int, dict[str, list[bench.Round]]] = {c: {"a": [], "b": []} for c in g.levels}
    processes = 0
    with host.forward(a.port) as la, host.forward(b.port) as lb:
        a.url, b.url = f"http://127.0.0.1:{la}", f"http://127.0.0.1:{lb}"

        def round_on(server: Side, c: int, seed: int) -> bench.Round:
            prompts = bench.prompts_for(text, server.words, c, seed=seed)
            return asyncio.run(
                bench_client.run_level(
                    server.url, prompts, c, g.max_tokens, seed, server.kind, REQUEST_TIMEOUT_S, server.api_key
                )
            )

        for i, (cycle, name, k) in enumerate(order):
            side = sides[name]
            if i % len(ORDER) == 0:
                say(f"cycle {cycle + 1} of {cycles}: A B B A, each block on a fresh process")
            failed = fresh(side)
            processes += 1
            if failed:  # the start waits for /health: None means it answers
                return {"error": f"{side.name} on {host.name}:{side.port} did not come up: {failed}"}
            if not side.words:  # the same words on every process of a side: its tokenizer's count
                side.words, why = prompt_words(side.url, text, side.kind, g.prompt_tokens, side.api_key)
                if why:
                    return {"error": f"{side.name} on {host.name}:{side.port} does not serve completions: {why}"}
            top = max(g.levels)  # a warm-up round at the widest level, left out: every stream's slot used once
            round_on(side, top, 100_000 + top)
            for c in g.levels:
                for r in range(rounds_per_block(c)):
                    rounds[c][name].append(round_on(side, c, 1000 * c + 100 * cycle + 10 * k + r))
    levels = [_level(rounds[c], order, c) for c in g.levels]
    for lv in levels:
        p = paired_change([(b_["cycle"], b_["side"], b_["decode"]) for b_ in lv["blocks"]], comparisons=len(levels))
        lv["change"] = None if p is None else p.as_dict()
        lv["verdict"] = verdict_text(lv["concurrency"], p)
    return {
        "at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "design": {
            "order": "A B B A",
            "cycles": cycles,
            "block_requests": BLOCK_REQUESTS,
            "family": len(levels),
            "processes": processes,
            "margin": MARGIN,
        },
        "workload": {"prompt_tokens": g.prompt_tokens, "max_tokens": g.max_tokens, "kind": g.workload},
        "levels": levels,
    }
