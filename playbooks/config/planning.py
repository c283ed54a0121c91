"""A recipe turned into the planner's inputs: its serving settings and its plan."""

from __future__ import annotations

from playbooks.config.recipe import LoadedRecipe
from playbooks.plan.gpus import get_gpu
from playbooks.plan.planner import DraftPlan, Plan, Serving, make_plan


def serving_from_recipe(loaded: LoadedRecipe, context: int | None = None) -> Serving:
    r = loaded.recipe
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
    )


def plan_recipe(loaded: LoadedRecipe, gpu: str | None = None, context: int | None = None) -> Plan:
    r = loaded.recipe
    draft = DraftPlan(loaded.draft_shape, r.draft.quant) if r.draft and loaded.draft_shape else None
    plan = make_plan(
        loaded.shape,
        get_gpu(gpu or r.gpu),
        serving_from_recipe(loaded, context),
        quant=r.quant_name,
        draft=draft,
        min_bpw=r.planner.min_bpw,
    )
    if r.model.repo and not r.model.pinned:
        plan.notes.append(
            f"model.revision {r.model.revision!r} is not a commit sha: provisioning records the sha it resolves to"
        )
    return plan
