"""The ceilings a bench measures a server against, and the probes that find them on the host:
the decode roofline and the prefill ceiling (the plan's bytes and FLOPs per token over the
memory's bandwidth and the card's FP16 throughput), the host's copy bandwidth (a stored host fact,
else the STREAM-style probe), and llama.cpp's own ``llama-bench`` figure on the served model.

The sweep that measures the server, and the gate that judges it, are bench_run.py's.
"""

from __future__ import annotations

import json
import shlex
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from playbooks.config.planning import host_from_recipe, plan_recipe, resolve_n_cpu_moe
from playbooks.config.recipe import LoadedRecipe
from playbooks.errors import VoltaforgeError
from playbooks.facts import membw as membw_facts
from playbooks.facts import read_fact
from playbooks.host import Host
from playbooks.plan.gpus import get_gpu
from playbooks.plan.moe import two_sided_tok_s
from playbooks.plan.tensors import parameter_count
from playbooks.steps.measure import roofline


def push_probe(host: Host, prefix: str, local: Path) -> str:
    remote = f"{prefix}/bench/{local.name}"
    host.run(f"mkdir -p -- {shlex.quote(prefix)}/bench", stream=False)
    host.put(str(local), remote, mode=0o644)
    return remote


def host_python(host: Host, prefix: str) -> str:
    """The python the probes run with: the toolchain venv's (it has numpy), else the system's."""
    venv = f"{prefix}/venv/bin/python"
    return venv if host.exists(venv) else "python3"


def ceilings(loaded: LoadedRecipe, membw_gb_s: float | None, llc_bytes: int | None = None) -> dict[str, Any]:
    """The decode roofline (bytes a token streams over the memory's bandwidth) and the prefill
    ceiling (2 x parameters FLOPs per token over FP16 tensor throughput), with their basis.
    A MoE with experts in host RAM (--n-cpu-moe) gets the two-sided roofline, its host side
    divided by the measured copy rate when there is one, else by the plan's figure.

    On a CPU whose last-level cache (``llc_bytes``, one instance: facts/system.py parse_llc)
    holds a token's bytes, the DRAM copy rate bounds nothing (:mod:`roofline`): no roofline,
    ``cache_resident`` says what fits where, with the DRAM figure it would have been."""
    plan = plan_recipe(loaded, host=host_from_recipe(loaded, membw_gb_s, membw_measured=True) if membw_gb_s else None)
    r = loaded.recipe
    option = next((o for o in plan.options if o.quant == r.quant_name), None)
    gpu = get_gpu(r.gpu)
    if option is None:
        return {
            "roofline_tok_s": None,
            "roofline_basis": f"the planner has no {r.quant_name} option",
            "cache_resident": None,
        }
    streamed = option.streamed_bytes
    params = parameter_count(loaded.shape)
    prefill = (
        {
            "prefill_ceiling_tok_s": round(gpu.fp16_tensor_tflops * 1e12 / (2 * params), 1),
            "prefill_basis": f"2 x {params / 1e9:.2f} B parameters FLOPs per token over {gpu.fp16_tensor_tflops:g} "
            "TFLOPS FP16 tensor (datasheet)",
        }
        if gpu.fp16_tensor_tflops
        else {
            "prefill_ceiling_tok_s": None,
            "prefill_basis": "no FP16 tensor figure: llama-bench's pp is the measured rate",
        }
    )
    if gpu.is_cpu and llc_bytes and roofline.is_cache_resident(streamed, llc_bytes):
        dram = round(membw_gb_s * 1e9 / streamed, 2) if membw_gb_s else None
        resident = {"bytes_per_token": streamed, "llc_bytes": llc_bytes, "dram_roofline_tok_s": dram}
        basis = roofline.cache_resident_basis(streamed, llc_bytes)
        if dram:
            basis += f" (the measured CPU copy {membw_gb_s:.1f} GB/s would put it at {dram:.1f} tok/s)"
        return {"roofline_tok_s": None, "roofline_basis": basis, "cache_resident": resident, **prefill}
    if gpu.is_cpu:
        if not membw_gb_s:
            return {
                "roofline_tok_s": None,
                "roofline_basis": "the host's memory bandwidth could not be measured",
                "cache_resident": None,
            }
        roof = membw_gb_s * 1e9 / streamed
        basis = f"measured CPU copy {membw_gb_s:.1f} GB/s / {streamed / 1e6:.1f} MB per token"
        if llc_bytes:
            basis += f" (more than the {llc_bytes / 2**20:g} MiB last-level cache holds)"
    elif option.host_bytes_per_token and option.host_membw_gb_s:
        gpu_b, host_b, host_bw = option.gpu_bytes_per_token, option.host_bytes_per_token, option.host_membw_gb_s
        roof = two_sided_tok_s(gpu_b, gpu.bandwidth_gb_s, host_b, host_bw)
        basis = (
            f"{gpu.name} datasheet {gpu.bandwidth_gb_s:g} GB/s / {gpu_b / 1e6:.0f} MB per token + host "
            f"{option.host_membw_source} {host_bw:.1f} GB/s / {host_b / 1e6:.0f} MB per token "
            f"(experts of {option.n_cpu_moe} layers in host RAM)"
        )
    else:
        roof = gpu.bandwidth_gb_s * 1e9 / streamed
        basis = f"{gpu.name} datasheet {gpu.bandwidth_gb_s:g} GB/s / {streamed / 1e6:.0f} MB per token"
    return {"roofline_tok_s": round(roof, 2), "roofline_basis": basis, "cache_resident": None, **prefill}


def served_n_cpu_moe(loaded: LoadedRecipe) -> int:
    """The layers whose experts the served model keeps in host RAM (0: none)."""
    try:
        return resolve_n_cpu_moe(loaded)
    except VoltaforgeError:  # a recipe that does not fit is the gate's to report, not the probe's
        return 0


def llama_bench_args(loaded: LoadedRecipe, n_cpu_moe: int) -> list[str]:
    """llama-bench with the served configuration: its defaults (an f16 cache, every layer's
    experts on the GPU) would measure another model than the one the gate judged."""
    r = loaded.recipe
    args = ["-fa", "1" if r.flash_attn else "0", "-ctk", r.cache.k, "-ctv", r.cache.v]
    if not get_gpu(r.gpu).is_cpu:
        args += ["-ngl", "999"]
    if n_cpu_moe:
        args += ["-ncmoe", str(n_cpu_moe)]
    return args


def no_room_for_llama_bench(loaded: LoadedRecipe) -> str | None:
    """Why llama-bench cannot run beside the serving model on this GPU (None: it can): it loads
    its own copy, and on a 16 GB V100 the server already holds most of the card."""
    gpu = get_gpu(loaded.recipe.gpu)
    if gpu.is_cpu:
        return None
    plan = plan_recipe(loaded)
    option = next((o for o in plan.options if o.quant == loaded.recipe.quant_name), None)
    if option is None:
        return None
    # beside the server's whole budget: the weights again, a compute buffer, a CUDA context (its
    # KV cache is a few hundred tokens: left out)
    need = option.vram_bytes + option.gpu_weights_bytes + option.compute_bytes + option.overhead_bytes
    if need <= option.gpu_bytes:
        return None
    return (
        f"not run: its own copy of the model beside the server's needs {need / 2**30:.1f} GiB "
        f"of the {option.gpu_bytes / 2**30:.0f} GiB card"
    )


def llama_bench(
    host: Host, prefix: str, model: str, prompt_tokens: int, max_tokens: int, extra: list[str] | None = None
) -> dict[str, Any] | None:
    """llama.cpp's own figure on the same model, when the build has llama-bench (the server
    keeps running: on a CPU host the two compete, and the report says it ran after the sweep)."""
    binary = f"{prefix}/llama.cpp/current/bin/llama-bench"
    if not host.exists(binary):
        return None
    flags = " ".join(shlex.quote(a) for a in extra or [])
    cmd = f"{shlex.quote(binary)} -m {shlex.quote(model)} -p {prompt_tokens} -n {max_tokens} {flags} -r 2 -o json"
    out = host.run(f"{cmd} 2>/dev/null", check=False, stream=False, timeout=600)
    try:
        rows = json.loads(out.stdout)
    except ValueError:
        return {"error": f"llama-bench printed no JSON (exit {out.exited})", "command": cmd}
    found: dict[str, Any] = {"command": cmd}
    for row in rows if isinstance(rows, list) else []:
        if row.get("n_gen"):
            found["tg_tok_s"] = round(float(row.get("avg_ts", 0)), 2)
        elif row.get("n_prompt"):
            found["pp_tok_s"] = round(float(row.get("avg_ts", 0)), 2)
    return found


def host_membw(host: Host, prefix: str, python: str, remeasure: bool = False) -> dict[str, Any]:
    """The host's copy bandwidth as a host fact: the stored figure when it was measured on this
    same memory system (and ``remeasure`` is off), else a fresh STREAM-style measurement, stored
    for the next run. Returns the figure with its basis (``source``: stored or measured)."""
    ident, stored = membw_facts.parse_identity(read_fact(host, membw_facts.identity_command(prefix)))
    found, why = (None, "--remeasure") if remeasure else membw_facts.reusable(stored, ident)
    if found is not None:
        return {"gb_s": found.copy_gb_s, "source": why, "probe": _membw_dict(found)}
    probe = push_probe(host, prefix, membw_facts.MEMBW_PROBE_PATH)
    fresh = membw_facts.read_membw(read_fact(host, membw_facts.membw_command(python, probe)))
    if fresh.copy_gb_s is None:
        return {"gb_s": None, "source": f"not measured: {fresh.error}", "probe": _membw_dict(fresh)}
    refused = membw_facts.ceiling_refusal(fresh)
    if refused:  # kept out of the store too: the next run measures again
        return {"gb_s": None, "source": refused, "probe": _membw_dict(fresh)}
    at = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    record = membw_facts.stored_record(ident, fresh, at)
    host.run(membw_facts.store_command(prefix, record), stream=False)
    return {
        "gb_s": fresh.copy_gb_s,
        "source": f"measured {at} ({why}), stored for the next runs",
        "probe": _membw_dict(fresh),
    }


def _membw_dict(m: membw_facts.Membw) -> dict[str, Any]:
    return {k: v for k, v in m.__dict__.items() if v is not None}
