"""A model's shape, read from its Hugging Face config.json.

Everything the planner computes (tensor sizes, KV cache, roofline) starts here, so the shape
is taken from the real config and never guessed: `head_dim` is used when the config declares
it (Gemma, Qwen3 and others do, and there it is not hidden_size / num_attention_heads).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from playbooks.errors import RecipeError

# Architectures whose tensor layout the GGUF size model knows (llama.cpp's names in brackets).
# Qwen2 carries biases on q/k/v; Qwen3 and Gemma3 have per-head q/k norms; Gemma2/3 add
# post-attention and post-FFN norms and tie their embeddings.
KNOWN_MODEL_TYPES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "gemma3": "gemma3",
    # Mixture-of-experts: llama.cpp converts Mixtral as `llama` with expert tensors.
    "mixtral": "llama",
    "qwen2_moe": "qwen2moe",
    "qwen3_moe": "qwen3moe",
    "gpt_oss": "gpt-oss",
}

# The MoE architectures and where their config keeps the expert FFN width: Qwen's MoE configs
# have a dense `intermediate_size` too (for mlp_only_layers) and the experts' own
# `moe_intermediate_size`; Mixtral and gpt-oss size every expert by `intermediate_size`.
MOE_MODEL_TYPES = {
    "mixtral": "intermediate_size",
    "qwen2_moe": "moe_intermediate_size",
    "qwen3_moe": "moe_intermediate_size",
    "gpt_oss": "intermediate_size",
}


class ModelShape(BaseModel):
    """The numbers that decide memory and speed. All counts, no units."""

    model_config = ConfigDict(frozen=True)

    model_type: str
    arch: str = Field(description="llama.cpp architecture family used for the tensor layout")
    hidden_size: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    num_hidden_layers: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    vocab_size: int = Field(gt=0)
    max_position_embeddings: int = Field(gt=0)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    torch_dtype: str = "bfloat16"
    # sliding-window attention as llama.cpp runs it (Gemma 2/3 only): window and SWA layer count
    sliding_window: int | None = None
    swa_layers: int = 0
    swa_pattern: int = 0  # layer il has a window when il % swa_pattern < swa_pattern - 1
    # Mixture of experts (0 = dense): every layer routes each token to num_experts_per_tok of
    # num_experts FFNs of width expert_intermediate_size; Qwen2-MoE adds one shared expert.
    num_experts: int = Field(0, ge=0)
    num_experts_per_tok: int = Field(0, ge=0)
    expert_intermediate_size: int = Field(0, ge=0)
    shared_expert_intermediate_size: int = Field(0, ge=0)
    # The checkpoint ships its expert weights already quantized to MXFP4 (gpt-oss: quantization_config
    # quant_method "mxfp4"); llama.cpp's converter copies them into the GGUF as MXFP4 whatever --outtype.
    mxfp4_experts: bool = False

    @model_validator(mode="after")
    def _gqa_divides(self) -> ModelShape:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok {self.num_experts_per_tok} must be between 1 and num_experts {self.num_experts}"
            )
        if self.num_experts and not self.expert_intermediate_size:
            raise ValueError("a mixture-of-experts model needs its experts' FFN width")
        return self

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def active_expert_fraction(self) -> float:
        """The share of every expert tensor one token reads (1.0 for a dense model)."""
        return self.num_experts_per_tok / self.num_experts if self.num_experts else 1.0

    @property
    def n_gqa(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim


def shape_from_config(cfg: dict[str, Any], where: str = "config.json") -> ModelShape:
    """Build a ModelShape from a config.json dict; errors name `where` and the key."""
    if not isinstance(cfg, dict):
        raise RecipeError(f"{where}: a model config must be a JSON object, got {type(cfg).__name__}")
    # Multimodal configs (Gemma 3, ...) keep the language model under text_config.
    if isinstance(cfg.get("text_config"), dict):
        merged = dict(cfg["text_config"])
        merged.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", True))
        merged.setdefault("torch_dtype", cfg.get("torch_dtype", "bfloat16"))
        cfg = merged
    model_type = cfg.get("model_type")
    if model_type not in KNOWN_MODEL_TYPES:
        raise RecipeError(
            f"{where}: model_type {model_type!r} is not supported by the planner; "
            f"supported: {', '.join(sorted(KNOWN_MODEL_TYPES))}"
        )
    moe = _experts(model_type, cfg, where)
    required = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    missing = [k for k in required if k not in cfg]
    if missing:
        raise RecipeError(f"{where}: missing key(s) {', '.join(missing)} (needed to size the model)")
    heads = cfg["num_attention_heads"]
    fields = {
        "model_type": model_type,
        "arch": KNOWN_MODEL_TYPES[model_type],
        "hidden_size": cfg["hidden_size"],
        "intermediate_size": cfg["intermediate_size"],
        "num_hidden_layers": cfg["num_hidden_layers"],
        "num_attention_heads": heads,
        "num_key_value_heads": cfg.get("num_key_value_heads") or heads,
        # Declared head_dim wins: Gemma-2-27B has hidden 4608 / 32 heads = 144 but head_dim 128.
        "head_dim": cfg.get("head_dim") or (cfg["hidden_size"] // heads if isinstance(heads, int) and heads else 0),
        "vocab_size": cfg["vocab_size"],
        "max_position_embeddings": cfg.get("max_position_embeddings", 4096),
        # transformers' own default when the key is absent: Gemma configs tie, the others do not
        "tie_word_embeddings": cfg.get("tie_word_embeddings", model_type.startswith("gemma")),
        # Qwen2 always has q/k/v biases (its config does not say so); others declare it.
        "attention_bias": bool(cfg.get("attention_bias", model_type in ("qwen2", "qwen2_moe"))),
        "torch_dtype": cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16",
    }
    fields.update(_sliding_window(model_type, cfg))
    fields.update(moe)
    try:
        return ModelShape(**fields)
    except ValidationError as exc:
        err = exc.errors()[0]
        key = ".".join(str(p) for p in err["loc"]) or "config"
        raise RecipeError(f"{where}: {key}: {err['msg']} (got {err.get('input')!r})") from None


def _experts(model_type: str, cfg: dict[str, Any], where: str) -> dict[str, Any]:
    """The expert counts and widths of a MoE config; {} for a dense one.

    A dense architecture that names experts, or a MoE one missing a count, is refused: the
    sizes would be silently wrong either way.
    """
    counts = {k: cfg.get(k) for k in ("num_local_experts", "num_experts", "n_routed_experts") if cfg.get(k)}
    if model_type not in MOE_MODEL_TYPES:
        if counts:
            key, value = next(iter(counts.items()))
            raise RecipeError(
                f"{where}: {key}={value} but model_type {model_type!r} is a dense architecture; "
                f"mixture-of-experts model types: {', '.join(sorted(MOE_MODEL_TYPES))}"
            )
        return {}
    width_key = MOE_MODEL_TYPES[model_type]
    n_expert = cfg.get("num_local_experts") or cfg.get("num_experts")
    missing = [
        k
        for k, v in (
            ("num_experts" if model_type.startswith("qwen") else "num_local_experts", n_expert),
            ("num_experts_per_tok", cfg.get("num_experts_per_tok")),
            (width_key, cfg.get(width_key)),
        )
        if not v
    ]
    if missing:
        raise RecipeError(
            f"{where}: {model_type} is a mixture-of-experts model but the config has no "
            f"{', '.join(missing)} (needed to size the experts)"
        )
    if model_type == "qwen3_moe" and (cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1):
        # llama.cpp's qwen3moe graph puts experts in every layer; a checkpoint with dense
        # layers between would not load there.
        raise RecipeError(
            f"{where}: mlp_only_layers / decoder_sparse_step: dense layers inside a qwen3_moe model "
            "are not supported (llama.cpp's qwen3moe has experts in every layer)"
        )
    return {
        "num_experts": n_expert,
        "num_experts_per_tok": cfg.get("num_experts_per_tok"),
        "expert_intermediate_size": cfg.get(width_key),
        "shared_expert_intermediate_size": cfg.get("shared_expert_intermediate_size") or 0,
        # conversion/gpt_oss.py repacks `*_blocks`/`*_scales` experts to ggml MXFP4 (repack_mxfp4) and
        # skips dequantizing them; a BF16 re-upload without quantization_config is converted like any model
        "mxfp4_experts": model_type == "gpt_oss" and _quant_method(cfg) == "mxfp4",
    }


def _quant_method(cfg: dict[str, Any]) -> str | None:
    qc = cfg.get("quantization_config")
    return qc.get("quant_method") if isinstance(qc, dict) else None


def _sliding_window(model_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Which layers llama.cpp gives a sliding-window KV cache (models/gemma2.cpp, gemma3.cpp).

    Gemma 2: every even layer (pattern 2), window 4096 unless the config says otherwise.
    Gemma 3: five of every six layers (pattern 6), only when the config sets sliding_window.
    gpt-oss: every even layer (pattern 2), window 128.
    Other architectures (Qwen2's use_sliding_window, Mistral v0.1's window) get a full cache in
    llama.cpp, so none is planned for them.
    """
    layers = cfg.get("num_hidden_layers")
    if not isinstance(layers, int) or layers <= 0:
        return {}
    if model_type == "gemma2":
        window, pattern = cfg.get("sliding_window") or 4096, 2
    elif model_type in ("gemma3", "gemma3_text") and cfg.get("sliding_window"):
        window, pattern = cfg["sliding_window"], cfg.get("sliding_window_pattern") or 6
    elif model_type == "gpt_oss":
        # llama.cpp's openai-moe graph: every other layer has a window (set_swa_pattern(2))
        window, pattern = cfg.get("sliding_window") or 128, 2
    else:
        return {}
    swa = sum(1 for il in range(layers) if il % pattern < pattern - 1)
    return {"sliding_window": window, "swa_layers": swa, "swa_pattern": pattern}


def is_swa_layer(shape: ModelShape, il: int) -> bool:
    """Whether llama.cpp gives layer `il` a sliding-window cache (see _sliding_window)."""
    p = shape.swa_pattern
    return bool(shape.swa_layers) and p > 0 and il % p < p - 1


def load_config_file(path: Path) -> ModelShape:
    """Read a config.json file into a ModelShape with file-and-line errors."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise RecipeError(f"{path}: cannot read model config: {exc.strerror}") from None
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RecipeError(f"{path}:{exc.lineno}: invalid JSON: {exc.msg}") from None
    return shape_from_config(cfg, where=str(path))
