"""`invoke preflight`'s judgement of the plan on the host: the recipe planned on the GPU the host
reports (else the inventory's, else the recipe's) with the RAM and RPC latency measured there,
whether it fits, and the disk and RAM the model's conversion needs. Pure, like the checks."""

from __future__ import annotations

from playbooks.config.planning import host_from_recipe, plan_recipe
from playbooks.plan.gpus import GIB, get_gpu, size_text
from playbooks.plan.planner import Plan
from playbooks.plan.tensors import parameter_count
from playbooks.steps.preflight_checks import Check, Context, host_gpu

MIN_RAM_BYTES = 16 * GIB  # HF -> GGUF conversion and EXL2 measurement hold a layer plus buffers


def plan_for_host(cx: Context) -> Plan | None:
    """The recipe planned on the GPU the host reports, else the inventory's, else the recipe's."""
    if cx.loaded is None or cx.recipe is None:
        return None
    r = cx.recipe
    gpu = host_gpu(cx.facts) or get_gpu(cx.inventory_gpu or r.gpu)
    # the host's RAM, measured: what a MoE's experts in host RAM (n_cpu_moe) must fit
    ram = cx.facts.memory.mem_total_bytes
    # plan_recipe: the recipe's draft model and objective as `invoke plan` counts them
    return plan_recipe(
        cx.loaded,
        gpu,
        host=host_from_recipe(cx.loaded, ram_bytes=ram, ram_source="measured") if ram else host_from_recipe(cx.loaded),
        # an RPC split: the slowest worker's connect time from this host, measured, per hop
        rpc_rtt_ms=max(cx.facts.rpc_connect_ms.values()) if cx.facts.rpc_connect_ms else None,
    )


def check_disk_and_ram(cx: Context, plan: Plan | None) -> list[Check]:
    if plan is None or plan.chosen is None or cx.loaded is None:
        return []
    out = []
    params = parameter_count(cx.loaded.shape)
    # download (BF16, 2 bytes/param) + FP16 intermediate (2 bytes/param) + the quantized file
    need_disk = 4 * params + plan.chosen.weights_bytes
    d = cx.facts.disk.get(cx.model_dir)
    if d and d.available_bytes is not None:
        ok = d.available_bytes >= need_disk
        out.append(
            Check(
                "disk",
                "pass" if ok else "fail",
                f"{size_text(d.available_bytes)} free at {d.existing_path}, need {size_text(need_disk)} "
                "(download + FP16 + quantized file)",
                ""
                if ok
                else f"free {max(0, need_disk - d.available_bytes) / 1e9:.1f} GB or point the model dir elsewhere",
                blocking=True,
            )
        )
    mem = cx.facts.memory.mem_total_bytes
    if mem:
        ok = mem >= MIN_RAM_BYTES or params < 2e9
        out.append(
            Check(
                "ram",
                "pass" if ok else "warn",
                f"{mem / GIB:.1f} GiB RAM",
                "" if ok else "conversion of 14-32B models wants >= 16 GiB RAM; add swap or convert elsewhere",
            )
        )
    return out


def fit_summary(cx: Context, plan: Plan) -> tuple[str, Check]:
    chosen = plan.chosen
    assert chosen is not None
    verdict = (
        f"{chosen.quant} fits with {chosen.headroom_bytes / 2**20:,.0f} MiB left"
        if chosen.fits
        else f"{chosen.quant} does not fit: {chosen.unfit_reason}"
        if chosen.unfit_reason  # not the GPU's memory (a backend without a CPU path, the host's RAM)
        else f"{chosen.quant} does not fit by {-chosen.headroom_bytes / 2**20:,.0f} MiB"
    )
    if not chosen.fits and not chosen.unfit_reason:
        # the plan's numbers, so the refusal can be checked against `invoke plan` by hand
        gib = 2**30
        verdict += (
            f" at {plan.serving.context} tokens x {plan.serving.parallel}: needs {chosen.vram_bytes / gib:.2f} GiB "
            f"of {chosen.gpu_bytes / gib:.2f} GiB (weights {chosen.gpu_weights_bytes / gib:.2f}, "
            f"KV {chosen.kv_bytes / gib:.2f}, compute {chosen.compute_bytes / gib:.2f}"
            + (f", draft model {chosen.draft_bytes / gib:.2f}" if chosen.draft_bytes else "")
            + ")"
        )
    source = "the inventory's" if cx.inventory_gpu else "the recipe's"
    target = plan.gpu.name + (
        f" ({source} GPU: none seen on the host)" if host_gpu(cx.facts) is None and cx.wants_gpu else ""
    )
    fix = (
        ""
        if chosen.fits
        else f"choose {plan.recommendation.quant if plan.recommendation else 'a smaller model'}, or a shorter context"
    )
    return f"{verdict} on {target}; {plan.reason}", Check(
        "fit", "pass" if chosen.fits else "fail", f"{verdict} on {target}", fix, blocking=True
    )
