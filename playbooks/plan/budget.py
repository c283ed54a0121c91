"""One device's memory budget at a context: weights + KV cache + compute buffers + CUDA
context + a margin (docs/knowledge.md, section 1), and the largest context that fits it.

Each part is the backend's own arithmetic: llama.cpp's compute buffer replayed through its
allocator (compute_buffer.py), ExLlamaV2's working memory from its source (exl2_size.py), the
KV cache of either (kv_cache.py). A draft model beside a llama.cpp target counts its own three.
Units: bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

from playbooks.plan.compute_buffer import replay, worst_case_graph
from playbooks.plan.exl2_size import (
    EXL2_MAX_INPUT_LEN,
    estimate_exl2,
    exl2_attention_bytes,
    exl2_chunk_bytes,
    exl2_scratch_bytes,
)
from playbooks.plan.gguf_size import estimate_gguf
from playbooks.plan.gpus import MIB, Gpu
from playbooks.plan.kv_cache import (
    exl2_cache_scratch_bytes,
    exl2_kv_bytes_per_token,
    llamacpp_kv_bytes,
    llamacpp_kv_bytes_per_token,
)
from playbooks.plan.model_config import ModelShape
from playbooks.plan.moe import (
    expert_layout,
)
from playbooks.plan.serving import DraftPlan, Serving
from playbooks.plan.tensors import model_tensors

CTX_STEP = 256  # llama.cpp pads its KV cache to 256 cells; contexts are planned in these steps


def llamacpp_compute_buffer_bytes(
    shape: ModelShape,
    n_ctx: int,
    n_ubatch: int,
    flash_attn: bool,
    *,
    n_seq: int = 1,
    cache_k: str = "f16",
    cache_v: str = "f16",
    device: bool = True,
    n_outputs: int | None = None,
    expert_copy: tuple[int, int, int] = (0, 0, 0),
) -> int:
    """llama.cpp's compute buffer at the pinned ref (0c1e570), as ggml-alloc reserves it.

    Not a fit: compute_buffer.replay() walks the worst-case graph llama_context reserves
    (n_ubatch tokens against every KV cell) with ggml-alloc's own placement rules, holes
    included. `n_ctx` is llama-server's -c (all slots), `n_seq` its --parallel (one KV stream
    per slot, one logits row per slot). `device`: the CUDA0 buffer of a full offload (inputs
    and token embeddings stay in host memory); False: the CPU buffer of a CPU-only run.
    `n_outputs`: logits rows reserved, llama-server's slot count unless given (llama-cli,
    llama-bench and ollama reserve n_ubatch rows).

    Exact for the graphs voltaforge plans (llama, mistral, qwen2, qwen3, gemma2, gemma3) at
    the pinned ref: tests/test_compute_buffer.py checks it byte for byte against real loads of
    the pinned build, CPU-only and with a device split. CUDA's 128-byte alignment and its F16
    copies of a quantized K/V for flash attention come from its source (no GPU here).

    Mixture-of-experts graphs (qwen3moe, qwen2moe, Mixtral, gpt-oss): the same allocator walks
    build_moe_ffn's tensors as transcribed from its source (router logits and argsort
    n_expert x n_ubatch, up/gate/GLU n_ff_exp x n_expert_used x n_ubatch, down
    n_embd x n_expert_used x n_ubatch); CPU-only loads of the pinned build agree to the printed
    0.01 MiB (27 of 28; one is 32 bytes over). A device split of a MoE is the split's estimate
    (split_compute_bytes), checked on one load over two RPC devices (tests/test_split.py).
    `expert_copy` is an ESTIMATE from the source: with --n-cpu-moe, the up/gate/down weight of
    an offloaded layer is copied into the device buffer for a prefill-sized batch (moe.py),
    which adds at most the largest such tensor.
    """
    return replay_cached(
        worst_case_graph(
            shape,
            n_ctx,
            n_ubatch,
            flash_attn,
            n_seq=n_seq,
            cache_k=cache_k,
            cache_v=cache_v,
            device=device,
            n_outputs=n_outputs,
            expert_copy=expert_copy,
        )
    )


# The planner replays the same graph for many candidate contexts and --n-cpu-moe values, and
# sizes the same quant for each of them.
replay_cached = lru_cache(maxsize=4096)(replay)
gguf_cached = lru_cache(maxsize=256)(estimate_gguf)


def exl2_compute_bytes(
    shape: ModelShape, max_seq_len: int, max_input_len: int = EXL2_MAX_INPUT_LEN, batch: int = 1
) -> int:
    """ExLlamaV2's own memory besides weights and cache (exllamav2 0.3.2 source):
    RoPE sin/cos tables for max_seq_len (device.py prepare_sincos), the hidden state and
    attention mask of one input chunk (model.py set_device_map's state_size and mask_size),
    the scratch allocated at load (exl2_scratch_bytes: for most models the head's 1 GiB
    dequant buffer), attention's per-forward working set without flash-attn
    (exl2_attention_bytes) and the last token's logits in FP32 (generator/base.py .float())."""
    chunk = exl2_chunk_bytes(shape, max_seq_len, max_input_len, batch)
    scratch = exl2_scratch_bytes(shape, max_input_len, batch)
    attention = exl2_attention_bytes(shape, max_seq_len, max_input_len, batch)
    logits = shape.vocab_size * 4 * batch
    return chunk + scratch + attention + logits


def kv_per_token(shape: ModelShape, s: Serving) -> int:
    if s.backend == "exllamav2":
        # ExLlamaV2 has one cache mode for K and V together
        return exl2_kv_bytes_per_token(shape, s.cache_k)
    return llamacpp_kv_bytes_per_token(shape, s.cache_k, s.cache_v)


def weight_bytes(shape: ModelShape, quant: str, s: Serving) -> tuple[int, int, int]:
    """(file bytes, bytes on the GPU, bytes streamed per token). A MoE token streams its active
    experts only (for GGUF the planner's MoE path splits this further by --n-cpu-moe)."""
    if quant.startswith("EXL2-"):
        bpw = float(quant[5:])
        e = estimate_exl2(shape, bpw, s.head_bits)
        streamed = e.streamed_bytes_per_token
        if shape.is_moe:
            # EXL2 quantizes each expert's matrices at the same target rate as the rest
            expert = sum(t.n_elements for t in model_tensors(shape) if t.experts and len(t.ne) == 3)
            streamed -= int(expert * bpw / 8 * (1 - shape.active_expert_fraction))
        return e.file_bytes, e.gpu_weight_bytes, streamed
    g = estimate_gguf(shape, quant, imatrix=s.imatrix)
    if shape.is_moe:
        lay = expert_layout(shape, quant, s.imatrix)
        return g.file_bytes, g.gpu_weight_bytes, sum(lay.per_token(0))
    return g.file_bytes, g.gpu_weight_bytes, g.streamed_bytes_per_token


def draft_vram(draft: DraftPlan, s: Serving, ctx: int, gpu: Gpu) -> tuple[int, int, int]:
    """(weights on the GPU, KV cache, compute buffer) of a draft model beside a llama.cpp target
    at `ctx` tokens per slot.

    At the pinned ref (common/speculative.cpp, common_base_params_to_speculative and
    common_speculative_init_result) llama-server gives the draft its own context with the
    target's parameters except: n_ctx = llama_n_ctx(ctx_tgt), the target's whole context (all
    slots); the KV cache types of -ctkd/-ctvd (f16 unless given: voltaforge renders the recipe's
    cache types there, steps/serve/units.py); one output row per slot. The same -ub, -fa and slots, so
    its compute buffer is the same worst-case graph walked for the draft's shape."""
    tokens = ctx * s.parallel
    weights = weight_bytes(draft.shape, draft.quant, s)[1]
    kv = llamacpp_kv_bytes(draft.shape, tokens, s.cache_k, s.cache_v, s.n_ubatch)
    compute = llamacpp_compute_buffer_bytes(
        draft.shape,
        tokens,
        s.n_ubatch,
        s.flash_attn,
        n_seq=s.parallel,
        cache_k=s.cache_k,
        cache_v=s.cache_v,
        device=not gpu.is_cpu,
    )
    return weights, kv, compute


def vram_at(
    shape: ModelShape,
    s: Serving,
    ctx: int,
    gpu: Gpu,
    draft: DraftPlan | None,
    expert_copy: tuple[int, int, int] = (0, 0, 0),
) -> tuple[int, int, int, int]:
    """(KV, compute, CUDA context + margin, draft model) bytes at `ctx` tokens per slot.
    `expert_copy`: see llamacpp_compute_buffer_bytes (--n-cpu-moe). A draft is llama-server's:
    an ExLlamaV2 serving counts none (evaluate marks such an option unfit instead)."""
    tokens = ctx * s.parallel
    if s.backend == "exllamav2":
        kv = kv_per_token(shape, s) * tokens  # ExLlamaV2 caches every layer for max_seq_len x batch
        compute = exl2_compute_bytes(shape, ctx, batch=s.parallel) + exl2_cache_scratch_bytes(shape, s.cache_k, tokens)
    else:
        # llama-server -c = context x slots, padded to 256; Gemma's SWA layers hold a window
        kv = llamacpp_kv_bytes(shape, tokens, s.cache_k, s.cache_v, s.n_ubatch)
        # llama-server: one KV stream and one logits row per slot; CUDA0 holds copies of the inputs
        compute = llamacpp_compute_buffer_bytes(
            shape,
            tokens,
            s.n_ubatch,
            s.flash_attn,
            n_seq=s.parallel,
            cache_k=s.cache_k,
            cache_v=s.cache_v,
            device=not gpu.is_cpu,
            expert_copy=expert_copy,
        )
    draft_b = sum(draft_vram(draft, s, ctx, gpu)) if draft is not None and s.backend == "llamacpp" else 0
    overhead = (0 if gpu.is_cpu else s.cuda_context_mib * MIB) + s.margin_mib * MIB
    return kv, compute, overhead, draft_b


def draft_parts(draft: DraftPlan | None, s: Serving, gpu: Gpu) -> tuple[int, int]:
    """A draft's (KV cache, compute buffer) at the serving's context, for Option's fields."""
    if draft is None or s.backend != "llamacpp":
        return 0, 0
    _, kv, compute = draft_vram(draft, s, s.context, gpu)
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
