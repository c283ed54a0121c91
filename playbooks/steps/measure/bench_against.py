"""`invoke bench --against`: the deployed server (A) and another configuration (B, served on the
scratch port beside it) measured in one run, their rounds interleaved A B B A, and the change
judged from the pairs (steps/measure/paired.py says why and how).

The workload is A's gate's (levels, prompt and completion sizes, its text), the same requests
for both sides (each side's prompts sized by its own tokenizer's count, cut at the same seeded
offsets). A block is whole rounds (a round: one request per stream, all at once) of at least
paired.BLOCK_REQUESTS requests. Each level starts with a
warm-up round on each side, left out.
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
from playbooks.steps.measure.bench_run import REQUEST_TIMEOUT_S, bench_health, prompt_words, workload_text
from playbooks.steps.measure.paired import (
    BLOCK_REQUESTS,
    CYCLES,
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


def _source(a: list[bench.Round], b: list[bench.Round]) -> str:
    """Whose rates both sides are judged by: the client's where it could time both sides'
    tokens, else the servers' own (both must report one; TabbyAPI does not: then each side its
    own judged source, which the result says)."""
    sa = bench.judged_values([s for got, _ in a for s in got])[1]
    sb = bench.judged_values([s for got, _ in b for s in got])[1]
    if sa == sb:
        return sa
    has = all("predicted_per_second" in s.timings for got, _ in a + b for s in got if s.error is None)
    return "server" if has else "mixed"


def _level(a: Side, b: Side, text: bench.Corpus, c: int, g: Gate, cycles: int) -> dict[str, Any]:
    """One level: a warm-up round per side, then the interleaved blocks."""
    sides = {"a": a, "b": b}

    def round_on(server: Side, seed: int) -> bench.Round:
        prompts = bench.prompts_for(text, server.words, c, seed=seed)
        return asyncio.run(
            bench_client.run_level(
                server.url, prompts, c, g.max_tokens, seed, server.kind, REQUEST_TIMEOUT_S, server.api_key
            )
        )

    for server in sides.values():
        round_on(server, 100_000 + c)
    order = schedule(cycles)
    per_block = rounds_per_block(c)
    rounds: dict[str, list[bench.Round]] = {"a": [], "b": []}
    for cycle, side, k in order:
        for r in range(per_block):
            rounds[side].append(round_on(sides[side], 1000 * c + 100 * cycle + 10 * k + r))
    source = _source(rounds["a"], rounds["b"])
    per_side = {
        s: bench.round_observations(rounds[s], bench.judged_values([x for got, _ in rounds[s] for x in got])[1])
        if source == "mixed"
        else bench.round_observations(rounds[s], source)
        for s in ("a", "b")
    }
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
    cycles: int = CYCLES,
    say: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Every level of ``g`` interleaved between the two servers on ``host``'s loopback; per level
    the blocks, each side's means and the change of B against A (:func:`paired.paired_change`,
    at 5% over the levels). ``{"error": ...}`` when either does not answer or serve completions."""
    for side in (a, b):
        if bench_health(host, side.port) == 0:
            return {"error": f"{side.name} on {host.name}:{side.port} does not answer: nothing listens there"}
    text = workload_text(g.workload)
    levels = []
    with host.forward(a.port) as la, host.forward(b.port) as lb:
        a.url, b.url = f"http://127.0.0.1:{la}", f"http://127.0.0.1:{lb}"
        for side in (a, b):
            side.words, why = prompt_words(side.url, text, side.kind, g.prompt_tokens, side.api_key)
            if why:
                return {"error": f"{side.name} on {host.name}:{side.port} does not serve completions: {why}"}
        for c in g.levels:
            say(f"concurrency {c}: {cycles} cycles of A B B A")
            levels.append(_level(a, b, text, c, g, cycles))
    for lv in levels:
        p = paired_change([(b_["cycle"], b_["side"], b_["decode"]) for b_ in lv["blocks"]], comparisons=len(levels))
        lv["change"] = None if p is None else p.as_dict()
        lv["verdict"] = verdict_text(lv["concurrency"], p)
    return {
        "at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "design": {"order": "A B B A", "cycles": cycles, "block_requests": BLOCK_REQUESTS, "family": len(levels)},
        "workload": {"prompt_tokens": g.prompt_tokens, "max_tokens": g.max_tokens, "kind": g.workload},
        "levels": levels,
    }
