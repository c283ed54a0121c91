"""`invoke render`: every file `invoke deploy` would install for a recipe, written under a local
directory that mirrors the host's paths (DIR/etc/systemd/system/...). Needs no host: for review,
diffing and packaging. ``--lb``: the balancer's configuration and unit, from the inventory's
placements (what each host serves), without connecting to any host."""

from __future__ import annotations

import ipaddress
from pathlib import Path

from rich.text import Text

from playbooks.cli import flags
from playbooks.cli.render import console
from playbooks.conduct.balancer import edge_settings
from playbooks.conduct.fleet import placed_fleet
from playbooks.conduct.host_files import host_files
from playbooks.conduct.settings import Settings
from playbooks.config.planning import refuse_unfit
from playbooks.config.recipe import RECIPES_DIR, load_recipe
from playbooks.errors import VoltaforgeError
from playbooks.steps.serve.balancer import CONFIG_PATH, UNIT_NAME, Balancer, render_haproxy_config, render_lb_unit
from playbooks.steps.serve.service_files import planned_service_files
from playbooks.steps.serve.units import UNIT_DIR, ServerLayout


def output_dir(value: object) -> Path:
    return flags.output_dir("--out", value)


def run_render(
    recipe: str | None,
    out: Path,
    gpus: tuple[int, ...] | None = None,
    recipes_dir: Path | None = None,
    prefix: str | None = None,
) -> int:
    if not recipe:
        raise flags.UsageError("--recipe is required (or voltaforge.recipe in invoke.yaml)")
    loaded = load_recipe(recipe, recipes_dir or RECIPES_DIR)
    layout = ServerLayout(prefix=prefix) if prefix else ServerLayout()
    refuse_unfit(loaded)
    _write(out, [(f.path, f.text, f.mode, f.kind) for f in planned_service_files(loaded, layout, gpus)])
    return 0


def run_render_host(host: str, out: Path, settings: Settings) -> int:
    """Every file the inventory gives ``host`` (conduct/host_files.py), without connecting."""
    files = host_files(settings, host)
    _write(out, [(f.path, f.text, f.mode, f.kind) for f in files])
    return 0


def _write(out: Path, files: list[tuple[str, str, int, str]]) -> None:
    """Each (host path, text, mode, kind) at its host path below ``out``, one line each."""
    show = console()
    for path, text, mode, kind in files:
        target = out / path.lstrip("/")
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
            target.chmod(mode)
        except OSError as exc:
            raise flags.UsageError(f"--out {str(out)!r}: cannot write {target}: {exc.strerror or exc}") from None
        show.print(Text(f"wrote {target} ({kind}, mode {mode:04o}, host path {path})"))


def run_render_lb(
    lb_host: str,
    hosts: list[str] | None,
    out: Path,
    settings: Settings,
    recipe: str | None = None,
    bind: str | None = None,
    port: int | None = None,
    tls: bool | None = None,
) -> int:
    """The balancer `invoke lb --host LB_HOST` would run, as systemd would run it: its HAProxy
    configuration and unit, every server grouped by model (conduct/fleet.py), from the
    inventory alone (its placements, and its lb: entry under the flags)."""
    try:
        edge = edge_settings(settings.lb(), lb_host, hosts, bind, port, tls)
        lb_spec = settings.host_spec(lb_host)
        specs = [settings.host_spec(n) for n in edge.hosts]
        fleet = placed_fleet(settings, lb_spec, specs, recipe, edge.key_ref)
        use_tls = edge.tls if edge.tls is not None else not ipaddress.ip_address(edge.bind).is_loopback
        lb = Balancer(fleet.recipe, fleet.backends, bind=edge.bind, port=edge.port, tls=use_tls)
    except VoltaforgeError as exc:
        raise type(exc)(f"--lb {lb_host}: {exc}") from None
    _write(
        out,
        [
            (CONFIG_PATH, render_haproxy_config(lb), 0o644, "config"),
            (f"{UNIT_DIR}/{UNIT_NAME}", render_lb_unit(lb), 0o644, "unit"),
        ],
    )
    for model, servers in lb.models.items():
        where = ", ".join(f"{b.name} {b.address}:{b.port} ({b.slots} slots)" for b in servers)
        console().print(Text(f"model {model}: {where}"))
    return 0
