"""systemd units, rendered from Jinja templates in templates/ (pure: no I/O but reading them).

Every value that reaches a unit is validated first, and every ExecStart argument is quoted by
systemd's own rules: a value cannot add a directive, a specifier (%) or a variable ($).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import jinja2

from playbooks.config.recipe import Recipe
from playbooks.errors import VoltaforgeError
from playbooks.plan.gpus import get_gpu
from playbooks.resources import resource_dir

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


@dataclass(frozen=True)
class ServerLayout:
    """Where things live on the host (all under the install prefix)."""

    prefix: str = "/opt/voltaforge"
    unit_name: str = "voltaforge-llama-server.service"

    @property
    def llama_server(self) -> str:
        # through `current`, which `invoke build` switches once a build is proven
        return f"{self.prefix}/llama.cpp/current/bin/llama-server"

    def model_file(self, recipe: Recipe) -> str:
        return f"{self.prefix}/models/{recipe.name}/{recipe.name}-{recipe.quant_name}.gguf"

    def api_key_file(self, recipe: Recipe) -> str | None:
        ref = recipe.service.api_key_ref
        return f"/etc/voltaforge/secrets/{ref}" if ref else None


def llama_server_argv(recipe: Recipe, layout: ServerLayout) -> tuple[list[str], frozenset[int]]:
    """The llama-server command line for a recipe, and which arguments are systemd specifiers.

    -c is the total context: llama-server splits it across -np slots (docs/docs/knowledge.md section 1).
    Every flag is spelled out because defaults move between llama.cpp versions (the port did).
    """
    if recipe.backend != "llamacpp":
        raise VoltaforgeError(f"recipe {recipe.name}: llama-server serves llamacpp recipes, not {recipe.backend}")
    gpu = not get_gpu(recipe.gpu).is_cpu
    argv = [
        layout.llama_server,
        "--model",
        layout.model_file(recipe),
        "--ctx-size",
        str(recipe.context * recipe.parallel),
        "--parallel",
        str(recipe.parallel),
        "--cache-type-k",
        recipe.cache.k,
        "--cache-type-v",
        recipe.cache.v,
        "--flash-attn",
        "on" if recipe.flash_attn else "off",
        "--gpu-layers",
        "all" if gpu else "0",
        "--host",
        recipe.service.bind,
        "--port",
        str(recipe.service.port),
        "--metrics",
        "--no-webui",
    ]
    raw: set[int] = set()
    if recipe.service.api_key_ref:
        argv += ["--api-key-file", "%d/api-key"]
        raw.add(len(argv) - 1)
    return argv, frozenset(raw)


@dataclass(frozen=True)
class RenderedUnit:
    name: str
    text: str
    argv: list[str] = field(default_factory=list)


def _env() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )


def render_llama_server_unit(
    recipe: Recipe, layout: ServerLayout = ServerLayout(), gpu_indexes: tuple[int, ...] = (0,)
) -> RenderedUnit:
    if not _UNIT_NAME.match(layout.unit_name):
        raise VoltaforgeError(f"unit name {layout.unit_name!r} must look like name.service")
    argv, raw = llama_server_argv(recipe, layout)
    gpu = not get_gpu(recipe.gpu).is_cpu
    environment = [("CUDA_VISIBLE_DEVICES", ",".join(map(str, gpu_indexes)))] if gpu else []
    for key, value in environment:
        if not _ENV_NAME.match(key) or not re.fullmatch(r"[0-9,]*", value):
            raise VoltaforgeError(f"bad environment entry {key}={value!r}")
    text = (
        _env()
        .get_template("llama-server.service.j2")
        .render(
            unit_name=layout.unit_name,
            recipe=recipe.name,
            exec_start=exec_line(argv, raw),
            api_key_file=layout.api_key_file(recipe),
            environment=environment,
            gpu=gpu,
            gpu_devices=[f"/dev/nvidia{i}" for i in gpu_indexes],
            loopback_only=recipe.service.bind in ("127.0.0.1", "::1"),
        )
    )
    return RenderedUnit(layout.unit_name, text, argv)
