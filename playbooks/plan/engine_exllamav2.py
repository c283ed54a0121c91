"""ExLlamaV2 (served by TabbyAPI) as the plan sees it: EXL2 quants at a target bits per weight,
its cache modes (one for K and V together), its working memory from its source
(plan/exl2_size.py), its placement over local cards (plan/exl2_split.py), and what it cannot
serve: a CPU, the MoE architectures it lacks, a draft model, RPC workers, parallel slots before
Ampere. The engine interface is plan/engine_base.py.

Where the rest of ExLlamaV2 lives: its host half (steps/serve/engine_exllamav2.py: TabbyAPI's
config and unit, what the host builds for it, the EXL2 directory it loads and the links beside
it), its build (steps/build/exllamav2.py, tabbyapi*.py), its conversion
(steps/weights/exl2_convert.py).
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from typing import TYPE_CHECKING

from playbooks.errors import VoltaforgeError
from playbooks.plan.engine_base import Engine, SplitPlan, split_devices
from playbooks.plan.exl2_size import (
    EXL2_BPW_LADDER,
    EXL2_BPW_RANGE,
    EXL2_MAX_INPUT_LEN,
    estimate_exl2,
    exl2_attention_bytes,
    exl2_chunk_bytes,
    exl2_quant_name,
    exl2_scratch_bytes,
    head_bits_per_weight,
)
from playbooks.plan.exl2_split import Exl2Limits, Exl2Memory, Exl2Split, exl2_modules, split_exl2
from playbooks.plan.kv_cache import EXL2_CACHE_MODES, exl2_cache_scratch_bytes, exl2_kv_bytes_per_token
from playbooks.plan.tensors import model_tensors

if TYPE_CHECKING:
    from playbooks.plan.engine_base import RecipeFields
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


#: Why an EXL2 quant is no alternative to a recipe with a draft model: the draft is
#: llama-server's --model-draft (a recipe refuses `draft:` with backend exllamav2).
EXL2_NO_DRAFT = "a draft is llama-server's"

#: the cache mode ExLlamaV2 takes for llama.cpp's cache types (plan --quant EXL2-x of a GGUF recipe)
FROM_LLAMACPP_CACHE = {
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


def exl2_weight_bytes(shape: ModelShape, quant: str, s: Serving) -> tuple[int, int, int]:
    """(file bytes, bytes on the GPU, bytes streamed per token) of an EXL2 quant."""
    bpw = float(quant[5:])
    e = estimate_exl2(shape, bpw, s.head_bits)
    streamed = e.streamed_bytes_per_token
    if shape.is_moe:
        # EXL2 quantizes each expert's matrices at the same target rate as the rest
        expert = sum(t.n_elements for t in model_tensors(shape) if t.experts and len(t.ne) == 3)
        streamed -= int(expert * bpw / 8 * (1 - shape.active_expert_fraction))
    return e.file_bytes, e.gpu_weight_bytes, streamed


_exl2_modules = lru_cache(maxsize=256)(exl2_modules)


def plan_exl2_split(shape: ModelShape, quant: str, gpu: Gpu, s: Serving, ctx: int) -> Exl2Split:
    """An EXL2 quant over s.gpu_count cards at `ctx` tokens per slot: ExLlamaV2's placement for
    the allotments planned (plan/exl2_split.py), each card's cache, scratch and working set by
    the one-card formulas (exl2_compute_bytes) at the recipe's slots."""
    bpw = float(quant.removeprefix("EXL2-"))
    lim = Exl2Limits(max_seq_len=ctx)
    tokens = ctx * s.parallel
    mem = Exl2Memory(
        kv_per_layer=exl2_kv_bytes_per_token(shape, s.cache_k) // shape.num_hidden_layers * tokens,
        cache_scratch=exl2_cache_scratch_bytes(shape, s.cache_k, tokens),
        attention_work=exl2_attention_bytes(shape, ctx, batch=s.parallel),
        per_card=exl2_chunk_bytes(shape, ctx, batch=s.parallel),
        logits=shape.vocab_size * 4 * s.parallel,
    )
    modules = _exl2_modules(shape, lim, bpw, head_bits_per_weight(s.head_bits))
    return split_exl2(shape, modules, lim, split_devices(gpu, s), s.split_weights(gpu), mem)


class ExLlamaV2(Engine):
    name = "exllamav2"
    label = "ExLlamaV2"
    weights_format = "EXL2"
    server = "tabbyapi"
    server_label = "TabbyAPI"
    ignore_eos = (("ban_eos_token", True),)  # TabbyAPI's sampler option
    one_server_per_host = True
    # the recipes' defaults file holds llama.cpp's cache (f16); ExLlamaV2's own default is FP16
    default_cache = ("FP16", "FP16")

    def batches(self, compute_capability: tuple[int, int]) -> bool:
        # ExLlamaV2's batching needs flash-attn >= 2.5.7 (Ampere+); TabbyAPI forces one
        # sequence at a time before Ampere
        return compute_capability >= (8, 0)

    continuous_rate = True

    def owns_quant(self, quant: str) -> bool:
        return quant.startswith("EXL2-")

    def quant_names(self) -> list[str]:
        return [exl2_quant_name(b) for b in EXL2_BPW_LADDER]

    def parse_quant(self, text: str) -> str | None:
        """'EXL2-4' and 'exl2-4.0' both mean EXL2 at 4.0 bpw."""
        if not text.upper().startswith("EXL2-"):
            return None
        try:
            bpw = float(text[5:])
        except ValueError:
            raise VoltaforgeError(f"--quant {text!r}: EXL2 needs a number of bits, e.g. EXL2-3.3") from None
        lo, hi = EXL2_BPW_RANGE
        if not lo <= bpw <= hi:
            raise VoltaforgeError(f"--quant {text!r}: EXL2 bpw must be between {lo} and {hi}")
        return exl2_quant_name(bpw)

    def recipe_refusal(self, recipe: RecipeFields) -> str:
        if recipe.spec_type is not None:
            return "spec_type: speculative decoding is llama-server's (backend llamacpp)"
        if isinstance(recipe.quant, str) or not hasattr(recipe.quant, "bpw"):
            return "quant: backend exllamav2 needs {bpw: 2.0-8.0, head_bits: 6}"
        if recipe.cache.k not in EXL2_CACHE_MODES or recipe.cache.v != recipe.cache.k:
            return f"cache: ExLlamaV2 has one cache mode for K and V; allowed: {', '.join(EXL2_CACHE_MODES)}"
        if recipe.draft is not None:
            return "draft: draft models are planned for llamacpp recipes only"
        if recipe.threads is not None:
            return "threads: is llama.cpp's -t; ExLlamaV2 runs on the GPU (remove it)"
        if recipe.n_cpu_moe is not None:
            return (
                "n_cpu_moe: is llama-server's --n-cpu-moe; ExLlamaV2 keeps every expert on the GPU "
                "(remove it, or use backend llamacpp)"
            )
        return ""

    def known_quant(self, quant: str) -> bool:
        return self.owns_quant(quant)  # any rate in range (parse_quant checked it)

    def bpw(self, quant: str, weights_bytes: int, params: int) -> float:
        # the target rate: its FP16 embedding table stays in host memory and would inflate it
        return float(quant[5:])

    def weight_bytes(self, shape: ModelShape, quant: str, s: Serving) -> tuple[int, int, int]:
        return exl2_weight_bytes(shape, quant, s)

    def kv_bytes_per_token(self, shape: ModelShape, s: Serving) -> int:
        # ExLlamaV2 has one cache mode for K and V together
        return exl2_kv_bytes_per_token(shape, s.cache_k)

    def kv_and_compute(
        self, shape: ModelShape, s: Serving, ctx: int, gpu: Gpu, expert_copy: tuple[int, int, int] = (0, 0, 0)
    ) -> tuple[int, int]:
        tokens = ctx * s.parallel
        kv = self.kv_bytes_per_token(shape, s) * tokens  # ExLlamaV2 caches every layer for max_seq_len x batch
        compute = exl2_compute_bytes(shape, ctx, batch=s.parallel) + exl2_cache_scratch_bytes(shape, s.cache_k, tokens)
        return kv, compute

    def refusal(self, gpu: Gpu, shape: ModelShape | None, draft: DraftPlan | None) -> str:
        if gpu.is_cpu:
            return EXL2_NEEDS_CUDA
        if shape is not None and shape.model_type in EXL2_MISSING_ARCHS:
            return f"ExLlamaV2 0.3.2 has no {EXL2_MISSING_ARCHS[shape.model_type]}"
        if draft is not None:
            return EXL2_NO_DRAFT
        return ""

    def split_refusal(self, shape: ModelShape, s: Serving) -> str:
        if s.rpc_devices:
            return "RPC workers are llama.cpp's: an EXL2 quant splits over local cards only"
        if shape.is_moe:
            return "no split planned for an EXL2 mixture of experts (ExLlamaV2's MoE module is not planned)"
        return ""

    def plan_split(self, shape: ModelShape, quant: str, gpu: Gpu, s: Serving, ctx: int) -> SplitPlan:
        planned = plan_exl2_split(shape, quant, gpu, s, ctx)
        return SplitPlan(planned.shares, planned.refusal, planned.gpu_split)

    def serving(self, s: Serving) -> Serving:
        mode = FROM_LLAMACPP_CACHE[s.cache_k]
        return replace(s, backend=self.name, cache_k=mode, cache_v=mode)

    renders_gpu_split = True

    def wrong_quant(self, recipe: str, quant: str) -> str:
        return (
            f"--quant {quant}: {recipe} is an ExLlamaV2 recipe; give an EXL2 rate (EXL2-3.5), or plan a "
            "llama.cpp recipe"
        )

    def recipe_quant(self, quant: str, given: object) -> object:
        # a recipe's EXL2 quant is {bpw, head_bits}: the rate changes, its head bits stay
        head_bits = given["head_bits"] if isinstance(given, dict) else None
        return {"bpw": float(quant[5:]), "head_bits": head_bits}

    def left_out(self, gpu: Gpu, s: Serving, draft: DraftPlan | None) -> tuple[str, bool]:
        if gpu.is_cpu:
            cpu = f"ExLlamaV2 {EXL2_NEEDS_CUDA} (it has no CPU path); a CPU serves GGUF through llama.cpp"
            return f"EXL2 is left out: {cpu}", False
        if s.rpc_devices:
            return "EXL2 is left out: RPC workers are llama.cpp's (ExLlamaV2 splits over local cards only)", False
        if draft is not None:
            return f"EXL2 is left out: {EXL2_NO_DRAFT} (--model-draft)", False
        if s.parallel > 1 and not self.batches(gpu.compute_capability):
            # so it cannot serve parallel slots here
            return (
                f"EXL2 is left out of the recommendation: {s.parallel} slots need batching, "
                "which ExLlamaV2 cannot do before Ampere (no flash-attn for sm_70)",
                True,
            )
        return "", False


EXLLAMAV2 = ExLlamaV2()
