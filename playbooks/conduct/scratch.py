"""A second server beside the live one: another configuration served under the scratch unit
(``voltaforge-tune``) on a scratch port, by the deploy step's own operations, measured, then
stopped and removed. `invoke tune` serves each candidate so; `invoke bench --against` serves the
other recipe so, beside the deployed one, for the length of one interleaved run.

A server started once can be started afresh cheaply (:meth:`Scratch.restart`): the same files
restarted by their manager and /health polled, without the deploy's reads and checks again
(`bench --against` starts 32 processes a run; the deploy chain is a dozen commands, each a round
trip over SSH, where a restart is one and its polls).

What it must never do: leave a rollback target between two configurations (a failed start must
not bring back the one before), or leave anything behind (:meth:`Scratch.remove`, in the
callers' finally blocks).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from playbooks.conduct.deploy import choose_manager, deploy_ops, single_service
from playbooks.conduct.quantize import draft_artifact, quantize_step, recipe_weights
from playbooks.config.planning import plan_recipe
from playbooks.config.recipe import LoadedRecipe
from playbooks.errors import VoltaforgeError
from playbooks.facts import read_fact
from playbooks.facts.files import cat_command, parse_json_object
from playbooks.facts.service import health_command, parse_health
from playbooks.host import Host
from playbooks.host.ops import Change, Command, run_command, run_ops
from playbooks.plan.gpus import get_gpu
from playbooks.steps.serve.deploy_record import DeployLayout
from playbooks.steps.serve.lifecycle import EnsureServing, health_timeout
from playbooks.steps.serve.service_manager import make_manager
from playbooks.steps.serve.units import ServerLayout
from playbooks.steps.weights.model_layout import ModelLayout, manifest_path

SCRATCH_UNIT = "voltaforge-tune.service"
SCRATCH_SERVICE = SCRATCH_UNIT.removesuffix(".service")
#: a second scratch unit: `bench --against` serves fresh processes of the deployed recipe under it,
#: taking turns with the other recipe's under SCRATCH_UNIT (each unit written once, then started)
SCRATCH_A_UNIT = "voltaforge-tune-a.service"
#: the services that are never a live deployment
SCRATCH_SERVICES = (SCRATCH_SERVICE, SCRATCH_A_UNIT.removesuffix(".service"))
#: /health polls after a restart: a tiny model answers within a second, and every poll saved is
#: saved 32 times a run
RESTART_POLL_S = 0.1

#: the operations a scratch server runs (conduct/deploy.py and conduct/quantize.py build them;
#: scratch_ops() gives the real ones): functions, so the loops that use them can be driven by others
DeployOps = Callable[[LoadedRecipe, Host, str, "ServerLayout | None"], list[Any]]
StopCommand = Callable[[LoadedRecipe, Host, str, "ServerLayout | None"], Any]
QuantizeOps = Callable[[LoadedRecipe, str, str], list[Any]]
ModelId = Callable[[LoadedRecipe], str]


@dataclass
class Ops:
    """The operations a scratch server runs, built by the task layer."""

    deploy: DeployOps
    stop: StopCommand
    quantize: QuantizeOps
    model_id: ModelId
    draft_artifact: Callable[[LoadedRecipe, str], str | None] = lambda _loaded, _prefix: None


def planned_bytes(loaded: LoadedRecipe) -> int:
    """The memory the plan gives the recipe at its own quant (0 where the plan has no such option)."""
    option = next((o for o in plan_recipe(loaded).options if o.quant == loaded.recipe.quant_name), None)
    return option.vram_bytes if option else 0


def crowded(gpu_name: str, what: str, scratch_bytes: int, live: Sequence[tuple[str, int]], remedy: str) -> str | None:
    """Why a scratch server (``what``) of ``scratch_bytes`` planned does not fit beside the live services
    ((name, planned bytes) each) within the card the plan budgets, or on a CPU target within the
    planner's host budget (None: it fits); ``remedy`` ends the line."""
    if not live:
        return None
    gpu = get_gpu(gpu_name)
    live_bytes = sum(b for _, b in live)
    if scratch_bytes + live_bytes <= gpu.memory_bytes:
        return None
    names = ", ".join(n for n, _ in live)
    return (
        f"{what} ({scratch_bytes / 2**30:.2f} GiB planned) does not fit beside the live service ({names}, "
        f"{live_bytes / 2**30:.2f} GiB) in the {gpu.name}'s {gpu.memory_bytes / 2**30:.0f} GiB the plan budgets: "
        f"{remedy}"
    )


def _stop(loaded: LoadedRecipe, host: Host, prefix: str, server: ServerLayout | None) -> Command:
    unit, unit_name, state = single_service(loaded, prefix, server)
    return make_manager(choose_manager(host, "auto"), state, unit_name, unit.text).stop()


def scratch_ops() -> Ops:
    return Ops(
        deploy=lambda loaded, host, prefix, server: deploy_ops(loaded, host, prefix, "auto", server=server),
        stop=_stop,
        quantize=lambda loaded, prefix, quant: quantize_step(loaded, prefix, quant),
        model_id=lambda loaded: recipe_weights(loaded).model_id,
        draft_artifact=draft_artifact,
    )


class Scratch:
    """The scratch server on one connected host."""

    def __init__(
        self, host: Host, prefix: str, ops: Ops, say: Callable[[str], None] = lambda _: None, unit: str = SCRATCH_UNIT
    ):
        self.host, self.prefix, self.ops, self.say = host, prefix, ops, say
        self.layout = ServerLayout(prefix=prefix, unit_name=unit)
        #: the last start's serving step (its manager, port, artifact): what :meth:`restart` restarts
        self.serving: EnsureServing | None = None

    def artifact(self, loaded: LoadedRecipe, quant: str) -> dict[str, Any]:
        """The recipe's GGUF at ``quant`` as its manifest describes it (made by the quantize step
        when the manifest, or the draft's, is missing: the artifact is verified or made)."""
        path = ModelLayout(self.prefix, self.ops.model_id(loaded)).gguf(quant)
        facts = parse_json_object(read_fact(self.host, cat_command(manifest_path(path))))
        draft = self.ops.draft_artifact(loaded, self.prefix)
        if draft and not parse_json_object(read_fact(self.host, cat_command(manifest_path(draft)))):
            facts = None  # the quantize step makes the draft's GGUF beside the model's
        if not facts:
            self.say(f"making {quant}: no verified artifact yet")
            changes = run_ops(self.host, self.ops.quantize(loaded, self.prefix, quant))
            failed = next((ch for ch in changes if ch.status == "failed"), None)
            if failed:
                raise VoltaforgeError(f"quantize {quant}: {failed.why}")
            facts = parse_json_object(read_fact(self.host, cat_command(manifest_path(path)))) or {}
        return facts

    def start(self, loaded: LoadedRecipe) -> str | None:
        """Serve ``loaded`` (its port the scratch port) under the scratch unit; the failure's
        line, or None."""
        ops = self.ops.deploy(loaded, self.host, self.prefix, self.layout)
        changes: list[Change] = run_ops(self.host, ops)
        failed = next((ch for ch in changes if ch.status == "failed"), None)
        self.serving = None if failed else next((op for op in ops if isinstance(op, EnsureServing)), None)
        return failed.why if failed else None

    def restart(self, loaded: LoadedRecipe) -> str | None:
        """A fresh process of what the last :meth:`start` served: its manager's restart, then
        /health polled until it answers; the failure's line, or None. The deploy's reads and checks
        are not run again: that start judged the files, the link and the load log, and the host
        lock keeps anyone from changing them since. Without a start to repeat (or after a failed
        one), a whole :meth:`start`."""
        serving = self.serving
        if serving is None:
            return self.start(loaded)
        manager, run = serving.manager, (self.host.sudo if serving.sudo else self.host.run)
        try:
            run_command(self.host, manager.restart())
        except VoltaforgeError as e:
            return str(e)
        timeout = health_timeout(serving.artifact_bytes)
        t0 = time.monotonic()
        while parse_health(read_fact(self.host, health_command(serving.port))) != 200:
            if not manager.running(run(manager.state_command(), check=False, stream=False).stdout).up:
                return f"{manager.describe()} exited while loading"
            if time.monotonic() - t0 > timeout:
                return f"/health on 127.0.0.1:{serving.port} did not answer 200 within {timeout:.0f} s of a restart"
            time.sleep(RESTART_POLL_S)
        return None

    def stop(self, loaded: LoadedRecipe) -> None:
        try:
            run_command(self.host, self.ops.stop(loaded, self.host, self.prefix, self.layout))
        except VoltaforgeError:
            pass  # nothing running there
        # no rollback target between configurations: a failed start must not bring back the last one
        state = DeployLayout(self.prefix, self.layout.service).state_dir
        self.host.run(f"rm -rf -- {state}/good", check=False, stream=False)

    def remove(self) -> None:
        """Nothing of the scratch server left: its state and its serve directory."""
        self.host.run(
            f"rm -rf -- {DeployLayout(self.prefix, self.layout.service).state_dir} {self.layout.serve_dir}",
            check=False,
            stream=False,
        )
