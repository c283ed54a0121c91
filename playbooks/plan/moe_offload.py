"""A mixture-of-experts GGUF quant with the experts of its first N layers in host RAM
(llama-server --n-cpu-moe N): the search for the smallest N that fits, the option at that N
with its two-sided roofline (moe.py), and the ladder of what each N costs and leaves."""

from __future__ import annotations

from dataclasses import dataclass

from playbooks.plan.budget import (
    draft_parts,
    kv_per_token,
    max_ctx,
    vram_at,
)
from playbooks.plan.engine_llamacpp import LLAMACPP, gguf_cached
from playbooks.plan.gguf_size import estimate_gguf
from playbooks.plan.gpus import Gpu
from playbooks.plan.model_config import ModelShape
from playbooks.plan.moe import (
    HostMemory,
    OffloadStep,
    expert_layout,
    ladder_points,
    two_sided_tok_s,
)
from playbooks.plan.refusals import (
    bf16_refusal,
)
from playbooks.plan.serving import DraftPlan, Option, Serving
from playbooks.plan.tensors import parameter_count


@dataclass(frozen=True)
class _MoeAt:
    """A MoE GGUF quant with the experts of its first n layers in host RAM."""

    n: int
    gpu_weights: int
    kv: int
    compute: int
    overhead: int
    draft: int
    gpu_bytes_per_token: int
    host_bytes_per_token: int
    host_weights: int
    host_resident: int
    copies: tuple[int, int, int]

    @property
    def vram(self) -> int:
        return self.gpu_weights + self.kv + self.compute + self.overhead + self.draft


def _moe_at(
    shape: ModelShape, quant: str, gpu: Gpu, s: Serving, draft: DraftPlan | None, n: int, ctx: int | None = None
) -> _MoeAt:
    lay = expert_layout(shape, quant, s.imatrix)
    gpu_w = gguf_cached(shape, quant, s.imatrix).gpu_weight_bytes - lay.host_expert_bytes(n)
    copies = lay.copies(n)
    kv, compute, overhead, draft_b = vram_at(shape, s, ctx or s.context, gpu, draft, copies)
    gpu_tok, host_tok = lay.per_token(n)
    return _MoeAt(
        n=n,
        gpu_weights=gpu_w,
        kv=kv,
        compute=compute,
        overhead=overhead,
        draft=draft_b,
        gpu_bytes_per_token=gpu_tok,
        host_bytes_per_token=host_tok,
        host_weights=lay.host_expert_bytes(n),
        host_resident=lay.host_resident_bytes(n),
        copies=copies,
    )


def smallest_n_cpu_moe(
    shape: ModelShape, quant: str, gpu: Gpu, s: Serving, draft: DraftPlan | None = None
) -> int | None:
    """The fewest layers whose experts must stay in host RAM for `quant` to fit the GPU at the
    serving settings (0: it fits whole); None when even all of them are not enough."""
    for n in range(shape.num_hidden_layers + 1):
        if _moe_at(shape, quant, gpu, s, draft, n).vram <= gpu.memory_bytes:
            return n
    return None


def _host_ram_reason(at: _MoeAt, host: HostMemory) -> str:
    if host.ram_bytes is None or at.host_resident <= host.ram_bytes:
        return ""
    return (
        f"host RAM: token_embd + the experts of {at.n} layer(s) need {at.host_resident / 2**30:.1f} GiB, "
        f"the host has {host.ram_bytes / 2**30:.1f} GiB ({host.ram_source})"
    )


def evaluate_moe(
    shape: ModelShape, quant: str, gpu: Gpu, s: Serving, draft: DraftPlan | None, host: HostMemory
) -> Option:
    """A MoE GGUF quant: its --n-cpu-moe N (none on a CPU target; the serving's number when
    pinned; the smallest that fits when "auto", all layers when none does), the VRAM without
    those experts, the host RAM they take, and the two-sided roofline."""
    n_layer = shape.num_hidden_layers
    if gpu.is_cpu:
        n = 0
    elif s.n_cpu_moe == "auto":
        found = smallest_n_cpu_moe(shape, quant, gpu, s, draft)
        n = n_layer if found is None else found
    else:
        n = min(int(s.n_cpu_moe), n_layer)
    at = _moe_at(shape, quant, gpu, s, draft, n)
    unfit = bf16_refusal(gpu, quant, (s.cache_k, s.cache_v)) or _host_ram_reason(at, host)
    # (on a CPU target n is 0: every byte is read at the catalog's CPU bandwidth, gpu.bandwidth_gb_s)
    membw = host.membw_gb_s
    roof = two_sided_tok_s(at.gpu_bytes_per_token, gpu.bandwidth_gb_s, at.host_bytes_per_token, membw)
    kv_tok = kv_per_token(shape, s)
    roof_full = two_sided_tok_s(
        at.gpu_bytes_per_token + kv_tok * s.context, gpu.bandwidth_gb_s, at.host_bytes_per_token, membw
    )
    file_b = estimate_gguf(shape, quant, imatrix=s.imatrix).file_bytes
    draft_kv, draft_compute = draft_parts(draft, s, gpu)
    return Option(
        quant=quant,
        backend=LLAMACPP.name,  # experts in host RAM are llama.cpp's (--n-cpu-moe)
        weights_bytes=file_b,
        params=parameter_count(shape),
        gpu_weights_bytes=at.gpu_weights,
        streamed_bytes=at.gpu_bytes_per_token + at.host_bytes_per_token,
        kv_bytes_per_token=kv_tok,
        kv_bytes=at.kv,
        compute_bytes=at.compute,
        overhead_bytes=at.overhead + at.draft,
        vram_bytes=at.vram,
        gpu_bytes=gpu.memory_bytes,
        max_ctx=0 if unfit else max_ctx(shape, s, at.gpu_weights, gpu, draft, at.copies),
        roofline_tok_s=roof,
        roofline_full_ctx_tok_s=roof_full,
        draft_bytes=at.draft,
        draft_kv_bytes=draft_kv,
        draft_compute_bytes=draft_compute,
        unfit_reason=unfit,
        n_cpu_moe=n,
        host_bytes_per_token=at.host_bytes_per_token,
        host_weights_bytes=at.host_weights,
        host_resident_bytes=at.host_resident,
        host_membw_gb_s=membw if at.host_bytes_per_token else None,
        host_membw_source=host.membw_source if at.host_bytes_per_token else None,
    )


def offload_ladder(
    shape: ModelShape, quant: str, gpu: Gpu, s: Serving, host: HostMemory, draft: DraftPlan | None = None
) -> list[OffloadStep]:
    """What --n-cpu-moe N costs and leaves, for N = 0, the smallest that fits and a few more
    (moe.ladder_points): VRAM at the serving's context, and the single-stream ceiling."""
    n_fit = smallest_n_cpu_moe(shape, quant, gpu, s, draft)
    steps = []
    for n in ladder_points(shape.num_hidden_layers, n_fit):
        at = _moe_at(shape, quant, gpu, s, draft, n)
        steps.append(
            OffloadStep(
                n_cpu_moe=n,
                vram_bytes=at.vram,
                fits=at.vram <= gpu.memory_bytes and not _host_ram_reason(at, host),
                host_weights_bytes=at.host_weights,
                gpu_bytes_per_token=at.gpu_bytes_per_token,
                host_bytes_per_token=at.host_bytes_per_token,
                roofline_tok_s=two_sided_tok_s(
                    at.gpu_bytes_per_token, gpu.bandwidth_gb_s, at.host_bytes_per_token, host.membw_gb_s
                ),
            )
        )
    return steps
