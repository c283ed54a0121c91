"""`invoke tune`: the flags and the table; the search is the conductor's (conduct/tune.py).

The levers' defaults, when no flag names them: the recipe's quant, its cache and an f16 one,
flash attention as the recipe has it, the recipe's slots (1..N with ``--slots N``), the
physical batch at the recipe's and at 64 (sm_70's MMQ kernels run only below 64-token
batches: -ub around 64 switches kernels), the recipe's speculation (``--spec
none,ngram-mod,draft-simple`` compares them; draft-simple needs the recipe's ``draft:``), the
recipe's threads (``--threads 1,2`` compares: on a small or shared CPU host, every core can
be slower than fewer)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

from playbooks.cli.render import console
from playbooks.conduct.settings import Settings
from playbooks.conduct.tune import Levers, TuneOptions, tune_host
from playbooks.conduct.tune_preview import preview
from playbooks.conduct.tune_store import store_path
from playbooks.conduct.view import Printer
from playbooks.errors import UsageError
from playbooks.plan.gguf_size import FILE_TYPES
from playbooks.plan.gpus import get_gpu
from playbooks.steps.measure import tune_report
from playbooks.steps.measure.tune_space import OBJECTIVES, Objective

CACHE_TYPES = ("f16", "f32", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
#: the pinned llama.cpp's speculation types (common/speculative.cpp) tune can move: the
#: draft-free n-gram ones, and draft-simple with the recipe's draft model
SPEC_TYPES = ("ngram-mod", "ngram-simple", "ngram-map-k", "draft-simple")


# -- flags ------------------------------------------------------------------------------------


def _list(flag: str, value: str | None) -> list[str]:
    if value is None:
        return []
    items = [v.strip() for v in str(value).split(",")]
    if not items or any(not v for v in items) or len(set(items)) != len(items):
        raise UsageError(f"{flag} {str(value)!r}: give distinct values separated by commas")
    return items


def parse_quants(value: str | None) -> tuple[str, ...]:
    allowed = [t for t in FILE_TYPES if t != "BF16"]
    items = _list("--quants", value)
    bad = [q for q in items if q not in allowed]
    if bad:
        raise UsageError(f"--quants {bad[0]!r}: not a GGUF type; allowed: {', '.join(allowed)}")
    return tuple(items)


def parse_ints(flag: str, value: str | None, lo: int, hi: int) -> tuple[int, ...]:
    out = []
    for item in _list(flag, value):
        if not item.isdigit() or not lo <= int(item) <= hi:
            raise UsageError(f"{flag} {item[:40]!r}: want whole numbers {lo}-{hi}, separated by commas")
        out.append(int(item))
    return tuple(out)


def parse_caches(value: str | None) -> tuple[tuple[str, str], ...]:
    """``--cache f16,q8_0`` (K and V the same) or ``q8_0/q4_0`` (K/V)."""
    pairs = []
    for item in _list("--cache", value):
        k, _, v = item.partition("/")
        v = v or k
        if k not in CACHE_TYPES or v not in CACHE_TYPES:
            raise UsageError(f"--cache {item[:40]!r}: want cache types ({', '.join(CACHE_TYPES)}), or K/V pairs")
        pairs.append((k, v))
    return tuple(pairs)


def parse_flash_attn(value: str | None) -> tuple[bool, ...]:
    out = []
    for item in _list("--flash-attn", value):
        if item not in ("on", "off"):
            raise UsageError(f"--flash-attn {item[:40]!r}: want on, off or on,off")
        out.append(item == "on")
    return tuple(out)


def parse_specs(value: str | None) -> tuple[str | None, ...]:
    out: list[str | None] = []
    for item in _list("--spec", value):
        if item != "none" and item not in SPEC_TYPES:
            raise UsageError(f"--spec {item[:40]!r}: want none or {', '.join(SPEC_TYPES)}")
        out.append(None if item == "none" else item)
    return tuple(out)


def parse_budget(value: str) -> float:
    """``45m``, ``90s``, ``1h30m`` -> seconds."""
    text = str(value).strip()
    m = re.fullmatch(r"(?:(\d{1,3})h)?(?:(\d{1,4})m)?(?:(\d{1,6})s)?", text)
    if not text or not m or not any(m.groups()):
        raise UsageError(f"--budget {text[:40]!r}: a duration such as 45m, 90s or 1h30m")
    h, mi, s = (int(g or 0) for g in m.groups())
    seconds = h * 3600 + mi * 60 + s
    if seconds <= 0:
        raise UsageError(f"--budget {text!r}: must be longer than nothing")
    return float(seconds)


# -- the operations the conductor runs ---------------------------------------------------------


def run_tune(
    host_name: str,
    recipe: str | None = None,
    opts: TuneOptions | None = None,
    as_json: bool = False,
    settings: Settings | None = None,
) -> int:
    settings = settings or Settings()
    opts = opts or TuneOptions()
    if opts.recipes_dir is None and settings.recipes_dir is not None:
        opts = TuneOptions(**{**opts.__dict__, "recipes_dir": settings.recipes_dir})
    # with --json stdout holds the JSON alone: the progress and the commands go to stderr
    out = console(sys.stderr) if as_json else console()
    printer = Printer(out=sys.stderr) if as_json else None
    outcome = tune_host(settings, host_name, recipe, opts, lambda name, line: out.print(f"[{name}] {line}"), printer)
    res = outcome.result
    if as_json:
        print(json.dumps(res, indent=2, sort_keys=True))
        return 0 if res.get("winner") else 1
    render_tune(res, outcome.report_dir)
    return 0 if res.get("winner") else 1


def run_tune_preview(
    host_name: str | None,
    recipe: str | None,
    opts: TuneOptions,
    gpu: str | None = None,
    as_json: bool = False,
    settings: Settings | None = None,
) -> int:
    """``tune --dry-run``: the space, its order and a predicted time, without a host (the
    recipe from --recipe or the inventory's entry; --gpu plans it for another card; the
    measurements kept for that host, where there are some, cost the rungs)."""
    settings = settings or Settings()
    spec = settings.host_spec(host_name) if host_name else None  # (a broken inventory is one line)
    named = recipe or (spec.recipe if spec else None)
    if not named:
        raise UsageError("tune --dry-run needs a recipe: --recipe R, or --host H whose inventory entry names one")
    loaded = settings.load_recipe(named)
    if gpu:
        loaded = loaded.model_copy(update={"recipe": loaded.recipe.model_copy(update={"gpu": get_gpu(gpu).key})})
    store = store_path(host_name, loaded.recipe.name) if host_name else None
    pv = preview(loaded, opts, store)
    res: dict[str, Any] = {
        "recipe": loaded.recipe.name,
        "gpu": get_gpu(loaded.recipe.gpu).name,
        "objective": opts.objective,
    }
    res |= pv.as_dict()
    if as_json:
        print(json.dumps(res, indent=2, sort_keys=True))
        return 0
    out = console()
    out.print(f"tune --dry-run: {res['recipe']} on {res['gpu']} ({opts.objective}): nothing is run", markup=False)
    pruned = "; ".join(f"{n} {why}" for why, n in sorted(pv.space.pruned.items(), key=lambda kv: -kv[1]))
    sp = res["space"]
    out.print(
        f"space: {sp['total']} candidates, {sp['measured']} planned to fit"
        + (f" (pruned: {pruned})" if pruned else ""),
        markup=False,
    )
    if not pv.space.survivors:
        out.print(pv.space.why_empty(), markup=False)
        return 1
    out.print("measuring order (fastest predicted first):", markup=False)
    for i, row in enumerate(res["order"], 1):
        out.print(f"  {i:>2}. {row['candidate']}: {row['predicted_tok_s']:.1f} tok/s predicted", markup=False)
    rungs = "; ".join(
        f"rung {r}: {n} x {tune_report.duration(c)} ({b})"
        for r, (n, c, b) in enumerate(zip(pv.schedule, pv.rung_s, pv.basis, strict=True))
    )
    out.print(f"schedule: {rungs}; a reference before each later rung; up to 4 interleaved blocks", markup=False)
    verdict = "within" if res["fits_budget"] else "over"
    budget = tune_report.duration(opts.budget_s)
    out.print(
        f"predicted: {tune_report.duration(pv.predicted_s)}, {verdict} the {budget} budget "
        "(the budget skips what would not fit)",
        markup=False,
    )
    return 0


def render_tune(res: dict, report_dir: Path | None) -> None:
    from rich.table import Table
    from rich.text import Text

    out = console()
    table = Table(title=Text(f"voltaforge tune: {res['recipe']} on {res['host']} ({res['objective']})"))
    for i, col in enumerate(tune_report.COLUMNS):
        table.add_column(col, justify="right" if 0 < i < 7 else "left", overflow="fold")
    for r in res["candidates"]:
        table.add_row(*(Text(c) for c in tune_report.table_cells(r)))
    out.print(table)
    sp = res["space"]
    pruned = "; ".join(f"{n} {why}" for why, n in sorted(sp["pruned"].items(), key=lambda kv: -kv[1]))
    out.print(
        Text(
            f"space: {sp['total']} candidates, {sp['measured']} planned to fit"
            + (f" (pruned: {pruned})" if pruned else "")
        )
    )
    live = res.get("live") or {}
    checks = live.get("checks") or []
    if live.get("services"):
        ok = sum(1 for _, code in checks if code == 200)
        state = (
            "stopped for the search and deployed again"
            if live.get("taken_over")
            else f"answered {ok} of {len(checks)} checks"
            if checks
            else "not checked: every measurement was kept from an earlier run"
        )
        out.print(Text(f"live service ({', '.join(live['services'])}): {state}"))
    moved = tune_report.references_text(res)
    if moved:
        out.print(Text(f"drift between rungs (each rung's leader measured again): {moved}"))
    if res.get("interleaved"):
        out.print(Text(f"the two contenders again, A B B A: {tune_report.interleaved_text(res['interleaved'])}"))
    if res.get("budget"):
        out.print(Text(f"budget: {tune_report.budget_text(res)}"))
    if res.get("budget_ran_out"):
        out.print(Text("the budget ran out: the best so far is reported", style="yellow"))
    w = res.get("winner")
    if w:
        out.print(Text(f"winner: {w['label']}: {w['why']}", style="green"))
        out.print(Text(f"recipe: {w['recipe']} (invoke provision --recipe {w['recipe']})"))
    else:
        out.print(Text("no winner: no candidate was measured without an error", style="bold red"))
    if report_dir:
        out.print(Text(f"reports: {report_dir}/tune.json, tune.md, tune.png"))


def options(
    objective: str,
    quants: str | None,
    cache: str | None,
    flash_attn: str | None,
    slots: int | None,
    ubatch: str | None,
    spec: str | None,
    min_ctx: int | None,
    min_bpw: float | None,
    budget: str,
    rungs: int | None,
    take_over: bool,
    port: int | None,
    threads: str | None = None,
    remeasure: bool = False,
) -> TuneOptions:
    """The flags, each checked (one line, exit 2, for a bad one)."""
    if objective not in OBJECTIVES:
        raise UsageError(f"--objective {objective[:40]!r}: want one of {', '.join(OBJECTIVES)}")
    obj: Objective = objective
    levers = Levers(
        quants=parse_quants(quants),
        caches=parse_caches(cache),
        flash_attn=parse_flash_attn(flash_attn),
        slots=tuple(range(1, slots + 1)) if slots else (),
        ubatches=parse_ints("--ubatch", ubatch, 1, 8192),
        spec_types=parse_specs(spec),
        threads=parse_ints("--threads", threads, 1, 1024),
    )
    return TuneOptions(
        objective=obj,
        levers=levers,
        min_ctx=min_ctx,
        min_bpw=min_bpw,
        budget_s=parse_budget(budget),
        rungs=rungs or 3,
        take_over=take_over,
        port=port,
        remeasure=remeasure,
    )
