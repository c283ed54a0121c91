"""`invoke bench --against RECIPE`: would this change help? The host's deployed recipe (A) and
RECIPE (B) measured in one run, their blocks interleaved A B B A, each block on a fresh process
(steps/measure/bench_against.py; paired.py says why the process is what is replicated).

Both sides are served on scratch units (conduct/scratch.py, tune's) in turn, one process at a time
beside the live service, which is never stopped, touched or measured: A afresh under
``voltaforge-tune-a`` on the live port + 101, B under ``voltaforge-tune`` on the live port + 100.
Each unit is deployed once (the deploy step's checks and load log) and then restarted for each
process (Scratch.restart); both are stopped and removed in a
finally (a failure, Ctrl-C).

Compute first: both recipes are loaded, and the one that is deployed read, before anything
changes; the larger of the two is refused up front when the plan says it does not fit beside the
live service (the card the plan budgets, or a CPU target's host budget). B's artifact is made by
the quantize step when it is missing, before the measurement. The run holds the host lock, so no
provision or tune changes the host under it.

The workload is A's gate's. Nothing enters the bench history: neither side is a gate run of what
the host serves (the result is written under ``bench/<host>/<A's recipe>/against-<time>/against.json``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from playbooks.conduct.deploy import served_instances
from playbooks.conduct.deployed import read_deployments
from playbooks.conduct.placements import with_port
from playbooks.conduct.scratch import SCRATCH_A_UNIT, Scratch, crowded, planned_bytes, scratch_ops
from playbooks.conduct.settings import Settings
from playbooks.errors import VoltaforgeError
from playbooks.facts.files import parse_writable, writable_command
from playbooks.host.lock import host_lock
from playbooks.host.output import Printer
from playbooks.plan.engines import engine
from playbooks.steps.measure.bench_against import Side, measure_against
from playbooks.steps.measure.bench_run import bench_dir
from playbooks.steps.serve.secrets import api_key_for

#: B's port: the live service's plus this (tune's scratch port); a fresh A's is one more
SCRATCH_OFFSET = 100


def bench_against(
    host_name: str,
    recipe: str | None,
    other: str,
    settings: Settings,
    say: Callable[[str], None] = lambda _: None,
) -> tuple[dict[str, Any], Path]:
    """A against B on one host: the result (per level each side's figures and B's change) and
    the file it was written to."""
    spec = settings.host_spec(host_name)
    one = settings.one_recipe(host_name, recipe)  # a bad name or a layout of several: before connecting
    b_loaded = settings.load_recipe(other)
    with settings.connect(spec, Printer(quiet=True)) as host:  # say() tells the steps; a failure its line
        served = one or settings.deployed_serves(host_name, recipe, host)[0]
        # the port the live server listens on, as its record says (not what the recipe file says now)
        instances = served_instances(served, spec.prefix, read_deployments(host, spec.prefix))[1]
        if len(instances) != 1:
            raise VoltaforgeError(
                f"{host.name}: --against compares one server with another; {served.loaded.recipe.name} runs "
                f"{len(instances)} instances here"
            )
        a_loaded = served.loaded
        name, _, a_port = instances[0]
        port = a_port + SCRATCH_OFFSET
        b_loaded = with_port(b_loaded, port)
        a_fresh = with_port(a_loaded, port + 1)
        # one scratch process at a time beside the live service: the larger of the two must fit
        why = crowded(
            a_loaded.recipe.gpu,
            f"{b_loaded.recipe.name} or a fresh {a_loaded.recipe.name}",
            max(planned_bytes(b_loaded), planned_bytes(a_fresh)),
            [(name, planned_bytes(a_loaded))],
            "compare on a host with room for both, or deploy it and compare the runs with --compare",
        )
        if why:
            raise VoltaforgeError(f"{host.name}: {why}")
        sudo = not parse_writable(host.run(writable_command(spec.prefix), check=False, stream=False).stdout)
        scratch = {
            "a": (Scratch(host, spec.prefix, scratch_ops(), say, unit=SCRATCH_A_UNIT), a_fresh),
            "b": (Scratch(host, spec.prefix, scratch_ops(), say), b_loaded),
        }
        a_key, b_key = api_key_for(host, a_loaded.recipe), api_key_for(host, b_loaded.recipe)
        a = Side(a_loaded.recipe.name, port + 1, engine(a_loaded.recipe.backend).server, a_key)
        b = Side(b_loaded.recipe.name, port, engine(b_loaded.recipe.backend).server, b_key)
        running: list[str] = []

        def fresh(side: Side) -> str | None:
            """The side's process started anew, the other stopped first (one at a time): deployed
            the first time, restarted after (Scratch.restart)."""
            for key in running:
                scratch[key][0].stop(scratch[key][1])
            running[:] = ["a" if side is a else "b"]
            unit, loaded = scratch[running[0]]
            return unit.restart(loaded)

        with host_lock(host, spec.prefix, sudo=sudo):
            try:
                for unit, loaded in scratch.values():
                    unit.artifact(loaded, loaded.recipe.quant_name)
                say(
                    f"{a_loaded.recipe.name} (A, port {port + 1}) and {b_loaded.recipe.name} (B, port {port}) "
                    f"served in turn beside {name} (port {a_port}, untouched)"
                )
                measured = measure_against(host, a, b, a_loaded.recipe.gate, fresh, say=say)
            finally:
                for unit, loaded in scratch.values():
                    unit.stop(loaded)
                    unit.remove()
    if "error" in measured:
        raise VoltaforgeError(f"{host.name}: {measured['error']}")
    result = {
        "host": host.name,
        "a": {
            "recipe": a_loaded.recipe.name,
            "path": str(a_loaded.path),
            "service": name,
            "port": port + 1,
            "live_port": a_port,
        },
        "b": {"recipe": b_loaded.recipe.name, "path": str(b_loaded.path), "port": port},
        **measured,
    }
    where = bench_dir() / host.name / a_loaded.recipe.name / f"against-{result['at'].replace(':', '')}"
    where.mkdir(parents=True, exist_ok=True)
    path = where / "against.json"
    path.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    return result, path
