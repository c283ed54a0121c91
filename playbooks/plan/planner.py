"""The physical ceiling, computed before anything is installed (docs/knowledge.md, section 1).

Pure functions: model shape + GPU + serving settings in, bytes and tokens per second out.

VRAM budget = weights on the GPU + KV cache + compute buffers + CUDA context + a margin.
Decode at small batch is bandwidth bound: tok/s <= bandwidth / bytes read per token.

Mixture-of-experts models read only their active experts per token, and can keep the experts
of their first N layers in host RAM (llama-server --n-cpu-moe N): see playbooks/plan/moe.py for
what moves and the two-sided roofline, and make_plan for how N is chosen.

Units: bytes everywhere inside; GiB (2^30) and GB (1e9) are labelled wherever shown.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import lru_cache

from playbooks.plan.compute_buffer import device_input_bytes, replay, worst_case_graph
from playbooks.plan.exl2_size import (
    EXL2_BPW_LADDER,
    EXL2_MAX_INPUT_LEN,
    estimate_exl2,
    exl2_attention_bytes,
    exl2_chunk_bytes,
    exl2_quant_name,
    exl2_scratch_bytes,
    head_bits_per_weight,
)
from playbooks.plan.exl2_split import Exl2Limits, Exl2Memory, Exl2Split, exl2_modules, split_exl2
from playbooks.plan.gguf_size import FILE_TYPES, estimate_gguf, quant_refusal
from playbooks.plan.gpus import MIB, Gpu
from playbooks.plan.kv_cache import (
    exl2_cache_scratch_bytes,
    exl2_kv_bytes_per_token,
    llamacpp_kv_bytes,
    llamacpp_kv_bytes_per_token,
)
from playbooks.plan.model_config import ModelShape
from playbooks.plan.moe import (
    HostMemory,
    NCpuMoe,
    OffloadStep,
    expert_layout,
    ladder_points,
    two_sided_tok_s,
)
from playbooks.plan.objective import Objective
from playbooks.plan.split import (
    CPU_ALIGNMENT,
    CUDA_ALIGNMENT,
    Device,
    DeviceShare,
    device_count,
    split_model,
    split_tok_s,
    worst,
)
from playbooks.plan.tensors import model_tensors, parameter_count

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
    return _replay(
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
_replay = lru_cache(maxsize=4096)(replay)
_gguf = lru_cache(maxsize=256)(estimate_gguf)


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
    # llama-server --n-cpu-moe for a MoE model: the experts of the first N layers in host RAM.
    # 0: none (every weight on the GPU); "auto": the smallest N that fits (make_plan)
    n_cpu_moe: NCpuMoe = 0
    # one model over several GPUs of the same kind (llama-server --split-mode layer, see
    # playbooks/plan/split.py); tensor_split: the share of each (empty: equal shares)
    gpu_count: int = 1
    tensor_split: tuple[float, ...] = ()
    # llama.cpp RPC servers holding layers too (--rpc): one device each, of the GPU's kind,
    # ahead of the local cards in llama.cpp's device list
    rpc_devices: int = 0
    # the round trip (ms) each RPC worker adds to a token, and where the figure came from:
    # given (the recipe's planner.rpc_rtt_ms) or measured (preflight's connect time)
    rpc_rtt_ms: float = 0.0
    rpc_rtt_source: str = "given"

    @property
    def split(self) -> bool:
        return self.gpu_count > 1 or self.rpc_devices > 0

    def device_count(self, gpu: Gpu) -> int:
        """Devices the layers go to (plan/split.py device_count)."""
        return device_count(self.rpc_devices, self.gpu_count, gpu.is_cpu)

    def split_weights(self, gpu: Gpu) -> tuple[float, ...]:
        """--tensor-split as rendered: the given shares, or one part per device."""
        return self.tensor_split or (1.0,) * self.device_count(gpu)


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
    # a speculative decoding draft model beside the target (llama-server --model-draft): its
    # weights on the GPU, its own KV cache and its own compute buffer; draft_bytes is their sum
    # and is part of overhead_bytes
    draft_bytes: int = 0
    draft_kv_bytes: int = 0
    draft_compute_bytes: int = 0
    # why it cannot run on this target whatever the memory says ("": nothing but memory counts)
    unfit_reason: str = ""
    # Mixture of experts (all 0 / None for a dense model or a MoE kept whole on the GPU):
    n_cpu_moe: int = 0  # llama-server --n-cpu-moe: the experts of layers 0..N-1 in host RAM
    host_bytes_per_token: int = 0  # of streamed_bytes, what is read in host RAM
    host_weights_bytes: int = 0  # expert bytes kept in host RAM
    host_resident_bytes: int = 0  # what the weights take of host RAM (those + token_embd)
    host_membw_gb_s: float | None = None  # the host bandwidth the roofline divided by
    host_membw_source: str | None = None  # measured | given | default
    # A split over several GPUs (Serving.gpu_count > 1): each card's share. The fields above
    # stay the whole model's (weights, KV, compute, overhead summed over the cards), while
    # vram_bytes and gpu_bytes are the worst card's (the one with the least headroom), so
    # `fits` and `headroom_bytes` speak of the card that decides.
    devices: tuple[DeviceShare, ...] = ()
    # An EXL2 split: the allotment of each card in GB, TabbyAPI's gpu_split (plan/exl2_split.py)
    gpu_split: tuple[float, ...] = ()

    @property
    def draft_weights_bytes(self) -> int:
        return self.draft_bytes - self.draft_kv_bytes - self.draft_compute_bytes

    @property
    def loaded_kv_bytes(self) -> int:
        """The KV cache llama-server's load log adds up: the target's and the draft's (both
        contexts print their buffers under the device's name, summed by facts/server_log.LoadLog)."""
        return self.kv_bytes + self.draft_kv_bytes

    @property
    def loaded_compute_bytes(self) -> int:
        return self.compute_bytes + self.draft_compute_bytes

    @property
    def active_bytes_per_token(self) -> int:
        """Weight bytes one decoded token reads, wherever they are (a MoE's active experts)."""
        return self.streamed_bytes

    @property
    def gpu_bytes_per_token(self) -> int:
        return self.streamed_bytes - self.host_bytes_per_token

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
    weights = _weights(draft.shape, draft.quant, s)[1]
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


def _vram_at(
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
            expert_copy=expert_copy,
        )
    draft_b = sum(draft_vram(draft, s, ctx, gpu)) if draft is not None and s.backend == "llamacpp" else 0
    overhead = (0 if gpu.is_cpu else s.cuda_context_mib * MIB) + s.margin_mib * MIB
    return kv, compute, overhead, draft_b


#: Why an EXL2 quant never runs on a CPU target. ExLlamaV2 0.3.2 has no CPU path: every layer
#: runs through its C++/CUDA extension (exllamav2/ext.py builds it from cuda/*.cu), its model
#: places modules on "cuda:N" (model.py _torch_device) and warns at import when torch has
#: neither CUDA nor ROCm (model.py, line 22); its converter measures on the GPU too.
EXL2_NEEDS_CUDA = "needs a CUDA GPU"
#: MoE architectures ExLlamaV2 0.3.2 cannot load (exllamav2/architecture.py knows
#: MixtralForCausalLM and Qwen3MoeForCausalLM, not these).
EXL2_MISSING_ARCHS = {"qwen2_moe": "Qwen2MoeForCausalLM", "gpt_oss": "GptOssForCausalLM"}


#: K/V cache type pairs a default CUDA build of the pinned llama.cpp compiles flash-attention
#: kernels for (ggml/CMakeLists.txt GGML_CUDA_FA_QUANTS "q4_0-q4_0;q8_0-q8_0;f16-f16;bf16-bf16";
#: fattn.cu takes an f32 side as f16); other pairs are converted to f16 with a warning (fattn.cu)
FA_COMPILED_PAIRS = frozenset({("f16", "f16"), ("q8_0", "q8_0"), ("q4_0", "q4_0"), ("bf16", "bf16")})


def fa_pair_compiled(cache_k: str, cache_v: str) -> bool:
    def as_f16(t: str) -> str:
        return "f16" if t == "f32" else t

    return (as_f16(cache_k), as_f16(cache_v)) in FA_COMPILED_PAIRS


#: Why an EXL2 quant is no alternative to a recipe with a draft model: the draft is
#: llama-server's --model-draft (a recipe refuses `draft:` with backend exllamav2).
EXL2_NO_DRAFT = "a draft is llama-server's"


def bf16_refusal(gpu: Gpu, quant: str, cache: tuple[str, ...] = ()) -> str:
    """Why BF16 weights or a BF16 cache cannot run on this card ("": they can, or none asked).
    A CPU build computes BF16 in software; a CUDA card needs it in hardware (sm_80 and later).
    Short: it is the fit table's cell (``no, sm_70 has no BF16``)."""
    if gpu.is_cpu or gpu.bf16 or (quant != "BF16" and "bf16" not in cache):
        return ""
    return f"sm_{gpu.compute_capability[0]}{gpu.compute_capability[1]} has no BF16"


def unfit_reason(
    backend: str,
    gpu: Gpu,
    shape: ModelShape | None = None,
    draft: DraftPlan | None = None,
    quant: str = "",
    cache: tuple[str, ...] = (),
) -> str:
    """Why this backend cannot run on this target at all, memory aside ("": it can)."""
    if why := bf16_refusal(gpu, quant, cache):
        return why
    if backend == "exllamav2" and gpu.is_cpu:
        return EXL2_NEEDS_CUDA
    if backend == "exllamav2" and shape is not None and shape.model_type in EXL2_MISSING_ARCHS:
        return f"ExLlamaV2 0.3.2 has no {EXL2_MISSING_ARCHS[shape.model_type]}"
    if backend == "exllamav2" and draft is not None:
        return EXL2_NO_DRAFT
    return ""


def _draft_parts(draft: DraftPlan | None, s: Serving, gpu: Gpu) -> tuple[int, int]:
    """A draft's (KV cache, compute buffer) at the serving's context, for Option's fields."""
    if draft is None or s.backend != "llamacpp":
        return 0, 0
    _, kv, compute = draft_vram(draft, s, s.context, gpu)
    return kv, compute


def evaluate(
    shape: ModelShape,
    quant: str,
    gpu: Gpu,
    s: Serving,
    draft: DraftPlan | None = None,
    host: HostMemory | None = None,
) -> Option:
    """One quant at these settings. A MoE GGUF quant gets its --n-cpu-moe (see _evaluate_moe);
    a dense GGUF quant over several GPUs its layer split (_evaluate_split)."""
    if s.split:
        return _evaluate_split(shape, quant, gpu, s, draft)
    if shape.is_moe and not quant.startswith("EXL2-"):
        return _evaluate_moe(shape, quant, gpu, s, draft, host or HostMemory())
    file_b, gpu_w, streamed = _weights(shape, quant, s)
    kv_tok = _kv_per_token(shape, s)
    kv, compute, overhead, draft_b = _vram_at(shape, s, s.context, gpu, draft)
    backend = "exllamav2" if quant.startswith("EXL2-") else "llamacpp"
    unfit = unfit_reason(backend, gpu, shape, draft, quant, (s.cache_k, s.cache_v))
    draft_kv, draft_compute = _draft_parts(draft, s, gpu)
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
        draft_kv_bytes=draft_kv,
        draft_compute_bytes=draft_compute,
        unfit_reason=unfit,
    )


def split_unfit_reason(shape: ModelShape, quant: str, gpu: Gpu, draft: DraftPlan | None, s: Serving) -> str:
    """Why a split over several devices is not planned for this ("": it is)."""
    if why := bf16_refusal(gpu, quant, (s.cache_k, s.cache_v)):
        return why
    if gpu.is_cpu and not s.rpc_devices:
        return "a CPU target has no cards to split over"
    if quant.startswith("EXL2-") and s.rpc_devices:
        return "RPC workers are llama.cpp's: an EXL2 quant splits over local cards only"
    if quant.startswith("EXL2-") and shape.is_moe:
        return "no split planned for an EXL2 mixture of experts (ExLlamaV2's MoE module is not planned)"
    if shape.is_moe and s.n_cpu_moe != 0:
        return "no split planned with experts in host RAM (n_cpu_moe): a split keeps every expert on a device"
    if draft is not None:
        return "no split planned with a draft"
    return ""


def split_devices(gpu: Gpu, s: Serving) -> list[Device]:
    """The devices of a split in llama.cpp's order: the RPC workers, then the local cards; each
    of the recipe's GPU kind with its CUDA context and margin (a CPU-backed worker: the CPU
    budget, its 32-byte alignment, the margin only)."""
    overhead = ((0 if gpu.is_cpu else s.cuda_context_mib) + s.margin_mib) * MIB
    align = CPU_ALIGNMENT if gpu.is_cpu else CUDA_ALIGNMENT
    rpc = [Device(f"RPC {i}", gpu.memory_bytes, gpu.bandwidth_gb_s, align, overhead) for i in range(s.rpc_devices)]
    local = (
        []
        if gpu.is_cpu
        else [Device(f"GPU {i}", gpu.memory_bytes, gpu.bandwidth_gb_s, align, overhead) for i in range(s.gpu_count)]
    )
    return rpc + local


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
    return _replay(g) + (copies - 1) * device_input_bytes(g)


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


def network_s(s: Serving) -> float:
    """Seconds the network adds to every token of an RPC split: each worker's part of the graph
    is one round trip from the server (its inputs sent, its output read back), one after the
    other; the transfer of a hidden state (KBs) is left out."""
    return s.rpc_devices * s.rpc_rtt_ms / 1000


def _evaluate_split(shape: ModelShape, quant: str, gpu: Gpu, s: Serving, draft: DraftPlan | None) -> Option:
    """A quant split by layers: GGUF over s.gpu_count cards and the RPC workers
    (playbooks/plan/split.py), a MoE model with every expert on a device; EXL2 over the cards as
    ExLlamaV2 places it (plan/exl2_split.py)."""
    one = replace(s, gpu_count=1, tensor_split=(), rpc_devices=0)
    why = split_unfit_reason(shape, quant, gpu, draft, s)
    if why:
        return replace(evaluate(shape, quant, gpu, one, draft), unfit_reason=why)
    if quant.startswith("EXL2-"):
        planned = plan_exl2_split(shape, quant, gpu, s, s.context)

        def exl2_fits(ctx: int) -> bool:
            at = plan_exl2_split(shape, quant, gpu, s, ctx)
            return not at.refusal and all(d.headroom_bytes >= 0 for d in at.shares)

        unfit = unfit_reason("exllamav2", gpu, shape, draft) or planned.refusal
        return _split_option(shape, quant, s, planned.shares, exl2_fits, unfit=unfit, gpu_split=planned.gpu_split)

    def fits(ctx: int) -> bool:
        return all(d.headroom_bytes >= 0 for d in plan_split(shape, quant, gpu, s, ctx))

    return _split_option(shape, quant, s, plan_split(shape, quant, gpu, s, s.context), fits, network_s(s))


def _split_option(
    shape: ModelShape,
    quant: str,
    s: Serving,
    shares: tuple[DeviceShare, ...],
    fits: Callable[[int], bool],
    network: float = 0.0,
    unfit: str = "",
    gpu_split: tuple[float, ...] = (),
) -> Option:
    """A split's option: the model's sums over its devices, the worst device's fit."""
    file_b, _, streamed = _weights(shape, quant, s)
    kv_tok = _kv_per_token(shape, s)
    w = worst(shares)
    per_layer_kv = kv_tok // shape.num_hidden_layers * s.context
    return Option(
        quant=quant,
        backend="exllamav2" if quant.startswith("EXL2-") else "llamacpp",
        weights_bytes=file_b,
        params=parameter_count(shape),
        gpu_weights_bytes=sum(d.weights_bytes for d in shares),
        streamed_bytes=streamed,
        kv_bytes_per_token=kv_tok,
        kv_bytes=sum(d.kv_bytes for d in shares),
        compute_bytes=sum(d.compute_bytes for d in shares),
        overhead_bytes=sum(d.overhead_bytes for d in shares),
        vram_bytes=w.total_bytes,
        gpu_bytes=w.capacity_bytes,
        max_ctx=0 if unfit else largest_ctx(shape, fits),
        roofline_tok_s=split_tok_s(shares, network_s=network),
        roofline_full_ctx_tok_s=split_tok_s(shares, [per_layer_kv * len(d.layers) for d in shares], network_s=network),
        unfit_reason=unfit,
        devices=shares,
        gpu_split=gpu_split,
    )


_exl2_modules = lru_cache(maxsize=256)(exl2_modules)


def plan_exl2_split(shape: ModelShape, quant: str, gpu: Gpu, s: Serving, ctx: int) -> Exl2Split:
    """An EXL2 quant over s.gpu_count cards at `ctx` tokens per slot: ExLlamaV2's placement for
    the allotments planned (plan/exl2_split.py), each card's cache, scratch and working set by
    the one-card formulas (exl2_compute_bytes) at the recipe's slots."""
    bpw = float(quant.removeprefix("EXL2-"))
    lim = Exl2Limits(max_seq_len=ctx)
    tokens = ctx * s.parallel
    mem = Exl2Memory(
        kv_per_layer=_kv_per_token(shape, s) // shape.num_hidden_layers * tokens,
        cache_scratch=exl2_cache_scratch_bytes(shape, s.cache_k, tokens),
        attention_work=exl2_attention_bytes(shape, ctx, batch=s.parallel),
        per_card=exl2_chunk_bytes(shape, ctx, batch=s.parallel),
        logits=shape.vocab_size * 4 * s.parallel,
    )
    modules = _exl2_modules(shape, lim, bpw, head_bits_per_weight(s.head_bits))
    return split_exl2(shape, modules, lim, split_devices(gpu, s), s.split_weights(gpu), mem)


def _max_ctx(
    shape: ModelShape,
    s: Serving,
    gpu_w: int,
    gpu: Gpu,
    draft: DraftPlan | None,
    expert_copy: tuple[int, int, int] = (0, 0, 0),
) -> int:
    """Largest per-slot context (a multiple of CTX_STEP, at most the model's maximum) that fits."""

    def fits(ctx: int) -> bool:
        return gpu_w + sum(_vram_at(shape, s, ctx, gpu, draft, expert_copy)) <= gpu.memory_bytes

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


@dataclass(frozen=True)
class _MoeAt:
    """A MoE GGUF quant with the experts of its first n layers in host RAM."""

    n: int
    gpu_weights: int
    kv: int
    compute: int
    overhead: int
    draft: int
    gpu_bytes_per_token: int
    host_bytes_per_token: int
    host_weights: int
    host_resident: int
    copies: tuple[int, int, int]

    @property
    def vram(self) -> int:
        return self.gpu_weights + self.kv + self.compute + self.overhead + self.draft


def _moe_at(
    shape: ModelShape, quant: str, gpu: Gpu, s: Serving, draft: DraftPlan | None, n: int, ctx: int | None = None
) -> _MoeAt:
    lay = expert_layout(shape, quant, s.imatrix)
    gpu_w = _gguf(shape, quant, s.imatrix).gpu_weight_bytes - lay.host_expert_bytes(n)
    copies = lay.copies(n)
    kv, compute, overhead, draft_b = _vram_at(shape, s, ctx or s.context, gpu, draft, copies)
    gpu_tok, host_tok = lay.per_token(n)
    return _MoeAt(
        n=n,
        gpu_weights=gpu_w,
        kv=kv,
        compute=compute,
        overhead=overhead,
        draft=draft_b,
        gpu_bytes_per_token=gpu_tok,
        host_bytes_per_token=host_tok,
        host_weights=lay.host_expert_bytes(n),
        host_resident=lay.host_resident_bytes(n),
        copies=copies,
    )


def smallest_n_cpu_moe(
    shape: ModelShape, quant: str, gpu: Gpu, s: Serving, draft: DraftPlan | None = None
) -> int | None:
    """The fewest layers whose experts must stay in host RAM for `quant` to fit the GPU at the
    serving settings (0: it fits whole); None when even all of them are not enough."""
    for n in range(shape.num_hidden_layers + 1):
        if _moe_at(shape, quant, gpu, s, draft, n).vram <= gpu.memory_bytes:
            return n
    return None


def _host_ram_reason(at: _MoeAt, host: HostMemory) -> str:
    if host.ram_bytes is None or at.host_resident <= host.ram_bytes:
        return ""
    return (
        f"host RAM: token_embd + the experts of {at.n} layer(s) need {at.host_resident / 2**30:.1f} GiB, "
        f"the host has {host.ram_bytes / 2**30:.1f} GiB ({host.ram_source})"
    )


def _evaluate_moe(
    shape: ModelShape, quant: str, gpu: Gpu, s: Serving, draft: DraftPlan | None, host: HostMemory
) -> Option:
    """A MoE GGUF quant: its --n-cpu-moe N (none on a CPU target; the serving's number when
    pinned; the smallest that fits when "auto", all layers when none does), the VRAM without
    those experts, the host RAM they take, and the two-sided roofline."""
    n_layer = shape.num_hidden_layers
    if gpu.is_cpu:
        n = 0
    elif s.n_cpu_moe == "auto":
        found = smallest_n_cpu_moe(shape, quant, gpu, s, draft)
        n = n_layer if found is None else found
    else:
        n = min(int(s.n_cpu_moe), n_layer)
    at = _moe_at(shape, quant, gpu, s, draft, n)
    unfit = bf16_refusal(gpu, quant, (s.cache_k, s.cache_v)) or _host_ram_reason(at, host)
    # (on a CPU target n is 0: every byte is read at the catalog's CPU bandwidth, gpu.bandwidth_gb_s)
    membw = host.membw_gb_s
    roof = two_sided_tok_s(at.gpu_bytes_per_token, gpu.bandwidth_gb_s, at.host_bytes_per_token, membw)
    kv_tok = _kv_per_token(shape, s)
    roof_full = two_sided_tok_s(
        at.gpu_bytes_per_token + kv_tok * s.context, gpu.bandwidth_gb_s, at.host_bytes_per_token, membw
    )
    file_b = estimate_gguf(shape, quant, imatrix=s.imatrix).file_bytes
    draft_kv, draft_compute = _draft_parts(draft, s, gpu)
    return Option(
        quant=quant,
        backend="llamacpp",
        weights_bytes=file_b,
        params=parameter_count(shape),
        gpu_weights_bytes=at.gpu_weights,
        streamed_bytes=at.gpu_bytes_per_token + at.host_bytes_per_token,
        kv_bytes_per_token=kv_tok,
        kv_bytes=at.kv,
        compute_bytes=at.compute,
        overhead_bytes=at.overhead + at.draft,
        vram_bytes=at.vram,
        gpu_bytes=gpu.memory_bytes,
        max_ctx=0 if unfit else _max_ctx(shape, s, at.gpu_weights, gpu, draft, at.copies),
        roofline_tok_s=roof,
        roofline_full_ctx_tok_s=roof_full,
        draft_bytes=at.draft,
        draft_kv_bytes=draft_kv,
        draft_compute_bytes=draft_compute,
        unfit_reason=unfit,
        n_cpu_moe=n,
        host_bytes_per_token=at.host_bytes_per_token,
        host_weights_bytes=at.host_weights,
        host_resident_bytes=at.host_resident,
        host_membw_gb_s=membw if at.host_bytes_per_token else None,
        host_membw_source=host.membw_source if at.host_bytes_per_token else None,
    )


def offload_ladder(
    shape: ModelShape, quant: str, gpu: Gpu, s: Serving, host: HostMemory, draft: DraftPlan | None = None
) -> list[OffloadStep]:
    """What --n-cpu-moe N costs and leaves, for N = 0, the smallest that fits and a few more
    (moe.ladder_points): VRAM at the serving's context, and the single-stream ceiling."""
    n_fit = smallest_n_cpu_moe(shape, quant, gpu, s, draft)
    steps = []
    for n in ladder_points(shape.num_hidden_layers, n_fit):
        at = _moe_at(shape, quant, gpu, s, draft, n)
        steps.append(
            OffloadStep(
                n_cpu_moe=n,
                vram_bytes=at.vram,
                fits=at.vram <= gpu.memory_bytes and not _host_ram_reason(at, host),
                host_weights_bytes=at.host_weights,
                gpu_bytes_per_token=at.gpu_bytes_per_token,
                host_bytes_per_token=at.host_bytes_per_token,
                roofline_tok_s=two_sided_tok_s(
                    at.gpu_bytes_per_token, gpu.bandwidth_gb_s, at.host_bytes_per_token, host.membw_gb_s
                ),
            )
        )
    return steps


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
    objective: Objective = field(default_factory=Objective)
    recommendation: Option | None = None
    # how the objective picked it: quality | fastest | below_speed_floor (objective.Pick.kind)
    recommendation_kind: str | None = None
    reason: str = ""
    notes: list[str] = field(default_factory=list)
    host: HostMemory = field(default_factory=HostMemory)
    # MoE: the --n-cpu-moe ladder of one GGUF quant (the chosen one, else the recommendation)
    offload: list[OffloadStep] = field(default_factory=list)
    offload_quant: str | None = None


def _offload_text(o: Option) -> str:
    return f" with the experts of {o.n_cpu_moe} layer(s) in host RAM (--n-cpu-moe {o.n_cpu_moe})" if o.n_cpu_moe else ""


def make_plan(
    shape: ModelShape,
    gpu: Gpu,
    serving: Serving,
    quant: str | None = None,
    draft: DraftPlan | None = None,
    objective: Objective | None = None,
    host: HostMemory | None = None,
) -> Plan:
    """Evaluate every quant on this GPU and recommend one.

    The recommendation is the objective's pick (playbooks/plan/objective.py) among the quants
    that fit the planned context and slots: the best quality of at least `min_bpw` bits per
    weight whose decode roofline reaches `min_tok_s`, or the fastest without a speed floor.
    MXFP4_MOE is for mixture-of-experts models and left out of a dense model's table.

    A MoE model's GGUF quants may keep experts in host RAM when the serving allows it
    (`n_cpu_moe` "auto": each quant gets the smallest N that fits; an integer pins N; 0 keeps
    everything on the GPU). Their roofline is two-sided (moe.two_sided_tok_s): an offloaded
    quant below the speed floor is not picked for its quality.

    With a draft model (llama-server --model-draft) every llama.cpp quant carries the draft's
    weights, KV cache and compute buffer (draft_vram); EXL2 quants cannot serve it.
    """
    host = host or HostMemory()
    objective = objective or Objective(imatrix=serving.imatrix, mxfp4_experts=shape.mxfp4_experts)
    # GGUF types llama.cpp cannot make for this model (gpt-oss's MXFP4 experts: MXFP4_MOE only)
    refused = {q: why for q in quant_names("llamacpp") if (why := quant_refusal(shape, q))}
    names = [q for q in quant_names() if q not in refused and (shape.is_moe or q != "MXFP4_MOE")]
    if serving.rpc_devices:  # RPC workers are llama.cpp's (split_unfit_reason)
        names = [q for q in names if not q.startswith("EXL2-")]
    options = [evaluate(shape, q, gpu, serving_for(q, serving), draft, host) for q in names]
    chosen = evaluate(shape, quant, gpu, serving, draft, host) if quant else None
    plan = Plan(shape, gpu, serving, chosen, options, objective, host=host)
    if refused:
        plan.notes.append(f"left out of the fit table: {', '.join(refused)} ({next(iter(refused.values()))})")
    fitting = [o for o in options if o.fits]  # an option that cannot run here does not fit
    if serving.split:
        _split_notes(plan)
    if gpu.is_cpu:
        plan.notes.append(
            f"EXL2 is left out: ExLlamaV2 {EXL2_NEEDS_CUDA} (it has no CPU path); a CPU serves GGUF through llama.cpp"
        )
    elif serving.rpc_devices:
        plan.notes.append("EXL2 is left out: RPC workers are llama.cpp's (ExLlamaV2 splits over local cards only)")
    elif draft is not None:
        plan.notes.append(f"EXL2 is left out: {EXL2_NO_DRAFT} (--model-draft)")
    elif serving.parallel > 1 and gpu.compute_capability < (8, 0):
        # ExLlamaV2's batching needs flash-attn >= 2.5.7 (Ampere+); TabbyAPI forces one
        # sequence at a time before Ampere, so it cannot serve parallel slots here.
        fitting = [o for o in fitting if o.backend != "exllamav2"]
        plan.notes.append(
            f"EXL2 is left out of the recommendation: {serving.parallel} slots need batching, "
            "which ExLlamaV2 cannot do before Ampere (no flash-attn for sm_70)"
        )
    cards = f"{serving.device_count(gpu)} x {gpu.name}" if serving.split else gpu.name
    where = f"{serving.context} tokens x {serving.parallel} slot(s) on {cards}"
    floor = f"at least {objective.min_bpw:g} bits/weight"
    pick = objective.pick(fitting)
    if pick is not None:
        r = plan.recommendation = pick.candidate
        plan.recommendation_kind = pick.kind
        left = f"{r.headroom_bytes / MIB:,.0f} MiB left"
        if pick.kind == "quality":
            plan.reason = (
                f"{r.quant} ({r.backend}){_offload_text(r)} is the best quality ({pick.quality.text()}) of the quants "
                f"of {floor} that fit {where} with a decode roofline of at least {objective.min_tok_s:g} tok/s: "
                f"roofline {r.roofline_tok_s:.0f} tok/s, {left}"
            )
        elif pick.kind == "fastest":
            plan.reason = (
                f"{r.quant} ({r.backend}){_offload_text(r)} is the fastest quant of {floor} that fits {where} "
                f"(no speed floor): roofline {r.roofline_tok_s:.0f} tok/s, {left}"
            )
        else:
            plan.reason = (
                f"no quant of {floor} that fits {where} reaches a decode roofline of {objective.min_tok_s:g} tok/s; "
                f"the fastest is {r.quant} ({r.backend}){_offload_text(r)}: roofline {r.roofline_tok_s:.0f} tok/s, "
                f"{left}"
            )
    elif fitting:
        best = min(fitting, key=lambda o: objective.quality(o.quant, o.bpw).kld)
        plan.reason = (
            f"no quant of {floor} fits {where}; the best quality that fits is {best.quant} ({best.bpw:.2f} bits/weight)"
        )
    else:
        plan.reason = f"no quant fits {where}: use a smaller model, a shorter context, fewer slots or a larger GPU"
    plan.notes.append(f"KLD: the quality the recommendation ranks by: {_quality_basis(objective, options)}")
    compiled = fa_pair_compiled(serving.cache_k, serving.cache_v)
    if serving.backend == "llamacpp" and serving.flash_attn and not gpu.is_cpu and not compiled:
        plan.notes.append(
            f"cache K={serving.cache_k} V={serving.cache_v}: a default CUDA build of llama.cpp 0c1e570 compiles "
            "flash attention for the K/V pairs f16/f16, q8_0/q8_0, q4_0/q4_0 and bf16/bf16 only "
            "(GGML_CUDA_FA_QUANTS); other pairs run slower (K and V converted to f16 on every step)"
        )
    if gpu.is_cpu:
        plan.notes.append(
            "on a CPU, quantized decode is often compute-bound, not bandwidth-bound: the roofline is "
            "a loose ceiling here (docs/knowledge.md section 8: Q4_K_M and Q8_0 on 2 cores)"
        )
    elif not gpu.bf16 and shape.torch_dtype == "bfloat16":
        plan.notes.append(f"{gpu.name} has no BF16: the BF16 weights are converted to FP16 before quantizing")
    if shape.is_moe:
        _moe_notes(plan, draft)
    return plan


def _split_notes(plan: Plan) -> None:
    """What a split's numbers rest on."""
    plan.notes.append(
        "split: layers, weights and KV cache per device are llama.cpp's own assignment (exact); each device's "
        f"compute buffer is an estimate: the single-device worst case plus {PIPELINE_COPIES - 1} more copies of its "
        "inputs (llama.cpp's pipeline parallelism), checked on CPU-backed RPC devices only"
    )
    s = plan.serving
    if not s.rpc_devices and not plan.gpu.is_cpu:
        plan.notes.append(
            "EXL2 split: ExLlamaV2's own placement (set_device_map: modules in order, each card up to its "
            "gpu_split allotment, the cache with its layer's attention), ported and held to ExLlamaV2's code on "
            "generated checkpoints; module sizes spread the bpw target evenly over the layers, and the rendered "
            "gpu_split is the plan's. Not run on two GPUs"
        )
    if s.rpc_devices:
        hop = (
            f"the roofline adds {s.rpc_devices} x {s.rpc_rtt_ms:g} ms of network per token (one round trip per "
            f"worker, {s.rpc_rtt_source})"
            if s.rpc_rtt_ms
            else "the roofline leaves out the network (one round trip per worker per token): give "
            "planner.rpc_rtt_ms, or run preflight, which measures it"
        )
        plan.notes.append(
            f"{s.rpc_devices} RPC worker(s) hold the first layers (llama.cpp puts RPC devices ahead of local "
            f"cards); {hop}"
        )


def _quality_basis(objective: Objective, options: list[Option]) -> str:
    """Where the KLD column's figures come from, in a few words."""
    sources = {objective.quality(o.quant, o.bpw).source for o in options}
    parts = []
    if "measured" in sources:
        parts.append("the mean KL divergence from F16 measured on this model (marked *, the artifacts' manifests)")
    parts.append(
        ("else " if parts else "")
        + "llama.cpp's published mean KL divergence from F16 for Llama-3-8B (tools/perplexity/README.md at 0c1e570)"
    )
    if "interpolated" in sources:
        parts.append("EXL2 placed on that curve by bits/weight")
    if "assumed" in sources:
        parts.append("MXFP4_MOE as " + ("Q8_0 (the checkpoint's own experts)" if objective.mxfp4_experts else "Q4_0"))
    return "; ".join(parts)


def _moe_notes(plan: Plan, draft: DraftPlan | None) -> None:
    """The MoE part of a plan: the --n-cpu-moe ladder and what its numbers rest on."""
    shape, gpu, s, host = plan.shape, plan.gpu, plan.serving, plan.host
    c = plan.chosen
    target = c if c is not None and c.backend == "llamacpp" else plan.recommendation
    # the ladder where offload is allowed, or where the planned quant does not fit without it
    wanted = s.n_cpu_moe != 0 or (c is not None and not c.fits)
    if wanted and target is not None and target.backend == "llamacpp" and not gpu.is_cpu:
        ts = serving_for(target.quant, s)
        plan.offload = offload_ladder(shape, target.quant, gpu, ts, host, draft)
        plan.offload_quant = target.quant
    plan.notes.append(
        f"mixture of experts: a token reads {shape.num_experts_per_tok} of {shape.num_experts} experts per layer, "
        "so the roofline counts the active experts only"
        + (
            ""
            if gpu.is_cpu
            else "; the GPU compute buffer of a MoE graph follows build_moe_ffn's tensors (+ a copy of one "
            "offloaded expert weight for prefill when --n-cpu-moe > 0): equal to CPU loads and to one CUDA load "
            "(Qwen3-30B-A3B on an H200 with --n-cpu-moe 24), not checked on a V100"
        )
    )
    # what the plan proposes to run with experts in host RAM
    offloaded = [o for o in (c, plan.recommendation) if o is not None and o.n_cpu_moe]
    if offloaded:
        plan.notes.append(
            f"host memory bandwidth {host.membw_gb_s:g} GB/s ({host.membw_source}"
            + (
                ": the seed host's DDR4 figure; give --host-membw GBPS or planner.host_membw_gb_s"
                if host.membw_source == "default"
                else ""
            )
            + "): the host side of the two-sided roofline, a ceiling (the CPU's arithmetic and the per-layer "
            "hand-offs can bind first)"
        )
        if host.ram_bytes is None:
            plan.notes.append(
                "host RAM unknown: not checked that it holds the offloaded experts + token_embd; "
                "give --host-ram GIB or planner.host_ram_gib (preflight checks it on the host)"
            )
        if s.parallel >= 32:
            plan.notes.append(
                f"{s.parallel} slots: a decode batch of 32+ tokens copies host-resident experts to the GPU over "
                "PCIe instead of reading them on the CPU; the two-sided roofline does not describe that"
            )
    if gpu.is_cpu and s.n_cpu_moe not in (0, "auto"):
        plan.notes.append(
            f"--n-cpu-moe {s.n_cpu_moe} on a CPU target moves no memory: every weight is in host memory already"
        )
    if c is not None and c.backend == "llamacpp" and s.n_cpu_moe == 0 and not c.fits and not gpu.is_cpu:
        n = smallest_n_cpu_moe(shape, c.quant, gpu, s, draft)
        if n is not None:
            plan.notes.append(
                f"{c.quant} fits with the experts of {n} layer(s) in host RAM: set n_cpu_moe: auto in the recipe "
                f"(or --n-cpu-moe auto)"
            )
