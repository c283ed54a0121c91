"""voltaforge's Invoke tasks. Thin by design: each task parses flags and calls playbooks/."""

from __future__ import annotations

import sys

from invoke import Collection, task

from playbooks.errors import VoltaforgeError


def _run(fn, *args, **kwargs) -> None:
    """Run a command; user errors print one line and exit 2, never a traceback."""
    try:
        code = fn(*args, **kwargs)
    except VoltaforgeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
    if code:
        sys.exit(code)


@task(
    help={
        "recipe": "recipe name (recipes/NAME.yaml) or path",
        "gpu": "plan for this GPU instead of the recipe's (e.g. v100-32gb, t4, a100-40gb)",
        "model-config": "plan a bare Hugging Face config.json instead of a recipe",
        "ctx": "tokens per slot (default: the recipe's, or 4096)",
        "parallel": "slots, with --model-config (default 1)",
        "quant": "with --model-config: the quant to check (default Q4_K_M; EXL2 as EXL2-3.3)",
        "json": "print JSON instead of tables",
    }
)
def plan(c, recipe=None, gpu=None, model_config=None, ctx=None, parallel=1, quant=None, json=False):
    """Compute the physical ceiling: weights, KV cache, VRAM budget, roofline, what fits."""
    from playbooks.cli.plan import run_plan

    _run(run_plan, recipe=recipe, gpu=gpu, model_config=model_config,
         ctx=int(ctx) if ctx is not None else None, parallel=int(parallel), quant=quant, as_json=json)


@task(
    help={
        "host": "inventory name, ~/.ssh/config name, or 'local'",
        "recipe": "judge the host against this recipe (default: the inventory's)",
        "json": "print JSON instead of tables",
        "inventory": "inventory file (default inventory.yaml)",
    }
)
def preflight(c, host, recipe=None, json=False, inventory="inventory.yaml"):
    """Read a host's facts and judge them: each check with a fix; non-zero exit when blocked."""
    from playbooks.steps.preflight import run_preflight

    _run(run_preflight, host, recipe=recipe, as_json=json, inventory=inventory)


@task(
    help={
        "host": "inventory name, ~/.ssh/config name, or 'local'",
        "recipe": "the recipe whose toolchain pins to install (default: the inventory's)",
        "dry-run": "print the exact commands and change nothing",
        "inventory": "inventory file (default inventory.yaml)",
    }
)
def toolchain(c, host, recipe=None, dry_run=False, inventory="inventory.yaml"):
    """Install the pinned CUDA toolkit and a venv with the pinned torch, idempotently."""
    from playbooks.steps.toolchain import run_toolchain

    _run(run_toolchain, host, recipe=recipe, dry_run=dry_run, inventory=inventory)


@task(help={"k": "only tests matching this pytest -k expression", "fast": "skip tests marked slow"})
def test(c, k=None, fast=False):
    """Run the test suite (what .ci/run runs)."""
    # the interpreter running invoke, so the venv's packages are used whatever PATH says
    args = [sys.executable, "-m", "pytest", "-q"]
    if k:
        args += ["-k", k]
    if fast:
        args += ["-m", "not slow"]
    c.run(" ".join(__import__("shlex").quote(a) for a in args), pty=False)


ns = Collection(plan, preflight, toolchain, test)
