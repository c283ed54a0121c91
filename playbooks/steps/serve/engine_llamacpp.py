"""llama.cpp's server on a host (its plan half: plan/engine_llamacpp.py): llama-server loads
the quant's GGUF through the unit's model link, its load log is held to the plan (layers on
the devices, KV cache and compute buffer, a MoE's experts, a split's devices), and as a managed
process it reads the API key from a private copy where systemd's LoadCredential= would put it.
Its units are here: the command line (llama_server_argv), a plain unit, or an instance template
with an environment file per GPU; its build: steps/build/build.py."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from playbooks.errors import VoltaforgeError
from playbooks.plan.engine_llamacpp import LLAMACPP
from playbooks.plan.gpus import get_gpu
from playbooks.steps.serve.deploy_record import DeployLayout
from playbooks.steps.serve.engine_base import ServerEngine
from playbooks.steps.serve.lifecycle import Expectations
from playbooks.steps.serve.router import RouterSet, preset_path
from playbooks.steps.serve.secrets import EnsureCredentialCopy
from playbooks.steps.serve.units import (
    UNIT_DIR,
    UNIT_NAME,
    RenderedFile,
    RenderedUnit,
    ServerLayout,
    check_environment,
    check_gpu_indexes,
    cuda_environment,
    default_gpu_indexes,
    exec_line,
    render_template,
)
from playbooks.steps.weights.model_layout import manifest_path

if TYPE_CHECKING:
    from playbooks.config.recipe import LoadedRecipe, Recipe
    from playbooks.host import Host
    from playbooks.host.ops import Operation
    from playbooks.plan.serving import Option
    from playbooks.steps.weights.model_layout import ModelLayout


def _template(recipe: Recipe, gpu_indexes: tuple[int, ...]) -> bool:
    """One card's recipe on several GPU indexes (or a CPU recipe's replica slots): the instance
    template, one instance per index; else one plain unit (over the recipe's split, if any)."""
    return not (recipe.gpu_count > 1 or len(gpu_indexes) == 1)


class LlamaServer(ServerEngine):
    engine = LLAMACPP

    def render_files(
        self,
        recipe: Recipe,
        layout: ServerLayout,
        gpu_indexes: tuple[int, ...],
        n_cpu_moe: int = 0,
        gpu_split: tuple[float, ...] = (),
    ) -> list[RenderedFile]:
        # one GPU index, or a split over gpu_count cards: the plain unit; several indexes: the
        # instance template and one environment file per instance (GPU i on recipe port + i; a
        # CPU recipe's indexes are replica slots)
        if not _template(recipe, gpu_indexes):
            unit = render_llama_server_unit(recipe, layout, gpu_indexes, n_cpu_moe)
            return [RenderedFile(f"{UNIT_DIR}/{unit.name}", unit.text, 0o644, "unit")]
        template = render_llama_server_template(recipe, layout, n_cpu_moe)
        return [RenderedFile(f"{UNIT_DIR}/{template.name}", template.text, 0o644, "unit")] + [
            RenderedFile(layout.instance_env_file(i), instance_environment(recipe, i), 0o644, "env")
            for i in gpu_indexes
        ]

    def unit_name(self, recipe: Recipe, layout: ServerLayout, gpu_indexes: tuple[int, ...]) -> str:
        return layout.template_unit_name if _template(recipe, gpu_indexes) else layout.unit_name

    def artifact(self, r: Recipe, model: ModelLayout, server: ServerLayout) -> tuple[str, str, str]:
        gguf = model.gguf(r.quant_name)
        return gguf, manifest_path(gguf), server.model_file(r)

    def expectations(self, loaded: LoadedRecipe, option: Option | None) -> Expectations:
        r = loaded.recipe
        gpu = not get_gpu(r.gpu).is_cpu
        return Expectations(
            # every layer on a device: the GPU's, or the RPC workers' (a CPU recipe split over them)
            layers=loaded.shape.num_hidden_layers + 1 if gpu or r.rpc else None,
            # a draft model's KV cache and compute buffer are printed beside the target's (summed)
            kv_mib=option.loaded_kv_bytes / 2**20 if option else None,
            compute_mib=option.loaded_compute_bytes / 2**20 if option else None,
            # a MoE: the experts in host RAM are exactly the planned ones (the layer count cannot tell)
            device_model_mib=(option.gpu_weights_bytes + option.draft_weights_bytes) / 2**20
            if option and gpu and loaded.shape.is_moe and not r.split
            else None,
            devices=tuple((d.weights_bytes / 2**20, d.kv_bytes / 2**20) for d in option.devices) if option else (),
        )

    def render_set_files(self, s: RouterSet, layout: ServerLayout) -> list[RenderedFile]:
        # the router's unit, in the same template as a server's (the same sandbox and key
        # credential), its command line router_argv's; the preset each member's own flags
        if not UNIT_NAME.match(layout.unit_name) or "@" in layout.unit_name:
            raise VoltaforgeError(f"unit name {layout.unit_name!r} must look like name.service")
        if s.gpu:
            check_gpu_indexes(s.gpu_indexes)
        preset = preset_path(layout)
        key = "%d/api-key" if s.api_key_file else None
        argv = router_argv(layout, preset, s.models_max, s.port, s.bind, s.sleep_idle_s, key)
        # the router's own cache, empty (the template's CacheDirectory= and LLAMA_CACHE): at start
        # it lists the hub models cached where LLAMA_CACHE (else HOME) points and serves them
        # beside the preset's; a dynamic user has no home (the start failed: "Failed to determine
        # HF cache directory"), and a managed process's home cache would add whatever its user
        # downloaded (service_manager maps %C to its state directory)
        cache = layout.unit_name.removesuffix(".service")
        environment = cuda_environment(s.gpu_indexes) if s.gpu else []
        check_environment(environment)
        text = render_template(
            "llama-server.service.j2",
            unit_name=layout.unit_name,
            recipe=f"model set {s.name} ({', '.join(r.name for r, _ in s.members)})",
            exec_start=exec_line(argv, frozenset({len(argv) - 1}) if key else frozenset()),
            api_key_file=s.api_key_file,
            environment=environment,
            environment_file=None,
            cache_directory=cache,
            gpu=s.gpu,
            gpu_devices=[f"/dev/nvidia{i}" for i in s.gpu_indexes] if s.gpu else [],
            loopback_only=s.bind in ("127.0.0.1", "::1"),
            rpc_peers=[],
        )
        ini = render_models_preset(list(s.members), s.load_at_start)
        return [
            RenderedFile(f"{UNIT_DIR}/{layout.unit_name}", text, 0o644, "unit"),
            RenderedFile(preset, ini, 0o644, "config"),
        ]

    def key_ops(self, secret: str | None, states: Sequence[DeployLayout], host: Host, systemd: bool) -> list[Operation]:
        if not secret or systemd:
            return []
        # systemd's LoadCredential= as a process gets it: a private copy where %d points
        # (service_manager.process_argv), owned by the user the process runs as
        return [EnsureCredentialCopy(secret, f"{state.state_dir}/credentials/api-key", host.user) for state in states]


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
    if not UNIT_NAME.match(layout.unit_name) or "@" in layout.unit_name:
        raise VoltaforgeError(f"unit name {layout.unit_name!r} must look like name.service")
    check_gpu_indexes(gpu_indexes)
    argv, raw = llama_server_argv(recipe, layout, n_cpu_moe=n_cpu_moe)
    gpu = not get_gpu(recipe.gpu).is_cpu
    environment = cuda_environment(gpu_indexes) if gpu else []
    check_environment(environment)
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
    if not UNIT_NAME.match(layout.unit_name) or "@" in layout.unit_name:
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


LLAMACPP_SERVER = LlamaServer()


# -- a model set: llama-server as a router (issue 55) ------------------------------------------
#
# llama-server started without a model is a router (tools/server/README.md at the pin, "Using
# multiple models"): it reads a preset INI, one section per model, each key a long flag without
# its dashes, and starts one child llama-server per model on demand on 127.0.0.1 and a free port
# of its own, stopping the least recently used past --models-max. A member's section is its own
# recipe's command line (llama_server_argv), so a model serves in a set as it serves alone.

#: flags of a member's command line the router sets for its children itself (the README: host,
#: port, API key and alias are removed or overwritten) or gives them from its own command line
#: (children inherit it), and the model, which is the section's ``model`` key
ROUTER_OWNED = frozenset(
    {"--host", "--port", "--alias", "--api-key-file", "--model", "--metrics", "--no-webui", "--log-verbosity"}
)


def _flag_pairs(argv: Sequence[str]) -> list[tuple[str, str]]:
    """``--flag value`` and bare ``--flag`` (true) of a command line, in order."""
    pairs: list[tuple[str, str]] = []
    i = 0
    while i < len(argv):
        flag = argv[i]
        if not flag.startswith("--"):
            raise VoltaforgeError(f"not a long flag in llama-server's command line: {flag!r}")
        if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            pairs.append((flag, argv[i + 1]))
            i += 2
        else:
            pairs.append((flag, "true"))
            i += 1
    return pairs


def preset_section(recipe: Recipe, model_file: str, load_at_start: bool = False) -> str:
    """One member's section of the router's preset: its served name, the path of its GGUF
    (absolute, as the README recommends) and its own recipe's flags."""
    argv, _ = llama_server_argv(recipe, ServerLayout())
    lines = [f"[{recipe.served_name}]", f"model = {model_file}"]
    lines += [f"{flag[2:]} = {value}" for flag, value in _flag_pairs(argv[1:]) if flag not in ROUTER_OWNED]
    if load_at_start:
        lines.append("load-on-startup = true")
    return "\n".join(lines) + "\n"


def render_models_preset(members: Sequence[tuple[Recipe, str]], load_at_start: frozenset[str] = frozenset()) -> str:
    """The router's preset INI: ``members`` are (recipe, the path of its GGUF) in the set's
    order; ``load_at_start``: served names loaded when the router starts (it may still stop
    them for another once --models-max are running)."""
    head = "; rendered by voltaforge: a model set served by llama-server's router\nversion = 1\n"
    return head + "".join(
        "\n" + preset_section(r, path, r.served_name in load_at_start) for r, path in members
    )  # fmt: skip


def router_argv(
    layout: ServerLayout,
    preset_file: str,
    models_max: int,
    port: int,
    bind: str = "127.0.0.1",
    sleep_idle_s: int | None = None,
    api_key_file: str | None = None,
) -> list[str]:
    """The router's command line: the preset, the count the residency plan gave (its k largest
    fit together: plan/residency.py), models loaded when first asked for, and what every child
    inherits (metrics, no web UI, the load log's verbosity: llama_server_argv says why 4)."""
    if models_max < 1:
        raise VoltaforgeError(f"--models-max {models_max}: a set keeps at least one model resident")
    argv = [layout.llama_server, "--models-preset", preset_file, "--models-max", str(models_max), "--models-autoload"]
    if sleep_idle_s is not None:
        argv += ["--sleep-idle-seconds", str(sleep_idle_s)]
    argv += ["--host", bind, "--port", str(port), "--metrics", "--no-webui", "--log-verbosity", "4"]
    if api_key_file:
        argv += ["--api-key-file", api_key_file]
    return argv
