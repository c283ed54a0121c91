"""inventory.yaml: host names -> SSH target, user, port, GPU kind, and what it serves: one
``recipe``, or a ``serve`` layout placing several recipes on disjoint GPU sets (an entry may be a
model set: several recipes served by one llama-server router, loaded on demand); and the fleet's
balancer, an ``lb:`` entry (which host runs it, over which hosts, where it listens, its key and
certificate), that `invoke lb`, `render --lb` and `bench --lb` read, flags overriding; and a
``monitor:`` entry, read by config/monitor_spec.py.

A host that is not listed falls back to the user's ~/.ssh/config (and then to plain DNS),
as Fabric does. The name `local` means this machine, without SSH.
"""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)

from playbooks.config.secret_names import check_secret_ref
from playbooks.config.yamlfile import explain_validation, load_yaml
from playbooks.errors import RecipeError
from playbooks.plan.gpus import get_gpu, gpu_names

DEFAULT_INVENTORY = Path("inventory.yaml")
DEFAULT_PREFIX = "/opt/voltaforge"
HOST_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
HOST_NAME_RULE = "host names may hold letters, digits and . _ - (max 63)"
_LABEL_RE = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9])?$")
_PATH_RE = re.compile(r"^/[A-Za-z0-9._/-]*$")
#: a set's name: part of its unit's name and its directories
_SET_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,39}$")


def check_host_name(v: str) -> str:
    """An inventory name (a host entry's, or one the lb: entry names)."""
    if not HOST_NAME_RE.match(v):
        raise ValueError(HOST_NAME_RULE)
    return v


def check_host_names(v: tuple[str, ...]) -> tuple[str, ...]:
    """A list of inventory names (an lb: or monitor: entry's hosts): each valid, none twice."""
    bad = [h for h in v if not HOST_NAME_RE.match(h)]
    if bad:
        raise ValueError(f"{bad[0]!r}: {HOST_NAME_RULE}")
    if len(set(v)) != len(v):
        raise ValueError("a host is named twice")
    return v


def check_bind(v: str | None, example: str = "127.0.0.1") -> str | None:
    """A ``bind:`` (a recipe's service, an lb: or monitor: entry): an IP address, never a name;
    None stays None (unset)."""
    if v is not None:
        try:
            ipaddress.ip_address(v)
        except ValueError:
            raise ValueError(f"must be an IP address, e.g. {example}") from None
    return v


def is_host_address(value: str) -> bool:
    """An IP address, or a DNS name of dot-separated labels (RFC 1123; `_` tolerated as
    ~/.ssh/config aliases use it). Anything else would fail deep in the resolver (an empty
    label raises UnicodeError there), so it is refused here with a message. A name ending in an
    all-digit label that is not an IP address ("5", "10.1") is refused too."""
    try:
        ipaddress.ip_address(value)
        return True
    except ValueError:
        pass
    if not value or len(value) > 253:
        return False
    labels = value.removesuffix(".").split(".")
    # all digits at the end and not an IP address: the resolver's shorthand ("5" is 0.0.0.5,
    # "10.1" is 10.0.0.1), never a name (no top-level domain is all digits)
    if labels[-1].isdigit():
        return False
    return all(_LABEL_RE.match(label) for label in labels)


class Placement(BaseModel):
    """One recipe of a host's ``serve:`` layout: on which GPUs, on which port.

    ``gpus``: the GPU indexes it owns (nvidia-smi's numbering). A recipe with ``gpu_count: N``
    is one server split over its N indexes; a one-card recipe given several runs one instance
    per GPU (the instance template, ports port, port+1, ...). Omitted: 0..gpu_count-1.
    ``instances``: a CPU recipe's replicas (the same template, one port each); GPU recipes
    take theirs from ``gpus``. ``port``: the first port, instead of the recipe's.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    recipe: str
    gpus: tuple[int, ...] | None = None
    instances: int | None = Field(None, ge=1, le=64)
    port: int | None = Field(None, ge=1, le=65535)

    @field_validator("gpus")
    @classmethod
    def _gpus(cls, v):
        return _gpu_indexes(v)

    @model_validator(mode="after")
    def _one_way(self):
        if self.gpus is not None and self.instances is not None:
            raise ValueError(
                "give gpus (a GPU recipe: one instance per GPU, or a split) or instances (a CPU recipe), not both"
            )
        return self


def _gpu_indexes(v: tuple[int, ...] | None) -> tuple[int, ...] | None:
    if v is not None and (not v or len(set(v)) != len(v) or any(not 0 <= i < 64 for i in v)):
        raise ValueError("give one or more distinct GPU indexes from 0 to 63")
    return v


class ModelSetSpec(BaseModel):
    """A model set in a host's ``serve:`` layout: several recipes served through one
    llama-server router on one GPU set and one port, each under its own served name and loaded
    when first asked for, as many at once as the residency plan allows (config/model_set.py,
    plan/residency.py).

    ``set``: the set's name (its unit and directories). ``models``: two or more recipes.
    ``gpus``: the indexes its children run on (omitted: 0). ``port``: the router's (omitted: the
    first member's). ``load_at_start``: members loaded when the router starts (the router may
    still stop one for another once its count is running). ``sleep_idle_s``: a child idle this
    long sleeps and gives its memory back (omitted: never)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    set: str
    models: tuple[str, ...] = Field(min_length=2)
    gpus: tuple[int, ...] | None = None
    port: int | None = Field(None, ge=1, le=65535)
    load_at_start: tuple[str, ...] = ()
    sleep_idle_s: int | None = Field(None, ge=1, le=7 * 24 * 3600)

    @field_validator("set")
    @classmethod
    def _set(cls, v):
        if not _SET_NAME_RE.match(v):
            raise ValueError("a set's name is lower-case letters, digits and -, at most 40")
        return v

    @field_validator("gpus")
    @classmethod
    def _gpus(cls, v):
        return _gpu_indexes(v)

    @model_validator(mode="after")
    def _members(self):
        if len(set(self.models)) != len(self.models):
            raise ValueError(f"models: a recipe is named twice in set {self.set}")
        stray = [m for m in self.load_at_start if m not in self.models]
        if stray:
            raise ValueError(f"load_at_start: {', '.join(stray)} is not among the set's models")
        return self


def _entry_kind(v: Any) -> str:
    """Which kind of ``serve:`` entry: a model set names ``models``."""
    got = v if isinstance(v, dict) else getattr(v, "__dict__", {})
    return "model-set" if "models" in got else "placement"


ServeEntry = Annotated[
    Annotated[Placement, Tag("placement")] | Annotated[ModelSetSpec, Tag("model-set")], Discriminator(_entry_kind)
]


class HostSpec(BaseModel):
    """Everything needed to reach and describe one host."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    host: str = Field(description="address or name the SSH client connects to")
    user: str | None = None
    port: int = Field(22, ge=1, le=65535)
    gpu: str | None = None
    recipe: str | None = None
    serve: tuple[ServeEntry, ...] = Field(
        (), description="several recipes (or model sets) on disjoint GPU sets (instead of recipe)"
    )
    memory_budget_gib: float | None = Field(
        None, gt=0, le=1048576, description="a CPU host: the GiB a model set's children may hold together"
    )
    key_file: str | None = None
    known_hosts: str | None = Field(None, description="known_hosts file to trust (default ~/.ssh/known_hosts)")
    host_key: str | None = Field(None, description="pinned public host key: 'ssh-ed25519 AAAA...'")
    prefix: str = DEFAULT_PREFIX
    local: bool = False

    @field_validator("name")
    @classmethod
    def _name(cls, v):
        return check_host_name(v)

    @field_validator("host")
    @classmethod
    def _host(cls, v):
        if not is_host_address(v):
            raise ValueError("must be a host name or IP address")
        return v

    @field_validator("gpu")
    @classmethod
    def _gpu(cls, v):
        if v is not None:
            try:
                get_gpu(v)
            except Exception:
                raise ValueError(f"unknown GPU; known: {', '.join(gpu_names())}") from None
        return v

    @field_validator("prefix")
    @classmethod
    def _prefix(cls, v):
        if not _PATH_RE.match(v) or "/../" in v + "/":
            raise ValueError("must be an absolute path of letters, digits and . _ / -")
        return v.rstrip("/") or "/"

    @field_validator("host_key")
    @classmethod
    def _host_key(cls, v):
        if v is not None and not re.match(r"^(ssh-ed25519|ecdsa-sha2-nistp\d+|ssh-rsa) [A-Za-z0-9+/=]+$", v.strip()):
            raise ValueError("must be '<type> <base64>', e.g. 'ssh-ed25519 AAAA...'")
        return v.strip() if v else v

    @property
    def placements(self) -> tuple[Placement, ...]:
        """The layout's single-recipe entries."""
        return tuple(e for e in self.serve if isinstance(e, Placement))

    @property
    def model_sets(self) -> tuple[ModelSetSpec, ...]:
        """The layout's model sets."""
        return tuple(e for e in self.serve if isinstance(e, ModelSetSpec))

    @model_validator(mode="after")
    def _layout(self):
        if self.serve and self.recipe:
            raise ValueError("give recipe (one) or serve (a layout of several), not both")
        seen: dict[int, str] = {}
        placed: dict[str, str] = {}
        for e in self.serve:
            owner = e.recipe if isinstance(e, Placement) else f"set {e.set}"
            # a set without gpus runs on GPU 0 (its children's one card)
            gpus = e.gpus if isinstance(e, Placement) or e.gpus is not None else (0,)
            for i in gpus or ():
                if i in seen:
                    raise ValueError(f"GPU {i} is placed twice in serve: {seen[i]} and {owner}")
                seen[i] = owner
            for name in (e.recipe,) if isinstance(e, Placement) else e.models:
                if name in placed:
                    raise ValueError(
                        f"a recipe is placed twice in serve ({name}: {placed[name]} and {owner}): place it once"
                        + (", with all its GPUs" if isinstance(e, Placement) and placed[name] == name else "")
                    )
                placed[name] = owner
        sets = [e.set for e in self.model_sets]
        if len(set(sets)) != len(sets):
            raise ValueError("a set's name is used twice in serve: give each set its own")
        if self.memory_budget_gib is not None and not self.model_sets:
            raise ValueError("memory_budget_gib: it is a model set's budget: this host serves no set")
        return self


class LbSpec(BaseModel):
    """The fleet's balancer (`invoke lb`). Every field is also a flag of `invoke lb`, which wins.

    ``api_key_ref``: the key the edge checks and forwards; every backend must accept it (the
    same ``service.api_key_ref``). Unset: the backends' one key (or none). ``tls``: HTTPS at
    the edge (unset: beyond loopback only; plain HTTP on a public bind only with ``false``);
    ``cert``/``key``: the pair to present (files on the controller, pushed as secrets), else a
    self-signed pair kept on the controller."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str | None = Field(None, description="the inventory host that runs HAProxy")
    hosts: tuple[str, ...] = Field((), description="the hosts whose servers it balances")
    bind: str | None = None
    port: int | None = Field(None, ge=1, le=65535)
    api_key_ref: str | None = None
    tls: bool | None = None
    cert: str | None = None
    key: str | None = None

    @field_validator("host")
    @classmethod
    def _host(cls, v):
        return v if v is None else check_host_name(v)

    @field_validator("hosts")
    @classmethod
    def _hosts(cls, v):
        return check_host_names(v)

    @field_validator("bind")
    @classmethod
    def _bind(cls, v):
        return check_bind(v, "0.0.0.0")

    @field_validator("api_key_ref")
    @classmethod
    def _key_ref(cls, v):
        return check_secret_ref(v)

    @model_validator(mode="after")
    def _pair(self):
        if (self.cert is None) != (self.key is None):
            raise ValueError("cert and key go together: the certificate and its private key")
        if self.cert and self.tls is False:
            raise ValueError("cert/key with tls: false: plain HTTP presents no certificate")
        return self


class InventoryFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    hosts: dict[str, dict] = {}
    lb: dict | None = None
    #: `invoke monitor`'s settings (config/monitor_spec.py reads it)
    monitor: dict | None = None


def load_inventory(path: Path = DEFAULT_INVENTORY) -> dict[str, HostSpec]:
    """Read inventory.yaml; a missing file is an empty inventory."""
    path = Path(path)
    if not path.exists():
        return {}
    data, lines = load_yaml(path)
    if data is None:
        return {}
    try:
        parsed = InventoryFile.model_validate(data)
    except ValidationError as exc:
        raise explain_validation(exc, path, lines, InventoryFile) from None
    specs = {}
    for name, entry in parsed.hosts.items():
        try:
            # `local` is this machine: its entry needs no address
            here = {"host": "localhost", "local": True} if name == "local" else {}
            specs[name] = HostSpec.model_validate({"name": name, **here, **(entry or {})})
        except ValidationError as exc:
            raise explain_validation(exc, path, lines, HostSpec, prefix=("hosts", name)) from None
    return specs


def load_lb(path: Path = DEFAULT_INVENTORY) -> LbSpec:
    """The inventory's ``lb:`` entry (an empty one when there is none or no file). Relative
    ``cert``/``key`` paths are read from the inventory's directory."""
    path = Path(path)
    if not path.exists():
        return LbSpec()
    data, lines = load_yaml(path)
    if data is None:
        return LbSpec()
    try:
        entry = InventoryFile.model_validate(data).lb
        spec = LbSpec.model_validate(entry or {})
    except ValidationError as exc:
        raise explain_validation(exc, path, lines, LbSpec, prefix=("lb",)) from None
    files = {k: str((path.parent / v).expanduser()) for k in ("cert", "key") if (v := getattr(spec, k))}
    return spec.model_copy(update=files) if files else spec


def resolve_host(name: str, inventory: Path = DEFAULT_INVENTORY, ssh_config: Path | None = None) -> HostSpec:
    """Find a host: `local`, an inventory entry, or ~/.ssh/config, in that order. `local` is
    this machine whatever its entry says of SSH; an entry named `local` gives it a recipe, a
    `serve:` layout or a prefix (so a whole fleet's shape can be tried on one machine)."""
    specs = load_inventory(inventory)
    if name == "local":
        entry = specs.get("local")
        if entry is None:
            return HostSpec(name="local", host="localhost", local=True)
        return HostSpec.model_validate({**entry.model_dump(exclude_unset=True), "host": "localhost", "local": True})
    if name in specs:
        return specs[name]
    if not is_host_address(name):
        raise RecipeError(f"host {name!r}: not in {inventory} and not a valid host name")
    import paramiko

    cfg_path = ssh_config or Path.home() / ".ssh" / "config"
    # paramiko's SSHConfigDict holds lists too (identityfile), though its stub says dict[str, str]
    looked: dict[str, Any] = {}
    if cfg_path.exists():
        looked = paramiko.SSHConfig.from_path(str(cfg_path)).lookup(name)
    files = looked.get("identityfile") or [None]
    return HostSpec(
        name=name,
        host=looked.get("hostname", name),
        user=looked.get("user"),
        port=int(looked.get("port", 22)),
        key_file=files[0],
        known_hosts=(looked.get("userknownhostsfile") or "").split()[0] if looked.get("userknownhostsfile") else None,
    )
