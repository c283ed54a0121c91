"""One model across several devices, split by layers the way llama.cpp splits it.

At the pinned ref (0c1e570, src/llama-model.cpp load_tensors, --split-mode layer):
- the split points are the running sums of ``--tensor-split`` (or, when it is unset or all
  zero, of each device's free memory at load time), normalized to 1, in float32;
- with every layer offloaded (``-ngl all``: n_layer + 1 offloadable "layers", the output
  layer counting as one), layer ``il`` goes to the first device whose split point is above
  ``il / (n_layer + 1)`` (``std::upper_bound``);
- the output layer (``output_norm``, ``output``; a tied model's copy of ``token_embd``) is
  "layer" n_layer, so it lands on the last device that gets any layer; the input layer
  (``token_embd``) always stays in host memory;
- each layer's KV cache lives on its layer's device (``offload_kqv``, the default);
- RPC devices (``--rpc``) come first in the device list, before local GPUs (src/llama.cpp:
  "add RPC servers at the front of the list to minimize network transfers").

voltaforge always renders ``--tensor-split`` (the recipe's, or equal parts for equal cards),
so the split that runs is the split that was planned: a default split by free memory would
move a boundary layer with a few MiB of difference between two cards.

Per device the plan counts the weights of its layers (exact, from the GGUF estimate's tensor
list, plus the buffer's per-tensor alignment), its layers' KV cache (exact), one compute
buffer and, on a GPU, its CUDA context and the margin. The compute buffer is an estimate
(layer_split.split_compute_bytes): the whole graph's single-device worst case plus the extra input
copies of llama.cpp's pipeline parallelism, not a replay of the scheduler's per-device split.
The RPC test on this machine holds weights and KV per device to equality (a real load of the
pinned build) and shows the compute estimate beside the real buffers.

Decode with a layer split runs the devices one after the other for each token, so the
roofline's time per token is the sum of each device's bytes over its bandwidth. A mixture of
experts splits the same way (its experts are tensors of their layer), every expert on a device
(no --n-cpu-moe beside a split); a token reads only its active experts' slices of each layer.
"""

from __future__ import annotations

import bisect
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from playbooks.plan.gguf_size import assign_types, tensor_bytes
from playbooks.plan.kv_cache import llamacpp_kv_bytes_per_token, llamacpp_kv_cells
from playbooks.plan.model_config import ModelShape, is_swa_layer
from playbooks.plan.tensors import Cat

#: the most devices one llama.cpp model spreads over (ggml's GGML_MAX_DEVICES is 16; eight
#: V100s is a DGX-1)
MAX_DEVICES = 16
#: ggml-cuda's buffer alignment (ggml_backend_cuda_buffer_type_get_alignment)
CUDA_ALIGNMENT = 128
#: the CPU backend's (TENSOR_ALIGNMENT), which an RPC server on a CPU reports
CPU_ALIGNMENT = 32


#: llama.cpp's --split-mode values other than ``layer``, and why voltaforge plans none of them
#: (read at the pinned ref, 0c1e570)
SPLIT_MODES_NOT_PLANNED = {
    "row": "the pinned llama.cpp's CUDA backend has no row-split buffers any more (ggml-cuda exports no "
    "ggml_backend_split_buffer_type; SYCL's alone does), so llama-server stops at load with \"device CUDA0 does "
    'not support split buffers" (src/llama-model.cpp make_gpu_buft_list)',
    "tensor": "llama.cpp calls it experimental (flash attention required, a few architectures, no --fit, "
    "backend sampling off) and voltaforge does not plan its per-card buffers",
    "none": "it uses one card only: that is gpu_count 1",
}


def split_mode_refusal(mode: str) -> str | None:
    """Why a --split-mode is not planned (None: ``layer``, the one that is)."""
    if mode == "layer":
        return None
    why = SPLIT_MODES_NOT_PLANNED.get(mode)
    if why is None:
        return f"unknown split mode {mode!r}: llama.cpp has none, layer, row, tensor"
    return f"--split-mode {mode} is not planned: {why}; use layer"


def device_count(rpc_workers: int, gpu_count: int, cpu: bool) -> int:
    """The devices a split spreads layers over: the RPC workers, then the local cards (a CPU
    target has none of its own: its layers go to the workers or stay on the CPU)."""
    return rpc_workers + (0 if cpu else gpu_count)


def _f32(x: float) -> float:
    """``x`` rounded to float32. An operation on float32 values done in a double and rounded once
    is the float32 operation's exact result (53 >= 2 * 24 + 2 bits: double rounding is
    innocuous for + - * /), so this is what the C++ computes, without numpy's import."""
    return float(struct.unpack("f", struct.pack("f", x))[0])


def layer_devices(n_layer: int, weights: Sequence[float]) -> list[int]:
    """The device index of each repeating layer and, last, of the output layer (n_layer + 1
    entries), with every layer offloaded. float32 as llama.cpp computes it: a split point that
    lands exactly on a layer boundary goes the way the C++ goes."""
    splits: list[float] = []
    total = 0.0
    for w in weights:
        total = _f32(total + _f32(w))
        splits.append(total)
    splits = [_f32(s / total) for s in splits]
    act = n_layer + 1
    out = []
    for il in range(n_layer + 1):
        x = _f32(il / act)
        out.append(bisect.bisect_right(splits, x))  # np.searchsorted(side="right")
    return out


@dataclass(frozen=True)
class DeviceShare:
    """What one device holds of a split model."""

    index: int
    name: str  # the catalog's GPU name, or an RPC worker's host:port
    layers: tuple[int, ...]  # the repeating layers it holds
    output: bool  # it holds the output layer
    weights_bytes: int
    kv_bytes: int
    compute_bytes: int
    overhead_bytes: int  # CUDA context + margin (a GPU), margin (an RPC server's CPU)
    capacity_bytes: int
    bandwidth_gb_s: float
    streamed_bytes: int  # weight bytes it reads per decoded token

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.compute_bytes + self.overhead_bytes

    @property
    def headroom_bytes(self) -> int:
        return self.capacity_bytes - self.total_bytes

    @property
    def layers_text(self) -> str:
        if not self.layers:
            return "-"
        span = f"{self.layers[0]}-{self.layers[-1]}" if len(self.layers) > 1 else str(self.layers[0])
        return span + (" + output" if self.output else "")


@dataclass(frozen=True)
class Device:
    """A device a split can use: its name, memory, bandwidth and buffer alignment."""

    name: str
    capacity_bytes: int
    bandwidth_gb_s: float
    alignment: int = CUDA_ALIGNMENT
    overhead_bytes: int = 0


def _aligned(n: int, alignment: int) -> int:
    return n + (-n % alignment)


def layer_weights(shape: ModelShape, quant: str, imatrix: bool, alignment: int) -> tuple[list[int], int]:
    """(bytes of each repeating layer's tensors, bytes of the output layer) as a device buffer
    holds them: each tensor padded to the buffer's alignment. A tied model's output layer is a
    copy of token_embd (llama-model-loader: "duplicated ... loaded as the output tensor")."""
    per_layer = [0] * shape.num_hidden_layers
    output = 0
    embd = 0
    for t, ttype in assign_types(shape, quant, imatrix=imatrix):
        size = _aligned(tensor_bytes(t.ne, ttype), alignment)
        if t.layer >= 0:
            per_layer[t.layer] += size
        elif t.cat is Cat.TOKEN_EMBD:
            embd = size
        else:
            output += size
    if shape.tie_word_embeddings:
        output += embd
    return per_layer, output


def layer_streamed(shape: ModelShape, quant: str, imatrix: bool) -> tuple[list[int], int]:
    """(bytes a decoded token reads of each repeating layer, of the output layer): every tensor,
    except that of a stacked expert tensor it reads only its n_expert_used experts' slices (each
    expert's slice is bytes / n_expert exactly, as plan/moe.py ExpertLayout.active reads them).
    A dense model reads its layers whole."""
    per_layer = [0] * shape.num_hidden_layers
    output = embd = 0
    for t, ttype in assign_types(shape, quant, imatrix=imatrix):
        size = tensor_bytes(t.ne, ttype)
        if t.experts and shape.num_experts:
            size = size // shape.num_experts * shape.num_experts_per_tok
        if t.layer >= 0:
            per_layer[t.layer] += size
        elif t.cat is Cat.TOKEN_EMBD:
            embd = size
        else:
            output += size
    # a tied model's output reads its copy of token_embd whole
    return per_layer, output + (embd if shape.tie_word_embeddings else 0)


def layer_kv_bytes(shape: ModelShape, n_ctx: int, cache_k: str, cache_v: str, n_ubatch: int) -> list[int]:
    """Each layer's KV cache in bytes (a sliding-window layer holds its window's cells)."""
    per_token = llamacpp_kv_bytes_per_token(shape, cache_k, cache_v) // shape.num_hidden_layers
    full, swa = llamacpp_kv_cells(shape, n_ctx, n_ubatch)
    return [per_token * (swa if is_swa_layer(shape, il) else full) for il in range(shape.num_hidden_layers)]


def split_model(
    shape: ModelShape,
    quant: str,
    devices: Sequence[Device],
    weights: Sequence[float],
    *,
    n_ctx: int,
    cache_k: str,
    cache_v: str,
    n_ubatch: int,
    compute_bytes: int,
    imatrix: bool = True,
) -> tuple[DeviceShare, ...]:
    """Every device's share of the model: layers, weights, KV cache, compute buffer, overhead."""
    assign = layer_devices(shape.num_hidden_layers, weights)
    kv = layer_kv_bytes(shape, n_ctx, cache_k, cache_v, n_ubatch)
    # what a token reads: all of a dense layer; of a MoE layer, its active experts only
    read_layer, read_output = layer_streamed(shape, quant, imatrix) if shape.is_moe else (None, 0)
    cache: dict[int, tuple[list[int], int]] = {}
    shares = []
    for d, dev in enumerate(devices):
        if dev.alignment not in cache:
            cache[dev.alignment] = layer_weights(shape, quant, imatrix, dev.alignment)
        per_layer, output = cache[dev.alignment]
        layers = tuple(il for il in range(shape.num_hidden_layers) if assign[il] == d)
        has_output = assign[-1] == d
        w = sum(per_layer[il] for il in layers) + (output if has_output else 0)
        read = w if read_layer is None else sum(read_layer[il] for il in layers) + (read_output if has_output else 0)
        shares.append(
            DeviceShare(
                index=d,
                name=dev.name,
                layers=layers,
                output=has_output,
                weights_bytes=w,
                kv_bytes=sum(kv[il] for il in layers),
                # a device with no layer gets no graph split, so no compute buffer
                compute_bytes=compute_bytes if layers or has_output else 0,
                overhead_bytes=dev.overhead_bytes,
                capacity_bytes=dev.capacity_bytes,
                bandwidth_gb_s=dev.bandwidth_gb_s,
                streamed_bytes=read,
            )
        )
    return tuple(shares)


def worst(shares: Sequence[DeviceShare]) -> DeviceShare:
    """The device with the least headroom: the one a split fits or fails on."""
    return min(shares, key=lambda s: (s.headroom_bytes, s.index))  # a tie: the first such device


def split_tok_s(shares: Sequence[DeviceShare], extra_bytes: Sequence[int] = (), network_s: float = 0.0) -> float:
    """Decode roofline of a layer split: the devices run one after the other, so a token takes
    the sum of each device's bytes (its weights, plus `extra_bytes[i]`, e.g. its KV reads) over
    its bandwidth, plus `network_s` (RPC workers' round trips)."""
    seconds = network_s
    for i, s in enumerate(shares):
        extra = extra_bytes[i] if i < len(extra_bytes) else 0
        seconds += (s.streamed_bytes + extra) / (s.bandwidth_gb_s * 1e9)
    return 1 / seconds if seconds else 0.0
