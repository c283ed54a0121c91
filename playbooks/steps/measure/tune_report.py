"""`invoke tune`'s report (pure but for the files it is asked to write): every candidate
measured, predicted beside measured with its ±, the Pareto front of quality against speed, the
winner and why, as rows, Markdown, a chart and JSON.

Quality is bits per weight (the planner's, the same floor the recommendation uses); where
`invoke quantize` measured a quant's mean KL divergence against F16 (its manifest's
verification), each row carries it, and when every measured row has one the Pareto front ranks
quality by it (lower is better) instead of by bits.
A candidate far below its roofline share is named with the bench's likely cause.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from playbooks.steps.measure import roofline
from playbooks.steps.measure.tune_search import Measured, Verdict, latest
from playbooks.steps.measure.tune_space import Planned, Space

#: below this share of the single-stream roofline a candidate is named with a likely cause
FAR_BELOW = 0.3


def figure_text(m: Measured, unit: str = "tok/s") -> str:
    if m.error:
        return f"failed: {m.error}"
    if m.figure is None:
        return "-"
    if m.figure < 0:  # latency: the slowest stream's TTFT per round, negated for ranking
        hw_ms = f" ± {m.halfwidth * 1000:.0f}" if m.halfwidth is not None else ""
        what = "slowest TTFT" if m.n is not None else "TTFT p95"  # (stored before rounds were the unit)
        return f"{what} {-m.figure * 1000:.0f}{hw_ms} ms"
    hw = f" ± {m.halfwidth:.1f}" if m.halfwidth is not None else ""
    return f"{m.figure:.1f}{hw} {unit}"


def quality(r: dict[str, Any], by_kld: bool) -> float:
    """Higher is better: bits per weight, or the negated KL divergence."""
    return -float(r["kld"]) if by_kld else float(r["bpw"] or 0)


def pareto_keys(rows: Sequence[dict[str, Any]]) -> set[str]:
    """The candidates no other beats on both quality (KL divergence where every row has one,
    else bits per weight) and measured speed, among comparable figures only: those of the last
    rung any candidate reached (a rung measured minutes earlier, on a machine that has since
    drifted, is not compared with it)."""
    measured = [r for r in rows if r.get("measured") is not None and not r.get("error")]
    top = max((int(r.get("rung") or 0) for r in measured), default=0)
    ok = [r for r in measured if int(r.get("rung") or 0) == top]
    by_kld = bool(ok) and all(r.get("kld") is not None for r in ok)
    front = set()
    for r in ok:
        q = quality(r, by_kld)
        dominated = any(
            o is not r
            and quality(o, by_kld) >= q
            and o["measured"] >= r["measured"]
            and (quality(o, by_kld) > q or o["measured"] > r["measured"])
            for o in ok
        )
        if not dominated:
            front.add(r["key"])
    return front


def rows(
    measured: Sequence[Measured],
    planned: Sequence[Planned],
    verdict: Verdict | None,
    kld: Mapping[str, float] | None = None,
) -> list[dict[str, Any]]:
    """One row per candidate measured (its last rung), fastest first, failures last; ``kld``:
    each quant's mean KL divergence against F16, where quantize measured it."""
    plans = {p.candidate: p for p in planned}
    winner = verdict.winner.candidate if verdict and verdict.winner else None
    out = []
    for m in latest(measured):
        p = plans.get(m.candidate)
        c = m.candidate
        single_roof = p.single_tok_s if p else None
        predicted = p.predicted_tok_s if p else None
        decode = (m.level.get("decode") or {}).get("mean")
        # the MBU of one stream: measured at concurrency 1 against the single-stream roofline
        one = m.level.get("concurrency") == 1
        share = decode / single_roof if decode and single_roof and one else None
        row: dict[str, Any] = {
            "key": c.key(),
            "label": c.label(),
            "quant": c.quant,
            "cache": f"{c.cache_k}/{c.cache_v}",
            "flash_attn": c.flash_attn,
            "slots": c.parallel,
            "ubatch": c.ubatch,
            "spec_type": c.spec_type,
            "bpw": round(p.option.bpw, 3) if p else None,
            "kld": (kld or {}).get(c.quant),
            "vram_gib": round(p.option.vram_bytes / 2**30, 3) if p else None,
            "predicted": round(predicted, 2) if predicted else None,
            "roofline_single": round(single_roof, 2) if single_roof else None,
            "measured": m.figure,
            "halfwidth": m.halfwidth,
            "n": (m.level.get("decode") or {}).get("n"),
            "roofline_share": round(share, 4) if share else None,
            # a speculating server that drafted nothing reports no counts: zero, not unknown
            "speculation": m.level.get("speculation")
            or ({"drafted": 0, "accepted": 0, "acceptance": None} if c.spec_type and not m.error else None),
            "rung": m.rung,
            "reused": m.reused,
            "error": m.error,
            "winner": c == winner,
            "note": "",
        }
        if share is not None and share < FAR_BELOW and not m.error:
            # the bench's diagnosis for a decode far below the bandwidth roofline
            row["note"] = "per-token overhead, not memory, bounds it"
        out.append(row)
    front = pareto_keys(out)
    same = {(r["quant"], r["cache"], r["flash_attn"], r["slots"], r["ubatch"]): r for r in out if not r["spec_type"]}
    for r in out:
        r["pareto"] = r["key"] in front
        # speculation against the same configuration without it (the speed-up it is kept for)
        plain = same.get((r["quant"], r["cache"], r["flash_attn"], r["slots"], r["ubatch"])) if r["spec_type"] else None
        ok = plain and plain["measured"] and r["measured"] and plain["measured"] > 0 and r["measured"] > 0
        r["spec_speedup"] = round(r["measured"] / plain["measured"], 3) if ok and plain else None
    out.sort(key=lambda r: (r["error"] is not None, -(r["measured"] or -math.inf)))
    return out


def result(
    host: str,
    recipe: str,
    objective: str,
    space: Space,
    table: list[dict[str, Any]],
    verdict: Verdict | None,
    ran_out: bool,
    live: dict[str, Any],
    winner_recipe: str | None,
    at: str,
    budget: dict[str, Any] | None = None,
    interleaved: dict[str, Any] | None = None,
    references: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    return {
        "version": 1,
        "at": at,
        "host": host,
        "recipe": recipe,
        "objective": objective,
        "space": {"total": space.total, "measured": len(space.survivors), "pruned": space.pruned},
        "candidates": table,
        "winner": None
        if not verdict or not verdict.winner
        else {
            "key": verdict.winner.candidate.key(),
            "label": verdict.winner.candidate.label(),
            "why": verdict.why,
            "figure": verdict.winner.figure,
            "halfwidth": verdict.winner.halfwidth,
            "tied_with": [m.candidate.label() for m in verdict.tied_with],
            "recipe": winner_recipe,
        },
        "budget_ran_out": ran_out,
        # planned against used, the quants made before the clock, what was skipped and why
        "budget": budget,
        # the two contenders measured again A B B A, and how far the figures drifted meanwhile
        "interleaved": interleaved,
        # each rung's leader measured again before the next rung: the drift between rungs
        "references": references or [],
        "live": live,
    }


#: what a measured rate over its roofline means (roofline.ABOVE_CEILING, after its colon)
OVER = roofline.ABOVE_CEILING.split(": ", 1)[1]

COLUMNS = ["candidate", "predicted", "measured ± 95%", "MBU", "bits/w", "VRAM GiB", "rung", "pareto", "note"]


def _spec_note(r: dict[str, Any]) -> str:
    spec = r.get("speculation") or {}
    if not r.get("spec_type"):
        return ""
    rate = spec.get("acceptance")
    acc = f"accepted {rate:.0%} of {spec.get('drafted')} drafted" if rate is not None else "nothing drafted"
    up = f", {r['spec_speedup']:.2f}x the same without it" if r.get("spec_speedup") else ""
    return acc + up


def table_cells(r: dict[str, Any]) -> list[str]:
    measured = (
        f"failed: {r['error']}"
        if r["error"]
        else f"{r['measured']:.1f}" + (f" ± {r['halfwidth']:.1f}" if r["halfwidth"] is not None else "")
        if r["measured"] is not None and r["measured"] >= 0
        else f"TTFT {-(r['measured'] or 0) * 1000:.0f} ms"
    )
    return [
        ("* " if r["winner"] else "") + r["label"],
        "-" if r["predicted"] is None else f"{r['predicted']:.1f}",
        measured + (" (kept)" if r["reused"] else ""),
        "-"
        if r["roofline_share"] is None
        else roofline.ABOVE_CEILING_CELL
        if roofline.above(r["roofline_share"])
        else f"{r['roofline_share']:.0%}",
        ("-" if r["bpw"] is None else f"{r['bpw']:.2f}")
        + (f" (KLD {r['kld']:.4f})" if r.get("kld") is not None else ""),
        "-" if r["vram_gib"] is None else f"{r['vram_gib']:.2f}",
        str(r["rung"]),
        "yes" if r["pareto"] else "",
        "; ".join(n for n in (r["note"], _spec_note(r)) if n),
    ]


def budget_text(res: dict[str, Any]) -> str:
    """``45m planned, 12m 3s used; quants made before it in 40 s; 2 candidates skipped (...)``."""
    b = res.get("budget") or {}
    if not b:
        return "ran out before the search ended" if res.get("budget_ran_out") else "enough"
    text = f"{duration(b['planned_s'])} planned, {duration(b['used_s'])} used"
    if b.get("quants_s"):
        text += f"; the quants made before it in {duration(b['quants_s'])}"
    skipped = b.get("skipped") or []
    if skipped:
        first = skipped[0]
        text += (
            f"; stopped before {first['candidate']} (rung {first['rung']}): predicted "
            f"{duration(first['predicted_s'])} with {duration(first['left_s'])} left"
        )
        if len(skipped) > 1:
            text += f"; not measured: {', '.join(s['candidate'] for s in skipped[1:])}"
    for cut in b.get("cut") or []:
        text += f"; left out: {cut}"
    return text


def interleaved_text(inter: dict[str, Any]) -> str:
    """``A 130.1, B 128.0, B 125.2, A 126.9 (drift -2.4% across the window)``."""
    order = ", ".join(f"{b['candidate']} {b['figure']:.1f}" for b in inter["order"] if b.get("figure") is not None)
    moved = inter.get("drift_pct")
    return order + (f" (drift {moved:+.1f}% across the window)" if moved is not None else "")


def references_text(res: dict[str, Any]) -> str | None:
    """``tiny np 1 ub 64 at rung 0: 148.2 then 131.0 (-11.6%)``, one per rung; None: none made."""
    refs = res.get("references") or []
    if not refs:
        return None
    return "; ".join(
        f"{r['candidate']} at rung {r['rung']}: {r['first']:.1f} then {r['again']:.1f} ({r['moved_pct']:+.1f}%)"
        for r in refs
    )


def duration(seconds: float) -> str:
    s = round(float(seconds))
    return f"{s // 60}m {s % 60}s" if s >= 60 else f"{s} s"


def markdown(res: dict[str, Any]) -> str:
    out = [f"# Tune: {res['recipe']} on {res['host']}, {res['at']}", ""]
    sp = res["space"]
    pruned = ", ".join(f"{n} {why}" for why, n in sorted(sp["pruned"].items(), key=lambda kv: -kv[1])) or "none"
    out += [
        f"- objective: {res['objective']}",
        f"- space: {sp['total']} candidates, {sp['measured']} left after pruning ({pruned})",
        f"- budget: {budget_text(res)}",
    ]
    if drift := references_text(res):
        out.append(f"- drift between rungs (the leader measured again): {drift}")
    if res.get("interleaved"):
        out.append(f"- final window: {interleaved_text(res['interleaved'])}")
    w = res.get("winner")
    out += [f"- winner: {w['label']} ({w['why']}); recipe {w['recipe']}" if w else "- winner: none", ""]
    out += ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in res["candidates"]:
        out.append("| " + " | ".join(c.replace("|", "\\|") for c in table_cells(r)) + " |")
    out += ["", "predicted: the plan's roofline (aggregate: times the slots); MBU: measured over predicted, one slot."]
    if any(roofline.above(r["roofline_share"]) for r in res["candidates"]):
        out.append(f"{roofline.ABOVE_CEILING_CELL}: a single stream measured faster than its roofline, {OVER}.")
    return "\n".join(out) + "\n"


def chart_png(res: dict[str, Any]) -> bytes:
    """Predicted against measured, one point per candidate with its 95% interval, the y = x
    line; the Pareto front of bits per weight against speed on the right."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ok = [r for r in res["candidates"] if r["measured"] is not None and r["measured"] >= 0 and not r["error"]]
    fig = Figure(figsize=(12.0, 5.0), dpi=100)
    FigureCanvasAgg(fig)
    ax, front = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for r in ok:
        ax.errorbar(
            r["predicted"],
            r["measured"],
            yerr=r["halfwidth"] or 0,
            fmt="o",
            color="tab:red" if r["winner"] else "tab:blue",
        )
    top = max([r["predicted"] or 0 for r in ok] + [r["measured"] for r in ok] + [1.0])
    ax.plot([0, top], [0, top], linestyle="--", color="grey", label="measured = predicted")
    ax.set_xlabel("predicted tok/s (roofline)")
    ax.set_ylabel("measured tok/s (95% interval)")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper left", fontsize="small")
    ax.set_title(f"{res['recipe']} on {res['host']}: {len(ok)} candidates")
    # the front from the last rung's figures only (pareto_keys), each point named, with its interval
    top = max((int(r.get("rung") or 0) for r in ok), default=0)
    last = [r for r in ok if int(r.get("rung") or 0) == top]
    for r in last:
        front.errorbar(
            r["bpw"],
            r["measured"],
            yerr=r["halfwidth"] or 0,
            fmt="o",
            color="tab:orange" if r["pareto"] else "tab:grey",
        )
        front.annotate(
            r["label"], (r["bpw"], r["measured"]), fontsize="x-small", xytext=(4, 4), textcoords="offset points"
        )
    pts = sorted((r["bpw"], r["measured"]) for r in last if r["pareto"])
    if len(pts) > 1:
        front.plot([p[0] for p in pts], [p[1] for p in pts], color="tab:orange", label="Pareto front")
    elif pts:
        front.plot(*pts[0], marker="o", linestyle="", color="tab:orange", label="Pareto front (one point)")
    if pts:
        front.legend(loc="upper right", fontsize="small")
    front.set_title(f"rung {top}: the figures measured together")
    front.set_xlabel("bits per weight (quality)")
    front.set_ylabel("measured tok/s (95% interval)")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": None})
    return buf.getvalue()


def write(res: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {"json": out_dir / "tune.json", "markdown": out_dir / "tune.md", "png": out_dir / "tune.png"}
    files["json"].write_text(json.dumps(res, indent=2, sort_keys=True) + "\n")
    files["markdown"].write_text(markdown(res))
    files["png"].write_bytes(chart_png(res))
    return files
