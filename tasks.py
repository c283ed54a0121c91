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
    from playbooks.plan_cmd import run_plan

    _run(run_plan, recipe=recipe, gpu=gpu, model_config=model_config,
         ctx=int(ctx) if ctx is not None else None, parallel=int(parallel), quant=quant, as_json=json)


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


ns = Collection(plan, test)
