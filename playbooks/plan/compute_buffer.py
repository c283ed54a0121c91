"""llama.cpp's compute buffer, computed the way llama.cpp computes it (pinned ref 0c1e570).

At load, llama_context::sched_reserve (src/llama-context.cpp) builds the worst-case graph
(n_ubatch tokens, every KV cell visible) and ggml_gallocr_reserve_n (ggml/src/ggml-alloc.c)
walks its nodes in order: each output tensor is placed by ggml_dyn_tallocr_alloc (best fit
among the free blocks below the top, else on top), each tensor is freed after its last
consumer, and element-wise ops (ggml_op_can_inplace) reuse their parent's memory. The buffer
is the high-water mark of that walk, holes included. This module replays the same walk with
the same allocator over the tensors of the graphs voltaforge plans: llama/mistral, qwen2,
qwen3, gemma2 and gemma3 (src/models/*.cpp) allocate in the same sequence - biases, Q/K norms,
Gemma's scalings, soft-capping and post-norms all happen in place. No term is fitted; the
sequence was transcribed from allocator traces of the pinned build (tests/tools/cbuf) and is
checked byte for byte against real loads in tests/test_compute_buffer.py.

What the graph holds at the pinned ref (src/llama-graph.cpp, src/llama-kv-cache.cpp):
- inputs, live until their last use: token ids, positions, the KQ mask (n_kv x n_tokens; F16
  with flash attention, F32 without: build_attn_inp_kq_mask), the KV store's row indices for
  ggml_set_rows (K: n_tokens I64; V: n_tokens x n_embd_v_gqa I64 without flash attention,
  because the V cache is transposed: build_input_v_idxs), out_ids, with a quantized cache the
  Hadamard rotation matrices (build_input_k_rot/_v_rot), and with sliding-window layers a
  second set for their own cache (llama-kv-cache-iswa.cpp: min(n_ctx, window + n_ubatch) cells);
- per layer: the F32 activations of attention (without flash attention the n_kv x n_tokens x
  n_head KQ matrix, softmax in place) and of the gated FFN (gate, up and their GLU product
  live together); the last layer keeps only the output rows (inp_out_ids);
- the logits, n_outputs x n_vocab F32. llama-server sets n_outputs_max to its slot count
  (tools/server/server-context.cpp server_output_limits), so its worst case is one row per
  slot; llama-cli, llama-bench and ollama reserve n_ubatch rows.

Where the buffer lives: in a CPU-only run everything is in the CPU buffer. With full GPU
offload the token embedding lookup and all inputs stay on the host (the scheduler assigns
inputs to the CPU backend: ggml-backend.cpp ggml_backend_sched_backend_id_from_cur) and the
device buffer holds copies of the inputs and of the embeddings, allocated at the start of the
device split; CUDA aligns to 128 bytes (ggml_backend_cuda_buffer_type_get_alignment) and sizes
a FLASH_ATTN_EXT node to also hold F16 copies of a non-F16 K/V for the tile/MMA kernels
(ggml_cuda_flash_attn_ext_get_alloc_size, ggml-cuda/fattn.cu) - on a V100 every batch of more
than two tokens per sequence takes those kernels. Those two CUDA terms come from the source
only (no GPU here); everything else is measured, a device split through an RPC device.

Mixture-of-experts layers (qwen3moe, qwen2moe with its shared expert, Mixtral, gpt-oss) follow
build_moe_ffn (_moe_ffn below). That walk was transcribed from the source, then checked against
CPU-only loads of the pinned llama-server (tests/test_moe_planner.py: 28 loads of the four,
27 equal to the printed 0.01 MiB, one 32 bytes - an alignment unit - over). What a device
buffer adds with --n-cpu-moe (a copy of an offloaded expert weight for a prefill-sized batch)
comes from ggml-backend.cpp's and ggml-cuda.cu's source only: an estimate until a CUDA load
log checks it.
"""

from __future__ import annotations

from dataclasses import dataclass

from playbooks.plan.kv_cache import llamacpp_kv_cells
from playbooks.plan.model_config import ModelShape

F32 = 4
_TOP = 1 << 62  # ggml_dyn_tallocr's last free block: as large as the buffer may grow


class _Allocator:
    """ggml_dyn_tallocr (ggml-alloc.c) with one chunk: the free blocks, sorted by offset, and
    the high-water mark. alloc: the smallest block below the top that fits (the last of equal
    ones), else the top block; free: merge with the neighbours."""

    def __init__(self, alignment: int) -> None:
        self.alignment = alignment
        self.blocks = [[0, _TOP]]
        self.peak = 0

    def _aligned(self, size: int) -> int:
        return size + (-size % self.alignment)

    def alloc(self, size: int) -> int:
        size = self._aligned(size)
        best, best_size = len(self.blocks) - 1, _TOP
        for i, (_, free) in enumerate(self.blocks[:-1]):
            if size <= free <= best_size:
                best, best_size = i, free
        block = self.blocks[best]
        offset = block[0]
        block[0] += size
        block[1] -= size
        if block[1] == 0:
            del self.blocks[best]
        self.peak = max(self.peak, offset + size)
        return offset

    def free(self, offset: int, size: int) -> None:
        size = self._aligned(size)
        b = self.blocks
        for i, block in enumerate(b):
            if block[0] + block[1] == offset:  # the freed range follows this block
                block[1] += size
                if i + 1 < len(b) and block[0] + block[1] == b[i + 1][0]:
                    block[1] += b.pop(i + 1)[1]
                return
            if offset + size == block[0]:  # the freed range precedes this block
                block[0], block[1] = offset, block[1] + size
                if i > 0 and b[i - 1][0] + b[i - 1][1] == offset:
                    b[i - 1][1] += b.pop(i)[1]
                return
        b.insert(sum(1 for blk in b if blk[0] < offset), [offset, size])


class _Walk:
    """Named live tensors on an _Allocator: A(llocate), F(ree), R(euse in place)."""

    def __init__(self, alignment: int) -> None:
        self.mem = _Allocator(alignment)
        self.live: dict[str, tuple[int, int]] = {}

    def A(self, name: str, size: int) -> None:
        self.live[name] = (self.mem.alloc(size), size)

    def F(self, *names: str) -> None:
        for name in names:
            self.mem.free(*self.live.pop(name))

    def R(self, new: str, old: str) -> None:
        self.live[new] = self.live.pop(old)


@dataclass(frozen=True)
class Graph:
    """The worst-case graph's dimensions (all counts; bytes are derived in replay())."""

    n_embd: int  # hidden size
    n_embd_q: int  # n_head x head_dim
    n_embd_kv: int  # n_head_kv x head_dim
    n_ff: int
    n_head: int
    n_vocab: int
    n_layer: int
    n_kv: int  # KV cells per sequence stream visible to the worst-case batch
    n_tokens: int  # tokens in the worst-case micro-batch (all streams together)
    n_kv_swa: int = 0  # KV cells of sliding-window layers (Gemma 2/3), 0: none
    swa_pattern: int = 0  # layer il slides when il % swa_pattern < swa_pattern - 1
    n_stream: int = 1  # KV streams (llama-server --parallel N without --kv-unified: N)
    n_outputs: int = 1  # logits rows reserved
    flash_attn: bool = True
    rot_k: int = 0  # Hadamard matrix size for a quantized K cache (0: none)
    rot_v: int = 0
    device: bool = True  # full GPU offload: the device's buffer; False: a CPU-only run's buffer
    alignment: int = 128
    fa_extra: int = 0  # bytes CUDA adds to each FLASH_ATTN_EXT node (F16 copies of K/V)
    # Two things older builds did differently, for checking their logs:
    kv_idx_inputs: bool = True  # KV stored by ggml_set_rows with index inputs (since mid-2025)
    out_rows: bool = True  # last layer always selects the output rows (since mid-2025;
    # before, only when fewer outputs than tokens)
    # Mixture of experts (n_expert 0: a dense FFN): llm_graph_context::build_moe_ffn, an
    # estimate (see replay). n_ff_exp: one expert's FFN width; n_ff_shexp: a shared expert's.
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_ff_shexp: int = 0
    moe_norm_w: bool = True  # weights renormalised over the selected experts (not gpt-oss)
    # bytes CUDA allocates to copy a host-resident up, gate and down expert weight to the GPU
    # for a prefill-sized batch (--n-cpu-moe; (0, 0, 0): every expert is on the device)
    expert_copy: tuple[int, int, int] = (0, 0, 0)


def replay(g: Graph) -> int:
    """The buffer size ggml-alloc reserves for graph g: the walk's high-water mark in bytes."""
    w = _Walk(g.alignment)
    T, E, Eq, Ekv, F = g.n_tokens, g.n_embd, g.n_embd_q, g.n_embd_kv, g.n_ff
    hidden = E * T * F32
    # inputs, at the bottom of the buffer (order as in the traces: first use in the graph)
    if g.device:
        w.A("embd", hidden)  # the host's token embeddings, copied in at the split's start
    else:
        w.A("tokens", T * 4)
        w.A("inp_embd", hidden)  # the embeddings input (for batches of embeddings), unused
    if g.rot_k and not g.device:
        w.A("k_rot", g.rot_k**2 * F32)
    w.A("pos", T * 4)
    if g.rot_k and g.device:
        w.A("k_rot", g.rot_k**2 * F32)
    if g.rot_v:
        w.A("v_rot", g.rot_v**2 * F32)
    if g.kv_idx_inputs:
        w.A("k_idxs", T * 8)
        w.A("v_idxs", T * 8 if g.flash_attn else T * Ekv * 8)
    w.A("mask", g.n_kv * T * (2 if g.flash_attn else F32))
    if g.n_kv_swa:  # llama_kv_cache_iswa: the sliding-window cache has its own inputs
        if g.rot_k:
            w.A("k_rot_swa", g.rot_k**2 * F32)
        if g.rot_v:
            w.A("v_rot_swa", g.rot_v**2 * F32)
        w.A("k_idxs_swa", T * 8)
        w.A("v_idxs_swa", T * 8 if g.flash_attn else T * Ekv * 8)
        w.A("mask_swa", g.n_kv_swa * T * (2 if g.flash_attn else F32))
    out_rows = g.out_rows or g.n_outputs < T
    if out_rows:
        w.A("out_ids", g.n_outputs * 4)
    if not g.device:
        w.A("embd", hidden)  # GET_ROWS on the CPU
        w.F("tokens")
    inp = "embd"
    last_inputs = [n for n in w.live if n not in ("embd", "inp_embd", "out_ids")]

    def slides(il: int) -> bool:
        return bool(g.n_kv_swa) and il % g.swa_pattern < g.swa_pattern - 1

    def last_use(name: str) -> None:  # inputs are freed after their last consumer
        swa = slides(il)
        if name != "pos" and swa:
            name += "_swa"
        users = [i for i in range(g.n_layer) if name == "pos" or slides(i) == swa]
        if il == users[-1] and name in w.live:
            w.F(name)

    for il in range(g.n_layer):
        last = il == g.n_layer - 1
        n_kv = g.n_kv_swa if slides(il) else g.n_kv
        w.A("norm", hidden)
        w.R("attn_norm", "norm")
        w.A("Qmm", Eq * T * F32)
        w.A("Q", Eq * T * F32)
        w.F("Qmm")  # rope (qwen3: q_norm)
        if g.rot_k:
            w.A("Qrot", Eq * T * F32)
            w.F("Q")
            w.R("Q", "Qrot")
        w.A("Vmm", Ekv * T * F32)
        if g.rot_v:
            w.A("Vrot", Ekv * T * F32)
            w.F("Vmm")
            w.R("Vmm", "Vrot")
            w.A("Kmm", Ekv * T * F32)
            w.F("attn_norm")
        else:
            w.A("Kmm", Ekv * T * F32)
            w.F("attn_norm")
        w.A("K", Ekv * T * F32)
        w.F("Kmm")
        last_use("pos")  # rope (qwen3: k_norm)
        if g.rot_k:
            w.A("Krot", Ekv * T * F32)
            last_use("k_rot")
            w.F("K")
            w.R("K", "Krot")
        w.F("K")
        last_use("k_idxs")  # set_rows into the K cache
        w.F("Vmm")
        last_use("v_idxs")  # set_rows into the V cache
        if g.flash_attn:
            w.A("kqv", Eq * T * F32 + g.fa_extra)
            w.F("Q")
            last_use("mask")
            if g.rot_v:
                w.A("kqv_rot", Eq * T * F32)
                last_use("v_rot")
                w.F("kqv")
                w.R("kqv", "kqv_rot")
        else:
            w.A("kq", n_kv * T * g.n_head * F32)
            w.F("Q")
            last_use("mask")  # softmax in place
            w.A("kqv_raw", Eq * T * F32)
            w.F("kq")
            w.A("kqv", Eq * T * F32)
            w.F("kqv_raw")  # permute + cont
        w.A("attn_out", hidden)
        w.F("kqv")
        t = T
        if last and out_rows:  # keep the output rows only (get_rows by inp_out_ids)
            t = g.n_outputs
            w.A("rows_attn", E * t * F32)
            w.F("attn_out")
            w.A("rows_inp", E * t * F32)
            w.F(inp, "out_ids")
            w.R("ffn_inp", "rows_attn")
            w.F("rows_inp")
        else:
            w.R("ffn_inp", "attn_out")
            w.F(inp)
        w.A("norm", E * t * F32)
        w.R("ffn_norm", "norm")
        if g.n_expert:
            _moe_ffn(w, g, t)
        else:
            w.A("gate", F * t * F32)
            w.A("up", F * t * F32)
            w.F("ffn_norm")
            w.A("swiglu", F * t * F32)
            w.F("gate", "up")
            w.A("ffn_out", E * t * F32)
            w.F("swiglu")
        w.R("l_out", "ffn_out")
        w.F("ffn_inp")
        inp = "l_out"
    assert not any(n in w.live for n in last_inputs), "an input outlived the graph"
    w.A("logits", g.n_vocab * g.n_outputs * F32)  # output norm in place, then the LM head
    return w.mem.peak


def device_input_bytes(g: Graph) -> int:
    """The graph inputs a device's split copies in from the host (or the previous device), each
    aligned: the hidden state, positions, the KV store's row indices, the masks, the Hadamard
    matrices of a quantized cache and the output row ids (replay's device inputs)."""
    T, a = g.n_tokens, g.alignment
    sizes = [g.n_embd * T * F32, T * 4]
    sizes += [g.rot_k**2 * F32] if g.rot_k else []
    sizes += [g.rot_v**2 * F32] if g.rot_v else []
    per_cache = [T * 8, T * 8 if g.flash_attn else T * g.n_embd_kv * 8]
    sizes += per_cache + [g.n_kv * T * (2 if g.flash_attn else F32)]
    if g.n_kv_swa:
        sizes += [g.rot_k**2 * F32] if g.rot_k else []
        sizes += [g.rot_v**2 * F32] if g.rot_v else []
        sizes += per_cache + [g.n_kv_swa * T * (2 if g.flash_attn else F32)]
    sizes.append(g.n_outputs * 4)
    return sum(n + (-n % a) for n in sizes)


def _moe_ffn(w: _Walk, g: Graph, t: int) -> None:
    """A MoE layer's FFN on `t` tokens, from ffn_norm to ffn_out, in build_moe_ffn's order
    (src/llama-graph.cpp at 0c1e570). Transcribed from the source, not from allocator traces
    like the rest of replay(); real CPU-only loads agree (see the module docstring), the
    device-side expert copies are from the source alone.

    router logits (n_expert x t, F32), softmax in place; the argsort of the probabilities
    (n_expert x t, I32), whose top-k view selects the experts and lives until the down
    projection; the selected experts' weights (k x t) and, when renormalised, their sum (t);
    then the mul_mat_id outputs: up and gate (n_ff_exp x k x t each), their GLU product, down
    (n_embd x k x t, the largest for most shapes), weighted in place, and the sum of the k
    expert rows (n_embd x t; the first add cannot reuse a view of a tensor with k views).
    Biases (gpt-oss) are added in place (ADD_ID). A host-resident expert weight is copied into
    the buffer at the start of its matmul's split and freed after it (ggml-backend.cpp: inputs
    of a split; one copy at a time on a single GPU). A shared expert (Qwen2-MoE) runs as a dense
    FFN beside it, its sigmoid gate a 1 x t row.
    """
    n_exp, k, Fe, E = g.n_expert, g.n_expert_used, g.n_ff_exp, g.n_embd
    up_copy, gate_copy, down_copy = g.expert_copy if t >= _OP_OFFLOAD_MIN_BATCH else (0, 0, 0)

    def matmul_id(name: str, size: int, copy: int) -> None:
        if copy:
            w.A("w_copy", copy)
        w.A(name, size)
        if copy:
            w.F("w_copy")

    w.A("logits", n_exp * t * F32)
    w.R("probs", "logits")  # soft_max in place (gpt-oss: the logits themselves)
    w.A("argsort", n_exp * t * 4)
    w.A("weights", k * t * F32)  # get_rows(probs, selected); softmax/div/scale in place
    w.F("probs")
    if g.moe_norm_w:
        w.A("weights_sum", t * F32)  # sum_rows, clamped in place
        w.F("weights_sum")  # div(weights, sum) in place
    # the graph reaches them through the GLU's sources: gate first, then up
    matmul_id("gate", Fe * k * t * F32, gate_copy)
    matmul_id("up", Fe * k * t * F32, up_copy)
    if not g.n_ff_shexp:
        w.F("ffn_norm")
    w.A("glu", Fe * k * t * F32)
    w.F("gate", "up")
    matmul_id("down", E * k * t * F32, down_copy)
    w.F("glu", "argsort")
    w.R("weighted", "down")  # mul(experts, weights) in place
    w.F("weights")
    w.A("ffn_out", E * t * F32)  # the sum of the k expert rows (then in place)
    w.F("weighted")
    if g.n_ff_shexp:
        # mul(ffn(cur), sigmoid gate): the graph reaches the FFN first, then the gate
        S = g.n_ff_shexp
        w.A("sh_gate", S * t * F32)
        w.A("sh_up", S * t * F32)
        w.A("sh_glu", S * t * F32)
        w.F("sh_gate", "sh_up")
        w.A("sh_out", E * t * F32)
        w.F("sh_glu")
        w.A("sh_gate_inp", t * F32)  # ffn_gate_inp_shexp x cur: 1 x t
        w.F("ffn_norm")
        w.A("sh_sigmoid", t * F32)  # silu(x) / x: the div in place
        w.F("sh_gate_inp")
        w.F("sh_sigmoid")  # mul in place
        w.F("sh_out")  # added to ffn_out in place


_OP_OFFLOAD_MIN_BATCH = 32  # ggml-cuda.cu: GGML_OP_OFFLOAD_MIN_BATCH's default
_UNQUANTIZED_CACHE = ("f16", "bf16", "f32")


def worst_case_graph(
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
    n_batch: int = 2048,
    expert_copy: tuple[int, int, int] = (0, 0, 0),
) -> Graph:
    """The Graph llama_context::sched_reserve builds for these llama-server settings
    (see budget.llamacpp_compute_buffer_bytes for the parameters; n_batch is -b).
    expert_copy: the bytes of a host-resident up, gate and down expert weight (--n-cpu-moe),
    which a device buffer holds a copy of while a prefill-sized batch multiplies by it."""
    if not flash_attn and cache_v not in _UNQUANTIZED_CACHE:
        # llama_context refuses it: a quantized V cache needs flash attention
        raise ValueError(f"llama.cpp needs flash attention for a quantized V cache ({cache_v})")
    ctx = -(-n_ctx // 256) * 256  # llama_context pads n_ctx, then each sequence's share
    n_kv = ctx if n_seq == 1 else -(-(ctx // n_seq) // 256) * 256
    ctx = n_kv * n_seq
    # llama_context: n_batch <= the requested n_ctx (causal attention), n_ubatch <= n_batch;
    # sched_reserve: n_tokens = min(n_ctx, n_ubatch); graph_reserve: a multiple of n_seq
    ubatch = min(n_ctx, n_batch, n_ubatch)
    tokens = -(-min(ctx, ubatch) // n_seq) * n_seq
    # Gemma 2/3: the sliding-window layers' own cache (llama-server's default, not --swa-full)
    n_kv_swa = llamacpp_kv_cells(shape, n_kv, ubatch)[1] if shape.swa_layers else 0
    head = shape.head_dim
    quant_k, quant_v = cache_k not in _UNQUANTIZED_CACHE, cache_v not in _UNQUANTIZED_CACHE
    rot_k = 0
    if quant_k and head % 64 == 0:  # llama_kv_cache::build_input_k_rot
        rot_k = 64
        while head % (rot_k * 2) == 0:
            rot_k *= 2
    rot_v = 64 if quant_v and head % 64 == 0 else 0  # build_input_v_rot
    fa_extra = 0
    if device and flash_attn and tokens // n_seq > 2:  # tile/MMA kernels want F16 K and V
        out = end = shape.q_dim * tokens * 4
        for cache in (cache_k, cache_v):
            if cache != "f16":
                end = -(-end // 128) * 128 + shape.kv_dim * n_kv * n_seq * 2
        fa_extra = end - out
    return Graph(
        n_embd=shape.hidden_size,
        n_embd_q=shape.q_dim,
        n_embd_kv=shape.kv_dim,
        n_ff=shape.intermediate_size,
        n_head=shape.num_attention_heads,
        n_vocab=shape.vocab_size,
        n_layer=shape.num_hidden_layers,
        n_kv=n_kv,
        n_tokens=tokens,
        n_stream=n_seq,
        n_kv_swa=n_kv_swa,
        # gemma2 and gpt-oss slide on every other layer (model_config._sliding_window)
        swa_pattern=2 if shape.arch in ("gemma2", "gpt-oss") else 6,
        n_outputs=n_seq if n_outputs is None else n_outputs,
        flash_attn=flash_attn,
        rot_k=rot_k,
        rot_v=rot_v,
        device=device,
        alignment=128 if device else 32,
        fa_extra=fa_extra,
        n_expert=shape.num_experts,
        n_expert_used=shape.num_experts_per_tok,
        n_ff_exp=shape.expert_intermediate_size,
        n_ff_shexp=shape.shared_expert_intermediate_size,
        # llama.cpp renormalises the selected experts' weights for Mixtral (llama) and Qwen3-MoE,
        # not for Qwen2-MoE or gpt-oss (norm_w in models/*.cpp)
        moe_norm_w=shape.arch in ("llama", "qwen3moe"),
        expert_copy=expert_copy if device else (0, 0, 0),
    )
