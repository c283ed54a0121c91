"""The aggregate decode ceiling: N streams decoding together on one server.

One decode step of a batch of N streams reads the weights once for all of them (that is why
batching pays on a memory-bound card) and each stream's own KV cache (its tokens so far), and
yields one token per stream. So, over the same bandwidth as the single-stream roofline:

    step time = 1 / single-stream roofline  +  N x kv bytes per token x cached tokens / bandwidth
    aggregate = N / step time

With empty caches it is N times the single stream; with every slot's cache full, the KV reads
take over as N grows. A MoE model's streams are routed to different experts, so its weight
reads grow with N: counting them once (as here) is an upper bound there too. `invoke plan`
prints it at the recipe's slots (or --parallel's), and `invoke tune` orders its candidates for
the aggregate objective by it, so the two never disagree about what more slots can give.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from playbooks.plan.planner import Plan


def aggregate_tok_s(
    single_tok_s: float, bandwidth_gb_s: float, kv_bytes_per_token: float, streams: int, cached_tokens: int
) -> float:
    """The ceiling of ``streams`` streams' tokens per second together, each holding
    ``cached_tokens`` tokens of KV cache, over the single-stream roofline ``single_tok_s`` of
    the same card (``bandwidth_gb_s``, the bandwidth that roofline divides by)."""
    if streams < 1 or single_tok_s <= 0:
        raise ValueError(f"streams {streams} and a single-stream roofline {single_tok_s} must be positive")
    step = 1 / single_tok_s + streams * kv_bytes_per_token * max(cached_tokens, 0) / (bandwidth_gb_s * 1e9)
    return streams / step


def plan_aggregate(plan: Plan) -> dict[str, Any] | None:
    """The chosen quant's aggregate ceiling at the plan's slots (above), empty and
    full caches; None for one slot or no chosen quant."""
    c, s = plan.chosen, plan.serving
    if c is None or s.parallel < 2 or c.roofline_tok_s <= 0:
        return None
    bw = plan.gpu.bandwidth_gb_s
    return {
        "slots": s.parallel,
        "tok_s": round(aggregate_tok_s(c.roofline_tok_s, bw, c.kv_bytes_per_token, s.parallel, 0), 2),
        "full_ctx_tok_s": round(aggregate_tok_s(c.roofline_tok_s, bw, c.kv_bytes_per_token, s.parallel, s.context), 2),
    }
