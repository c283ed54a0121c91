"""What every engine's rendered files share (the engines render their own: steps/serve/engine_*.py;
steps/serve/service_files.py asks the recipe's): Jinja templates from templates/ (pure: no I/O
but reading them), ``RenderedFile`` values with their host path and mode, where things live on a
host (``ServerLayout``), and the checks every unit's values pass.

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

from playbooks.config.recipe import Recipe
from playbooks.errors import VoltaforgeError
from playbooks.resources import resource_dir
from playbooks.steps.build.toolchain import venv_path
from playbooks.steps.serve.secrets import secret_path

TEMPLATES = resource_dir("templates")
_SAFE_ARG = re.compile(r"^[A-Za-z0-9_./:=,+@-]+$")
UNIT_NAME = re.compile(r"^[A-Za-z0-9_.@-]+\.service$")
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


def check_gpu_indexes(gpu_indexes: tuple[int, ...]) -> None:
    if not gpu_indexes or len(set(gpu_indexes)) != len(gpu_indexes):
        raise VoltaforgeError(f"GPU indexes {gpu_indexes!r}: give one or more distinct indexes")
    for i in gpu_indexes:
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < 64:
            raise VoltaforgeError(f"GPU index {i!r} must be a whole number 0-63")


def check_environment(environment: list[tuple[str, str]]) -> None:
    for key, value in environment:
        if not _ENV_NAME.match(key) or not re.fullmatch(r"[A-Z0-9_,]*", value):
            raise VoltaforgeError(f"bad environment entry {key}={value!r}")


def cuda_environment(gpu_indexes: tuple[int, ...]) -> list[tuple[str, str]]:
    # PCI_BUS_ID: CUDA's index i is nvidia-smi's GPU i and /dev/nvidia<i> (CUDA's default
    # order is fastest first, which would not match on a mixed host)
    return [("CUDA_DEVICE_ORDER", "PCI_BUS_ID"), ("CUDA_VISIBLE_DEVICES", ",".join(map(str, gpu_indexes)))]


def default_gpu_indexes(recipe: Recipe) -> tuple[int, ...]:
    """The GPUs a deployment uses unless told: 0, or 0..N-1 for a split over N cards."""
    return tuple(range(recipe.gpu_count))


UNIT_DIR = "/etc/systemd/system"
