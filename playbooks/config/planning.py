"""A recipe turned into the planner's inputs: its serving settings and its plan."""

from __future__ import annotations

import copy
import threading
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from pydantic import ValidationError

from playbooks.config.recipe import (
    DEFAULTS_FILE,
    RECIPES_DIR,
    LoadedRecipe,
    PlannerSettings,
    Recipe,
    recipe_argument,
    shadowed_shipped,
)
from playbooks.config.yamlfile import explain_validation, load_yaml
from playbooks.errors import VoltaforgeError
from playbooks.plan.engines import engine
from playbooks.plan.gpus import GIB, Gpu, get_gpu
from playbooks.plan.model_config import ModelShape
from playbooks.plan.moe import HOST_MEMBW_DEFAULT_GB_S, HostMemory, NCpuMoe, RamSource
from playbooks.plan.objective import Objective
from playbooks.plan.planner import Plan, make_plan
from playbooks.plan.serving import DraftPlan, Serving
from playbooks.plan.split import worst

#: a speed floor given as "none": no floor, the fastest quant of at least min_bpw
NO_SPEED_FLOOR = "none"
#: a speed floor as a flag gives it: tok/s, NO_SPEED_FLOOR, or None (the recipe's or the default)
SpeedFloor = float | str | None


def planner_defaults(recipes_dir: Path = RECIPES_DIR) -> PlannerSettings:
    """The `planner:` section of the recipes' defaults.yaml: what a plan without a recipe
    (`invoke plan --model-config`) plans with, so that it is planned as a shipped recipe is.
    No such file: the settings' own defaults, which are the shipped file's values."""
    path = recipes_dir / DEFAULTS_FILE
    if not path.is_file():
        return PlannerSettings()
    data, lines = load_yaml(path)
    section = (data or {}).get("planner") if isinstance(data, dict) else None
    try:
        return PlannerSettings.model_validate(section or {})
    except ValidationError as exc:
        raise explain_validation(exc, path, lines, PlannerSettings, prefix=("planner",)) from None


def objective_for(
    planner: PlannerSettings,
    shape: ModelShape,
    min_tok_s: SpeedFloor = None,
    measured_kld: Mapping[str, float] | None = None,
) -> Objective:
    """The recommendation's objective from a recipe's (or defaults.yaml's) planner settings;
    `min_tok_s` (a flag) instead of planner.min_tok_s; `measured_kld`: quant -> mean KLD measured
    on this model (the artifacts' manifests on a host)."""
    floor = planner.min_tok_s if min_tok_s is None else None if min_tok_s == NO_SPEED_FLOOR else float(min_tok_s)
    return Objective(
        min_bpw=planner.min_bpw,
        min_tok_s=floor,
        measured_kld=dict(measured_kld or {}),
        imatrix=planner.imatrix,
        mxfp4_experts=shape.mxfp4_experts,
    )


def draft_from_recipe(loaded: LoadedRecipe) -> DraftPlan | None:
    """The recipe's speculative decoding draft model, as the planner counts it."""
    r = loaded.recipe
    return DraftPlan(loaded.draft_shape, r.draft.quant) if r.draft and loaded.draft_shape else None


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
        gpu_count=r.gpu_count,
        tensor_split=tuple(r.tensor_split or ()),
        rpc_devices=len(r.rpc),
        rpc_rtt_ms=r.planner.rpc_rtt_ms or 0.0,
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


_PLANS: dict[tuple, Plan] = {}
_PLANS_LOCK = threading.Lock()


def planned(
    shape: ModelShape,
    gpu: Gpu,
    serving: Serving,
    quant: str,
    draft: DraftPlan | None,
    objective: Objective,
    host: HostMemory,
) -> Plan:
    """``make_plan``, computed once per process for the same inputs: the steps of one host ask
    for their recipe's plan three times, and every host of a fleet that shares a recipe asks
    again (0.15 s each for a 14B model on the 2-core controller). The inputs are frozen
    dataclasses; the objective holds a dict, so its repr stands in for it. Each caller gets its
    own copy (callers append notes)."""
    key = (shape, gpu, serving, quant, draft, repr(objective), host)
    with _PLANS_LOCK:
        found = _PLANS.get(key)
    if found is None:
        found = make_plan(shape, gpu, serving, quant=quant, draft=draft, objective=objective, host=host)
        with _PLANS_LOCK:
            _PLANS[key] = found
    return copy.deepcopy(found)


def plan_recipe(
    loaded: LoadedRecipe,
    gpu: str | Gpu | None = None,
    context: int | None = None,
    n_cpu_moe: NCpuMoe | None = None,
    host: HostMemory | None = None,
    min_tok_s: SpeedFloor = None,
    measured_kld: Mapping[str, float] | None = None,
    gpu_count: int | None = None,
    tensor_split: tuple[float, ...] | None = None,
    rpc_rtt_ms: float | None = None,
) -> Plan:
    """The recipe planned: on `gpu` (a name or the GPU a host reports) instead of the recipe's,
    with its draft model, its planner settings' objective (`min_tok_s` and `measured_kld`: see
    objective_for)."""
    r = loaded.recipe
    serving = serving_from_recipe(loaded, context, n_cpu_moe)
    if gpu_count is not None:  # a flag's split instead of the recipe's
        serving = replace(serving, gpu_count=gpu_count, tensor_split=tensor_split or ())
    if rpc_rtt_ms is not None:  # measured by preflight: instead of the recipe's figure
        serving = replace(serving, rpc_rtt_ms=rpc_rtt_ms, rpc_rtt_source="measured")
    plan = planned(
        loaded.shape,
        gpu if isinstance(gpu, Gpu) else get_gpu(gpu or r.gpu),
        serving,
        quant=r.quant_name,
        draft=draft_from_recipe(loaded),
        objective=objective_for(r.planner, loaded.shape, min_tok_s, measured_kld),
        host=host or host_from_recipe(loaded),
    )
    if r.model.repo and not r.model.pinned:
        plan.notes.append(
            f"model.revision {r.model.revision!r} is not a commit sha: provisioning records the sha it resolves to"
        )
    if hidden := shadowed_shipped(loaded.path):
        plan.notes.append(f"{loaded.path} is used, not the shipped recipe of the same name ({hidden})")
    return plan


def unfit_text(plan: Plan) -> str | None:
    """Why the recipe's planned quant does not fit (None: it fits): the card that overflows
    and by how much, or why it cannot run there at all."""
    c = plan.chosen
    if c is None or c.fits:
        return None
    if c.unfit_reason.endswith("has no BF16"):
        s = plan.serving
        wanted = (["BF16 weights (quant: F16)"] if c.quant == "BF16" else []) + (
            ["a bf16 cache (cache: f16)"] if "bf16" in (s.cache_k, s.cache_v) else []
        )
        return f"{c.unfit_reason} for {' or '.join(wanted)}"
    if c.unfit_reason:
        return c.unfit_reason
    over = -c.headroom_bytes / 2**20
    if c.devices:
        card = worst(c.devices)
        return (
            f"device {card.index} of {len(c.devices)} ({card.name}, layers {card.layers_text}) needs "
            f"{card.total_bytes / GIB:.2f} GiB "
            f"of {card.capacity_bytes / GIB:.2f} GiB: over by {over:,.0f} MiB"
        )
    return f"it needs {c.vram_bytes / GIB:.2f} GiB of {c.gpu_bytes / GIB:.2f} GiB: over by {over:,.0f} MiB"


def refuse_unfit(loaded: LoadedRecipe) -> None:
    """Refuse to render or deploy what the plan says does not fit (a MoE recipe with n_cpu_moe
    auto is judged by resolve_n_cpu_moe, which finds the N that fits or refuses)."""
    r = loaded.recipe
    if loaded.shape.is_moe and r.n_cpu_moe == "auto":
        return
    why = unfit_text(plan_recipe(loaded))
    if why:
        raise VoltaforgeError(
            f"{loaded.path}: {r.quant_name} does not fit {r.device_count} x {r.gpu} at {r.context} tokens x "
            f"{r.parallel} slot(s): {why} (invoke plan --recipe {recipe_argument(loaded.path)})"
            if r.split
            else f"{loaded.path}: {r.quant_name} does not fit {r.gpu} at {r.context} tokens x {r.parallel} slot(s): "
            f"{why} (invoke plan --recipe {recipe_argument(loaded.path)})"
        )


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
    if r.n_cpu_moe is None or not engine(r.backend).offloads_experts or not loaded.shape.is_moe:
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


def resolve_gpu_split(loaded: LoadedRecipe) -> tuple[float, ...]:
    """TabbyAPI's gpu_split for an EXL2 recipe over several cards: the allotments its plan chose
    (plan/exl2_split.py); () for anything else. What does not fit is refused before this
    (refuse_unfit), so the allotments rendered are always ones the plan fitted."""
    r = loaded.recipe
    e = engine(r.backend)
    if not e.renders_gpu_split or r.gpu_count < 2:
        return ()
    # the chosen quant's split only, as the plan computes it (not the whole fit table)
    serving = serving_from_recipe(loaded)
    return e.plan_split(loaded.shape, r.quant_name, get_gpu(r.gpu), serving, serving.context).gpu_split


def with_overrides(
    loaded: LoadedRecipe,
    parallel: int | None = None,
    quant: str | None = None,
    cache_k: str | None = None,
    cache_v: str | None = None,
) -> tuple[LoadedRecipe, list[str]]:
    """The recipe with a what-if's values in place of its own (validated as the recipe is, so a
    quantized V cache without flash attention is refused the same way), and one line per value
    overridden: ``parallel 4 (the recipe: 2)``. ``quant``: a GGUF type for a llama.cpp recipe,
    ``EXL2-3.5`` for an ExLlamaV2 one (the backend is the recipe's); the cache types are
    llama-server's."""
    r = loaded.recipe
    data = r.model_dump()
    said: list[str] = []
    if parallel is not None and parallel != r.parallel:
        data["parallel"] = parallel
        said.append(f"parallel {parallel} (the recipe: {r.parallel})")
    e = engine(r.backend)
    if quant is not None and quant != r.quant_name:
        if not e.owns_quant(quant):
            raise VoltaforgeError(e.wrong_quant(r.name, quant))
        if why := e.quant_refusal(loaded.shape, quant):
            raise VoltaforgeError(f"--quant {quant}: {why}")
        data["quant"] = e.recipe_quant(quant, data["quant"])
        said.append(f"quant {quant} (the recipe: {r.quant_name})")
    cache = {"k": cache_k, "v": cache_v}
    for part, value in cache.items():
        if value is None or value == getattr(r.cache, part):
            continue
        if not e.takes_cache_flags:
            raise VoltaforgeError(
                f"--cache-type-{part} is llama-server's; {r.name} is an {e.label} recipe (its cache: in the file)"
            )
        data["cache"][part] = value
        said.append(f"cache {part.upper()} {value} (the recipe: {getattr(r.cache, part)})")
    if not said:
        return loaded, []
    try:
        new = Recipe.model_validate(data)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]["msg"].removeprefix("Value error, ")
        raise VoltaforgeError(f"{r.name} with {', '.join(said)}: {first}") from None
    return loaded.model_copy(update={"recipe": new}), said
