"""What a serving engine is on a host: the interface each engine's serving half fills
(steps/serve/engine_llamacpp.py, steps/serve/engine_exllamav2.py; the plan's half is
plan/engine_base.py). conduct/build.py and steps/serve/deploy.py ask it
(:func:`playbooks.steps.serve.engines.server_engine`) instead of comparing the engine's name:
what the host builds for it beyond llama.cpp (which every host gets: its conversion and
quantize tools), the artifact its server loads and the link it reads it through, where a
managed process keeps its state, what of its load log is held to the plan, and the files,
links and keys beside its unit, and, for an engine whose server routes several models (the plan
half's ``routes_models``), a model set's files."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from playbooks.config.recipe import LoadedRecipe, Recipe, Toolchain
    from playbooks.host import Host
    from playbooks.host.ops import Operation
    from playbooks.plan.engine_base import Engine
    from playbooks.plan.serving import Option
    from playbooks.steps.serve.deploy_record import DeployLayout
    from playbooks.steps.serve.lifecycle import Expectations
    from playbooks.steps.serve.router import RouterSet
    from playbooks.steps.serve.units import RenderedFile, ServerLayout
    from playbooks.steps.weights.model_layout import ModelLayout


class ServerEngine:
    """An engine's server on a host. ``engine``: its plan half (name, flags, memory model)."""

    engine: Engine

    def render_files(
        self,
        recipe: Recipe,
        layout: ServerLayout,
        gpu_indexes: tuple[int, ...],
        n_cpu_moe: int = 0,
        gpu_split: tuple[float, ...] = (),
    ) -> list[RenderedFile]:
        """Every file deploy installs for its server (steps/serve/service_files.py checked the
        indexes against the recipe's split)."""
        raise NotImplementedError

    def unit_name(self, recipe: Recipe, layout: ServerLayout, gpu_indexes: tuple[int, ...]) -> str:
        """The name of the unit ``render_files`` renders first (an instance template ends in
        ``@.service``): what its instances are called, without rendering or planning."""
        raise NotImplementedError

    def build_ops(self, prefix: str, venv: str, tc: Toolchain) -> list[Operation]:
        """What the build step adds for this engine after llama.cpp and its bindings."""
        return []

    def process_layout(self, server: ServerLayout, state_root: str) -> ServerLayout:
        """``server`` as a managed process (no systemd) keeps it: where its own files go."""
        return server

    def artifact(self, r: Recipe, model: ModelLayout, server: ServerLayout) -> tuple[str, str, str]:
        """(the artifact its server loads, that artifact's manifest, the link the unit reads)."""
        raise NotImplementedError

    def expectations(self, loaded: LoadedRecipe, option: Option | None) -> Expectations:
        """What its load log must show, from the plan's chosen option."""
        raise NotImplementedError

    def key_ops(self, secret: str | None, states: Sequence[DeployLayout], host: Host, systemd: bool) -> list[Operation]:
        """Where its server reads the API key from, besides what its unit loads (before the model link)."""
        return []

    def serve_dir_ops(self, server: ServerLayout, secret: str | None, host: Host) -> list[Operation]:
        """The directories, links and credentials its server opens beside its unit (after /etc)."""
        return []

    def render_set_files(self, s: RouterSet, layout: ServerLayout) -> list[RenderedFile]:
        """A model set's files (steps/serve/router.py): the router's unit, then its preset.
        Only an engine whose plan half ``routes_models`` has them (config/model_set.py refuses
        a set of any other before this is asked)."""
        raise NotImplementedError(f"{self.engine.server_label} serves one model per server")
