"""`invoke bench --against RECIPE`: would this change help? The host's deployed server (A) and
RECIPE (B) served beside it on the scratch port (conduct/scratch.py, tune's), measured in one
run with their rounds interleaved (steps/measure/bench_against.py), then B stopped and removed.

Compute first: B is loaded and planned before the host is reached, and refused when the plan
says it does not fit beside A (the card the plan budgets, or a CPU target's host budget); A is
never stopped or touched. B's artifact is made by the quantize step when it is missing, before
the measurement. The run holds the host lock, so no provision or tune changes the host under it.

B is served on A's port + 100 (tune's scratch port), with A's workload (A's gate). Nothing enters
the bench history: neither side is a gate run of what the host serves (the result is written
under ``bench/<host>/<A's recipe>/against-<time>/against.json``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from playbooks.conduct.deploy import served_instances
from playbooks.conduct.scratch import Scratch, crowded, planned_bytes, scratch_ops
from playbooks.conduct.settings import Settings
from playbooks.conduct.tune_candidates import candidate_port
from playbooks.errors import VoltaforgeError
from playbooks.facts.files import parse_writable, writable_command
from playbooks.host.lock import host_lock
from playbooks.host.output import Printer
from playbooks.plan.engines import engine
from playbooks.steps.measure.bench_against import Side, measure_against
from playbooks.steps.measure.bench_run import bench_dir
from playbooks.steps.serve.secrets import api_key_for

#: B's port: A's plus this (tune's scratch port)
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
        instances = served_instances(served, spec.prefix)[1]
        if len(instances) != 1:
            raise VoltaforgeError(
                f"{host.name}: --against compares one server with another; {served.loaded.recipe.name} runs "
                f"{len(instances)} instances here"
            )
        a_loaded = served.loaded
        name, _, a_port = instances[0]
        port = a_port + SCRATCH_OFFSET
        b_loaded = candidate_port(b_loaded, port)
        why = crowded(
            a_loaded.recipe.gpu,
            b_loaded.recipe.name,
            planned_bytes(b_loaded),
            [(name, planned_bytes(a_loaded))],
            "compare on a host with room for both, or deploy it and compare the runs with --compare",
        )
        if why:
            raise VoltaforgeError(f"{host.name}: {why}")
        sudo = not parse_writable(host.run(writable_command(spec.prefix), check=False, stream=False).stdout)
        scratch = Scratch(host, spec.prefix, scratch_ops(), say)
        with host_lock(host, spec.prefix, sudo=sudo):
            try:
                scratch.artifact(b_loaded, b_loaded.recipe.quant_name)
                say(f"serving {b_loaded.recipe.name} on port {port} beside {name} (port {a_port})")
                failed = scratch.start(b_loaded)
                if failed:
                    raise VoltaforgeError(
                        f"{host.name}: {b_loaded.recipe.name} did not come up on port {port}: {failed}"
                    )
                a = Side(name, a_port, engine(a_loaded.recipe.backend).server, api_key_for(host, a_loaded.recipe))
                b = Side(
                    b_loaded.recipe.name,
                    port,
                    engine(b_loaded.recipe.backend).server,
                    api_key_for(host, b_loaded.recipe),
                )
                measured = measure_against(host, a, b, a_loaded.recipe.gate, say=say)
            finally:
                scratch.stop(b_loaded)
                scratch.remove()
    if "error" in measured:
        raise VoltaforgeError(f"{host.name}: {measured['error']}")
    result = {
        "host": host.name,
        "a": {"recipe": a_loaded.recipe.name, "path": str(a_loaded.path), "service": name, "port": a_port},
        "b": {"recipe": b_loaded.recipe.name, "path": str(b_loaded.path), "port": port},
        **measured,
    }
    where = bench_dir() / host.name / a_loaded.recipe.name / f"against-{result['at'].replace(':', '')}"
    where.mkdir(parents=True, exist_ok=True)
    path = where / "against.json"
    path.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    return result, path
