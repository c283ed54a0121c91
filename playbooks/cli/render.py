"""Everything voltaforge shows people: plans, preflight verdicts, operation reports.

One module, one console factory. Rich tables for people, JSON for tools; no computation here.
Text that comes from a host, a recipe or a file reaches rich as ``Text`` or escaped, never as
markup: an OS name like ``Debian [/testing]`` or a path with ``[brackets]`` is data.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from rich.console import Console, JustifyMethod
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from playbooks.plan.aggregate import plan_aggregate
from playbooks.plan.engines import engine
from playbooks.plan.gpus import ALIASES, GIB, MIB, size_text
from playbooks.plan.gpus import mem_text as _gib
from playbooks.plan.moe import OffloadStep
from playbooks.plan.planner import Plan
from playbooks.plan.serving import Option
from playbooks.plan.split import DeviceShare, worst
from playbooks.plan.tensors import active_parameter_count, parameter_count
from playbooks.steps.preflight import Verdict

_gb = size_text

if TYPE_CHECKING:  # a report is drawn from the changes; cli/ never runs a host itself
    from playbooks.host.ops import Change


def console(file: TextIO | None = None, width: int = 120) -> Console:
    """The console every command prints to: a fixed width, so output is the same in a pipe."""
    return Console(file=file or sys.stdout, width=width)


def _params(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def option_json(o: Option, plan: Plan | None = None) -> dict[str, Any]:
    """One option; with its plan, also the quality figure the recommendation ranks it by."""
    quality = plan.objective.quality(o.quant, o.bpw) if plan is not None else None
    return {
        "quant": o.quant,
        "backend": o.backend,
        "weights_bytes": o.weights_bytes,
        "bits_per_weight": round(o.bpw, 3),
        "gpu_weights_bytes": o.gpu_weights_bytes,
        "kv_bytes_per_token": o.kv_bytes_per_token,
        "kv_bytes": o.kv_bytes,
        "compute_bytes": o.compute_bytes,
        "overhead_bytes": o.overhead_bytes,
        "vram_bytes": o.vram_bytes,
        "gpu_bytes": o.gpu_bytes,
        "fits": o.fits,
        "unfit_reason": o.unfit_reason or None,
        "headroom_bytes": o.headroom_bytes,
        "max_ctx": o.max_ctx,
        "roofline_tok_s": round(o.roofline_tok_s, 2),
        "roofline_full_ctx_tok_s": round(o.roofline_full_ctx_tok_s, 2),
        # weight bytes a decoded token reads, and where (a MoE: its active experts; host: the
        # experts of the first n_cpu_moe layers, read by the CPU at host_membw_gb_s)
        "n_cpu_moe": o.n_cpu_moe,
        "active_bytes_per_token": o.active_bytes_per_token,
        "gpu_bytes_per_token": o.gpu_bytes_per_token,
        "host_bytes_per_token": o.host_bytes_per_token,
        "host_weights_bytes": o.host_weights_bytes,
        "host_resident_bytes": o.host_resident_bytes,
        "host_membw_gb_s": o.host_membw_gb_s,
        "host_membw_source": o.host_membw_source,
        # a draft model beside the target (llama-server --model-draft): its weights, KV cache
        # and compute buffer together, and the last two alone (overhead_bytes includes all)
        "draft_bytes": o.draft_bytes,
        "draft_kv_bytes": o.draft_kv_bytes,
        "draft_compute_bytes": o.draft_compute_bytes,
        # a split over several cards: each card's share (vram_bytes/gpu_bytes: the worst card's)
        "devices": [device_json(d) for d in o.devices],
    } | ({"kld": quality.kld, "kld_source": quality.source} if quality is not None else {})


def device_json(d: DeviceShare) -> dict[str, Any]:
    return {
        "index": d.index,
        "name": d.name,
        "layers": [d.layers[0], d.layers[-1]] if d.layers else [],
        "layer_count": len(d.layers),
        "output": d.output,
        "weights_bytes": d.weights_bytes,
        "kv_bytes": d.kv_bytes,
        "compute_bytes": d.compute_bytes,
        "overhead_bytes": d.overhead_bytes,
        "total_bytes": d.total_bytes,
        "capacity_bytes": d.capacity_bytes,
        "headroom_bytes": d.headroom_bytes,
    }


def offload_step_json(st: OffloadStep) -> dict[str, Any]:
    return {
        "n_cpu_moe": st.n_cpu_moe,
        "vram_bytes": st.vram_bytes,
        "fits": st.fits,
        "host_weights_bytes": st.host_weights_bytes,
        "gpu_bytes_per_token": st.gpu_bytes_per_token,
        "host_bytes_per_token": st.host_bytes_per_token,
        "roofline_tok_s": round(st.roofline_tok_s, 2),
    }


def plan_json(plan: Plan, recipe: str | None = None) -> dict[str, Any]:
    s = plan.serving
    # kv_bytes_per_token is the recipe's backend and cache type: the number a user plans with
    # (without a chosen option: the first option of the recipe's engine)
    first_kv = {o.backend: o.kv_bytes_per_token for o in reversed(plan.options)}
    kv = plan.chosen.kv_bytes_per_token if plan.chosen else first_kv[s.backend]
    model: dict[str, Any] = {
        "model_type": plan.shape.model_type,
        "parameters": parameter_count(plan.shape),
        "layers": plan.shape.num_hidden_layers,
        "kv_heads": plan.shape.num_key_value_heads,
        "head_dim": plan.shape.head_dim,
        "max_position_embeddings": plan.shape.max_position_embeddings,
    }
    if plan.shape.is_moe:
        model |= {
            "experts": plan.shape.num_experts,
            "experts_per_token": plan.shape.num_experts_per_tok,
            "active_parameters": active_parameter_count(plan.shape),
        }
    h = plan.host
    return {
        "recipe": recipe,
        "model": model,
        "gpu": {
            "key": plan.gpu.key,
            "aliases": sorted(a for a, k in ALIASES.items() if k == plan.gpu.key),
            "name": plan.gpu.name,
            "memory_bytes": plan.gpu.memory_bytes,
            "bandwidth_gb_s": plan.gpu.bandwidth_gb_s,
            "compute_capability": list(plan.gpu.compute_capability),
            "bf16": plan.gpu.bf16,
        },
        "serving": {
            "backend": s.backend,
            "context": s.context,
            "parallel": s.parallel,
            "cache_k": s.cache_k,
            "cache_v": s.cache_v,
            "flash_attn": s.flash_attn,
            "n_cpu_moe": s.n_cpu_moe,
            "gpu_count": s.gpu_count,
            "rpc_devices": s.rpc_devices,
            "tensor_split": list(s.split_weights(plan.gpu)) if s.split else [],
        },
        # what the two-sided roofline of a MoE with experts in host RAM divides by, and where
        # the figure came from (measured on the host | given by flag or recipe | default)
        "host": {
            "membw_gb_s": h.membw_gb_s,
            "membw_source": h.membw_source,
            "ram_bytes": h.ram_bytes,
            "ram_source": h.ram_source,
        },
        "kv_bytes_per_token": kv,
        "chosen": option_json(plan.chosen, plan) if plan.chosen else None,
        "aggregate": plan_aggregate(plan),
        "quants": [option_json(o, plan) for o in plan.options],
        # what the recommendation optimizes (playbooks/plan/objective.py)
        "objective": {
            "min_bpw": plan.objective.min_bpw,
            "min_tok_s": plan.objective.min_tok_s,
            "measured_kld": dict(plan.objective.measured_kld),
        },
        "recommendation": plan.recommendation.quant if plan.recommendation else None,
        "recommendation_kind": plan.recommendation_kind,
        "recommended": option_json(plan.recommendation, plan) if plan.recommendation else None,
        "offload": (
            {"quant": plan.offload_quant, "steps": [offload_step_json(st) for st in plan.offload]}
            if plan.offload
            else None
        ),
        "reason": plan.reason,
        "notes": plan.notes,
    }


def _fits_cell(o: Option) -> str:
    if o.unfit_reason:
        return f"[red]no, {escape(o.unfit_reason)}[/]"
    return "[green]yes[/]" if o.fits else f"[red]no, by {-o.headroom_bytes / MIB:,.0f} MiB[/]"


def render_plan(plan: Plan, console: Console, recipe: str | None = None) -> None:
    s = plan.serving
    shape = plan.shape
    experts = (
        f", {shape.num_experts} experts ({shape.num_experts_per_tok} per token, "
        f"{_params(active_parameter_count(shape))} active)"
        if shape.is_moe
        else ""
    )
    console.print(
        f"[bold]{escape(recipe or 'model')}[/]: {shape.model_type}, {_params(parameter_count(shape))} parameters, "
        f"{shape.num_hidden_layers} layers, {shape.num_key_value_heads} KV heads x head_dim {shape.head_dim}" + experts
    )
    arch = "memory budget" if plan.gpu.is_cpu else plan.gpu.sm + ("" if plan.gpu.bf16 else ", no BF16")
    console.print(
        f"{'CPU' if plan.gpu.is_cpu else 'GPU'}: {plan.gpu.name}, {plan.gpu.memory_gib:g} GiB "
        f"({plan.gpu.memory_bytes / 1e9:.2f} GB), {plan.gpu.bandwidth_gb_s:g} GB/s, {arch}"
    )
    shares = ",".join(f"{x:g}" for x in s.split_weights(plan.gpu))
    gpu_split = engine(s.backend).renders_gpu_split
    how = f"gpu_split planned for shares {shares}" if gpu_split else f"--tensor-split {shares}"
    split = f", split by layers over {s.device_count(plan.gpu)} devices ({how})" if s.split else ""
    console.print(
        f"Serving: {s.backend}, {s.context} tokens x {s.parallel} slot(s), cache K={s.cache_k} V={s.cache_v}, "
        f"flash attention {'on' if s.flash_attn else 'off'}{split}"
    )
    if plan.chosen and plan.chosen.devices:
        _render_split(plan, plan.chosen, console)
    elif plan.chosen:
        c = plan.chosen
        if c.unfit_reason:
            verdict = f"[red]does not fit: {escape(c.unfit_reason)}[/]"
        elif c.fits:
            verdict = f"[green]fits with {c.headroom_bytes / MIB:,.0f} MiB left[/]"
        else:
            verdict = f"[red]does not fit by {-c.headroom_bytes / MIB:,.0f} MiB[/]"
        offload = (
            f" (the experts of {c.n_cpu_moe} of {shape.num_hidden_layers} layers, {_gib(c.host_weights_bytes)}, "
            f"stay in host RAM: --n-cpu-moe {c.n_cpu_moe})"
            if c.n_cpu_moe
            else ""
        )
        console.print(
            f"\n[bold]Planned quant {c.quant}[/]: weights {_gb(c.weights_bytes)} on disk, "
            f"{_gib(c.gpu_weights_bytes)} in {'memory' if plan.gpu.is_cpu else 'VRAM'}{offload} "
            f"+ KV {_gib(c.kv_bytes)} "
            f"({c.kv_bytes_per_token:,} B/token) + compute {_gib(c.compute_bytes)}"
            f"{' (estimate)' if shape.is_moe and engine(c.backend).offloads_experts and not plan.gpu.is_cpu else ''} + "
            + (
                f"draft model {_gib(c.draft_bytes)} (weights, KV {_gib(c.draft_kv_bytes)}, compute "
                f"{_gib(c.draft_compute_bytes)}) + "
                if c.draft_bytes
                else ""
            )
            + f"context/margin {_gib(c.overhead_bytes - c.draft_bytes)} = {_gib(c.vram_bytes)} of "
            f"{_gib(c.gpu_bytes)}: {verdict}"
        )
        console.print(_roofline_text(plan, c))
        if (agg := plan_aggregate(plan)) is not None:
            console.print(
                f"Aggregate at {agg['slots']} slots: {agg['tok_s']:.0f} tok/s with empty caches, "
                f"{agg['full_ctx_tok_s']:.0f} tok/s with every slot's full {s.context}-token cache (a step reads "
                "the weights once for all slots and each slot's own KV cache)"
            )
        if c.n_cpu_moe:
            h = plan.host
            ram = (
                f"of {_gib(h.ram_bytes)} ({h.ram_source})"
                if h.ram_bytes is not None
                else "(the host's RAM is unknown: not checked)"
            )
            console.print(f"Host RAM for weights: token_embd + offloaded experts = {_gib(c.host_resident_bytes)} {ram}")
    cards = f"{s.device_count(plan.gpu)} x {plan.gpu.key}" if s.split else plan.gpu.key
    table = Table(title=f"Fit table: {s.context} tokens x {s.parallel} slot(s) on {cards}")
    columns: list[tuple[str, JustifyMethod]] = [
        ("quant", "left"),
        ("backend", "left"),
        ("file", "right"),
        ("bits/w", "right"),
        ("KLD", "right"),
        ("VRAM, worst card" if s.split else "VRAM", "right"),
        ("fits?", "left"),
        ("max ctx/slot", "right"),
        ("roofline tok/s", "right"),
    ]
    # the experts of the first N layers in host RAM (llama-server --n-cpu-moe; not on a CPU)
    moe_column = shape.is_moe and not plan.gpu.is_cpu
    if moe_column:
        columns.insert(6, ("n-cpu-moe", "right"))
    for col, just in columns:
        # one line per quant where the width allows: the headers of the numbers wrap instead
        keep = col in ("quant", "backend", "file", "VRAM", "VRAM, worst card", "n-cpu-moe") or (
            col == "fits?" and not moe_column
        )
        table.add_column(col, justify=just, no_wrap=keep)
    for o in plan.options:
        mark = " (recommended)" if plan.recommendation is o else ""
        quality = plan.objective.quality(o.quant, o.bpw)
        cells = [
            o.quant + mark,
            o.backend,
            _gb(o.weights_bytes),
            f"{o.bpw:.2f}",
            f"{quality.kld:.4f}" + ("*" if quality.source == "measured" else ""),
            _gib(o.vram_bytes),
            _fits_cell(o),
            f"{o.max_ctx:,}" if o.max_ctx else "-",
            f"{o.roofline_tok_s:.0f}",
        ]
        if moe_column:
            cells.insert(6, str(o.n_cpu_moe) if engine(o.backend).offloads_experts else "-")
        table.add_row(*cells)
    console.print(table)
    if plan.offload:
        _render_offload(plan, console)
    console.print(f"[bold]Recommendation:[/] {escape(plan.reason)}")
    for note in plan.notes:
        console.print(f"[yellow]Note:[/] {escape(note)}")


def _render_split(plan: Plan, c: Option, console: Console) -> None:
    """A split's planned quant: the whole model's sizes, then one row per card."""
    if c.unfit_reason:
        verdict = f"[red]does not fit: {escape(c.unfit_reason)}[/]"
    elif c.fits:
        verdict = f"[green]fits: the fullest device has {c.headroom_bytes / MIB:,.0f} MiB left[/]"
    else:
        full = worst(c.devices)
        over = -full.headroom_bytes / MIB
        verdict = f"[red]does not fit: device {full.index} ({escape(full.name)}) overflows by {over:,.0f} MiB[/]"
    console.print(
        f"\n[bold]Planned quant {c.quant}[/] over {len(c.devices)} devices: weights {_gb(c.weights_bytes)} on disk, "
        f"{_gib(c.gpu_weights_bytes)} on the devices + KV {_gib(c.kv_bytes)} ({c.kv_bytes_per_token:,} B/token): "
        f"{verdict}"
    )
    table = Table(title=f"Per device: {plan.serving.context} tokens x {plan.serving.parallel} slot(s)")
    for col in ("device", "layers", "weights", "KV", "compute", "context/margin", "total", "of", "left"):
        table.add_column(col, justify="left" if col in ("device", "layers") else "right", no_wrap=col == "layers")
    for d in c.devices:
        left = d.headroom_bytes
        table.add_row(
            escape(d.name),
            d.layers_text,
            _gib(d.weights_bytes),
            _gib(d.kv_bytes),
            _gib(d.compute_bytes),
            _gib(d.overhead_bytes),
            _gib(d.total_bytes),
            _gib(d.capacity_bytes),
            f"{left / MIB:,.0f} MiB" if left >= 0 else f"[red]-{-left / MIB:,.0f} MiB[/]",
        )
    console.print(table)
    per_card = " + ".join(f"{_gb(d.streamed_bytes)}/{d.bandwidth_gb_s:g} GB/s" for d in c.devices)
    sv = plan.serving
    if sv.rpc_devices and sv.rpc_rtt_ms:
        per_card += f" + {sv.rpc_devices} x {sv.rpc_rtt_ms:g} ms network ({sv.rpc_rtt_source})"
    console.print(
        f"Roofline: the devices run one after the other for each token: 1 / ({per_card}) = "
        f"{c.roofline_tok_s:.0f} tok/s ({c.roofline_full_ctx_tok_s:.0f} tok/s with a full "
        f"{plan.serving.context}-token cache); a layer split adds memory, not speed"
    )
    if c.gpu_split:
        split = ", ".join(f"{a:g}" for a in c.gpu_split)
        console.print(
            f"TabbyAPI: gpu_split [{split}] (GB each card gives weights and scratch; its layers' cache comes on "
            "top), rendered with gpu_split_auto: false"
        )
    if c.unfit_reason and c.devices:
        console.print(f"[red]{escape(c.unfit_reason)}[/]")


def _roofline_text(plan: Plan, c: Option) -> str:
    bw = plan.gpu.bandwidth_gb_s
    full = f"({c.roofline_full_ctx_tok_s:.0f} tok/s with a full {plan.serving.context}-token cache)"
    if not c.host_bytes_per_token:
        active = (
            f" (the active experts: {plan.shape.num_experts_per_tok} of {plan.shape.num_experts})"
            if plan.shape.is_moe and engine(c.backend).offloads_experts
            else ""
        )
        return (
            f"Roofline: {bw:g} GB/s / {_gb(c.streamed_bytes)} per token{active} = {c.roofline_tok_s:.0f} tok/s {full}"
        )
    return (
        f"Roofline, two-sided (--n-cpu-moe {c.n_cpu_moe}): {_gb(c.gpu_bytes_per_token)} per token on the GPU / "
        f"{bw:g} GB/s + {_gb(c.host_bytes_per_token)} per token in host RAM / {c.host_membw_gb_s:g} GB/s "
        f"({c.host_membw_source}) = {c.roofline_tok_s:.0f} tok/s {full}"
    )


def _render_offload(plan: Plan, console: Console) -> None:
    h = plan.host
    table = Table(
        title=f"Expert offload, {plan.offload_quant}: --n-cpu-moe N = experts of layers 0..N-1 in host RAM "
        f"({h.membw_gb_s:g} GB/s, {h.membw_source})"
    )
    for col in ("N", "VRAM", "fits?", "experts in host RAM", "GPU per token", "host per token", "ceiling tok/s"):
        table.add_column(col, justify="left" if col == "fits?" else "right")
    for st in plan.offload:
        table.add_row(
            str(st.n_cpu_moe),
            _gib(st.vram_bytes),
            "[green]yes[/]" if st.fits else "[red]no[/]",
            _gib(st.host_weights_bytes) if st.host_weights_bytes else "-",
            _gb(st.gpu_bytes_per_token),
            _gb(st.host_bytes_per_token) if st.host_bytes_per_token else "-",
            f"{st.roofline_tok_s:.0f}",
        )
    console.print(table)


# ------------------------------------------------------------------------------------------
# preflight
# ------------------------------------------------------------------------------------------

_VERDICT_STYLE = {"pass": "green", "warn": "yellow", "fail": "red"}


def verdict_json(v: Verdict) -> dict[str, Any]:
    return {
        "host": v.facts.host,
        "ok": v.ok,
        "facts": json.loads(v.facts.model_dump_json()),
        "checks": [c.__dict__ for c in v.checks],
        "plan": v.plan_summary,
    }


def render_verdict(v: Verdict, out: Console) -> None:
    f = v.facts
    head = Text()
    head.append(f.host, style="bold")
    head.append(
        f": {f.os.pretty_name or 'unknown OS'}, {f.machine or '?'}, {f.nproc or '?'} CPUs, "
        f"{(f.memory.mem_total_bytes or 0) / GIB:.1f} GiB RAM"
    )
    out.print(head)
    table = Table(title=Text(f"preflight {f.host}"))
    for col in ("check", "status", "detail", "fix"):
        table.add_column(col, overflow="fold")
    for c in v.checks:
        status = c.status + (" (blocking)" if c.status == "fail" and c.blocking else "")
        table.add_row(Text(c.name), Text(status, style=_VERDICT_STYLE[c.status]), Text(c.detail), Text(c.fix))
    out.print(table)
    out.print(Text("ready", style="green") if v.ok else Text("not ready: fix the blocking checks above", style="red"))


# ------------------------------------------------------------------------------------------
# operations
# ------------------------------------------------------------------------------------------

_CHANGE_STYLE = {"changed": "yellow", "ok": "green", "failed": "bold red"}


def render_report(changes: Sequence[Change], out: Console | None = None, log: Path | None = None) -> Table:
    """Print one table, host | step | status | why, and a count per host; returns the table.
    The why column holds one line per step (a failure's summary, never its output); ``log``:
    the file that holds what the summaries left out."""
    out = out or console()
    table = Table(title="voltaforge: what changed")
    for col in ("host", "step", "status", "why"):
        table.add_column(col, overflow="fold")
    for c in changes:
        table.add_row(Text(c.host), Text(c.step), Text(c.status, style=_CHANGE_STYLE[c.status]), Text(c.why))
    out.print(table)
    for host in dict.fromkeys(c.host for c in changes):
        counts = {s: sum(1 for c in changes if c.host == host and c.status == s) for s in _CHANGE_STYLE}
        out.print(Text(f"{host}: {counts['changed']} changed, {counts['ok']} ok, {counts['failed']} failed"))
    if log is not None:
        out.print(Text(f"the full output of what failed is in {log}"))
    return table


def render_artifacts(rows: Sequence[dict[str, Any]], host: str, out: Console | None = None) -> Table:
    """`invoke artifacts`: one row per verified file, its size beside the planner's prediction."""
    out = out or console()
    table = Table(title=f"voltaforge: artifacts on {host}")
    for col in ("file", "quant", "bytes", "predicted", "sha256", "verification"):
        table.add_column(col, overflow="fold")
    for r in rows:
        size, pred = r.get("bytes"), r.get("predicted_bytes")
        ratio = f" ({(pred - size) / size * 100:+.2f}%)" if isinstance(size, int) and isinstance(pred, int) else ""
        v = r.get("verification") or {}
        figures = []
        if "compare" in v:
            c = v["compare"]
            if "skipped" in c:
                figures.append(f"not compared with the original: {c['skipped']}")
            else:
                agree, diff = c.get("top1_agreement", 0), c.get("max_abs_logit_diff", 0)
                figures.append(f"top-1 vs original {agree:.2%}, max |dlogit| {diff:.3g}")
        if "kld" in v:
            figures.append(f"KLD {v['kld'].get('mean_kld', 0):.5f}, same top {v['kld'].get('same_top_p', 0):.1f}%")
        table.add_row(
            Text(str(r.get("path"))),
            Text(str(r.get("quant"))),
            Text(size_text(size) if isinstance(size, int) else "?"),
            Text((size_text(pred) if isinstance(pred, int) else "?") + ratio),
            Text(str(r.get("sha256") or "")[:12]),
            Text(r.get("error") or "; ".join(figures)),
        )
    out.print(table)
    return table
