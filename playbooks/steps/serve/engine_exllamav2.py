"""ExLlamaV2's server on a host, TabbyAPI (its plan half: plan/engine_exllamav2.py): the host
builds ExLlamaV2 for its GPU and TabbyAPI at its pinned commit; TabbyAPI loads the EXL2
directory through a link named for the served model, opens its templates, sampler overrides,
logs and API tokens relative to its working directory, and prints no offload or buffer lines
(ExLlamaV2 loads every layer on the GPU or fails), so nothing of its load log is held to the
plan. Its config.yml and unit are here (render_tabbyapi_config, render_tabbyapi_unit); its build:
steps/build/exllamav2.py, steps/build/tabbyapi.py; its conversion: steps/weights/exl2_convert.py."""

from __future__ import annotations

import shlex
from dataclasses import replace
from typing import TYPE_CHECKING

from playbooks.errors import VoltaforgeError
from playbooks.host.commands import check_path
from playbooks.host.ops import Decision, EnsureDirectory, Operation, OperationError, Shell
from playbooks.plan.engine_exllamav2 import EXLLAMAV2
from playbooks.steps.build.exllamav2 import EnsureExllamav2
from playbooks.steps.build.tabbyapi import EnsureTabbyAPI
from playbooks.steps.serve.engine_base import ServerEngine
from playbooks.steps.serve.lifecycle import Expectations
from playbooks.steps.serve.model_links import EnsureSymlink
from playbooks.steps.serve.secrets import KEY_CHARS
from playbooks.steps.serve.units import (
    UNIT_DIR,
    UNIT_NAME,
    RenderedFile,
    RenderedUnit,
    ServerLayout,
    check_environment,
    check_gpu_indexes,
    cuda_environment,
    exec_line,
    render_template,
)
from playbooks.steps.weights.exl2_convert import STAMP_NAME, Exl2Layout

if TYPE_CHECKING:
    from playbooks.config.recipe import LoadedRecipe, Recipe, Toolchain
    from playbooks.host import Host
    from playbooks.plan.serving import Option
    from playbooks.steps.weights.model_layout import ModelLayout


class TabbyAPI(ServerEngine):
    engine = EXLLAMAV2

    def render_files(
        self,
        recipe: Recipe,
        layout: ServerLayout,
        gpu_indexes: tuple[int, ...],
        n_cpu_moe: int = 0,
        gpu_split: tuple[float, ...] = (),
    ) -> list[RenderedFile]:
        # one TabbyAPI over all of the recipe's cards, and its config.yml
        unit = render_tabbyapi_unit(recipe, layout, gpu_indexes)
        config = render_tabbyapi_config(recipe, layout, gpu_split)
        return [
            RenderedFile(f"{UNIT_DIR}/{unit.name}", unit.text, 0o644, "unit"),
            RenderedFile(layout.tabbyapi_config, config, 0o644, "config"),
        ]

    def unit_name(self, recipe: Recipe, layout: ServerLayout, gpu_indexes: tuple[int, ...]) -> str:
        return layout.tabbyapi_unit_name

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


def tabbyapi_argv(layout: ServerLayout) -> list[str]:
    """TabbyAPI's main.py in the toolchain venv, with our config (its --config overrides the
    config.yml it would read from the working directory)."""
    return [f"{layout.venv}/bin/python", f"{layout.tabbyapi_dir}/main.py", "--config", layout.tabbyapi_config]


# TabbyAPI's cache modes for ExLlamaV2 (common/config_models.py CACHE_SIZES at the pinned ref)
TABBYAPI_CACHE_MODES = {"FP16": "FP16", "Q8": "Q8", "Q6": "Q6", "Q4": "Q4"}


def render_tabbyapi_config(
    recipe: Recipe, layout: ServerLayout = ServerLayout(), gpu_split: tuple[float, ...] = ()
) -> str:
    """TabbyAPI's config.yml for an EXL2 recipe. No key in it: with an api_key_ref, auth is on
    and the keys come from api_tokens.yml (a credential); without one the service is loopback
    only (the recipe refuses an open port without a key) and auth is off, like llama-server.

    Over several cards (gpu_count > 1) it gives the plan's ``gpu_split`` with
    ``gpu_split_auto: false``: ExLlamaV2 places the modules by those allotments, as planned
    (plan/exl2_split.py). One card: autosplit stays on, and TabbyAPI turns it off itself when it
    sees one GPU."""
    if recipe.backend != "exllamav2" or isinstance(recipe.quant, str):
        raise VoltaforgeError(f"recipe {recipe.name}: TabbyAPI serves exllamav2 recipes, not {recipe.backend}")
    mode = TABBYAPI_CACHE_MODES.get(recipe.cache.k)
    if mode is None:
        raise VoltaforgeError(f"recipe {recipe.name}: cache {recipe.cache.k!r} is not a TabbyAPI cache mode")
    if recipe.gpu_count > 1 and len(gpu_split) != recipe.gpu_count:
        raise VoltaforgeError(
            f"recipe {recipe.name}: an EXL2 split over {recipe.gpu_count} cards needs the plan's gpu_split "
            f"(one allotment per card), got {list(gpu_split)}"
        )
    if any(not 0 < a < 1024 for a in gpu_split):
        raise VoltaforgeError(f"recipe {recipe.name}: gpu_split {list(gpu_split)}: want GB figures above 0")
    model_dir, model_name = layout.tabbyapi_model_link(recipe).rsplit("/", 1)
    total = recipe.context * recipe.parallel
    return render_template(
        "tabbyapi-config.yml.j2",
        recipe=recipe.name,
        path=layout.tabbyapi_config,
        # where the keys are, by how the server runs (ServerLayout.tabbyapi_tokens)
        tokens=f"{layout.tabbyapi_tokens}, 0600"
        + ("" if layout.process_state else ", the unit's credential (LoadCredential)"),
        host=recipe.service.bind,
        port=recipe.service.port,
        disable_auth=not recipe.service.api_key_ref,
        model_dir=model_dir,
        model_name=model_name,
        max_seq_len=recipe.context,
        # a multiple of 256 (TabbyAPI); ignored by ExLlamaV2 before Ampere, which sizes by max_seq_len
        cache_size=-(-total // 256) * 256,
        cache_mode=mode,
        max_batch_size=recipe.parallel,
        gpu_split=", ".join(f"{a:.2f}" for a in gpu_split) if recipe.gpu_count > 1 else "",
    )


def render_tabbyapi_unit(
    recipe: Recipe, layout: ServerLayout = ServerLayout(), gpu_indexes: tuple[int, ...] = (0,)
) -> RenderedUnit:
    """One TabbyAPI over the given GPUs (it splits a model across them itself)."""
    if not UNIT_NAME.match(layout.tabbyapi_unit_name) or "@" in layout.tabbyapi_unit_name:
        raise VoltaforgeError(f"unit name {layout.tabbyapi_unit_name!r} must look like name.service")
    if recipe.backend != "exllamav2":
        raise VoltaforgeError(f"recipe {recipe.name}: TabbyAPI serves exllamav2 recipes, not {recipe.backend}")
    check_gpu_indexes(gpu_indexes)
    argv = tabbyapi_argv(layout)
    environment = cuda_environment(gpu_indexes)
    check_environment(environment)
    name = layout.tabbyapi_unit_name
    text = render_template(
        "tabbyapi.service.j2",
        unit_name=name,
        recipe=recipe.name,
        exec_start=exec_line(argv),
        working_directory=layout.tabbyapi_serve_dir,
        service=name.removesuffix(".service"),
        tokens_file=layout.tabbyapi_tokens if recipe.service.api_key_ref else None,
        environment=environment,
        gpu_devices=[f"/dev/nvidia{i}" for i in gpu_indexes],
        loopback_only=recipe.service.bind in ("127.0.0.1", "::1"),
    )
    return RenderedUnit(name, text, argv)


EXLLAMAV2_SERVER = TabbyAPI()


class EnsureTabbyTokens(Operation):
    """TabbyAPI's api_tokens.yml (root, 0600) holds the recipe's API key and an admin key of
    its own, generated on the host. The key is read from its secret file on the host and never
    crosses the wire, argv or a log (the comparison feeds grep its pattern on stdin; printf is
    the shell's builtin); the facts say only missing / same / differs."""

    def __init__(self, secret: str, tokens: str, owner: str | None = None):
        # owner: a managed process's user, who must read its copy (0600 still); else root's
        self.secret, self.tokens, self.owner = check_path(secret), check_path(tokens), owner
        self.name = f"Ensure {tokens} holds the API key of {secret}"

    def read(self, host: Host) -> str:
        s, t = shlex.quote(self.secret), shlex.quote(self.tokens)
        return host.sudo(
            f"if [ ! -s {s} ]; then echo no-secret; elif [ ! -f {t} ]; then echo missing; "
            # the key goes to grep as a pattern on stdin (-f -), never in its argv (`ps` shows argv)
            f"""elif head -n1 -- {s} | sed 's/.*/api_key: "&"/' | grep -qxF -f - -- {t}; then echo same; """
            "else echo differs; fi",
            check=False,
            stream=False,
        ).stdout.strip()

    def decide(self, facts: str) -> Decision:
        if facts == "no-secret":
            raise OperationError(
                f"the recipe's API key is not on the host: put it in {self.secret} (root, mode 0600) first"
            )
        if facts == "same":
            return Decision.ok("the API key is current")
        s, t = shlex.quote(self.secret), shlex.quote(self.tokens)
        script = (
            f"umask 077; key=$(head -n1 -- {s}); "
            f'case "$key" in ""|*[!{KEY_CHARS}]*) echo "the key in {self.secret} has characters an API key '
            f'should not" >&2; exit 1;; esac; '
            "admin=$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \\n'); "
            f'printf \'api_key: "%s"\\nadmin_key: "%s"\\n\' "$key" "$admin" > {t}.new && '
            + (f"chown -- {shlex.quote(self.owner)} {t}.new && " if self.owner else "")
            + f"mv -T -- {t}.new {t}"
        )
        return Decision.act("no tokens file yet" if facts == "missing" else "the API key changed", Shell(script, True))
