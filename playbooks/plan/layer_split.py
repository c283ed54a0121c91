"""One model over several devices, placed by its engine (plan/engine_*.py: llama.cpp's layer split over
local cards and RPC workers, ExLlamaV2's over local cards). Each device's share is checked
against its own memory; the option speaks of the worst device."""

from __future__ import annotations

from collections.abc import Callable

from playbooks.plan.budget import (
    kv_per_token,
    largest_ctx,
    weight_bytes,
)
from playbooks.plan.engines import engine_of_quant
from playbooks.plan.gpus import Gpu
from playbooks.plan.model_config import ModelShape
from playbooks.plan.refusals import (
    unfit_reason,
)
from playbooks.plan.serving import DraftPlan, Option, Serving
from playbooks.plan.split import (
    DeviceShare,
    split_tok_s,
    worst,
)
from playbooks.plan.tensors import parameter_count


def network_s(s: Serving) -> float:
    """Seconds the network adds to every token of an RPC split: each worker's part of the graph
    is one round trip from the server (its inputs sent, its output read back), one after the
    other; the transfer of a hidden state (KBs) is left out."""
    return s.rpc_devices * s.rpc_rtt_ms / 1000


def evaluate_split(shape: ModelShape, quant: str, gpu: Gpu, s: Serving, draft: DraftPlan | None) -> Option:
    """A quant split over several devices as its engine places it (plan/engine_*.py: llama.cpp's layer
    split over the cards and the RPC workers, a MoE model with every expert on a device;
    ExLlamaV2's placement over the cards)."""
    e = engine_of_quant(quant)
    planned = e.plan_split(shape, quant, gpu, s, s.context)

    def fits(ctx: int) -> bool:
        at = e.plan_split(shape, quant, gpu, s, ctx)
        return not at.refusal and all(d.headroom_bytes >= 0 for d in at.shares)

    unfit = unfit_reason(e.name, gpu, shape, draft) or planned.refusal
    return _split_option(shape, quant, s, planned.shares, fits, network_s(s), unfit, planned.gpu_split)


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
        backend=engine_of_quant(quant).name,
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
