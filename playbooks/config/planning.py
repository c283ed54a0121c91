"""A recipe turned into the planner's inputs: its serving settings and its plan."""

from __future__ import annotations

from playbooks.config.recipe import LoadedRecipe
from playbooks.errors import VoltaforgeError
from playbooks.plan.gpus import GIB, get_gpu
from playbooks.plan.moe import HOST_MEMBW_DEFAULT_GB_S, HostMemory, NCpuMoe, RamSource
from playbooks.plan.planner import DraftPlan, Plan, Serving, make_plan


def serving_from_recipe(loaded: LoadedRecipe, context: int | None = None, n_cpu_moe: NCpuMoe | None = None) -> Serving:
    """`n_cpu_moe`: instead of the recipe's (a flag); the recipe's unset means none (0)."""
    r = loaded.recipe
    if n_cpu_moe is None:
        n_cpu_moe = r.n_cpu_moe if r.n_cpu_moe is not None else 0
    return Serving(
        backend=r.backend,
        context=context or r.context,
        parallel=r.parallel,
        cache_k=r.cache.k,
        cache_v=r.cache.v,
        flash_attn=r.flash_attn,
        n_ubatch=r.planner.n_ubatch,
        cuda_context_mib=r.planner.cuda_context_mib,
        margin_mib=r.planner.margin_mib,
        imatrix=r.planner.imatrix,
        head_bits=r.quant.head_bits if not isinstance(r.quant, str) else 6,
        n_cpu_moe=n_cpu_moe,
    )


def host_from_recipe(
    loaded: LoadedRecipe,
    membw_gb_s: float | None = None,
    ram_bytes: int | None = None,
    ram_source: RamSource = "given",
    membw_measured: bool = False,
) -> HostMemory:
    """The host memory a plan assumes: a figure passed here (a flag: "given"; a measurement:
    membw_measured / ram_source "measured") wins over the recipe's planner.host_membw_gb_s /
    host_ram_gib ("given"), which win over the default bandwidth and an unknown RAM."""
    p = loaded.recipe.planner
    if membw_gb_s is not None:
        membw, membw_source = membw_gb_s, "measured" if membw_measured else "given"
    elif p.host_membw_gb_s is not None:
        membw, membw_source = p.host_membw_gb_s, "given"
    else:
        membw, membw_source = HOST_MEMBW_DEFAULT_GB_S, "default"
    if ram_bytes is None and p.host_ram_gib is not None:
        ram_bytes, ram_source = int(p.host_ram_gib * GIB), "given"
    return HostMemory(
        membw_gb_s=membw,
        membw_source=membw_source,  # type: ignore[arg-type]
        ram_bytes=ram_bytes,
        ram_source=ram_source if ram_bytes is not None else "unknown",
    )


def plan_recipe(
    loaded: LoadedRecipe,
    gpu: str | None = None,
    context: int | None = None,
    n_cpu_moe: NCpuMoe | None = None,
    host: HostMemory | None = None,
) -> Plan:
    r = loaded.recipe
    draft = DraftPlan(loaded.draft_shape, r.draft.quant) if r.draft and loaded.draft_shape else None
    plan = make_plan(
        loaded.shape,
        get_gpu(gpu or r.gpu),
        serving_from_recipe(loaded, context, n_cpu_moe),
        quant=r.quant_name,
        draft=draft,
        min_bpw=r.planner.min_bpw,
        host=host or host_from_recipe(loaded),
    )
    if r.model.repo and not r.model.pinned:
        plan.notes.append(
            f"model.revision {r.model.revision!r} is not a commit sha: provisioning records the sha it resolves to"
        )
    return plan


def resolve_n_cpu_moe(
    loaded: LoadedRecipe, gpu: str | None = None, context: int | None = None, host: HostMemory | None = None
) -> int:
    """The --n-cpu-moe a deployment of this recipe passes to llama-server: 0 for a dense model,
    an ExLlamaV2 recipe or a recipe without n_cpu_moe; its number when it pins one; for `auto`
    the smallest N with which the recipe's quant fits the GPU (planned with `gpu`, `context`
    and `host` when given, else the recipe's). Pass it explicitly: llama-server's own `--fit`
    (on by default) would otherwise choose its own expert overrides at load time.

    Raises VoltaforgeError when `auto` finds no N: the quant does not fit even with every
    layer's experts in host RAM (or the host RAM known to the plan cannot hold them)."""
    r = loaded.recipe
    if r.n_cpu_moe is None or r.backend != "llamacpp" or not loaded.shape.is_moe:
        return 0
    if isinstance(r.n_cpu_moe, int):
        return r.n_cpu_moe
    plan = plan_recipe(loaded, gpu, context, host=host)
    c = plan.chosen
    assert c is not None  # a recipe always names its quant
    if not c.fits:
        why = c.unfit_reason or f"{c.vram_bytes / GIB:.2f} GiB needed of {c.gpu_bytes / GIB:.2f} GiB"
        raise VoltaforgeError(
            f"{loaded.path}: n_cpu_moe: auto: {c.quant} does not fit {plan.gpu.name} at {plan.serving.context} "
            f"tokens x {plan.serving.parallel} slot(s) with any number of layers' experts in host RAM "
            f"(at --n-cpu-moe {c.n_cpu_moe}: {why})"
        )
    return c.n_cpu_moe
