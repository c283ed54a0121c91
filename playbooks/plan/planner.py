"""The physical ceiling, computed before anything is installed (docs/docs/knowledge.md, section 1).

Pure functions: model shape + GPU + serving settings in, bytes and tokens per second out.

VRAM budget = weights on the GPU + KV cache + compute buffers + CUDA context + a margin.
Decode at small batch is bandwidth bound: tok/s <= bandwidth / bytes read per token.

Units: bytes everywhere inside; GiB (2^30) and GB (1e9) are labelled wherever shown.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from playbooks.plan.compute_buffer import replay, worst_case_graph
from playbooks.plan.exl2_size import (
    EXL2_BPW_LADDER,
    EXL2_MAX_INPUT_LEN,
    estimate_exl2,
    exl2_attention_bytes,
    exl2_quant_name,
    exl2_scratch_bytes,
)
from playbooks.plan.gguf_size import FILE_TYPES, estimate_gguf
from playbooks.plan.gpus import MIB, Gpu
from playbooks.plan.kv_cache import (
    exl2_cache_scratch_bytes,
    exl2_kv_bytes_per_token,
    llamacpp_kv_bytes,
    llamacpp_kv_bytes_per_token,
)
from playbooks.plan.model_config import ModelShape
from playbooks.plan.tensors import parameter_count

CTX_STEP = 256  # llama.cpp pads its KV cache to 256 cells; contexts are planned in these steps


def roofline_tok_s(bandwidth_gb_s: float, bytes_per_token: float) -> float:
    """Upper bound on single-stream decode speed: every weight byte is read once per token."""
    return bandwidth_gb_s * 1e9 / bytes_per_token


def mbu(tok_s: float, bytes_per_token: float, bandwidth_gb_s: float) -> float:
    """Memory bandwidth utilisation: the fraction of peak bandwidth a measured speed uses."""
    return tok_s * bytes_per_token / (bandwidth_gb_s * 1e9)


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
    """
    return replay(
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
        )
    )


def exl2_compute_bytes(
    shape: ModelShape, max_seq_len: int, max_input_len: int = EXL2_MAX_INPUT_LEN, batch: int = 1
) -> int:
    """ExLlamaV2's own memory besides weights and cache (exllamav2 0.3.2 source):
    RoPE sin/cos tables for max_seq_len (device.py prepare_sincos), the hidden state and
    attention mask of one input chunk (model.py set_device_map's state_size and mask_size),
    the scratch allocated at load (exl2_scratch_bytes: for most models the head's 1 GiB
    dequant buffer), attention's per-forward working set without flash-attn
    (exl2_attention_bytes) and the last token's logits in FP32 (generator/base.py .float())."""
    rope = shape.head_dim * max_seq_len * 2 * 2
    state = shape.hidden_size * max_input_len * batch * 2
    mask = max_input_len**2 * batch * 2
    scratch = exl2_scratch_bytes(shape, max_input_len, batch)
    attention = exl2_attention_bytes(shape, max_seq_len, max_input_len, batch)
    logits = shape.vocab_size * 4 * batch
    return rope + state + mask + scratch + attention + logits


@dataclass(frozen=True)
class Serving:
    """How the model is served: what the budget depends on besides the weights."""

    backend: str = "llamacpp"  # llamacpp | exllamav2
    context: int = 4096  # tokens per slot (per request)
    parallel: int = 1  # slots served at once
    cache_k: str = "f16"  # llama.cpp: f16|q8_0|q4_0...; exllamav2: FP16|Q8|Q6|Q4
    cache_v: str = "f16"
    flash_attn: bool = True
    n_ubatch: int = 512
    cuda_context_mib: int = 400  # CUDA context + cuBLAS workspace: 0.3-0.5 GiB on V100
    margin_mib: int = 256
    imatrix: bool = True
    head_bits: int = 6  # EXL2 lm_head bits (convert.py -hb)


@dataclass(frozen=True)
class Option:
    """One quantization evaluated against one GPU at one serving setting."""

    quant: str  # "Q4_K_M" or "EXL2-3.3"
    backend: str
    weights_bytes: int  # predicted file size on disk
    params: int
    gpu_weights_bytes: int  # what the backend puts in VRAM
    streamed_bytes: int  # weight bytes read per decoded token
    kv_bytes_per_token: int
    kv_bytes: int
    compute_bytes: int
    overhead_bytes: int  # CUDA context + margin (+ draft model, when planned)
    vram_bytes: int
    gpu_bytes: int
    max_ctx: int  # largest per-slot context that fits (0: not even CTX_STEP)
    roofline_tok_s: float
    roofline_full_ctx_tok_s: float
    draft_bytes: int = 0
    # why it cannot run on this target whatever the memory says ("": nothing but memory counts)
    unfit_reason: str = ""

    @property
    def fits(self) -> bool:
        return not self.unfit_reason and self.vram_bytes <= self.gpu_bytes

    @property
    def headroom_bytes(self) -> int:
        return self.gpu_bytes - self.vram_bytes

    @property
    def bpw(self) -> float:
        """Bits per weight of the quant, the quality measure the floor applies to: GGUF's whole
        file over all parameters; EXL2's target rate (its FP16 embedding table stays in host
        memory and would otherwise inflate the rate)."""
        if self.quant.startswith("EXL2-"):
            return float(self.quant[5:])
        return self.weights_bytes * 8 / self.params


@dataclass(frozen=True)
class DraftPlan:
    shape: ModelShape
    quant: str


def _kv_per_token(shape: ModelShape, s: Serving) -> int:
    if s.backend == "exllamav2":
        # ExLlamaV2 has one cache mode for K and V together
        return exl2_kv_bytes_per_token(shape, s.cache_k)
    return llamacpp_kv_bytes_per_token(shape, s.cache_k, s.cache_v)


def _weights(shape: ModelShape, quant: str, s: Serving) -> tuple[int, int, int]:
    """(file bytes, bytes on the GPU, bytes streamed per token)."""
    if quant.startswith("EXL2-"):
        e = estimate_exl2(shape, float(quant[5:]), s.head_bits)
        return e.file_bytes, e.gpu_weight_bytes, e.streamed_bytes_per_token
    g = estimate_gguf(shape, quant, imatrix=s.imatrix)
    return g.file_bytes, g.gpu_weight_bytes, g.streamed_bytes_per_token


def _vram_at(shape: ModelShape, s: Serving, ctx: int, gpu: Gpu, draft: DraftPlan | None) -> tuple[int, int, int, int]:
    """(KV, compute, CUDA context + margin, draft model) bytes at `ctx` tokens per slot."""
    tokens = ctx * s.parallel
    if s.backend == "exllamav2":
        kv = _kv_per_token(shape, s) * tokens  # ExLlamaV2 caches every layer for max_seq_len x batch
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
        )
    draft_b = 0
    if draft is not None:
        # the draft model sits beside the target with its own KV cache for the same context
        draft_b = _weights(draft.shape, draft.quant, s)[1] + llamacpp_kv_bytes(
            draft.shape, tokens, s.cache_k, s.cache_v, s.n_ubatch
        )
    overhead = (0 if gpu.is_cpu else s.cuda_context_mib * MIB) + s.margin_mib * MIB
    return kv, compute, overhead, draft_b


#: Why an EXL2 quant never runs on a CPU target. ExLlamaV2 0.3.2 has no CPU path: every layer
#: runs through its C++/CUDA extension (exllamav2/ext.py builds it from cuda/*.cu), its model
#: places modules on "cuda:N" (model.py _torch_device) and warns at import when torch has
#: neither CUDA nor ROCm (model.py, line 22); its converter measures on the GPU too.
EXL2_NEEDS_CUDA = "needs a CUDA GPU"


def unfit_reason(backend: str, gpu: Gpu) -> str:
    """Why this backend cannot run on this target at all, memory aside ("": it can)."""
    if backend == "exllamav2" and gpu.is_cpu:
        return EXL2_NEEDS_CUDA
    return ""


def evaluate(shape: ModelShape, quant: str, gpu: Gpu, s: Serving, draft: DraftPlan | None = None) -> Option:
    file_b, gpu_w, streamed = _weights(shape, quant, s)
    kv_tok = _kv_per_token(shape, s)
    kv, compute, overhead, draft_b = _vram_at(shape, s, s.context, gpu, draft)
    backend = "exllamav2" if quant.startswith("EXL2-") else "llamacpp"
    unfit = unfit_reason(backend, gpu)
    return Option(
        quant=quant,
        backend=backend,
        weights_bytes=file_b,
        params=parameter_count(shape),
        gpu_weights_bytes=gpu_w,
        streamed_bytes=streamed,
        kv_bytes_per_token=kv_tok,
        kv_bytes=kv,
        compute_bytes=compute,
        overhead_bytes=overhead + draft_b,
        vram_bytes=gpu_w + kv + compute + overhead + draft_b,
        gpu_bytes=gpu.memory_bytes,
        max_ctx=0 if unfit else _max_ctx(shape, s, gpu_w, gpu, draft),
        roofline_tok_s=roofline_tok_s(gpu.bandwidth_gb_s, streamed),
        # one slot reading its full context of KV on every token
        roofline_full_ctx_tok_s=roofline_tok_s(gpu.bandwidth_gb_s, streamed + kv_tok * s.context),
        draft_bytes=draft_b,
        unfit_reason=unfit,
    )


def _max_ctx(shape: ModelShape, s: Serving, gpu_w: int, gpu: Gpu, draft: DraftPlan | None) -> int:
    """Largest per-slot context (a multiple of CTX_STEP, at most the model's maximum) that fits."""

    def fits(ctx: int) -> bool:
        return gpu_w + sum(_vram_at(shape, s, ctx, gpu, draft)) <= gpu.memory_bytes

    lo, hi = 0, shape.max_position_embeddings // CTX_STEP
    while lo < hi:  # VRAM grows with context, so the last fitting step is found by bisection
        mid = (lo + hi + 1) // 2
        if fits(mid * CTX_STEP):
            lo = mid
        else:
            hi = mid - 1
    return lo * CTX_STEP


def quant_names(backend: str | None = None) -> list[str]:
    gguf = [q for q in FILE_TYPES]
    exl2 = [exl2_quant_name(b) for b in EXL2_BPW_LADDER]
    if backend == "llamacpp":
        return gguf
    if backend == "exllamav2":
        return exl2
    return gguf + exl2


def serving_for(quant: str, s: Serving) -> Serving:
    """The same serving settings, with the cache type translated for the quant's backend."""
    backend = "exllamav2" if quant.startswith("EXL2-") else "llamacpp"
    if backend == s.backend:
        return s
    to_exl2 = {
        "f16": "FP16",
        "bf16": "FP16",
        "f32": "FP16",
        "q8_0": "Q8",
        "q5_1": "Q6",
        "q5_0": "Q6",
        "q4_1": "Q4",
        "q4_0": "Q4",
        "iq4_nl": "Q4",
    }
    to_llama = {"FP16": ("f16", "f16"), "Q8": ("q8_0", "q8_0"), "Q6": ("q8_0", "q4_0"), "Q4": ("q4_0", "q4_0")}
    if backend == "exllamav2":
        mode = to_exl2[s.cache_k]
        return replace(s, backend=backend, cache_k=mode, cache_v=mode)
    k, v = to_llama[s.cache_k]
    # `flash_attn: false` in an EXL2 recipe is about the flash-attn library (no sm_70 build);
    # llama.cpp's own FA kernels run on sm_70 and a quantized V cache needs them
    return replace(s, backend=backend, cache_k=k, cache_v=v, flash_attn=s.flash_attn or v != "f16")


@dataclass
class Plan:
    shape: ModelShape
    gpu: Gpu
    serving: Serving
    chosen: Option | None
    options: list[Option]
    min_bpw: float
    recommendation: Option | None = None
    best_quality: Option | None = None
    reason: str = ""
    notes: list[str] = field(default_factory=list)


def make_plan(
    shape: ModelShape,
    gpu: Gpu,
    serving: Serving,
    quant: str | None = None,
    draft: DraftPlan | None = None,
    min_bpw: float = 3.0,
) -> Plan:
    """Evaluate every quant on this GPU and pick one.

    The recommendation is the fastest configuration (highest roofline) that fits the planned
    context and slots among quants of at least `min_bpw` bits per weight: below about 3 bpw
    14-32B models lose quality quickly, and the fastest quant overall would always be the
    smallest. `best_quality` is the largest quant that fits, for users who prefer quality.
    """
    options = [evaluate(shape, q, gpu, serving_for(q, serving), draft) for q in quant_names()]
    chosen = evaluate(shape, quant, gpu, serving, draft) if quant else None
    plan = Plan(shape, gpu, serving, chosen, options, min_bpw)
    fitting = [o for o in options if o.fits]  # an option that cannot run here does not fit
    if gpu.is_cpu:
        plan.notes.append(
            f"EXL2 is left out: ExLlamaV2 {EXL2_NEEDS_CUDA} (it has no CPU path); a CPU serves GGUF through llama.cpp"
        )
    elif serving.parallel > 1 and gpu.compute_capability < (8, 0):
        # ExLlamaV2's batching needs flash-attn >= 2.5.7 (Ampere+); TabbyAPI forces one
        # sequence at a time before Ampere, so it cannot serve parallel slots here.
        fitting = [o for o in fitting if o.backend != "exllamav2"]
        plan.notes.append(
            f"EXL2 is left out of the recommendation: {serving.parallel} slots need batching, "
            "which ExLlamaV2 cannot do before Ampere (no flash-attn for sm_70)"
        )
    good = [o for o in fitting if o.bpw >= min_bpw]
    if good:
        plan.recommendation = max(good, key=lambda o: o.roofline_tok_s)
        plan.best_quality = max(good, key=lambda o: o.bpw)
        r = plan.recommendation
        plan.reason = (
            f"{r.quant} ({r.backend}) is the fastest quant of at least {min_bpw:g} bits/weight that fits "
            f"{serving.context} tokens x {serving.parallel} slot(s) on {gpu.name}: "
            f"{r.headroom_bytes / MIB:,.0f} MiB left, roofline {r.roofline_tok_s:.0f} tok/s"
        )
    elif fitting:
        plan.best_quality = max(fitting, key=lambda o: o.bpw)
        plan.reason = (
            f"no quant of at least {min_bpw:g} bits/weight fits {serving.context} tokens x "
            f"{serving.parallel} slot(s) on {gpu.name}; the largest that fits is "
            f"{plan.best_quality.quant} ({plan.best_quality.bpw:.2f} bits/weight)"
        )
    else:
        plan.reason = (
            f"no quant fits {serving.context} tokens x {serving.parallel} slot(s) on {gpu.name}: "
            "use a smaller model, a shorter context, fewer slots or a larger GPU"
        )
    if gpu.is_cpu:
        plan.notes.append(
            "on a CPU, quantized decode is often compute-bound, not bandwidth-bound: the roofline is "
            "a loose ceiling here (docs/docs/knowledge.md section 8: Q4_K_M and Q8_0 on 2 cores)"
        )
    elif not gpu.bf16 and shape.torch_dtype == "bfloat16":
        plan.notes.append(f"{gpu.name} has no BF16: the BF16 weights are converted to FP16 before quantizing")
    return plan
