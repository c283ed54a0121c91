"""`invoke rpc-worker`: make a host one of a recipe's RPC workers (conduct/rpc_worker.py)."""

from __future__ import annotations

from playbooks.cli.converge import converge
from playbooks.conduct.converge import per_recipe
from playbooks.conduct.rpc_worker import rpc_worker_ops
from playbooks.conduct.settings import Settings


def run_rpc_worker(
    host_name: str, recipe: str | None = None, dry_run: bool = False, settings: Settings | None = None
) -> int:
    return converge(settings or Settings(), host_name, recipe, per_recipe(rpc_worker_ops), dry_run)
