"""One EXL2 model over several cards, split the way ExLlamaV2 splits it (TabbyAPI's gpu_split).

ExLlamaV2 0.3.2 places a model by ``set_device_map(allocation)`` (model.py), which TabbyAPI
calls through ``model.load_gen(gpu_split)`` when its config gives ``gpu_split`` (GB per card):

- the modules go in order (token embedding, then each layer's attention and its MLP, the final
  norm, the head); the embedding stays in host RAM (``embed_cpu``);
- each card's allotment is ``gpu_split[i]`` GiB less the RoPE tables, one hidden state and one
  attention mask of a chunk, counted once per card;
- a module stays on the current card while its weights plus the card's reserved scratch (the
  largest ``scratch_space()`` of the modules there, and separately the largest attention
  working set) fit what is left; otherwise it moves to the next card, and never back;
- each card then allocates one scratch tensor, the largest ``scratch_space_fixed()`` of its
  modules (the head's FP16 dequant buffer, 1 GiB on most models, on the card holding it);
- the cache is not in the allotment: each layer's K and V go where its attention went
  (``set_cache_map``), allocated after the weights.

So the allotment is a budget for weights and scratch, and what a card really holds adds its
layers' cache. voltaforge renders ``gpu_split_auto: false`` and the ``gpu_split`` planned here,
for the same reason it renders llama.cpp's ``--tensor-split``: the split that runs is the split
that was planned. (TabbyAPI's default, autosplit, fills each card by the free memory it
measures while loading, which nothing can replay before the card is there.) The allotments are
chosen as llama.cpp's default split would be: each card but the last gets its share of the
weights (the recipe's tensor_split, else equal shares), lowered until its cache fits beside
them; the last card takes the rest.

What is exact and what is not:
- the placement is ``set_device_map`` ported statement for statement, and its scratch sizes
  are attn.py's, mlp.py's and linear.py's; tests/test_exl2_split.py runs ExLlamaV2's own
  ``set_device_map`` (the pinned wheel, its CUDA extension absent: placement needs none) on
  generated checkpoints and holds the port to it, module by module;
- a module's weight bytes are a prediction: ``bpw`` spread evenly over every linear layer,
  while the converter gives layers different rates around the target (exl2_size.py says how
  far the whole-model figure is checked). ExLlamaV2 counts every norm as hidden_size x 2 bytes
  (rmsnorm.py and headnorm.py ``weight_footprint``), and so does this port;
- nothing here has run on two GPUs: no lent machine had two.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from playbooks.plan.exl2_size import EXL2_MAX_DQ_SIZE, EXL2_MAX_INPUT_LEN, exl2_chunk_bytes
from playbooks.plan.model_config import ModelShape
from playbooks.plan.split import Device, DeviceShare
from playbooks.plan.tensors import Cat, model_tensors

GIB = 1024**3
#: TabbyAPI's gpu_split is a list of GB figures; voltaforge writes them to the hundredth
SPLIT_STEP = 0.01

# one layer's tensors that ExLlamaV2's attention module holds (the rest are its MLP's)
_ATTENTION_PARTS = ("attn_", "post_attention_norm")


@dataclass(frozen=True)
class Exl2Limits:
    """The ExLlamaV2Config fields the placement depends on, as TabbyAPI sets them: max_seq_len
    from its config, max_input_len and max_attention_size from chunk_size (2048, so the config
    defaults), max_batch_size left at ExLlamaV2's 1 (TabbyAPI batches through its paged
    generator, not the config)."""

    max_seq_len: int
    max_input_len: int = EXL2_MAX_INPUT_LEN
    max_batch_size: int = 1
    max_dq_size: int = EXL2_MAX_DQ_SIZE

    @property
    def max_attention_size(self) -> int:
        return self.max_input_len**2  # TabbyAPI: chunk_size ** 2


@dataclass(frozen=True)
class Module:
    """One of ExLlamaV2's top-level modules, with the sizes set_device_map reads."""

    key: str  # ExLlamaV2's key: model.layers.3 (twice: attention, then MLP), model.norm, lm_head
    kind: str  # attention | mlp | norm | head
    layer: int  # -1 for the norm and the head
    footprint: int  # weight_footprint(): bytes on the card
    scratch: int  # scratch_space(): reserved in the allotment
    scratch_fixed: int  # scratch_space_fixed(): the card's scratch tensor is the largest
    attention: int = 0  # temp_attn_size(): reserved apart (attention modules only)


def _pad32(n: int) -> int:
    return n + (-n % 32)  # ExLlamaV2Linear pads its output features to 32 (pad32)


def _dq(lim: Exl2Limits, in_features: int, out_features: int) -> int:
    """linear.py temp_dq_size, over the padded output features."""
    return 2 * min(in_features * _pad32(out_features), lim.max_dq_size)


def _layer_bytes(shape: ModelShape, bits: float) -> tuple[list[int], list[int]]:
    """(attention bytes, MLP bytes) of each layer: linear weights at `bits` per weight, biases in
    FP16, each norm as ExLlamaV2 counts it (hidden_size x 2)."""
    attention = [0] * shape.num_hidden_layers
    mlp = [0] * shape.num_hidden_layers
    for t in model_tensors(shape):
        if t.layer < 0:
            continue
        part = t.name.split(".", 2)[2]
        if t.cat is Cat.OTHER:
            size = shape.hidden_size * 2 if part.endswith("norm.weight") else t.n_elements * 2
        else:
            size = int(t.n_elements * bits / 8)
        (attention if part.startswith(_ATTENTION_PARTS) else mlp)[t.layer] += size
    return attention, mlp


def exl2_modules(shape: ModelShape, lim: Exl2Limits, bits: float, head_bits: float) -> tuple[Module, ...]:
    """The modules ExLlamaV2 builds for a dense model, after the embedding (which stays in host
    RAM), at `bits` per linear weight and `head_bits` per head weight (16 and 16: an FP16
    checkpoint). A tied model's head is still a head of its own (the EXL2 converter writes one;
    ExLlamaV2 loads an FP16 tied head from the embedding)."""
    if shape.is_moe:
        raise ValueError("an EXL2 mixture of experts is not split (ExLlamaV2's MoE MLP is not planned)")
    rows = lim.max_input_len * lim.max_batch_size
    h, q, kv, ff = shape.hidden_size, shape.q_dim, shape.kv_dim, shape.intermediate_size
    heads = shape.num_attention_heads
    # attn.py: temp_state, temp_q, temp_k, temp_v, temp_dq, temp_kv; temp_attn_size apart
    state = rows * max(q, h) * 2 + 128
    tq, tk = rows * q * 2 + 128, rows * kv * 2 + 128
    dq = max(_dq(lim, h, q), _dq(lim, h, kv), _dq(lim, q, h))
    expanded = 0 if shape.num_key_value_heads == heads else 2 * lim.max_seq_len * lim.max_batch_size * q * 2 + 128
    attn_work = 2 * min(lim.max_attention_size, lim.max_seq_len**2) * heads * 2 + 128
    attention_scratch, attention_fixed = state + tq + 2 * tk + dq + expanded, state + dq
    # mlp.py: temp_state (output features: hidden), temp_a, temp_b, temp_dq
    wide = rows * max(h, ff) * 2 + 128
    mlp_scratch = rows * h * 2 + 128 + 2 * wide + max(_dq(lim, h, ff), _dq(lim, ff, h))
    attention_b, mlp_b = _layer_bytes(shape, bits)
    out: list[Module] = []
    for il in range(shape.num_hidden_layers):
        key = f"model.layers.{il}"
        out.append(Module(key, "attention", il, attention_b[il], attention_scratch, attention_fixed, attn_work))
        out.append(Module(key, "mlp", il, mlp_b[il], mlp_scratch, mlp_scratch))
    out.append(Module("model.norm", "norm", -1, h * 2, 0, 0))
    head_dq = _dq(lim, h, shape.vocab_size)  # not a sub-module: no forward buffer of its own
    out.append(Module("lm_head", "head", -1, int(shape.vocab_size * h * head_bits / 8), head_dq, head_dq))
    return tuple(out)


def chunk_bytes(shape: ModelShape, lim: Exl2Limits) -> int:
    """What set_device_map takes off every card's allotment first (exl2_size.exl2_chunk_bytes)."""
    return exl2_chunk_bytes(shape, lim.max_seq_len, lim.max_input_len, lim.max_batch_size)


class AllotmentTooSmall(ValueError):
    """set_device_map's "Insufficient space in device allocation": a module found no card."""

    def __init__(self, module: Module, cards: int) -> None:
        where = f"layer {module.layer}'s {module.kind}" if module.layer >= 0 else f"the {module.kind}"
        super().__init__(f"{where} ({module.key}) fits none of the {cards} card(s)' allotments")
        self.module = module


@dataclass(frozen=True)
class DeviceMap:
    """set_device_map's result: where each module went, and per card what it reserved."""

    device: tuple[int, ...]  # per module of exl2_modules, the card's index
    free_gib: tuple[float, ...]  # set_device_map's return: allotment left, in GB
    scratch_fixed: tuple[int, ...]  # the scratch tensor each card allocates (0: none)


def set_device_map(
    modules: Sequence[Module], allocation: Sequence[float], shape: ModelShape, lim: Exl2Limits
) -> DeviceMap:
    """ExLlamaV2 0.3.2's model.py set_device_map, in its own arithmetic (floats included, so the
    free figures come out the same)."""
    left = [a * 1024**3 - chunk_bytes(shape, lim) for a in allocation]
    reserve = [0] * len(allocation)
    reserve_attn = [0] * len(allocation)
    fixed = [0] * len(allocation)
    placed = []
    current = 0
    for m in modules:
        while True:
            if current >= len(left):
                raise AllotmentTooSmall(m, len(allocation))
            scratch = max(m.scratch, reserve[current])
            scratch_attn = max(m.attention, reserve_attn[current])
            if m.footprint + scratch + scratch_attn <= left[current]:
                break
            current += 1
        fixed[current] = max(m.scratch_fixed, fixed[current])
        reserve[current] = scratch
        reserve_attn[current] = scratch_attn
        left[current] -= m.footprint
        placed.append(current)
    free = tuple((a - r - ra) / 1024**3 for a, r, ra in zip(left, reserve, reserve_attn, strict=True))
    return DeviceMap(tuple(placed), free, tuple(fixed))


@dataclass(frozen=True)
class Exl2Memory:
    """Per-layer and per-card sizes besides the weights, from the planner's one-card formulas
    (planner.exl2_compute_bytes): what a card holds once it holds any module."""

    kv_per_layer: int  # one layer's K and V for every cached token
    cache_scratch: int  # a quantized cache's FP16 copy of one layer, on each card with layers
    attention_work: int  # attention's per-forward working set, on each card with attention
    per_card: int  # RoPE tables, a chunk's hidden state and mask, on each card used
    logits: int  # the last token's FP32 logits, on the head's card


@dataclass(frozen=True)
class Exl2Split:
    gpu_split: tuple[float, ...]  # GB per card, as TabbyAPI's config takes it
    shares: tuple[DeviceShare, ...]
    # why the allotments would not load although every card's memory holds its share ("": they
    # would); a split that overflows a card says so by its headroom instead
    refusal: str = ""


def _shares(
    modules: Sequence[Module], dmap: DeviceMap, devices: Sequence[Device], mem: Exl2Memory
) -> tuple[DeviceShare, ...]:
    out = []
    for d, dev in enumerate(devices):
        mine = [m for m, at in zip(modules, dmap.device, strict=True) if at == d]
        layers = tuple(m.layer for m in mine if m.kind == "attention")
        head = any(m.kind == "head" for m in mine)
        weights = sum(m.footprint for m in mine)
        compute = 0
        if mine:
            compute = mem.per_card + dmap.scratch_fixed[d]
            compute += (mem.attention_work + mem.cache_scratch) if layers else 0
            compute += mem.logits if head else 0
        out.append(
            DeviceShare(
                index=d,
                name=dev.name,
                layers=layers,
                output=head,
                weights_bytes=weights,
                kv_bytes=mem.kv_per_layer * len(layers),
                compute_bytes=compute,
                overhead_bytes=dev.overhead_bytes,
                capacity_bytes=dev.capacity_bytes,
                bandwidth_gb_s=dev.bandwidth_gb_s,
                streamed_bytes=weights,
            )
        )
    return tuple(out)


def _down(x: float) -> float:
    return math.floor(round(x / SPLIT_STEP, 6)) * SPLIT_STEP


def _up(x: float) -> float:
    return math.ceil(round(x / SPLIT_STEP, 6)) * SPLIT_STEP


def split_exl2(
    shape: ModelShape,
    modules: Sequence[Module],
    lim: Exl2Limits,
    devices: Sequence[Device],
    weights: Sequence[float],
    mem: Exl2Memory,
) -> Exl2Split:
    """The allotments and what each card then holds. Every card but the last starts at its
    share of the weights plus its reserve, rounded up to the hundredth; while a card's total
    (weights, cache, compute, overhead) overflows it, its allotment drops by the overflow, which
    moves modules onward. The last card's allotment is its memory less what it holds outside
    the allotment; when its modules overflow that, the plan shows by how much (headroom < 0)."""
    total = sum(m.footprint for m in modules)
    # what a card of layers reserves besides weights (the head's larger scratch is the last card's)
    layers = [m for m in modules if m.layer >= 0]
    reserve = chunk_bytes(shape, lim) + max(m.scratch for m in layers) + max(m.attention for m in layers)
    whole = sum(weights)
    alloc = [_up((total * w / whole + reserve) / GIB) for w in weights[:-1]]
    last = devices[-1]
    # the last card first takes whatever reaches it (a model too big shows as its overflow)
    alloc.append(math.inf)
    while True:
        dmap = set_device_map(modules, alloc, shape, lim)
        shares = _shares(modules, dmap, devices, mem)
        over = [s.total_bytes - s.capacity_bytes for s in shares[:-1]]
        if all(o <= 0 for o in over):
            break
        for i, o in enumerate(over):
            if o > 0:
                # down by the overflow, and by one step at least
                alloc[i] = max(0.0, min(_down(alloc[i] - o / GIB), alloc[i] - SPLIT_STEP))
    # the last card's allotment: its memory less what it holds outside the allotment (its
    # layers' cache, a quantized cache's copy, the logits, the CUDA context and margin)
    s_last = shares[-1]
    outside = s_last.kv_bytes + s_last.overhead_bytes
    outside += (mem.cache_scratch if s_last.layers else 0) + (mem.logits if s_last.output else 0)
    alloc[-1] = max(_down((last.capacity_bytes - outside) / GIB), 0.0)
    refusal = ""
    try:
        if set_device_map(modules, alloc, shape, lim).device != dmap.device:
            refusal = f"ExLlamaV2 would place the modules otherwise with gpu_split {alloc}"
    except AllotmentTooSmall as e:
        if all(s.headroom_bytes >= 0 for s in shares):
            refusal = f"with gpu_split {[round(a, 2) for a in alloc]} {e}"
    return Exl2Split(tuple(round(a, 2) for a in alloc), shares, refusal)
