"""The folders are layers, and imports only go down (docs/layout.md).

    errors, resources, results                            (anyone)
    plan/     pure planning (the serving engines: plan/engine_*.py, asked through plan/engines.py)
                                                          -> nothing above
    facts/    fact commands + pure parsers                -> nothing above
    config/   recipes, inventory                          -> plan
    host/     transports, operations, lock               -> config (HostSpec), facts
    modelgen/ generated tiny models (random weights)     -> plan
    steps/    what runs against a host                    -> host, facts, config, plan
    conduct/  the conductors: steps run in order per host -> steps and below
    cli/      flags and tables                            -> conduct and below, never host/ or facts/
              (what runs or reads a host is conduct/'s; a type named under TYPE_CHECKING is not an import)

Also: no module imports another module's private (_underscored) names, and there is no
import cycle between modules. Read from the source with ast, so a lazy import inside a
function counts too.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "playbooks"

ALLOWED = {
    "plan": {"plan"},
    "facts": {"facts"},
    "config": {"config", "plan"},
    "host": {"host", "config", "facts"},
    "modelgen": {"modelgen", "plan"},
    "steps": {"steps", "host", "facts", "config", "plan", "modelgen"},
    "conduct": {"conduct", "steps", "host", "facts", "config", "plan", "modelgen"},
    "cli": {"cli", "conduct", "steps", "config", "plan", "modelgen"},
}
#: what a module may name for its annotations only (under ``if TYPE_CHECKING:``, never run)
TYPES_ONLY = {"cli": {"host", "facts"}}
ANYONE = {"errors", "resources", "results", "words", "__init__"}  # words: clip(), for any one-line reason


def modules() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG.parent).with_suffix("")
        name = ".".join(rel.parts)
        out[name.removesuffix(".__init__")] = path
    return out


def _type_only_lines(tree: ast.AST) -> set[int]:
    """The lines of ``if TYPE_CHECKING:`` bodies: imports there never run."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def imports_of(path: Path, runtime_only: bool = False) -> list[tuple[str, list[str], int]]:
    """(module imported from, names imported, line) for every playbooks import in the file;
    ``runtime_only``: without those under ``if TYPE_CHECKING:``."""
    tree = ast.parse(path.read_text())
    skip = _type_only_lines(tree) if runtime_only else set()
    found = []
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("playbooks"):
            assert node.level == 0, f"{path}:{node.lineno}: use absolute imports (playbooks.x.y)"
            found.append((node.module, [a.name for a in node.names], node.lineno))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("playbooks"):
                    found.append((a.name, [], node.lineno))
    return found


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


MODULES = modules()


def test_layers_are_folders():
    layers = {layer(m) for m in MODULES} - ANYONE
    assert layers == set(ALLOWED), layers
    flat = [m for m in MODULES if m.count(".") == 1 and layer(m) not in ANYONE | set(ALLOWED)]
    assert flat == [], f"modules outside the layer folders: {flat}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_go_down_only(module):
    if layer(module) in ANYONE:
        allowed = set()
    else:
        allowed = ALLOWED[layer(module)]
    for target, _, line in imports_of(MODULES[module], runtime_only=True):
        # `from playbooks.facts import lines` names the facts package itself
        to = layer(target) if target != "playbooks" else "__init__"
        assert to in ANYONE or to in allowed, (
            f"{module} (line {line}) imports {target}: {layer(module)} may not use {to}"
        )


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_private_names_from_other_modules(module):
    for target, names, line in imports_of(MODULES[module]):
        private = [n for n in names if n.startswith("_") and not n.startswith("__") and target != module]
        assert not private, f"{module} (line {line}) imports private {private} from {target}"


def test_no_import_cycles():
    graph = {m: set() for m in MODULES}
    for m, path in MODULES.items():
        # what runs: a name under TYPE_CHECKING (an annotation's type) is never imported
        for target, names, _ in imports_of(path, runtime_only=True):
            for cand in [f"{target}.{n}" for n in names] + [target]:
                if cand in MODULES and cand != m:
                    graph[m].add(cand)
                    break
    # packages import their own modules (re-exports): a package -> its submodule is not a cycle
    seen, stack, cycles = set(), [], []

    def visit(m):
        if m in stack:
            cycles.append(stack[stack.index(m) :] + [m])
            return
        if m in seen:
            return
        seen.add(m)
        stack.append(m)
        for n in sorted(graph[m]):
            if n.startswith(m + ".") or m.startswith(n + "."):
                continue
            visit(n)
        stack.pop()

    for m in sorted(graph):
        visit(m)
    assert not cycles, cycles


def test_the_checker_sees_a_violation(tmp_path):
    """The rules are not vacuous: an upward import in a plan module is caught."""
    bad = tmp_path / "bad.py"
    bad.write_text("from playbooks.host.ops import run_ops\n")
    ((target, _, _),) = imports_of(bad)
    assert layer(target) == "host" and layer(target) not in ALLOWED["plan"]


@pytest.mark.parametrize("module", sorted(MODULES))
def test_type_only_imports_go_down_too(module):
    """An annotation may name a lower layer's type the module may not run (cli/ naming Host)."""
    if layer(module) in ANYONE:
        return
    allowed = ALLOWED[layer(module)] | TYPES_ONLY.get(layer(module), set())
    for target, _, line in imports_of(MODULES[module]):
        to = layer(target) if target != "playbooks" else "__init__"
        assert to in ANYONE or to in allowed, f"{module} (line {line}) names {target}: {layer(module)} may not"


def test_cli_running_a_host_is_caught(tmp_path):
    """cli/ importing host/ at run time is a violation; under TYPE_CHECKING it is not."""
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from typing import TYPE_CHECKING\nfrom playbooks.host.lock import host_lock\n"
        "if TYPE_CHECKING:\n    from playbooks.host import Host\n"
    )
    assert [t for t, _, _ in imports_of(bad, runtime_only=True)] == ["playbooks.host.lock"]
    assert "host" not in ALLOWED["cli"] and "facts" not in ALLOWED["cli"]


# ------------------------------------------------------------------------------------------
# the engine is asked, not compared (issue 54)
# ------------------------------------------------------------------------------------------

#: a branch on the engine: its recipe field compared, an engine's name as a literal, an EXL2
#: quant told by its prefix (llama.cpp's own cpu/cuda build backend is another `backend`)
ENGINE_BRANCH = re.compile(
    r"""\.backend\s*(==|!=|\bin\b|\bnot in\b)|(==|!=|\bin\b)\s*\S*\.backend\b|"""
    r"""["'](llamacpp|exllamav2|tabbyapi)["']|startswith\(\s*["']EXL2-["']\s*\)"""
)
#: where an engine may be compared: the engines themselves (each one's plan half and host half),
#: the recipe schema that names them (its `backend:` choices; what a recipe of each may hold is
#: the engine's recipe_refusal), and an engine's own operation modules (ENGINE_OWNED)
ENGINE_OWNED = ("playbooks.steps.build.exllamav2", "playbooks.steps.weights.exl2_convert")
ENGINE_HOMES = ("playbooks.plan.engine", "playbooks.steps.serve.engine", "playbooks.config.recipe_schema")
ENGINE_HOMES += ENGINE_OWNED


def engine_branches(path: Path) -> list[int]:
    """The lines of a module that branch on the engine (ENGINE_BRANCH), comments left out."""
    found = []
    for n, text in enumerate(path.read_text().splitlines(), 1):
        code = text.split("#", 1)[0]
        if ENGINE_BRANCH.search(code) and "cpu" not in code.split("backend")[-1][:12]:
            found.append(n)
    return found


@pytest.mark.parametrize("module", sorted(m for m in MODULES if not m.startswith(ENGINE_HOMES)))
def test_only_the_engines_compare_an_engine(module):
    lines = engine_branches(MODULES[module])
    assert not lines, (
        f"{module} branches on the engine at lines {lines}: ask the engine (playbooks/plan/engines.py, "
        "playbooks/steps/serve/engines.py; docs/layout.md)"
    )


def test_an_engines_own_modules_are_named_by_the_engine():
    """A reader finds an engine's operation modules by opening the engine: each module the rule
    lets name an engine is named (as a path) by an engine module's text."""
    engines = [p for name, p in MODULES.items() if name.startswith(ENGINE_HOMES[:2])]
    text = "".join(p.read_text() for p in engines)
    for module in ENGINE_OWNED:
        assert module in MODULES, module
        path = module.removeprefix("playbooks.").replace(".", "/") + ".py"
        assert path in text, f"{module} is no engine module's: name it in the engine that owns it"


def test_the_engine_rule_sees_a_branch(tmp_path):
    """The rule is not vacuous: a synthetic module comparing the recipe's engine, naming one,
    or telling an EXL2 quant by its prefix is caught, line by line; llama.cpp's cpu build
    backend and a comment are not."""
    bad = tmp_path / "bad.py"
    bad.write_text(
        'if r.backend == "exllamav2":\n'
        "    pass\n"
        'kind = "tabbyapi"\n'
        'if quant.startswith("EXL2-"):\n'
        "    pass\n"
        'if inputs.backend == "cpu":  # the build backend\n'
        "    pass\n"
        "# a comment naming exllamav2 is no branch\n"
    )
    assert engine_branches(bad) == [1, 3, 4]
