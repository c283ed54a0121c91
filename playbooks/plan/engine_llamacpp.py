"""llama.cpp (llama-server) as the plan sees it: GGUF quants, its KV cache and compute buffer
replayed through ggml-alloc (plan/compute_buffer.py), a draft model beside the target,
layers split over local cards and RPC workers (plan/split.py), experts in host RAM
(--n-cpu-moe: plan/moe.py, plan/moe_offload.py), and the flash-attention cache pairs its CUDA
build compiles. The engine interface is plan/engine_base.py.

Where the rest of llama.cpp lives: its host half (steps/serve/engine_llamacpp.py: llama-server's
command line and units, the GGUF it loads, what of its load log is held to the plan), its build
(steps/build/build.py, llamacpp_source.py), its quantize (steps/weights/), its load log's reader
(facts/server_log.py).
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from typing import TYPE_CHECKING

from playbooks.plan.compute_buffer import device_input_bytes, replay, worst_case_graph
from playbooks.plan.engine_base import Engine, SplitPlan, split_devices
from playbooks.plan.gguf_size import FILE_TYPES, estimate_gguf, quant_refusal
from playbooks.plan.gpus import MIB
from playbooks.plan.kv_cache import LLAMACPP_CACHE_TYPES, llamacpp_kv_bytes, llamacpp_kv_bytes_per_token
from playbooks.plan.moe import expert_layout
from playbooks.plan.split import split_model

if TYPE_CHECKING:
    from playbooks.plan.engine_base import RecipeFields
    from playbooks.plan.gpus import Gpu
    from playbooks.plan.model_config import ModelShape
    from playbooks.plan.serving import DraftPlan, Serving
    from playbooks.plan.split import DeviceShare


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


def gguf_weight_bytes(shape: ModelShape, quant: str, s: Serving) -> tuple[int, int, int]:
    """(file bytes, bytes on the GPU, bytes streamed per token) of a GGUF quant. A MoE token
    streams its active experts only (the planner's MoE path splits this further by --n-cpu-moe)."""
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
    cache types there, steps/serve/engine_llamacpp.py); one output row per slot. The same -ub, -fa and slots, so
    its compute buffer is the same worst-case graph walked for the draft's shape."""
    weights = gguf_weight_bytes(draft.shape, draft.quant, s)[1]
    return (weights, *kv_and_compute(draft.shape, s, ctx, gpu))


def kv_and_compute(
    shape: ModelShape, s: Serving, ctx: int, gpu: Gpu, expert_copy: tuple[int, int, int] = (0, 0, 0)
) -> tuple[int, int]:
    """llama-server's (KV cache, compute buffer) bytes at ``ctx`` tokens per slot, the target's
    or a draft's (which runs with the target's -c, -ub, -fa, slots and cache types)."""
    tokens = ctx * s.parallel
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
    return kv, compute


#: ggml-backend's GGML_SCHED_MAX_COPIES at the pinned ref: with pipeline parallelism (more than
#: one device, every layer offloaded, all devices async: CUDA and RPC are) the scheduler keeps
#: this many copies of each split's inputs, so consecutive micro-batches overlap across devices
PIPELINE_COPIES = 4


def split_compute_bytes(shape: ModelShape, s: Serving, tokens: int, devices: int) -> int:
    """Each device's compute buffer in a split, an ESTIMATE: the single-device worst case, plus,
    under pipeline parallelism, the extra copies of the inputs a split copies in. One real load
    checks it (tests/test_rpc_split_real.py: two CPU-backed RPC devices, the first device's
    buffer 5% above this, the last one's below it); not checked on CUDA cards."""
    g = worst_case_graph(
        shape, tokens, s.n_ubatch, s.flash_attn, n_seq=s.parallel, cache_k=s.cache_k, cache_v=s.cache_v, device=True
    )
    copies = PIPELINE_COPIES if devices > 1 else 1
    return replay_cached(g) + (copies - 1) * device_input_bytes(g)


def plan_split(shape: ModelShape, quant: str, gpu: Gpu, s: Serving, ctx: int) -> tuple[DeviceShare, ...]:
    """Every device's share at `ctx` tokens per slot (llama-server -c = ctx x slots)."""
    tokens = ctx * s.parallel
    compute = split_compute_bytes(shape, s, tokens, s.device_count(gpu))
    return split_model(
        shape,
        quant,
        split_devices(gpu, s),
        s.split_weights(gpu),
        n_ctx=tokens,
        cache_k=s.cache_k,
        cache_v=s.cache_v,
        n_ubatch=s.n_ubatch,
        compute_bytes=compute,
        imatrix=s.imatrix,
    )


#: K/V cache type pairs a default CUDA build of the pinned llama.cpp compiles flash-attention
#: kernels for (ggml/CMakeLists.txt GGML_CUDA_FA_QUANTS "q4_0-q4_0;q8_0-q8_0;f16-f16;bf16-bf16";
#: fattn.cu takes an f32 side as f16); other pairs are converted to f16 with a warning (fattn.cu)
FA_COMPILED_PAIRS = frozenset({("f16", "f16"), ("q8_0", "q8_0"), ("q4_0", "q4_0"), ("bf16", "bf16")})


def fa_pair_compiled(cache_k: str, cache_v: str) -> bool:
    def as_f16(t: str) -> str:
        return "f16" if t == "f32" else t

    return (as_f16(cache_k), as_f16(cache_v)) in FA_COMPILED_PAIRS


#: the cache types a CUDA build of llama.cpp takes from ExLlamaV2's cache modes (plan --quant
#: of a GGUF type for an EXL2 recipe)
FROM_EXL2_CACHE = {"FP16": ("f16", "f16"), "Q8": ("q8_0", "q8_0"), "Q6": ("q8_0", "q4_0"), "Q4": ("q4_0", "q4_0")}


class LlamaCpp(Engine):
    name = "llamacpp"
    label = "llama.cpp"
    weights_format = "GGUF"
    server = "llama-server"
    server_label = "llama-server"
    # every unit runs it with --metrics; a router answers /metrics?model= for a loaded model only
    metrics_path = "/metrics"
    serves_llamacpp_build = True
    # llama-server without a model is a router (tools/server/README.md, "Using multiple models")
    routes_models = True
    # measured: llama-server 0c1e570, CPU build, as a router with an empty --models-dir, 4 s after
    # its start: VmRSS 14,488 kB (2,748 kB anonymous, 11,740 kB its mapped libraries), rounded up;
    # a child's resident memory beyond its weights, KV cache and compute buffers is of that size
    # (12-14 MB over three generated models, measured when the router was first served; each
    # child held within its plan: tests/test_set_edge_real.py)
    process_cpu_bytes = 16 * MIB
    ignore_eos = (("ignore_eos", True),)  # llama-server's own extension
    takes_draft = True
    takes_rpc = True
    offloads_experts = True

    def owns_quant(self, quant: str) -> bool:
        return not quant.startswith("EXL2-")

    def quant_names(self) -> list[str]:
        return list(FILE_TYPES)

    def parse_quant(self, text: str) -> str | None:
        """GGUF names are upper case; anything another engine does not claim is llama.cpp's to
        know or refuse (:meth:`known_quant`)."""
        return text.upper()

    def quant_refusal(self, shape: ModelShape, quant: str) -> str:
        return quant_refusal(shape, quant) or ""

    def recipe_refusal(self, recipe: RecipeFields) -> str:
        quant, cache = recipe.quant, recipe.cache
        if not isinstance(quant, str):
            return (
                f"quant: {{bpw: {getattr(quant, 'bpw', quant):g}}} is an EXL2 quant (backend exllamav2); "
                f"backend llamacpp needs a GGUF type: {', '.join(FILE_TYPES)}"
            )
        if quant not in FILE_TYPES:
            return f"quant: unknown GGUF quant {quant!r} for backend llamacpp; allowed: {', '.join(FILE_TYPES)}"
        for side in ("k", "v"):
            if getattr(cache, side) not in LLAMACPP_CACHE_TYPES:
                return (
                    f"cache.{side}: {getattr(cache, side)!r} is not a llama.cpp cache type; "
                    f"allowed: {', '.join(LLAMACPP_CACHE_TYPES)}"
                )
        if cache.v not in ("f16", "bf16", "f32") and not recipe.flash_attn:
            return "cache.v: a quantized V cache needs flash_attn: true in llama.cpp"
        if recipe.spec_type == "draft-simple" and recipe.draft is None:
            return "spec_type: draft-simple needs a draft model (draft: {model: ..., quant: ...})"
        if recipe.draft is not None and recipe.spec_type not in (None, "draft-simple"):
            # the server would load the draft's weights and cache and never draft with them
            return (
                f"draft: a draft model is used by spec_type draft-simple, not {recipe.spec_type} "
                "(remove draft:, or spec_type:)"
            )
        return ""

    def weight_bytes(self, shape: ModelShape, quant: str, s: Serving) -> tuple[int, int, int]:
        return gguf_weight_bytes(shape, quant, s)

    def kv_bytes_per_token(self, shape: ModelShape, s: Serving) -> int:
        return llamacpp_kv_bytes_per_token(shape, s.cache_k, s.cache_v)

    def kv_and_compute(
        self, shape: ModelShape, s: Serving, ctx: int, gpu: Gpu, expert_copy: tuple[int, int, int] = (0, 0, 0)
    ) -> tuple[int, int]:
        return kv_and_compute(shape, s, ctx, gpu, expert_copy)

    def draft_vram(self, draft: DraftPlan, s: Serving, ctx: int, gpu: Gpu) -> tuple[int, int, int]:
        return draft_vram(draft, s, ctx, gpu)

    def plan_split(self, shape: ModelShape, quant: str, gpu: Gpu, s: Serving, ctx: int) -> SplitPlan:
        return SplitPlan(plan_split(shape, quant, gpu, s, ctx))

    def serving(self, s: Serving) -> Serving:
        k, v = FROM_EXL2_CACHE[s.cache_k]
        # `flash_attn: false` in an EXL2 recipe is about the flash-attn library (no sm_70 build);
        # llama.cpp's own FA kernels run on sm_70 and a quantized V cache needs them
        return replace(s, backend=self.name, cache_k=k, cache_v=v, flash_attn=s.flash_attn or v != "f16")

    takes_cache_flags = True

    def wrong_quant(self, recipe: str, quant: str) -> str:
        return (
            f"--quant {quant}: {recipe} is a llama.cpp recipe; give a GGUF type (Q4_K_M), or plan an ExLlamaV2 recipe"
        )

    def serving_notes(self, s: Serving, gpu: Gpu) -> list[str]:
        if not s.flash_attn or gpu.is_cpu or fa_pair_compiled(s.cache_k, s.cache_v):
            return []
        return [
            f"cache K={s.cache_k} V={s.cache_v}: a default CUDA build of llama.cpp 0c1e570 compiles "
            "flash attention for the K/V pairs f16/f16, q8_0/q8_0, q4_0/q4_0 and bf16/bf16 only "
            "(GGML_CUDA_FA_QUANTS); other pairs run slower (K and V converted to f16 on every step)"
        ]


LLAMACPP = LlamaCpp()
