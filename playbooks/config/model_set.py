"""A model set (issue 55) turned into its residency plan: several recipes served by one router
on one GPU set (or one CPU memory budget), each planned alone on the set's target, then judged
together (plan/residency.py).

Decisions recorded here:
- Every member is planned on the set's target (``--gpu``, else the first member's recipe
  GPU), whatever GPU its own recipe names: the set's children share those cards.
- On a CPU target the memory the children share is a budget (``memory_gib``: a flag, or the
  inventory's setting for the host), else the CPU target's own figure; on a GPU it is the
  card's memory, and a budget is refused (the card's memory is not a setting).
- A member must be an engine that routes models (llama-server's router); two members may not
  serve the same name (the router routes by it); a member whose plan cannot run for a reason
  other than memory is refused with that reason. Not in a set (refused, said): RPC splits (a
  child runs on the set's own cards) and draft models (speculation needs the draft's own link
  per member; left for later).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from playbooks.config.planning import plan_recipe, unfit_text
from playbooks.config.recipe import RECIPES_DIR, LoadedRecipe, load_recipe
from playbooks.errors import UsageError, VoltaforgeError
from playbooks.plan.engines import engine
from playbooks.plan.gpus import GIB, MIB, Gpu, get_gpu
from playbooks.plan.planner import Plan
from playbooks.plan.residency import Member, Residency, refusal

#: the fewest recipes a set names: one model is a plain server
MIN_MEMBERS = 2


@dataclass
class SetPlan:
    """A set's plan: its target and the residency its members' own plans make."""

    gpu: Gpu
    residency: Residency
    budget_source: str  # where the capacity came from: the card, the CPU target, a budget

    @property
    def refusal(self) -> str | None:
        return refusal(self.residency, f"{self.gpu.name} ({self.budget_source})")


def member_of(loaded: LoadedRecipe, plan: Plan) -> Member:
    """What one member holds alone, from its plan's chosen option."""
    c = plan.chosen
    if c is None:  # the planner found no quant to plan (a recipe always names one)
        raise VoltaforgeError(f"{loaded.recipe.name}: the plan has no option for {loaded.recipe.quant_name}")
    parts = [("weights", c.gpu_weights_bytes), ("KV cache", c.kv_bytes), ("compute", c.compute_bytes)]
    held = c.vram_bytes  # the card that decides (a split's parts above are the whole model's)
    if plan.gpu.is_cpu:
        # the child is a process of its own: its base beside the model's terms, as the router's
        base = engine(loaded.recipe.backend).process_cpu_bytes
        parts += [("process", base), ("margin", c.overhead_bytes)]
        held += base
    else:  # its own CUDA context is in the plan's overhead
        parts += [("context + margin", c.overhead_bytes)]
    return Member(loaded.recipe.served_name, loaded.recipe.name, c.quant, held, tuple(parts))


def plan_set(
    recipes: Sequence[str],
    gpu: str | None = None,
    memory_gib: float | None = None,
    recipes_dir: Path = RECIPES_DIR,
    budget_from: str = "--memory-budget",
) -> SetPlan:
    """Plan each of ``recipes`` on the set's target and judge them together. Raises
    VoltaforgeError (one line) for a set that cannot be planned: too few members, a member of
    an engine without a router, a served name twice, a member that cannot run there; a member
    too large for the set is the SetPlan's refusal (the plan shows why)."""
    if len(recipes) < MIN_MEMBERS:
        raise UsageError(f"a set names {MIN_MEMBERS} or more recipes, got {len(recipes)}: one model is a plain server")
    if len(set(recipes)) != len(recipes):
        raise UsageError(f"a recipe is named twice in the set: {', '.join(recipes)}")
    loaded = [load_recipe(name, recipes_dir) for name in recipes]
    target = get_gpu(gpu or loaded[0].recipe.gpu)
    seen: dict[str, str] = {}
    for lr in loaded:
        r = lr.recipe
        if not (e := engine(r.backend)).routes_models:
            raise VoltaforgeError(f"{r.name} is an {e.label} recipe: {e.server_label} serves one model per server")
        if r.rpc:
            raise VoltaforgeError(f"{r.name} splits over RPC workers: a set's children run on the set's own cards")
        if r.draft is not None:
            raise VoltaforgeError(f"{r.name} has a draft model: a set serves its members without speculation")
        if r.served_name in seen:
            raise VoltaforgeError(
                f"{seen[r.served_name]} and {r.name} both serve {r.served_name!r}: the router routes by the "
                "served name (service.model_name)"
            )
        seen[r.served_name] = r.name
    if memory_gib is not None and not target.is_cpu:
        raise UsageError(f"a memory budget ({budget_from}) is for a CPU target; {target.name}'s memory is its card's")
    members = []
    for lr in loaded:
        plan = plan_recipe(lr, target)
        if (c := plan.chosen) is not None and c.unfit_reason:
            raise VoltaforgeError(f"{lr.recipe.name} in the set: {unfit_text(plan)}")
        members.append(member_of(lr, plan))
    if not target.is_cpu:
        capacity, source = target.memory_bytes, "the card's memory"
        parent = loaded[0].recipe.planner.cuda_context_mib * MIB
    elif memory_gib is not None:
        capacity, source = int(memory_gib * GIB), f"a {memory_gib:g} GiB budget"
    else:
        capacity, source = target.memory_bytes, f"the CPU target's {target.memory_gib:g} GiB"
    if target.is_cpu:
        parent = engine(loaded[0].recipe.backend).process_cpu_bytes
    return SetPlan(target, Residency(tuple(members), capacity, parent), source)
