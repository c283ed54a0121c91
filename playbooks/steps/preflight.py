"""`invoke preflight`: read a host's facts, then judge them against a recipe.

Gathering is I/O (steps/preflight_facts.py: one command per fact, over the host layer); judging is
pure: `judge()` takes facts and a recipe and returns checks, each with a verdict and a fix
(steps/preflight_checks.py, area by area; steps/preflight_fit.py, the plan on the host). A
check that fails and is blocking makes preflight exit non-zero. Callers import all of it from
here.
"""

from __future__ import annotations

from playbooks.config.recipe import LoadedRecipe
from playbooks.steps.preflight_checks import (
    Check,
    Context,
    Verdict,
    check_cuda,
    check_gpu,
    check_gpu_indexes,
    check_os,
    check_python,
    check_rpc,
    check_systemd,
)
from playbooks.steps.preflight_facts import HostFacts, gather, rpc_endpoints
from playbooks.steps.preflight_fit import check_disk_and_ram, fit_summary, plan_for_host

__all__ = ["Check", "HostFacts", "Verdict", "gather", "judge", "rpc_endpoints"]


def judge(
    facts: HostFacts,
    loaded: LoadedRecipe | None,
    model_dir: str,
    prefix: str,
    inventory_gpu: str | None = None,
    gpu_indexes: tuple[int, ...] | None = None,
) -> Verdict:
    """Pure: turn facts (and the recipe, when given) into checks with fixes, one area at a time.

    The GPU the plan is judged against: the one the host reports; else the inventory's `gpu`;
    else the recipe's. An inventory entry that disagrees with the host is flagged.
    ``gpu_indexes``: the GPUs a host's layout gives the recipe, which must be there."""
    cx = Context(facts, loaded, model_dir, prefix, inventory_gpu, gpu_indexes)
    v = Verdict(facts)
    for area in (check_os, check_systemd, check_python, check_gpu, check_gpu_indexes, check_cuda, check_rpc):
        v.checks += area(cx)
    plan = plan_for_host(cx)
    v.checks += check_disk_and_ram(cx, plan)
    if plan is not None:
        v.plan_summary, fit = fit_summary(cx, plan)
        v.checks.append(fit)
    return v
