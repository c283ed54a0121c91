"""What the planner evaluates: how a model is served (Serving), one quant's evaluation at it
(Option), a draft model (DraftPlan), and the quants there are to evaluate."""

from __future__ import annotations

from dataclasses import dataclass

from playbooks.plan.engines import ENGINES, LLAMACPP, engine, engine_of_quant
from playbooks.plan.gpus import Gpu
from playbooks.plan.model_config import ModelShape
from playbooks.plan.moe import (
    NCpuMoe,
)
from playbooks.plan.split import (
    DeviceShare,
    device_count,
)


@dataclass(frozen=True)
class Serving:
    """How the model is served: what the budget depends on besides the weights."""

    backend: str = LLAMACPP.name  # the engine's name (plan/engines.py)
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
        return engine_of_quant(self.quant).bpw(self.quant, self.weights_bytes, self.params)


@dataclass(frozen=True)
class DraftPlan:
    shape: ModelShape
    quant: str


def quant_names(backend: str | None = None) -> list[str]:
    """The quants the planner evaluates: one engine's (by its `backend:` name), or every engine's."""
    return [q for e in ENGINES if backend is None or e is engine(backend) for q in e.quant_names()]


def serving_for(quant: str, s: Serving) -> Serving:
    """The same serving settings, with the cache type translated for the quant's engine."""
    target = engine_of_quant(quant)
    return s if target is engine(s.backend) else target.serving(s)
