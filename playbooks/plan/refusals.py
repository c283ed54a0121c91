"""Why a quant, a cache type or a split cannot run on a target whatever the memory says:
BF16 on a card without it, then what each engine refuses (plan/engine_*.py: ExLlamaV2 on a CPU or for
an architecture it lacks, a draft or RPC workers with EXL2). Each reason is short text, the
fit table's cell ("": it can run)."""

from __future__ import annotations

from playbooks.plan.engines import engine, engine_of_quant
from playbooks.plan.gpus import Gpu
from playbooks.plan.model_config import ModelShape
from playbooks.plan.serving import DraftPlan, Serving


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
    """Why this engine cannot run on this target at all, memory aside ("": it can): BF16 on a
    card without it, then the engine's own refusals (plan/engines.py)."""
    if why := bf16_refusal(gpu, quant, cache):
        return why
    return engine(backend).refusal(gpu, shape, draft)


def split_unfit_reason(shape: ModelShape, quant: str, gpu: Gpu, draft: DraftPlan | None, s: Serving) -> str:
    """Why a split over several devices is not planned for this ("": it is)."""
    if why := bf16_refusal(gpu, quant, (s.cache_k, s.cache_v)):
        return why
    if gpu.is_cpu and not s.rpc_devices:
        return "a CPU target has no cards to split over"
    if why := engine_of_quant(quant).split_refusal(shape, s):
        return why
    if shape.is_moe and s.n_cpu_moe != 0:
        return "no split planned with experts in host RAM (n_cpu_moe): a split keeps every expert on a device"
    if draft is not None:
        return "no split planned with a draft"
    return ""
