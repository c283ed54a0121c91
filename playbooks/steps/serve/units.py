"""Everything `invoke deploy` installs for a recipe, rendered from Jinja templates in templates/
(pure: no I/O but reading them): systemd units, their per-instance environment files and
TabbyAPI's config.yml, as ``RenderedFile`` values with their host path and mode.

Every value that reaches a unit is validated first, and every ExecStart argument is quoted by
systemd's own rules: a value cannot add a directive, a specifier (%) or a variable ($).
``parse_exec_start`` reads an ExecStart back by the same rules, so a runner without systemd
starts exactly the argv systemd would.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from typing import Literal

import jinja2

from playbooks.config.planning import resolve_gpu_split, resolve_n_cpu_moe
from playbooks.config.recipe import LoadedRecipe, Recipe
from playbooks.errors import VoltaforgeError
from playbooks.plan.gpus import get_gpu
from playbooks.resources import resource_dir
from playbooks.steps.build.toolchain import venv_path
from playbooks.steps.serve.secrets import secret_path

TEMPLATES = resource_dir("templates")
_SAFE_ARG = re.compile(r"^[A-Za-z0-9_./:=,+@-]+$")
_UNIT_NAME = re.compile(r"^[A-Za-z0-9_.@-]+\.service$")
_ENV_NAME = re.compile(r"^[A-Z_][A-Z0-9_]*$")


def systemd_quote(arg: str) -> str:
    """One ExecStart argument as systemd reads it (systemd.service, "Command lines").

    `%` starts a specifier and `$` a variable, so both are doubled; backslashes and double
    quotes are escaped inside double quotes. Control characters cannot be expressed: refused.
    """
    if any(ord(c) < 32 or ord(c) == 127 for c in arg):
        raise VoltaforgeError(f"refusing a unit argument with control characters: {arg!r}")
    escaped = arg.replace("%", "%%").replace("$", "$$")
    if _SAFE_ARG.match(arg):
        return escaped
    return '"' + escaped.replace("\\", "\\\\").replace('"', '\\"') + '"'


def exec_line(argv: list[str], raw: frozenset[int] = frozenset()) -> str:
    """argv -> an ExecStart value; indexes in `raw` are emitted as they are (for %d)."""
    return " ".join(a if i in raw else systemd_quote(a) for i, a in enumerate(argv))


_ESCAPES = {"\\": "\\", '"': '"', "'": "'", "n": "\n", "t": "\t", "r": "\r", "s": " "}


def parse_exec_start(unit_text: str) -> list[str]:
    """The argv of a unit's ExecStart, read by systemd's rules (systemd.service, "Command lines").

    Words split at whitespace; double or single quotes group a word and C escapes apply
    (\\\\, \\", ...); then ``%%`` is ``%`` and ``$$`` is ``$``. Specifiers (``%d``, ``%i``) and
    variables (``${VOLTAFORGE_PORT}``) that exec_line wrote raw are returned as they are: a
    runner without systemd substitutes them itself. The inverse of ``exec_line``.
    """
    lines = [line for line in unit_text.splitlines() if line.startswith("ExecStart=")]
    if len(lines) != 1:
        raise VoltaforgeError(f"expected exactly one ExecStart= line, found {len(lines)}")
    text = lines[0][len("ExecStart=") :]
    argv: list[str] = []
    i, n = 0, len(text)
    while True:
        while i < n and text[i] in " \t":
            i += 1
        if i >= n:
            break
        word: list[str] = []
        quote = ""
        while i < n:
            c = text[i]
            if quote and c == quote:
                quote = ""
            elif not quote and c in " \t":
                break
            elif not quote and c in "\"'":
                quote = c
            elif c == "\\":  # C escapes apply inside quotes and out
                i += 1
                if i >= n or text[i] not in _ESCAPES:
                    raise VoltaforgeError(f"unsupported escape in ExecStart: {text!r}")
                word.append(_ESCAPES[text[i]])
            else:
                word.append(c)
            i += 1
        if quote:
            raise VoltaforgeError(f"unterminated quote in ExecStart: {text!r}")
        argv.append(re.sub(r"%%|\$\$", lambda m: m.group(0)[0], "".join(word)))
    return argv


TABBYAPI_UNIT = "voltaforge-tabbyapi.service"


@dataclass(frozen=True)
class ServerLayout:
    """Where things live on the host (all under the install prefix, configuration in /etc).

    The services read their weights through links in ``serve_dir``, which `invoke deploy`
    switches: a new quant is a new link target, never a rewritten unit.
    """

    prefix: str = "/opt/voltaforge"
    unit_name: str = "voltaforge-llama-server.service"
    tabbyapi_unit_name: str = TABBYAPI_UNIT
    #: TabbyAPI as a managed process (no systemd): its config, tokens and logs live in this
    #: state directory, owned by the SSH user, instead of /etc, /run/credentials and /var/log
    process_state: str | None = None

    @property
    def service(self) -> str:
        """The unit name without .service (and without the @ of an instance template)."""
        return self.unit_name.removesuffix(".service").removesuffix("@")

    @property
    def serve_dir(self) -> str:
        return f"{self.prefix}/serve/{self.service}"

    @property
    def llama_server(self) -> str:
        # through `current`, which `invoke build` switches once a build is proven
        return f"{self.prefix}/llama.cpp/current/bin/llama-server"

    def model_file(self, recipe: Recipe) -> str:
        """The link to the recipe's GGUF that llama-server loads (shared by every instance)."""
        return f"{self.serve_dir}/model.gguf"

    def draft_file(self, recipe: Recipe) -> str:
        return f"{self.serve_dir}/draft.gguf"

    def api_key_file(self, recipe: Recipe) -> str | None:
        return secret_path(recipe)

    @property
    def template_unit_name(self) -> str:
        """The instance template for hosts with several GPUs: one instance per GPU index."""
        return f"{self.service}@.service"

    def instance_env_file(self, index: int | str) -> str:
        """Root-owned: CUDA_VISIBLE_DEVICES and VOLTAFORGE_PORT of one instance (%i in the unit)."""
        return f"/etc/voltaforge/{self.service}@{index}.env"

    # TabbyAPI (EXL2 recipes)
    @property
    def venv(self) -> str:
        return venv_path(self.prefix)

    @property
    def tabbyapi_dir(self) -> str:
        # where steps/build/tabbyapi.py installs the pinned tree
        return f"{self.prefix}/tabbyAPI"

    @property
    def tabbyapi_serve_dir(self) -> str:
        return f"{self.prefix}/serve/{self.tabbyapi_unit_name.removesuffix('.service')}"

    def tabbyapi_model_link(self, recipe: Recipe) -> str:
        """The link to the recipe's EXL2 directory: TabbyAPI's model_dir/model_name. TabbyAPI
        names a model by its directory's base name, so the link carries the served name; it
        lives in models/ of its own so no name meets TabbyAPI's other links."""
        return f"{self.tabbyapi_serve_dir}/models/{recipe.served_name}"

    @property
    def tabbyapi_config(self) -> str:
        return f"{self.process_state}/config.yml" if self.process_state else "/etc/voltaforge/tabbyapi/config.yml"

    @property
    def tabbyapi_tokens(self) -> str:
        """Root-only (0600) api_tokens.yml, written by deploy from the recipe's secret; reaches
        the service as a credential, never through config.yml. A managed process's: its own
        0600 copy in its state directory."""
        if self.process_state:
            return f"{self.process_state}/api_tokens.yml"
        return "/etc/voltaforge/tabbyapi/api_tokens.yml"

    @property
    def tabbyapi_logs(self) -> str:
        if self.process_state:
            return f"{self.process_state}/logs"
        return f"/var/log/{self.tabbyapi_unit_name.removesuffix('.service')}"

    def tabbyapi_links(self) -> dict[str, str]:
        """The links deploy keeps in tabbyapi_serve_dir, TabbyAPI's working directory, besides
        ``model``: TabbyAPI opens templates/, sampler_overrides/, logs/ and api_tokens.yml
        relative to its working directory (common/templating.py, common/sampling.py,
        common/logger.py, common/auth.py at the pinned ref). Its source tree stays read-only;
        logs/ is the unit's LogsDirectory and api_tokens.yml its credential."""
        return {
            "templates": f"{self.tabbyapi_dir}/templates",
            "sampler_overrides": f"{self.tabbyapi_dir}/sampler_overrides",
            "logs": self.tabbyapi_logs,
            "api_tokens.yml": self.tabbyapi_tokens
            if self.process_state
            else f"/run/credentials/{self.tabbyapi_unit_name}/api_tokens.yml",
        }


DEFAULT_BATCH = 2048  # llama.cpp's own -b default at the pinned ref; the planner assumes it


def llama_server_argv(
    recipe: Recipe, layout: ServerLayout, port: str | None = None, n_cpu_moe: int = 0
) -> tuple[list[str], frozenset[int]]:
    """The llama-server command line for a recipe, and which arguments are systemd specifiers
    or variables (written raw).

    -c is the total context: llama-server splits it across -np slots (knowledge.md section 1).
    Every flag is spelled out because defaults move between llama.cpp versions (the port did).
    ``--fit off``: at the pinned ref llama-server otherwise shrinks any argument it thinks is
    unset to the free memory at load time (knowledge.md section 4); the plan is the contract.
    -ub is planner.n_ubatch, the size the compute buffer was planned with; -b is recipe.batch
    or llama.cpp's default 2048 (which the planner assumes), written out all the same. A draft
    model gets the same KV cache types as the target (the planner sizes its cache so) and runs
    at the target's context (the pinned ref has no separate draft context flag).
    ``port``: a raw value (``${VOLTAFORGE_PORT}`` in an instance template) instead of the recipe's.
    ``n_cpu_moe``: the experts of the first N layers stay in host RAM (the recipe's n_cpu_moe,
    `auto` resolved by the planner: config/planning.py resolve_n_cpu_moe); written only when
    N > 0, and with --fit off llama-server moves nothing else.
    """
    if recipe.backend != "llamacpp":
        raise VoltaforgeError(f"recipe {recipe.name}: llama-server serves llamacpp recipes, not {recipe.backend}")
    gpu = not get_gpu(recipe.gpu).is_cpu
    # RPC workers are devices too: every layer goes to a device (plan/split.py)
    layers = "all" if gpu or recipe.rpc else "0"
    argv = [
        layout.llama_server,
        "--model",
        layout.model_file(recipe),
        "--ctx-size",
        str(recipe.context * recipe.parallel),
        "--parallel",
        str(recipe.parallel),
        "--batch-size",
        str(recipe.batch or DEFAULT_BATCH),
        "--ubatch-size",
        str(recipe.planner.n_ubatch),
        "--cache-type-k",
        recipe.cache.k,
        "--cache-type-v",
        recipe.cache.v,
        "--flash-attn",
        "on" if recipe.flash_attn else "off",
        "--gpu-layers",
        layers,
        "--fit",
        "off",
    ]
    if recipe.draft is not None:
        argv += [
            "--model-draft",
            layout.draft_file(recipe),
            "--gpu-layers-draft",
            layers,
            "--cache-type-k-draft",
            recipe.cache.k,
            "--cache-type-v-draft",
            recipe.cache.v,
        ]
    if recipe.threads:
        argv += ["--threads", str(recipe.threads), "--threads-batch", str(recipe.threads)]
        if recipe.draft is not None:
            argv += ["--spec-draft-threads", str(recipe.threads), "--spec-draft-threads-batch", str(recipe.threads)]
    if recipe.spec_type:
        argv += ["--spec-type", recipe.spec_type]
    if n_cpu_moe:
        argv += ["--n-cpu-moe", str(n_cpu_moe)]
    if recipe.rpc:
        argv += ["--rpc", ",".join(w.endpoint for w in recipe.rpc)]
    if recipe.split:
        # the split the planner planned (plan/split.py): never llama.cpp's default by free memory
        shares = recipe.tensor_split or [1.0] * recipe.device_count
        argv += ["--split-mode", "layer", "--tensor-split", ",".join(f"{x:g}" for x in shares)]
    # the name clients list and ask for (/v1/models, each answer's `model`), never the file's path
    argv += ["--alias", recipe.served_name]
    argv += ["--host", recipe.service.bind, "--port", port or str(recipe.service.port)]
    raw: set[int] = {len(argv) - 1} if port else set()
    # -lv 4: at the pinned ref the load lines deploy checks (offloaded N/M layers, the KV and
    # compute buffer sizes, the build) are printed from verbosity 4 only; 5 would add the
    # trial loads of --fit and count buffers twice (facts/server_log.py)
    argv += ["--metrics", "--no-webui", "--log-verbosity", "4"]
    if recipe.service.api_key_ref:
        argv += ["--api-key-file", "%d/api-key"]
        raw.add(len(argv) - 1)
    return argv, frozenset(raw)


def tabbyapi_argv(layout: ServerLayout) -> list[str]:
    """TabbyAPI's main.py in the toolchain venv, with our config (its --config overrides the
    config.yml it would read from the working directory)."""
    return [f"{layout.venv}/bin/python", f"{layout.tabbyapi_dir}/main.py", "--config", layout.tabbyapi_config]


@dataclass(frozen=True)
class RenderedUnit:
    name: str
    text: str
    argv: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class RenderedFile:
    """One file deploy installs: its absolute path on the host, its text and mode."""

    path: str
    text: str
    mode: int
    kind: Literal["unit", "config", "env"]


@functools.cache
def _environment() -> jinja2.Environment:
    # one environment for the process: it keeps each template compiled after its first render
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )


def render_template(template: str, /, **values: object) -> str:
    """templates/TEMPLATE rendered with these values (an undefined one is an error, not blank)."""
    return _environment().get_template(template).render(**values)


def _check_gpu_indexes(gpu_indexes: tuple[int, ...]) -> None:
    if not gpu_indexes or len(set(gpu_indexes)) != len(gpu_indexes):
        raise VoltaforgeError(f"GPU indexes {gpu_indexes!r}: give one or more distinct indexes")
    for i in gpu_indexes:
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < 64:
            raise VoltaforgeError(f"GPU index {i!r} must be a whole number 0-63")


def _check_environment(environment: list[tuple[str, str]]) -> None:
    for key, value in environment:
        if not _ENV_NAME.match(key) or not re.fullmatch(r"[A-Z0-9_,]*", value):
            raise VoltaforgeError(f"bad environment entry {key}={value!r}")


def _cuda_environment(gpu_indexes: tuple[int, ...]) -> list[tuple[str, str]]:
    # PCI_BUS_ID: CUDA's index i is nvidia-smi's GPU i and /dev/nvidia<i> (CUDA's default
    # order is fastest first, which would not match on a mixed host)
    return [("CUDA_DEVICE_ORDER", "PCI_BUS_ID"), ("CUDA_VISIBLE_DEVICES", ",".join(map(str, gpu_indexes)))]


def default_gpu_indexes(recipe: Recipe) -> tuple[int, ...]:
    """The GPUs a deployment uses unless told: 0, or 0..N-1 for a split over N cards."""
    return tuple(range(recipe.gpu_count))


def rpc_peers(recipe: Recipe) -> list[str]:
    """The RPC workers' addresses a loopback-only server must still reach (IPAddressAllow)."""
    return sorted({w.address for w in recipe.rpc if not w.ip.is_loopback})


def render_llama_server_unit(
    recipe: Recipe,
    layout: ServerLayout = ServerLayout(),
    gpu_indexes: tuple[int, ...] | None = None,
    n_cpu_moe: int = 0,
) -> RenderedUnit:
    """The plain unit: one llama-server over the given GPUs (all of them in one process;
    none given: default_gpu_indexes)."""
    gpu_indexes = default_gpu_indexes(recipe) if gpu_indexes is None else gpu_indexes
    if not _UNIT_NAME.match(layout.unit_name) or "@" in layout.unit_name:
        raise VoltaforgeError(f"unit name {layout.unit_name!r} must look like name.service")
    _check_gpu_indexes(gpu_indexes)
    argv, raw = llama_server_argv(recipe, layout, n_cpu_moe=n_cpu_moe)
    gpu = not get_gpu(recipe.gpu).is_cpu
    environment = _cuda_environment(gpu_indexes) if gpu else []
    _check_environment(environment)
    text = render_template(
        "llama-server.service.j2",
        unit_name=layout.unit_name,
        recipe=recipe.name,
        exec_start=exec_line(argv, raw),
        api_key_file=layout.api_key_file(recipe),
        environment=environment,
        environment_file=None,
        gpu=gpu,
        gpu_devices=[f"/dev/nvidia{i}" for i in gpu_indexes],
        loopback_only=recipe.service.bind in ("127.0.0.1", "::1"),
        rpc_peers=rpc_peers(recipe),
    )
    return RenderedUnit(layout.unit_name, text, argv)


def render_llama_server_template(
    recipe: Recipe, layout: ServerLayout = ServerLayout(), n_cpu_moe: int = 0
) -> RenderedUnit:
    """The instance template ``<service>@.service``: instance %i serves GPU %i on the port its
    environment file names (recipe port + i); every instance loads the same model link. A CPU
    recipe's instances are replicas on the host's cores (a layout's ``instances:``): the same
    template without a GPU."""
    if not _UNIT_NAME.match(layout.unit_name) or "@" in layout.unit_name:
        raise VoltaforgeError(f"unit name {layout.unit_name!r} must look like name.service")
    gpu = not get_gpu(recipe.gpu).is_cpu
    argv, raw = llama_server_argv(recipe, layout, port="${VOLTAFORGE_PORT}", n_cpu_moe=n_cpu_moe)
    name = layout.template_unit_name
    text = render_template(
        "llama-server.service.j2",
        unit_name=name,
        recipe=recipe.name,
        exec_start=exec_line(argv, raw),
        api_key_file=layout.api_key_file(recipe),
        environment=[("CUDA_DEVICE_ORDER", "PCI_BUS_ID")] if gpu else [],
        environment_file=layout.instance_env_file("%i"),
        gpu=gpu,
        gpu_devices=["/dev/nvidia%i"] if gpu else [],
        loopback_only=recipe.service.bind in ("127.0.0.1", "::1"),
        rpc_peers=rpc_peers(recipe),
    )
    return RenderedUnit(name, text, argv)


def instance_environment(recipe: Recipe, index: int) -> str:
    """The environment file of instance ``index``: its port (recipe port + index) and, on a
    GPU recipe, its GPU."""
    port = recipe.service.port + index
    if port > 65535:
        raise VoltaforgeError(f"recipe {recipe.name}: instance {index} would listen on port {port}, above 65535")
    gpu = "" if get_gpu(recipe.gpu).is_cpu else f"CUDA_VISIBLE_DEVICES={index}\n"
    return (
        f"# rendered by voltaforge for {recipe.name}: instance {index} of the llama-server template\n"
        f"{gpu}VOLTAFORGE_PORT={port}\n"
    )


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
    if not _UNIT_NAME.match(layout.tabbyapi_unit_name) or "@" in layout.tabbyapi_unit_name:
        raise VoltaforgeError(f"unit name {layout.tabbyapi_unit_name!r} must look like name.service")
    if recipe.backend != "exllamav2":
        raise VoltaforgeError(f"recipe {recipe.name}: TabbyAPI serves exllamav2 recipes, not {recipe.backend}")
    _check_gpu_indexes(gpu_indexes)
    argv = tabbyapi_argv(layout)
    environment = _cuda_environment(gpu_indexes)
    _check_environment(environment)
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


UNIT_DIR = "/etc/systemd/system"


def render_service_files(
    recipe: Recipe,
    layout: ServerLayout = ServerLayout(),
    gpu_indexes: tuple[int, ...] | None = None,
    n_cpu_moe: int = 0,
    gpu_split: tuple[float, ...] = (),
) -> list[RenderedFile]:
    """Every file deploy installs for a recipe (not the secrets, nor the links in serve_dir).
    ``n_cpu_moe``: the resolved --n-cpu-moe of a MoE recipe (llama_server_argv); ``gpu_split``:
    the planned allotments of an EXL2 recipe over several cards (render_tabbyapi_config).

    llamacpp, one GPU index: the plain unit. Several: the instance template and one environment
    file per instance (GPU i on recipe port + i; a CPU recipe's indexes are replica slots); a
    recipe with gpu_count N and N indexes: one plain unit over all N (a layer split).
    exllamav2: TabbyAPI's unit (over all of the recipe's cards) and config.yml.
    No indexes: default_gpu_indexes.
    """
    gpu_indexes = default_gpu_indexes(recipe) if gpu_indexes is None else gpu_indexes
    _check_gpu_indexes(gpu_indexes)
    if recipe.gpu_count > 1:
        if len(gpu_indexes) != recipe.gpu_count:
            raise VoltaforgeError(
                f"recipe {recipe.name} splits one server over {recipe.gpu_count} GPUs: give {recipe.gpu_count} GPU "
                f"indexes (--gpus {','.join(map(str, range(recipe.gpu_count)))}), not {len(gpu_indexes)}"
            )
    if recipe.backend == "exllamav2":
        unit = render_tabbyapi_unit(recipe, layout, gpu_indexes)
        config = render_tabbyapi_config(recipe, layout, gpu_split)
        return [
            RenderedFile(f"{UNIT_DIR}/{unit.name}", unit.text, 0o644, "unit"),
            RenderedFile(layout.tabbyapi_config, config, 0o644, "config"),
        ]
    if recipe.gpu_count > 1:
        unit = render_llama_server_unit(recipe, layout, gpu_indexes, n_cpu_moe)
        return [RenderedFile(f"{UNIT_DIR}/{unit.name}", unit.text, 0o644, "unit")]
    if len(gpu_indexes) == 1:
        unit = render_llama_server_unit(recipe, layout, gpu_indexes, n_cpu_moe)
        return [RenderedFile(f"{UNIT_DIR}/{unit.name}", unit.text, 0o644, "unit")]
    template = render_llama_server_template(recipe, layout, n_cpu_moe)
    return [RenderedFile(f"{UNIT_DIR}/{template.name}", template.text, 0o644, "unit")] + [
        RenderedFile(layout.instance_env_file(i), instance_environment(recipe, i), 0o644, "env") for i in gpu_indexes
    ]


def planned_service_files(
    loaded: LoadedRecipe, layout: ServerLayout = ServerLayout(), gpu_indexes: tuple[int, ...] | None = None
) -> list[RenderedFile]:
    """render_service_files with what the recipe's plan decides: a MoE's --n-cpu-moe, an EXL2
    split's gpu_split."""
    return render_service_files(
        loaded.recipe, layout, gpu_indexes, resolve_n_cpu_moe(loaded), resolve_gpu_split(loaded)
    )
