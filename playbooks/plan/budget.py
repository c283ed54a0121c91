"""One device's memory budget at a context: weights + KV cache + compute buffers + CUDA
context + a margin (docs/knowledge.md, section 1), and the largest context that fits it.

Each part is the engine's own arithmetic (plan/engine_*.py: llama.cpp's compute buffer replayed
through its allocator, ExLlamaV2's working memory from its source, the KV cache of either); a
draft model beside the target counts its own three where the engine serves one. Units: bytes.
"""

from __future__ import annotations

from collections.abc import Callable

from playbooks.plan.engines import engine, engine_of_quant
from playbooks.plan.gpus import MIB, Gpu
from playbooks.plan.model_config import ModelShape
from playbooks.plan.serving import DraftPlan, Serving

CTX_STEP = 256  # llama.cpp pads its KV cache to 256 cells; contexts are planned in these steps


def kv_per_token(shape: ModelShape, s: Serving) -> int:
    return engine(s.backend).kv_bytes_per_token(shape, s)


def weight_bytes(shape: ModelShape, quant: str, s: Serving) -> tuple[int, int, int]:
    """(file bytes, bytes on the GPU, bytes streamed per token), the quant's engine's. A MoE
    token streams its active experts only (for GGUF the planner's MoE path splits this further
    by --n-cpu-moe)."""
    return engine_of_quant(quant).weight_bytes(shape, quant, s)


def vram_at(
    shape: ModelShape,
    s: Serving,
    ctx: int,
    gpu: Gpu,
    draft: DraftPlan | None,
    expert_copy: tuple[int, int, int] = (0, 0, 0),
) -> tuple[int, int, int, int]:
    """(KV, compute, CUDA context + margin, draft model) bytes at `ctx` tokens per slot.
    `expert_copy`: see llamacpp_compute_buffer_bytes (--n-cpu-moe). A draft counts where the
    engine serves one: an ExLlamaV2 serving counts none (evaluate marks such an option unfit)."""
    e = engine(s.backend)
    kv, compute = e.kv_and_compute(shape, s, ctx, gpu, expert_copy)
    draft_b = sum(e.draft_vram(draft, s, ctx, gpu)) if draft is not None else 0
    overhead = (0 if gpu.is_cpu else s.cuda_context_mib * MIB) + s.margin_mib * MIB
    return kv, compute, overhead, draft_b


def draft_parts(draft: DraftPlan | None, s: Serving, gpu: Gpu) -> tuple[int, int]:
    """A draft's (KV cache, compute buffer) at the serving's context, for Option's fields."""
    if draft is None:
        return 0, 0
    _, kv, compute = engine(s.backend).draft_vram(draft, s, s.context, gpu)
    return kv, compute


def max_ctx(
    shape: ModelShape,
    s: Serving,
    gpu_w: int,
    gpu: Gpu,
    draft: DraftPlan | None,
    expert_copy: tuple[int, int, int] = (0, 0, 0),
) -> int:
    """Largest per-slot context (a multiple of CTX_STEP, at most the model's maximum) that fits."""

    def fits(ctx: int) -> bool:
        return gpu_w + sum(vram_at(shape, s, ctx, gpu, draft, expert_copy)) <= gpu.memory_bytes

    return largest_ctx(shape, fits)


def largest_ctx(shape: ModelShape, fits: Callable[[int], bool]) -> int:
    """The largest per-slot context, a multiple of CTX_STEP up to the model's maximum, for which
    `fits` holds (0: not even CTX_STEP). Memory grows with context, so bisection finds it."""
    lo, hi = 0, shape.max_position_embeddings // CTX_STEP
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid * CTX_STEP):
            lo = mid
        else:
            hi = mid - 1
    return lo * CTX_STEP
