"""`invoke build`: llama.cpp from the pinned source for the host's arch, proven and stamped."""

from __future__ import annotations

from pathlib import Path

from playbooks.cli.render import render_report
from playbooks.cli.settings import Settings
from playbooks.errors import VoltaforgeError
from playbooks.facts import read_fact
from playbooks.facts.files import parse_writable, writable_command
from playbooks.host.lock import host_lock
from playbooks.host.ops import run_ops
from playbooks.plan.gpus import get_gpu
from playbooks.steps.build import LLAMACPP_TARGETS, BuildLayout, FleetCache, build_ops, fetch_sdist


def run_build(
    host_name: str,
    recipe: str | None = None,
    dry_run: bool = False,
    inventory: str | Path = "inventory.yaml",
    settings: Settings | None = None,
    targets: tuple[str, ...] = LLAMACPP_TARGETS,
    extra_flags: tuple[str, ...] = (),
    no_cache: bool = False,
) -> int:
    settings = settings or Settings(inventory=Path(inventory))
    spec = settings.host_spec(host_name)
    name = recipe or spec.recipe
    if not name:
        raise VoltaforgeError(f"{host_name}: no recipe: pass --recipe or set one in inventory.yaml")
    r = settings.load_recipe(name).recipe
    tc = r.toolchain
    major, minor = (int(x) for x in tc.cuda.split("."))  # the recipe schema checks MAJOR.MINOR
    cuda_release = None if get_gpu(r.gpu).is_cpu else (major, minor)
    source = fetch_sdist(tc.llamacpp_sdist, tc.llamacpp_ref)
    layout = BuildLayout(spec.prefix)
    with settings.connect(spec) as host:
        sudo = not parse_writable(read_fact(host, writable_command(spec.prefix)))
        ops = build_ops(
            layout,
            source,
            cuda_release=cuda_release,
            recipe_arch=tc.cuda_arch,
            targets=targets,
            extra_flags=extra_flags,
            owner=host.user,
            sudo=sudo,
            cache=None if no_cache else FleetCache.default(),
        )
        if dry_run:
            changes = run_ops(host, ops, dry_run=True)
        else:
            with host_lock(host, spec.prefix, sudo=sudo):
                changes = run_ops(host, ops)
    render_report(changes)
    return 1 if any(c.status == "failed" for c in changes) else 0
