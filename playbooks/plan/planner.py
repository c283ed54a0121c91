"""The physical ceiling, computed before anything is installed (docs/knowledge.md, section 1):
every quant evaluated on the target, and the objective's pick among those that fit.

Pure functions: model shape + GPU + serving settings in, bytes and tokens per second out.
The parts, one idea each: budget.py (one device's VRAM at a context: weights + KV cache +
compute buffers + CUDA context + a margin), roofline.py (decode at small batch is bandwidth
bound: tok/s <= bandwidth / bytes read per token), refusals.py (what cannot run whatever the
memory), evaluate.py (one quant on one target), layer_split.py (several devices),
moe_offload.py (a mixture of experts with the experts of its first N layers in host RAM, and
how N is chosen; moe.py says what moves and the two-sided roofline). This module: the plan,
its recommendation and the notes that say what its numbers rest on.

Units: bytes everywhere inside; GiB (2^30) and GB (1e9) are labelled wherever shown.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from playbooks.plan.engine_llamacpp import PIPELINE_COPIES
from playbooks.plan.engines import ENGINES, engine, engine_of_quant
from playbooks.plan.evaluate import evaluate
from playbooks.plan.gpus import MIB, Gpu
from playbooks.plan.model_config import ModelShape
from playbooks.plan.moe import (
    HostMemory,
    OffloadStep,
)
from playbooks.plan.moe_offload import offload_ladder, smallest_n_cpu_moe
from playbooks.plan.objective import Objective
from playbooks.plan.serving import DraftPlan, Option, Serving, quant_names, serving_for


@dataclass
class Plan:
    shape: ModelShape
    gpu: Gpu
    serving: Serving
    chosen: Option | None
    options: list[Option]
    objective: Objective = field(default_factory=Objective)
    recommendation: Option | None = None
    # how the objective picked it: quality | fastest | below_speed_floor (objective.Pick.kind)
    recommendation_kind: str | None = None
    reason: str = ""
    notes: list[str] = field(default_factory=list)
    host: HostMemory = field(default_factory=HostMemory)
    # MoE: the --n-cpu-moe ladder of one GGUF quant (the chosen one, else the recommendation)
    offload: list[OffloadStep] = field(default_factory=list)
    offload_quant: str | None = None


def _offload_text(o: Option) -> str:
    return f" with the experts of {o.n_cpu_moe} layer(s) in host RAM (--n-cpu-moe {o.n_cpu_moe})" if o.n_cpu_moe else ""


def make_plan(
    shape: ModelShape,
    gpu: Gpu,
    serving: Serving,
    quant: str | None = None,
    draft: DraftPlan | None = None,
    objective: Objective | None = None,
    host: HostMemory | None = None,
) -> Plan:
    """Evaluate every quant on this GPU and recommend one.

    The recommendation is the objective's pick (playbooks/plan/objective.py) among the quants
    that fit the planned context and slots: the best quality of at least `min_bpw` bits per
    weight whose decode roofline reaches `min_tok_s`, or the fastest without a speed floor.
    MXFP4_MOE is for mixture-of-experts models and left out of a dense model's table.

    A MoE model's GGUF quants may keep experts in host RAM when the serving allows it
    (`n_cpu_moe` "auto": each quant gets the smallest N that fits; an integer pins N; 0 keeps
    everything on the GPU). Their roofline is two-sided (moe.two_sided_tok_s): an offloaded
    quant below the speed floor is not picked for its quality.

    With a draft model (llama-server --model-draft) every llama.cpp quant carries the draft's
    weights, KV cache and compute buffer (draft_vram); EXL2 quants cannot serve it.
    """
    host = host or HostMemory()
    objective = objective or Objective(imatrix=serving.imatrix, mxfp4_experts=shape.mxfp4_experts)
    # GGUF types llama.cpp cannot make for this model (gpt-oss's MXFP4 experts: MXFP4_MOE only)
    refused = {q: why for e in ENGINES for q in e.quant_names() if (why := e.quant_refusal(shape, q))}
    names = [q for q in quant_names() if q not in refused and (shape.is_moe or q != "MXFP4_MOE")]
    if serving.rpc_devices:  # only an engine that takes RPC workers (split_unfit_reason)
        names = [q for q in names if engine_of_quant(q).takes_rpc]
    options = [evaluate(shape, q, gpu, serving_for(q, serving), draft, host) for q in names]
    chosen = evaluate(shape, quant, gpu, serving, draft, host) if quant else None
    plan = Plan(shape, gpu, serving, chosen, options, objective, host=host)
    if refused:
        plan.notes.append(f"left out of the fit table: {', '.join(refused)} ({next(iter(refused.values()))})")
    fitting = [o for o in options if o.fits]  # an option that cannot run here does not fit
    if serving.split:
        _split_notes(plan)
    # what each engine cannot serve here: said, and out of the recommendation where it must be
    for e in ENGINES:
        note, drop = e.left_out(gpu, serving, draft)
        if drop:
            fitting = [o for o in fitting if engine(o.backend) is not e]
        if note:
            plan.notes.append(note)
    cards = f"{serving.device_count(gpu)} x {gpu.name}" if serving.split else gpu.name
    where = f"{serving.context} tokens x {serving.parallel} slot(s) on {cards}"
    floor = f"at least {objective.min_bpw:g} bits/weight"
    pick = objective.pick(fitting)
    if pick is not None:
        r = plan.recommendation = pick.candidate
        plan.recommendation_kind = pick.kind
        left = f"{r.headroom_bytes / MIB:,.0f} MiB left"
        if pick.kind == "quality":
            plan.reason = (
                f"{r.quant} ({r.backend}){_offload_text(r)} is the best quality ({pick.quality.text()}) of the quants "
                f"of {floor} that fit {where} with a decode roofline of at least {objective.min_tok_s:g} tok/s: "
                f"roofline {r.roofline_tok_s:.0f} tok/s, {left}"
            )
        elif pick.kind == "fastest":
            plan.reason = (
                f"{r.quant} ({r.backend}){_offload_text(r)} is the fastest quant of {floor} that fits {where} "
                f"(no speed floor): roofline {r.roofline_tok_s:.0f} tok/s, {left}"
            )
        else:
            plan.reason = (
                f"no quant of {floor} that fits {where} reaches a decode roofline of {objective.min_tok_s:g} tok/s; "
                f"the fastest is {r.quant} ({r.backend}){_offload_text(r)}: roofline {r.roofline_tok_s:.0f} tok/s, "
                f"{left}"
            )
    elif fitting:
        best = min(fitting, key=lambda o: objective.quality(o.quant, o.bpw).kld)
        plan.reason = (
            f"no quant of {floor} fits {where}; the best quality that fits is {best.quant} ({best.bpw:.2f} bits/weight)"
        )
    else:
        plan.reason = f"no quant fits {where}: use a smaller model, a shorter context, fewer slots or a larger GPU"
    plan.notes.append(f"KLD: the quality the recommendation ranks by: {_quality_basis(objective, options)}")
    plan.notes += engine(serving.backend).serving_notes(serving, gpu)
    if gpu.is_cpu:
        plan.notes.append(
            "on a CPU, quantized decode is often compute-bound, not bandwidth-bound: the roofline is "
            "a loose ceiling here (docs/knowledge.md section 8: Q4_K_M and Q8_0 on 2 cores)"
        )
    elif not gpu.bf16 and shape.torch_dtype == "bfloat16":
        plan.notes.append(f"{gpu.name} has no BF16: the BF16 weights are converted to FP16 before quantizing")
    if shape.is_moe:
        _moe_notes(plan, draft)
    return plan


def _split_notes(plan: Plan) -> None:
    """What a split's numbers rest on."""
    plan.notes.append(
        "split: layers, weights and KV cache per device are llama.cpp's own assignment (exact); each device's "
        f"compute buffer is an estimate: the single-device worst case plus {PIPELINE_COPIES - 1} more copies of its "
        "inputs (llama.cpp's pipeline parallelism), checked on CPU-backed RPC devices only"
    )
    s = plan.serving
    if not s.rpc_devices and not plan.gpu.is_cpu:
        plan.notes.append(
            "EXL2 split: ExLlamaV2's own placement (set_device_map: modules in order, each card up to its "
            "gpu_split allotment, the cache with its layer's attention), ported and held to ExLlamaV2's code on "
            "generated checkpoints; module sizes spread the bpw target evenly over the layers, and the rendered "
            "gpu_split is the plan's. Not run on two GPUs"
        )
    if s.rpc_devices:
        hop = (
            f"the roofline adds {s.rpc_devices} x {s.rpc_rtt_ms:g} ms of network per token (one round trip per "
            f"worker, {s.rpc_rtt_source})"
            if s.rpc_rtt_ms
            else "the roofline leaves out the network (one round trip per worker per token): give "
            "planner.rpc_rtt_ms, or run preflight, which measures it"
        )
        plan.notes.append(
            f"{s.rpc_devices} RPC worker(s) hold the first layers (llama.cpp puts RPC devices ahead of local "
            f"cards); {hop}"
        )


def _quality_basis(objective: Objective, options: list[Option]) -> str:
    """Where the KLD column's figures come from, in a few words."""
    sources = {objective.quality(o.quant, o.bpw).source for o in options}
    parts = []
    if "measured" in sources:
        parts.append("the mean KL divergence from F16 measured on this model (marked *, the artifacts' manifests)")
    parts.append(
        ("else " if parts else "")
        + "llama.cpp's published mean KL divergence from F16 for Llama-3-8B (tools/perplexity/README.md at 0c1e570)"
    )
    if "interpolated" in sources:
        parts.append("EXL2 placed on that curve by bits/weight")
    if "assumed" in sources:
        parts.append("MXFP4_MOE as " + ("Q8_0 (the checkpoint's own experts)" if objective.mxfp4_experts else "Q4_0"))
    return "; ".join(parts)


def _moe_notes(plan: Plan, draft: DraftPlan | None) -> None:
    """The MoE part of a plan: the --n-cpu-moe ladder and what its numbers rest on."""
    shape, gpu, s, host = plan.shape, plan.gpu, plan.serving, plan.host
    c = plan.chosen
    # the ladder is --n-cpu-moe's: for the planned quant where its engine offloads experts
    target = c if c is not None and engine(c.backend).offloads_experts else plan.recommendation
    # the ladder where offload is allowed, or where the planned quant does not fit without it
    wanted = s.n_cpu_moe != 0 or (c is not None and not c.fits)
    if wanted and target is not None and engine(target.backend).offloads_experts and not gpu.is_cpu:
        ts = serving_for(target.quant, s)
        plan.offload = offload_ladder(shape, target.quant, gpu, ts, host, draft)
        plan.offload_quant = target.quant
    plan.notes.append(
        f"mixture of experts: a token reads {shape.num_experts_per_tok} of {shape.num_experts} experts per layer, "
        "so the roofline counts the active experts only"
        + (
            ""
            if gpu.is_cpu
            else "; the GPU compute buffer of a MoE graph follows build_moe_ffn's tensors (+ a copy of one "
            "offloaded expert weight for prefill when --n-cpu-moe > 0): equal to CPU loads and to one CUDA load "
            "(Qwen3-30B-A3B on an H200 with --n-cpu-moe 24), not checked on a V100"
        )
    )
    # what the plan proposes to run with experts in host RAM
    offloaded = [o for o in (c, plan.recommendation) if o is not None and o.n_cpu_moe]
    if offloaded:
        plan.notes.append(
            f"host memory bandwidth {host.membw_gb_s:g} GB/s ({host.membw_source}"
            + (
                ": the seed host's DDR4 figure; give --host-membw GBPS or planner.host_membw_gb_s"
                if host.membw_source == "default"
                else ""
            )
            + "): the host side of the two-sided roofline, a ceiling (the CPU's arithmetic and the per-layer "
            "hand-offs can bind first)"
        )
        if host.ram_bytes is None:
            plan.notes.append(
                "host RAM unknown: not checked that it holds the offloaded experts + token_embd; "
                "give --host-ram GIB or planner.host_ram_gib (preflight checks it on the host)"
            )
        if s.parallel >= 32:
            plan.notes.append(
                f"{s.parallel} slots: a decode batch of 32+ tokens copies host-resident experts to the GPU over "
                "PCIe instead of reading them on the CPU; the two-sided roofline does not describe that"
            )
    if gpu.is_cpu and s.n_cpu_moe not in (0, "auto"):
        plan.notes.append(
            f"--n-cpu-moe {s.n_cpu_moe} on a CPU target moves no memory: every weight is in host memory already"
        )
    if c is not None and engine(c.backend).offloads_experts and s.n_cpu_moe == 0 and not c.fits and not gpu.is_cpu:
        n = smallest_n_cpu_moe(shape, c.quant, gpu, s, draft)
        if n is not None:
            plan.notes.append(
                f"{c.quant} fits with the experts of {n} layer(s) in host RAM: set n_cpu_moe: auto in the recipe "
                f"(or --n-cpu-moe auto)"
            )
