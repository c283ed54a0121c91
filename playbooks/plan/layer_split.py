"""One model over several devices: llama.cpp's layer split over local cards and RPC workers
(split.py assigns the layers) and ExLlamaV2's over local cards (exl2_split.py places the
modules). Each device's share is checked against its own memory; the option speaks of the
worst device."""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

from playbooks.plan.budget import (
    kv_per_token,
    largest_ctx,
    replay_cached,
    weight_bytes,
)
from playbooks.plan.compute_buffer import device_input_bytes, worst_case_graph
from playbooks.plan.exl2_size import (
    exl2_attention_bytes,
    exl2_chunk_bytes,
    head_bits_per_weight,
)
from playbooks.plan.exl2_split import Exl2Limits, Exl2Memory, Exl2Split, exl2_modules, split_exl2
from playbooks.plan.gpus import MIB, Gpu
from playbooks.plan.kv_cache import (
    exl2_cache_scratch_bytes,
)
from playbooks.plan.model_config import ModelShape
from playbooks.plan.refusals import (
    unfit_reason,
)
from playbooks.plan.serving import DraftPlan, Option, Serving
from playbooks.plan.split import (
    CPU_ALIGNMENT,
    CUDA_ALIGNMENT,
    Device,
    DeviceShare,
    split_model,
    split_tok_s,
    worst,
)
from playbooks.plan.tensors import parameter_count


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


def network_s(s: Serving) -> float:
    """Seconds the network adds to every token of an RPC split: each worker's part of the graph
    is one round trip from the server (its inputs sent, its output read back), one after the
    other; the transfer of a hidden state (KBs) is left out."""
    return s.rpc_devices * s.rpc_rtt_ms / 1000


def evaluate_split(shape: ModelShape, quant: str, gpu: Gpu, s: Serving, draft: DraftPlan | None) -> Option:
    """A quant split by layers: GGUF over s.gpu_count cards and the RPC workers
    (playbooks/plan/split.py), a MoE model with every expert on a device; EXL2 over the cards as
    ExLlamaV2 places it (plan/exl2_split.py)."""
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
    file_b, _, streamed = weight_bytes(shape, quant, s)
    kv_tok = kv_per_token(shape, s)
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
        kv_per_layer=kv_per_token(shape, s) // shape.num_hidden_layers * tokens,
        cache_scratch=exl2_cache_scratch_bytes(shape, s.cache_k, tokens),
        attention_work=exl2_attention_bytes(shape, ctx, batch=s.parallel),
        per_card=exl2_chunk_bytes(shape, ctx, batch=s.parallel),
        logits=shape.vocab_size * 4 * s.parallel,
    )
    modules = _exl2_modules(shape, lim, bpw, head_bits_per_weight(s.head_bits))
    return split_exl2(shape, modules, lim, split_devices(gpu, s), s.split_weights(gpu), mem)
