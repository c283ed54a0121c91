"""Facts about Python environments on a host: the version of a package inside a venv."""

from __future__ import annotations

import re
import shlex

from playbooks.facts import Runs, read_fact


def packages_command(venv: str) -> str:
    """Every distribution in the venv with its version, one per line: one command for all the
    versions a run reads (a reads pass sends it once, host/prefetch.py), not one per package."""
    code = "import importlib.metadata as m\nfor d in m.distributions(): print(d.metadata['Name'], d.version)"
    return f"{shlex.quote(venv + '/bin/python')} -c {shlex.quote(code)} 2>/dev/null || true"


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()  # PEP 503


def parse_packages(output: str) -> dict[str, str]:
    found: dict[str, str] = {}
    for line in output.splitlines():
        name, _, version = line.strip().partition(" ")
        if name and version:
            found.setdefault(_normal(name), version.strip())  # the first on sys.path wins, as in import
    return found


def read_package_version(host: Runs, venv: str, package: str) -> str | None:
    """The installed version of ``package`` in the venv; None when the venv or the package is missing."""
    return parse_packages(read_fact(host, packages_command(venv))).get(_normal(package))


def torch_cuda_command(venv: str) -> str:
    """torch's own word on the CUDA it was built with (PyPI's wheels carry no +cuXXX label)."""
    code = "import torch; print(torch.version.cuda or 'none')"
    return f"{shlex.quote(venv + '/bin/python')} -c {shlex.quote(code)} 2>/dev/null || true"


def parse_torch_cuda(output: str) -> tuple[int, int] | None:
    """(11, 8) for a +cu118 torch; None for a CPU build or no torch."""
    text = output.strip().splitlines()[-1] if output.strip() else ""
    major, _, minor = text.partition(".")
    return (int(major), int(minor)) if major.isdigit() and minor.isdigit() else None


#: the wheel directories the host's own pip is told about: PIP_FIND_LINKS, or find-links in a
#: pip configuration file (the global, site-wide and user files, and PIP_CONFIG_FILE's; none of
#: them when PIP_CONFIG_FILE is /dev/null, as pip does)
PIP_FIND_LINKS_COMMAND = (
    'printf "env %s\\n" "${PIP_FIND_LINKS-}"; '
    'if [ "${PIP_CONFIG_FILE-}" != /dev/null ]; then '
    'cat /etc/pip.conf /etc/xdg/pip/pip.conf "$HOME/.config/pip/pip.conf" "$HOME/.pip/pip.conf" '
    '${PIP_CONFIG_FILE:+"$PIP_CONFIG_FILE"} 2>/dev/null '
    "| grep -i '^[[:space:]]*find[-_]links[[:space:]]*=' || true; fi"
)


def parse_pip_find_links(output: str) -> bool:
    """Whether the host's pip has a local wheel source of its own (its find-links)."""
    for line in output.splitlines():
        text = line.strip()
        if text.startswith("env "):
            if text[4:].strip():
                return True
        elif text.partition("=")[2].strip():
            return True
    return False
