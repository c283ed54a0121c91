"""Three generated members of a model set (issue 55), for the tests that serve one for real:
tiny-cpu's model at three widths, each its own recipe (its served name its width's word, one
thread: two children beside each other and the client on two cores) and its own Q4_K_M GGUF;
and how those tests count the router's children (strace's record of every start and exit) and
read them (as `invoke status` does)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from playbooks.facts.router import Child, children_command, parse_children
from playbooks.host.local import LocalHost
from tests import llamacpp_tools
from tests.helpers import ROOT

#: three widths of tiny-cpu's model: a set whose members differ in size
WIDTHS = {"small": 256, "mid": 512, "large": 768}


def member_recipes(tmp_path: Path, service: dict | None = None) -> Path:
    """The three recipes, under tmp_path/recipes (``service``: keys over each one's service)."""
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    (recipes / "defaults.yaml").write_text((ROOT / "recipes/defaults.yaml").read_text())
    base = yaml.safe_load((ROOT / "recipes/tiny-cpu.yaml").read_text())
    for name, hidden in WIDTHS.items():
        data = yaml.safe_load(yaml.safe_dump(base))
        data["model"]["config"] |= {"hidden_size": hidden, "intermediate_size": hidden * 3}
        data["service"] = data.get("service", {}) | (service or {}) | {"model_name": name}
        data["threads"] = 1
        (recipes / f"{name}.yaml").write_text(yaml.safe_dump(data))
    return recipes


def three_members(tmp_path: Path, service: dict | None = None) -> tuple[Path, dict[str, Path]]:
    """The three recipes (under tmp_path/recipes) and each one's quantized GGUF."""
    recipes = member_recipes(tmp_path, service)
    ggufs = {}
    for name in WIDTHS:
        config = yaml.safe_load((recipes / f"{name}.yaml").read_text())["model"]["config"]
        work = tmp_path / name
        work.mkdir()
        f16 = llamacpp_tools.tiny_f16(work, config)
        ggufs[name] = llamacpp_tools.quantize(f16, work / f"{name}-Q4_K_M.gguf", "Q4_K_M")
    return recipes, ggufs


#: strace's record of a program started and of a process gone, in the order the kernel told it
EXECVE = re.compile(r'^(\d+) +execve\("[^"]*", \[(.*)\], ')
GONE = re.compile(r"^(\d+) +\+\+\+ (?:exited with \d+|killed by \w+)")


def router_children(pid_file: Path) -> list[Child]:
    """The router's children as the product reads them (facts/router.py's command, run here)."""
    with LocalHost() as host:
        return parse_children(host.run(children_command(str(pid_file)), check=False, stream=False).stdout)


def alive_most(trace: str, attached: bool = False) -> tuple[int, int, int]:
    """(the most children alive at once, starts, exits) by strace's record of the router: each
    child's execve and its exit, in the order strace saw them. The first execve is the router's
    own, unless strace was ``attached`` to a router already running (every execve a child's).
    The router's own log cannot tell it: it writes a child's exit after freeing its slot, racing
    the next spawn's line."""
    router = None
    alive: set[str] = set()
    most = starts = exits = 0
    for line in trace.splitlines():
        if m := EXECVE.match(line):
            if router is None and not attached:
                router = m[1]
                continue
            alive.add(m[1])
            starts += 1
            most = max(most, len(alive))
        elif (m := GONE.match(line)) and m[1] in alive:
            alive.discard(m[1])
            exits += 1
    return most, starts, exits
