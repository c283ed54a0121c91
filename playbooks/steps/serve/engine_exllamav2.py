"""ExLlamaV2's server on a host, TabbyAPI (its plan half: plan/engine_exllamav2.py): the host
builds ExLlamaV2 for its GPU and TabbyAPI at its pinned commit; TabbyAPI loads the EXL2
directory through a link named for the served model, opens its templates, sampler overrides,
logs and API tokens relative to its working directory, and prints no offload or buffer lines
(ExLlamaV2 loads every layer on the GPU or fails), so nothing of its load log is held to the
plan. Its config and unit: steps/serve/units.py (render_tabbyapi_config); its build:
steps/build/exllamav2.py, steps/build/tabbyapi.py; its conversion: steps/weights/exl2_convert.py."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from playbooks.host.ops import EnsureDirectory
from playbooks.plan.engine_exllamav2 import EXLLAMAV2
from playbooks.steps.build.exllamav2 import EnsureExllamav2
from playbooks.steps.build.tabbyapi import EnsureTabbyAPI
from playbooks.steps.serve.deploy import EnsureSymlink, EnsureTabbyTokens, Expectations
from playbooks.steps.serve.engine_base import ServerEngine
from playbooks.steps.weights.exl2_convert import STAMP_NAME, Exl2Layout

if TYPE_CHECKING:
    from playbooks.config.recipe import LoadedRecipe, Recipe, Toolchain
    from playbooks.host import Host
    from playbooks.host.ops import Operation
    from playbooks.plan.serving import Option
    from playbooks.steps.serve.units import ServerLayout
    from playbooks.steps.weights.model_layout import ModelLayout


class TabbyAPI(ServerEngine):
    engine = EXLLAMAV2

    def build_ops(self, prefix: str, venv: str, tc: Toolchain) -> list[Operation]:
        # ExLlamaV2 with its extension built for this host's GPU, then TabbyAPI on it
        return [EnsureExllamav2(prefix, venv, tc), EnsureTabbyAPI(prefix, venv, tc)]

    def process_layout(self, server: ServerLayout, state_root: str) -> ServerLayout:
        # TabbyAPI as a managed process: its config, tokens and logs where the SSH user owns
        # them, the same directory its rendered files are copied into
        return replace(server, process_state=f"{state_root}/{server.tabbyapi_unit_name.removesuffix('.service')}")

    def artifact(self, r: Recipe, model: ModelLayout, server: ServerLayout) -> tuple[str, str, str]:
        assert not isinstance(r.quant, str)  # the recipe schema: an exllamav2 recipe gives bpw
        out = Exl2Layout(model.root).output(Exl2Layout.tag(r.quant.bpw, r.quant.head_bits))
        return out, f"{out}/{STAMP_NAME}", server.tabbyapi_model_link(r)

    def expectations(self, loaded: LoadedRecipe, option: Option | None) -> Expectations:
        return Expectations(layers=None, kv_mib=None, compute_mib=None)

    def serve_dir_ops(self, server: ServerLayout, secret: str | None, host: Host) -> list[Operation]:
        # TabbyAPI opens these relative to its working directory (ServerLayout.tabbyapi_links)
        ops: list[Operation] = []
        if server.process_state:  # systemd's LogsDirectory=, as a process has it
            ops.append(EnsureDirectory(server.tabbyapi_logs, 0o700))
        ops += [EnsureSymlink(f"{server.tabbyapi_serve_dir}/{n}", t) for n, t in server.tabbyapi_links().items()]
        if secret:
            owner = host.user if server.process_state else None  # a process reads its own copy
            ops.append(EnsureTabbyTokens(secret, server.tabbyapi_tokens, owner))
        return ops


EXLLAMAV2_SERVER = TabbyAPI()
