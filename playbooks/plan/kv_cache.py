"""KV cache bytes: 2 (K and V) x layers x kv_heads x head_dim x bytes per element.

llama.cpp cache types are ggml types stored in blocks (q8_0: 34 bytes per 32 values).
ExLlamaV2's quantized caches (exllamav2/cache.py, 0.3.2) store K and V packed in uint8 plus one
FP16 scale per 32 values: Q4 = 4-bit K and V, Q6 = 8-bit K with 4-bit V, Q8 = 8-bit both.
They also keep one layer's K and V in FP16 as a scratch copy, counted separately here.
"""

from __future__ import annotations

from fractions import Fraction

from playbooks.plan.ggml_types import GGML_QUANT_SIZES
from playbooks.plan.ggml_types import GGMLQuantizationType as T
from playbooks.plan.model_config import ModelShape

# bytes per cached element, as exact fractions, for (K, V)
LLAMACPP_CACHE_TYPES: dict[str, T] = {
    "f16": T.F16,
    "bf16": T.BF16,
    "f32": T.F32,
    "q8_0": T.Q8_0,
    "q5_1": T.Q5_1,
    "q5_0": T.Q5_0,
    "q4_1": T.Q4_1,
    "q4_0": T.Q4_0,
    "iq4_nl": T.IQ4_NL,
}

_SCALE = Fraction(2, 32)  # one FP16 scale per 32 values
EXL2_CACHE_MODES: dict[str, tuple[Fraction, Fraction]] = {
    "FP16": (Fraction(2), Fraction(2)),
    "Q8": (Fraction(1) + _SCALE, Fraction(1) + _SCALE),
    "Q6": (Fraction(1) + _SCALE, Fraction(1, 2) + _SCALE),
    "Q4": (Fraction(1, 2) + _SCALE, Fraction(1, 2) + _SCALE),
}


def llamacpp_element_bytes(cache_type: str) -> Fraction:
    block, size = GGML_QUANT_SIZES[LLAMACPP_CACHE_TYPES[cache_type]]
    return Fraction(size, block)


def kv_bytes_per_token(shape: ModelShape, k_bytes: Fraction, v_bytes: Fraction | None = None) -> int:
    """Bytes of K and V one token occupies across all layers."""
    v_bytes = k_bytes if v_bytes is None else v_bytes
    per_layer = shape.kv_dim * (k_bytes + v_bytes)
    total = per_layer * shape.num_hidden_layers
    if total.denominator != 1:
        raise ValueError(f"kv_dim {shape.kv_dim} is not a whole number of cache blocks")
    return int(total)


def llamacpp_kv_bytes_per_token(shape: ModelShape, type_k: str = "f16", type_v: str | None = None) -> int:
    return kv_bytes_per_token(shape, llamacpp_element_bytes(type_k), llamacpp_element_bytes(type_v or type_k))


def exl2_kv_bytes_per_token(shape: ModelShape, mode: str = "FP16") -> int:
    k, v = EXL2_CACHE_MODES[mode]
    return kv_bytes_per_token(shape, k, v)


def exl2_cache_scratch_bytes(shape: ModelShape, mode: str, tokens: int) -> int:
    """ExLlamaV2_Cache_Q keeps FP16 temp K and V for one layer (touch_device)."""
    if mode == "FP16":
        return 0
    return 2 * tokens * shape.kv_dim * 2


def _pad(n: int, to: int = 256) -> int:
    return (n + to - 1) // to * to


def llamacpp_kv_cells(shape: ModelShape, n_ctx: int, n_ubatch: int = 512) -> tuple[int, int]:
    """(cells of a full layer, cells of a sliding-window layer) llama.cpp allocates.

    llama_context pads n_ctx to 256; a SWA layer holds min(n_ctx, n_swa + n_ubatch) cells,
    padded to 256 (llama-kv-cache-iswa.cpp, one sequence per slot as with an explicit -np).
    """
    full = _pad(n_ctx)
    if not shape.swa_layers:
        return full, 0
    assert shape.sliding_window is not None  # SWA layers come with their window (model_config._sliding_window)
    return full, _pad(min(full, shape.sliding_window + n_ubatch))


def llamacpp_kv_bytes(
    shape: ModelShape, n_ctx: int, type_k: str = "f16", type_v: str | None = None, n_ubatch: int = 512
) -> int:
    """Total KV buffer llama.cpp allocates for n_ctx cells (all slots together)."""
    per_layer_token = llamacpp_kv_bytes_per_token(shape, type_k, type_v) // shape.num_hidden_layers
    full, swa = llamacpp_kv_cells(shape, n_ctx, n_ubatch)
    full_layers = shape.num_hidden_layers - shape.swa_layers
    return per_layer_token * (full_layers * full + shape.swa_layers * swa)
