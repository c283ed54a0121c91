"""One quant evaluated on one target: the option's memory, fit, largest context and roofline.

The dispatch is here; a split over several devices is layer_split.py's, a MoE GGUF quant with
experts in host RAM moe_offload.py's, one card's budget budget.py's.
"""

from __future__ import annotations

from dataclasses import replace

from playbooks.plan.budget import (
    draft_parts,
    kv_per_token,
    max_ctx,
    vram_at,
    weight_bytes,
)
from playbooks.plan.engines import engine_of_quant
from playbooks.plan.gpus import Gpu
from playbooks.plan.layer_split import (
    evaluate_split,
)
from playbooks.plan.model_config import ModelShape
from playbooks.plan.moe import (
    HostMemory,
)
from playbooks.plan.moe_offload import evaluate_moe
from playbooks.plan.refusals import (
    split_unfit_reason,
    unfit_reason,
)
from playbooks.plan.roofline import roofline_tok_s
from playbooks.plan.serving import DraftPlan, Option, Serving
from playbooks.plan.tensors import parameter_count


def evaluate(
    shape: ModelShape,
    quant: str,
    gpu: Gpu,
    s: Serving,
    draft: DraftPlan | None = None,
    host: HostMemory | None = None,
) -> Option:
    """One quant at these settings. A MoE GGUF quant gets its --n-cpu-moe (see evaluate_moe);
    a dense GGUF quant over several GPUs its layer split (evaluate_split)."""
    if s.split:
        if why := split_unfit_reason(shape, quant, gpu, draft, s):
            # what it would take on one card, marked unfit with the split's reason
            one = replace(s, gpu_count=1, tensor_split=(), rpc_devices=0)
            return replace(evaluate(shape, quant, gpu, one, draft), unfit_reason=why)
        return evaluate_split(shape, quant, gpu, s, draft)
    if shape.is_moe and engine_of_quant(quant).offloads_experts:
        return evaluate_moe(shape, quant, gpu, s, draft, host or HostMemory())
    file_b, gpu_w, streamed = weight_bytes(shape, quant, s)
    kv_tok = kv_per_token(shape, s)
    kv, compute, overhead, draft_b = vram_at(shape, s, s.context, gpu, draft)
    backend = engine_of_quant(quant).name
    unfit = unfit_reason(backend, gpu, shape, draft, quant, (s.cache_k, s.cache_v))
    draft_kv, draft_compute = draft_parts(draft, s, gpu)
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
        max_ctx=0 if unfit else max_ctx(shape, s, gpu_w, gpu, draft),
        roofline_tok_s=roofline_tok_s(gpu.bandwidth_gb_s, streamed),
        # one slot reading its full context of KV on every token
        roofline_full_ctx_tok_s=roofline_tok_s(gpu.bandwidth_gb_s, streamed + kv_tok * s.context),
        draft_bytes=draft_b,
        draft_kv_bytes=draft_kv,
        draft_compute_bytes=draft_compute,
        unfit_reason=unfit,
    )
