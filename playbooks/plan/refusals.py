"""Why a quant, a cache type or a split cannot run on a target whatever the memory says:
BF16 on a card without it, ExLlamaV2 on a CPU or for an architecture it lacks, a draft or RPC
workers with EXL2. Each reason is short text, the fit table's cell ("": it can run)."""

from __future__ import annotations

from playbooks.plan.gpus import Gpu
from playbooks.plan.model_config import ModelShape
from playbooks.plan.serving import DraftPlan, Serving

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
