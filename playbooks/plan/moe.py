"""Mixture-of-experts on a small GPU: expert tensors in host RAM, and the two-sided roofline.

A MoE token reads only its routed experts: num_experts_per_tok of num_experts slices of every
stacked expert tensor, so the bytes read per token are far below the weights' size. When the
weights do not fit the GPU, llama-server can keep the expert tensors of some layers in host
RAM and run those layers' expert matmuls on the CPU: its `--n-cpu-moe N` (common/arg.cpp at
the pinned ref 0c1e570) adds, for i in 0..N-1, a buffer override `blk\\.{i}\\.ffn_(up|down|gate|
gate_up)_(ch|)exps` -> CPU (common/common.h, LLM_FFN_EXPS_REGEX and llm_add_n_cpu_ffn_overrides).
The loader matches it with std::regex_search on the tensor name (src/llama-model-loader.cpp),
so it moves:
- the expert weights AND their biases (gpt-oss's `ffn_{gate,up,down}_exps.bias` match too) of
  the FIRST N layers;
- not the router (`ffn_gate_inp`), not a shared expert (`ffn_*_shexp` does not match `_exps`),
  not attention or norms: those stay on the GPU.
N larger than the layer count is accepted by llama.cpp (the extra patterns match nothing).

Decode then costs, per token: the GPU's bytes over its bandwidth plus the host-resident
active expert bytes over the host's memory bandwidth (the CPU reads them in its own RAM; a
1-token matmul is below the CUDA backend's op-offload batch of 32, so it is not copied to the
GPU). That is the two-sided roofline. Not in it: the per-layer hand-offs (two tiny activation
copies over PCIe and a synchronisation per offloaded layer) and the CPU's arithmetic, which
on few cores can bind before its memory does (docs/knowledge.md section 8). It stays a
ceiling.

Prefill is different: a micro-batch of >= 32 tokens makes the scheduler copy each host-resident
expert tensor to the GPU for its matmul (ggml-backend.cpp, op_offload; ggml-cuda.cu,
GGML_OP_OFFLOAD_MIN_BATCH default 32). The copy lives in the CUDA compute buffer, one tensor at
a time (each such matmul starts its own split, so the previous copy's memory is reused), so
the compute buffer grows by about the largest expert tensor of an offloaded layer: see
copy_bytes and compute_buffer.replay.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

from playbooks.plan.ggml_types import GGML_QUANT_SIZES
from playbooks.plan.ggml_types import GGMLQuantizationType as T
from playbooks.plan.gguf_size import assign_types, estimate_gguf, tensor_bytes
from playbooks.plan.model_config import ModelShape
from playbooks.plan.tensors import Cat

#: Host memory bandwidth assumed when neither the host (a measurement) nor the user (a flag or
#: the recipe's planner.host_membw_gb_s) gives one: the ~50 GB/s DDR4 read rate of the seed
#: report's host (docs/knowledge.md section 1: 17 GB of Q8_0 read at ~50 GB/s -> 4 tok/s).
#: Dual-socket Xeon hosts of V100s reach more on paper; one llama.cpp process on one NUMA node
#: usually does not. Conservative on purpose: the plan says when it used this default.
HOST_MEMBW_DEFAULT_GB_S = 50.0
#: ggml-cuda.cu: an op whose batch has at least this many rows runs on the GPU even when its
#: weights are in host memory (the weights are copied over for it).
OP_OFFLOAD_MIN_BATCH = 32
#: ggml-cuda: a quantized tensor's allocation is padded to a multiple of 512 elements per row
#: (ggml_backend_cuda_buffer_type_get_alloc_size, MATRIX_ROW_PADDING).
MATRIX_ROW_PADDING = 512

MembwSource = Literal["measured", "given", "default"]
RamSource = Literal["measured", "given", "unknown"]
NCpuMoe = int | Literal["auto"]


@dataclass(frozen=True)
class HostMemory:
    """What the planner knows of the host's memory: its bandwidth (always a figure, with where
    it came from) and its RAM (None: unknown, the plan says it could not check)."""

    membw_gb_s: float = HOST_MEMBW_DEFAULT_GB_S
    membw_source: MembwSource = "default"
    ram_bytes: int | None = None
    ram_source: RamSource = "unknown"


_UNQUANTIZED = {T.F32, T.F16, T.BF16}


def cuda_alloc_bytes(ne: tuple[int, ...], ttype: T) -> int:
    """What ggml-cuda allocates for a tensor: its bytes, plus the row padding of a quantized
    type whose row length is not a multiple of 512 (one partial row's worth, not per row)."""
    size = tensor_bytes(ne, ttype)
    if ttype not in _UNQUANTIZED and ne[0] % MATRIX_ROW_PADDING:
        block, per_block = GGML_QUANT_SIZES[ttype]
        size += (MATRIX_ROW_PADDING - ne[0] % MATRIX_ROW_PADDING) // block * per_block
    return size


@dataclass(frozen=True)
class ExpertLayout:
    """One GGUF quant of a MoE model, split the way --n-cpu-moe splits it (all bytes)."""

    n_expert: int
    n_expert_used: int
    #: bytes read per token outside the experts: every tensor on the GPU but the experts (the
    #: router, attention, norms, a shared expert, the LM head); token_embd only when tied (then
    #: the LM head reads it whole), since one row of it is looked up in host memory otherwise
    resident_read_bytes: int
    #: per layer: the bytes of the tensors --n-cpu-moe moves (stacked expert weights + biases)
    expert_bytes: tuple[int, ...]
    #: per layer: what CUDA allocates to copy the up, gate and down expert weights for prefill
    copy_bytes: tuple[tuple[int, int, int], ...]
    #: token_embd: in host memory always (llama.cpp's input layer); tied: also the LM head
    token_embd_bytes: int
    tied: bool

    @property
    def n_layer(self) -> int:
        return len(self.expert_bytes)

    def active(self, expert_bytes: int) -> int:
        """The bytes one token reads of stacked expert tensors of this many bytes: each expert's
        slice is bytes / n_expert (nb[2]) exactly, and a token reads n_expert_used of them."""
        return expert_bytes // self.n_expert * self.n_expert_used

    def host_expert_bytes(self, n: int) -> int:
        """Bytes --n-cpu-moe n keeps in host RAM (the experts of layers 0..n-1)."""
        return sum(self.expert_bytes[:n])

    def per_token(self, n: int) -> tuple[int, int]:
        """(bytes read on the GPU, bytes read in host RAM) per decoded token with n layers'
        experts in host RAM. KV reads are not included (see the planner's full-context figure)."""
        host = sum(self.active(b) for b in self.expert_bytes[:n])
        gpu = self.resident_read_bytes + sum(self.active(b) for b in self.expert_bytes[n:])
        return gpu, host

    def copies(self, n: int) -> tuple[int, int, int]:
        """The largest up, gate and down copy among the first n layers ((0, 0, 0) for n = 0)."""
        rows = self.copy_bytes[:n]
        if not rows:
            return (0, 0, 0)
        return (max(r[0] for r in rows), max(r[1] for r in rows), max(r[2] for r in rows))

    def host_resident_bytes(self, n: int) -> int:
        """Host RAM the weights take: token_embd plus the offloaded experts (mmap'd pages)."""
        return self.token_embd_bytes + self.host_expert_bytes(n)


@lru_cache(maxsize=128)
def expert_layout(shape: ModelShape, ftype: str, imatrix: bool = False) -> ExpertLayout:
    """The bytes of a GGUF quant of a MoE shape, per layer: the size model's own sums
    (gguf_size.estimate_gguf: the expert bytes of each layer, token_embd, what a token streams),
    plus what CUDA allocates to copy each expert weight for prefill. Nothing here is a second
    size model."""
    if not shape.is_moe:
        raise ValueError(f"{shape.model_type} is a dense model: it has no experts to lay out")
    est = estimate_gguf(shape, ftype, imatrix=imatrix)
    copies = [[0, 0, 0] for _ in range(shape.num_hidden_layers)]
    for t, ttype in assign_types(shape, ftype, imatrix=imatrix):
        if t.experts and len(t.ne) == 3:  # the weights (biases are copied too, but are small)
            slot = {Cat.FFN_UP: 0, Cat.FFN_GATE: 1, Cat.FFN_DOWN: 2}[t.cat]
            copies[t.layer][slot] = cuda_alloc_bytes(t.ne, ttype)
    return ExpertLayout(
        n_expert=est.n_expert,
        n_expert_used=est.n_expert_used,
        # what a token streams (token_embd only when tied) less the experts, which it reads in part
        resident_read_bytes=est.streamed_bytes_per_token - est.expert_bytes,
        expert_bytes=est.expert_bytes_per_layer,
        copy_bytes=tuple((c[0], c[1], c[2]) for c in copies),
        token_embd_bytes=est.token_embd_bytes,
        tied=est.tied_output,
    )


def two_sided_tok_s(gpu_bytes: float, gpu_gb_s: float, host_bytes: float, host_gb_s: float) -> float:
    """Single-stream decode ceiling when a token reads gpu_bytes in VRAM and host_bytes in host
    RAM, one after the other (a layer's experts run where they are, in layer order):
    1 / (gpu_bytes / gpu bandwidth + host_bytes / host bandwidth). GB/s = 1e9 bytes/s."""
    seconds = gpu_bytes / (gpu_gb_s * 1e9) + (host_bytes / (host_gb_s * 1e9) if host_bytes else 0.0)
    return 1.0 / seconds


@dataclass(frozen=True)
class OffloadStep:
    """One row of the --n-cpu-moe ladder: what N costs in VRAM and what it leaves of speed."""

    n_cpu_moe: int
    vram_bytes: int
    fits: bool
    host_weights_bytes: int  # experts kept in host RAM
    gpu_bytes_per_token: int
    host_bytes_per_token: int
    roofline_tok_s: float


def ladder_points(n_layer: int, n_fit: int | None) -> list[int]:
    """Which N the text output shows: 0, the smallest that fits, then quarters of the layer count
    up to all layers (the fitting ones and a few beyond, never all of them)."""
    points = {0, n_layer}
    if n_fit is not None:
        points.add(n_fit)
    quarters = {round(n_layer * q / 4) for q in (1, 2, 3)}
    points |= {q for q in quarters if n_fit is None or q > n_fit}
    return sorted(points)
